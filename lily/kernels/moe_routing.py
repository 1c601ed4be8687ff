"""Prefill MoE routing: the top-k experts of each token and their weights, in one launch.

From the router logits [T, E] (fp32): the k largest per row (ties to the lower index, as a stable
argmax), then weights w_j = softmax over the chosen logits (norm_topk_prob: the full softmax's
denominator cancels in the renormalisation) or, without renormalisation, the full softmax's value
exp(l_j - logsumexp(l)). Replaces topk + softmax (+ logsumexp) in torch: three to five launches a layer.

With the shared expert (`shared=True`): the logits carry one more column, the shared expert's gate, and each
row gets a (k+1)-th slot: expert E (the shared expert, stacked after the routed ones) with weight
sigmoid(gate). The grouped expert GEMMs then run the shared expert with the routed ones, in the same launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2

@triton.jit
def _moe_topk_kernel(logit_ptr, w_ptr, id_ptr, T, stride_l, stride_part, E, PARTS: tl.constexpr,
                     E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
                     SHARED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    t64 = tl.where(ok, t, 0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    # the logits: the sum of the router GEMM's K-split partials, in split order (as q_gemm sums them)
    row = logit_ptr + t64 * stride_l
    summed = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for part in tl.static_range(PARTS):   # (unrolled: every partial's load in flight at once)
        summed += tl.load(row[:, None] + part * stride_part + e[None, :], mask=(e < E)[None, :], other=0.0)
    logits = tl.where((e < E)[None, :], summed, float("-inf"))
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
    if SHARED:  # slot K: the shared expert (index E), weighted by the sigmoid of its gate (column E)
        gate = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for part in tl.static_range(PARTS):
            gate += tl.load(row + part * stride_part + E, mask=ok, other=0.0)
        w = tl.where(kk[None, :] == K, tl.sigmoid(gate)[:, None], w)
        ids = tl.where(kk[None, :] == K, E, ids)
    out = t64[:, None] * SLOTS + kk[None, :]
    keep = ok[:, None] & (kk < SLOTS)[None, :]
    tl.store(w_ptr + out, w, mask=keep)
    tl.store(id_ptr + out, ids, mask=keep)


# Rows a program routes, at most. H200, a 256-token prompt: 16 rows a program (16 programs, each a long
# serial top-k) 0.52 ms of routing kernels a prompt in top-k; 4 took the routing class 1.26 -> 0.95 ms.
TOPK_ROWS = 4


def moe_topk(logits: torch.Tensor, k: int, renormalize: bool = True,
             shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] (rows contiguous) -> (weights fp32 [T, k], ids int32 [T, k]), the experts in
    descending logit order. shared: logits [T, E + 1], the last column the shared expert's gate; then
    [T, k + 1], slot k being (E, sigmoid(gate)). logits may also be [S, T, ...]: the router GEMM's K-split
    partials (lily.kernels.q4_gemm.q_gemm_parts), summed here in split order, as q_gemm would."""
    parts = logits if logits.dim() == 3 else logits[None]
    S, T, E = parts.shape
    E -= int(shared)
    if parts.dtype != torch.float32 or parts.stride(2) != 1 or not 0 < k <= E:
        raise ValueError(f"moe_topk: logits {tuple(logits.shape)} {logits.dtype}, k {k}, shared {shared}")
    slots = k + int(shared)
    w = torch.empty(T, slots, device=logits.device, dtype=torch.float32)
    ids = torch.empty(T, slots, device=logits.device, dtype=torch.int32)
    e_pad = next_power_of_2(E)
    bt = max(1, min(TOPK_ROWS, 4096 // e_pad))
    _moe_topk_kernel[(cdiv(T, bt),)](parts, w, ids, T, parts.stride(1), parts.stride(0), E, PARTS=S,
                                     E_PAD=e_pad, K=k, K_PAD=next_power_of_2(slots), RENORM=renormalize,
                                     SHARED=shared, SLOTS=slots, BLOCK_T=bt, num_warps=4)
    return w, ids


def summed_partials(logits: torch.Tensor) -> torch.Tensor:
    """[S, T, N] K-split partials -> [T, N], summed in split order from zero as moe_topk sums them (a [T, N]
    tensor is returned as it is)."""
    if logits.dim() != 3:
        return logits
    summed = torch.zeros_like(logits[0])
    for part in logits:
        summed = summed + part
    return summed


def moe_topk_reference(logits: torch.Tensor, k: int, renormalize: bool = True, shared: bool = False):
    """The model's routing in plain torch: softmax, top-k, optional renormalisation (shared/MODEL.md); with
    shared, the shared expert (index E, weight sigmoid of the last column) appended to each row. [S, T, ...]
    partials are summed first."""
    logits = summed_partials(logits)
    routed = logits[:, :-1] if shared else logits
    p = routed.float().softmax(-1)
    vals, ids = p.topk(k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    if shared:
        E = routed.shape[1]
        vals = torch.cat([vals, torch.sigmoid(logits[:, -1:].float())], 1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], 1)
    return vals, ids
