"""Gated full attention for B sequences at once, each over its own slot's KV cache and length (the batched
decode step), in three launches after the batched q|k|v GEMM (proj [B, Hq*2D | Hkv*D | Hkv*D] fp32):

  prep:    grid (B, Hq + Hkv): q/k RMSNorm, partial NeoX RoPE at the slot's position, q to scratch, K and V
           appended to the slot's cache at that position.
  split-K: grid (B, Hkv, n_split): the G = Hq / Hkv query heads of one KV head together (each K/V row read
           once); split s covers an equal share of the slot's own length (online softmax inside).
  combine: grid (B, Hq, D / DB): log-sum-exp merge of the splits, times sigmoid(gate); natural order out.

The cache of one layer is the slot pool's [slots, max_seq, Hkv, D] bf16 (K after k_norm and RoPE), or its int8
rows (lily.kernels.kv_int8); the positions are the pool's per-slot int32 counters, read on the device, so a CUDA
graph replays at any length. Rows b >= n_valid (a graph's padding) do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.host_math import next_power_of_2
from lily.kernels.pdl import wait_prior
from lily.kernels.attention_decode import UPCAST_DOT, attend_span, load_queries, norm_rope_head, store_kv
from lily.kernels.kv_int8 import is_kv8, kv_head_dim


@triton.jit
def merge_splits(part_acc_ptr, part_ml_ptr, part0, h, d, HQ: tl.constexpr, D: tl.constexpr,
                 NSPLIT: tl.constexpr, NS_P2: tl.constexpr):
    """Head h's attention output at dims d: the log-sum-exp merge of the splits' partials, split s's at
    part0 + s * HQ + h (an empty split weighs nothing)."""
    s = tl.arange(0, NS_P2)
    smask = s < NSPLIT
    part = part0 + s * HQ + h
    ms = tl.load(part_ml_ptr + part * 2, mask=smask, other=float("-inf"))
    ls = tl.load(part_ml_ptr + part * 2 + 1, mask=smask, other=0.0)
    a = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    mx = tl.max(ms, 0)
    w = tl.where(ms > float("-inf"), tl.exp(ms - mx), 0.0)
    return tl.sum(a * w[:, None], 0) / tl.sum(ls * w, 0)


@triton.jit
def attn_prep_rows_kernel(proj_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slots_ptr, n_valid_ptr,
                          q_gain_ptr, k_gain_ptr, inv_freq_ptr, eps, proj_stride, max_seq,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                          KV8: tl.constexpr = False, GDC: tl.constexpr = False):
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        wait_prior(GDC)                  # (lily.kernels.pdl) proj comes from the previous kernel
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + slot)
        d = tl.arange(0, D)
        is_q = h < HQ
        kvh = h - HQ
        row = proj_ptr + b * proj_stride
        base = tl.where(is_q, h * 2 * D, HQ * 2 * D + kvh * D)
        y = norm_rope_head(row, base, is_q, q_gain_ptr, k_gain_ptr, inv_freq_ptr, pos, eps, D, ROT)
        if is_q:
            tl.store(q_ptr + (b * HQ + h) * D + d, y)
        else:
            v = tl.load(row + HQ * 2 * D + HKV * D + kvh * D + d)
            store_kv(k_cache_ptr, v_cache_ptr, (slot * max_seq + pos) * HKV + kvh, y, v, D, KV8)


@triton.jit
def attn_split_rows_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slots_ptr, n_valid_ptr, part_acc_ptr,
                           part_ml_ptr, scale, max_seq,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                           BT: tl.constexpr, NSPLIT: tl.constexpr, UPCAST: tl.constexpr, KV8: tl.constexpr = False,
                           GDC: tl.constexpr = False):
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        wait_prior(GDC)                  # q and this token's K/V row come from the previous kernel
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        length = tl.load(pos_ptr + slot) + 1
        per = tl.cdiv(tl.cdiv(length, NSPLIT), BT) * BT
        start = split * per
        end = tl.minimum(start + per, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        qd = load_queries(q_ptr, b * HQ + kvh * G, G, GP, D, scale, UPCAST, KV8)
        m, l, acc = attend_span(qd, k_cache_ptr, v_cache_ptr, slot * max_seq, kvh, start, end, HKV, D, GP, BT,
                                UPCAST, KV8)
        part = (b * NSPLIT + split) * HQ + kvh * G + g
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=gmask)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=gmask)


@triton.jit
def attn_combine_rows_kernel(part_acc_ptr, part_ml_ptr, proj_ptr, o_ptr, n_valid_ptr, proj_stride,
                             HQ: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr,
                             DB: tl.constexpr, GDC: tl.constexpr = False):
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        wait_prior(GDC)                  # the splits' partials come from the previous kernel
        h = tl.program_id(1)
        d = tl.program_id(2) * DB + tl.arange(0, DB)
        out = merge_splits(part_acc_ptr, part_ml_ptr, b * NSPLIT * HQ, h, d, HQ, D, NSPLIT, NS_P2)
        gate = tl.load(proj_ptr + b * proj_stride + h * 2 * D + D + d)
        tl.store(o_ptr + (b * HQ + h) * D + d, out * tl.sigmoid(gate))


def splits_for(batch: int, n_kv_heads: int, device) -> int:
    """Context splits of the split-K pass: enough programs to fill the GPU (about 512) at any batch size."""
    if torch.device(device).type != "cuda":
        return 2
    return max(1, min(64, 512 // max(1, batch * n_kv_heads)))


def attention_decode_rows(proj: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                          slots: torch.Tensor, n_valid: torch.Tensor, q_gain: torch.Tensor, k_gain: torch.Tensor,
                          inv_freq: torch.Tensor, eps: float, hq: int, n_split: int | None = None,
                          block_t: int = 32, num_warps: int = 4) -> torch.Tensor:
    """proj fp32 [B, Hq*2D + 2*Hkv*D] (rows contiguous); k_cache, v_cache [slots, max_seq, Hkv, D] (one layer of
    the slot pool; or its int8 rows); pos int32 [slots] (each slot's position, the row this token's K/V is written
    to); slots, n_valid int32. Returns the gated attention output fp32 [B, Hq*D] (rows >= n_valid unwritten)."""
    _, max_seq, hkv, _ = k_cache.shape
    dim, kv8 = kv_head_dim(k_cache), is_kv8(k_cache)
    B = proj.shape[0]
    if proj.stride(1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("attention_decode_rows: proj rows and the caches must be contiguous")
    ns = n_split or splits_for(B, hkv, proj.device)
    f32 = dict(dtype=torch.float32, device=proj.device)
    q = torch.empty(B, hq, dim, **f32)
    part_acc = torch.empty(B, ns, hq, dim, **f32)
    part_ml = torch.empty(B, ns, hq, 2, **f32)
    out = torch.empty(B, hq * dim, **f32)
    attn_prep_rows_kernel[(B, hq + hkv)](proj, q, k_cache, v_cache, pos, slots, n_valid, q_gain, k_gain, inv_freq,
                                         eps, proj.stride(0), max_seq, HQ=hq, HKV=hkv, D=dim,
                                         ROT=inv_freq.numel() * 2, KV8=kv8, num_warps=num_warps,
                                         **pdl.kernel_args(q, "rows_attn"))
    g = hq // hkv
    attn_split_rows_kernel[(B, hkv, ns)](q, k_cache, v_cache, pos, slots, n_valid, part_acc, part_ml, dim ** -0.5,
                                         max_seq, HQ=hq, HKV=hkv, D=dim, G=g,
                                         GP=max(16, next_power_of_2(g)), BT=block_t, NSPLIT=ns,
                                         UPCAST=UPCAST_DOT, KV8=kv8, num_warps=num_warps,
                                         **pdl.kernel_args(q, "rows_attn"))
    db = min(dim, 64)
    attn_combine_rows_kernel[(B, hq, dim // db)](part_acc, part_ml, proj, out, n_valid, proj.stride(0), HQ=hq,
                                                 D=dim, NSPLIT=ns, NS_P2=next_power_of_2(ns), DB=db,
                                                 num_warps=num_warps, **pdl.kernel_args(out, "rows_attn"))
    return out


def attention_decode_rows_reference(proj: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                                    positions: list[int], q_gain: torch.Tensor, k_gain: torch.Tensor,
                                    inv_freq: torch.Tensor, eps: float, hq: int):
    """Row by row through the batch-1 decode references: (out [B, Hq*D], this token's K rows [B, Hkv, D] after
    k_norm and RoPE, its V rows). keys[b], values[b]: the slot's cache rows 0..pos_b, this token's included
    (as the cache holds them once it is appended)."""
    from lily.kernels.attention_decode import attention_decode_reference, rmsnorm_rope_reference

    hkv, dim = keys[0].shape[1], keys[0].shape[2]
    outs, ks, vs = [], [], []
    for b, pos in enumerate(positions):
        qg = proj[b, :hq * 2 * dim].reshape(hq, 2 * dim)
        ks.append(rmsnorm_rope_reference(proj[b, hq * 2 * dim:hq * 2 * dim + hkv * dim].reshape(hkv, dim), k_gain,
                                         pos, inv_freq, eps))
        vs.append(proj[b, hq * 2 * dim + hkv * dim:].reshape(hkv, dim))
        q = rmsnorm_rope_reference(qg[:, :dim], q_gain, pos, inv_freq, eps)
        outs.append(attention_decode_reference(q, qg[:, dim:], keys[b][:pos + 1], values[b][:pos + 1]))
    return torch.stack(outs), torch.stack(ks), torch.stack(vs)
