"""Prefill MoE routing: the top-k experts of each token and their weights, in one launch.

From the router logits [T, E] (fp32): the k largest per row (ties to the lower index, as a stable
argmax), then weights w_j = softmax over the chosen logits (norm_topk_prob: the full softmax's
denominator cancels in the renormalisation) or, without renormalisation, the full softmax's value
exp(l_j - logsumexp(l)). Replaces topk + softmax (+ logsumexp) in torch: three to five launches a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2

@triton.jit
def _moe_topk_kernel(logit_ptr, w_ptr, id_ptr, T, stride_l, E,
                     E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    t64 = tl.where(ok, t, 0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    logits = tl.load(logit_ptr + t64[:, None] * stride_l + e[None, :], mask=(e < E)[None, :], other=float("-inf"))
    row_max = tl.max(logits, axis=1)
    if RENORM:
        denom = tl.zeros((BLOCK_T,), dtype=tl.float32)
    else:
        denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    work = logits
    kk = tl.arange(0, K_PAD)
    vals = tl.full((BLOCK_T, K_PAD), float("-inf"), dtype=tl.float32)  # padding columns weigh exp(-inf) = 0
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(K):
        m = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == m[:, None], e[None, :], E_PAD), axis=1)  # first index of the max
        idx = tl.minimum(idx, E - 1)  # a NaN row matches nothing: keep the index in range (NaN weights follow)
        vals = tl.where(kk[None, :] == j, m[:, None], vals)
        ids = tl.where(kk[None, :] == j, idx[:, None], ids)
        work = tl.where(e[None, :] == idx[:, None], float("-inf"), work)
    p = tl.exp(vals - row_max[:, None])
    if RENORM:
        denom = tl.sum(p, axis=1)
    w = p / denom[:, None]
    out = t64[:, None] * K + kk[None, :]
    keep = ok[:, None] & (kk < K)[None, :]
    tl.store(w_ptr + out, w, mask=keep)
    tl.store(id_ptr + out, ids, mask=keep)


def moe_topk(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] (rows contiguous) -> (weights fp32 [T, k], ids int32 [T, k]), the experts in
    descending logit order."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1 or not 0 < k <= E:
        raise ValueError(f"moe_topk: logits {tuple(logits.shape)} {logits.dtype}, k {k}")
    w = torch.empty(T, k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(T, k, device=logits.device, dtype=torch.int32)
    e_pad = next_power_of_2(E)
    bt = max(1, min(16, 4096 // e_pad))
    _moe_topk_kernel[(cdiv(T, bt),)](logits, w, ids, T, logits.stride(0), E, E_PAD=e_pad, K=k,
                                           K_PAD=next_power_of_2(k),
                                           RENORM=renormalize, BLOCK_T=bt, num_warps=4)
    return w, ids


def moe_topk_reference(logits: torch.Tensor, k: int, renormalize: bool = True):
    """The model's routing in plain torch: softmax, top-k, optional renormalisation (shared/MODEL.md)."""
    p = logits.float().softmax(-1)
    vals, ids = p.topk(k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    return vals, ids
