"""Gated full attention, one decode token, in three launches (after the fused q+k+v GEMV):

  prep:    grid (Hq + Hkv,): q/k RMSNorm (their own gains), partial NeoX RoPE on the first `rotary` dims,
           q to a scratch buffer, K and V appended to the cache at `pos` (read from the device, so the
           launch can be replayed in a CUDA graph at any position).
  split-K: grid (Hkv, n_split): the G = Hq / Hkv query heads of one KV head in one program, so each cached
           K/V row is read once; each split covers an equal share of the context (online softmax inside)
           and writes (max, sum, unnormalised acc).
  combine: grid (Hq,): log-sum-exp merge of the splits, times sigmoid(gate) (the per-head output gate).

The fused projection is [q|gate per head (Hq * 2D) | k (Hkv * D) | v (Hkv * D)] in fp32; the cache is bf16
[max_seq, Hkv, D] per layer, K stored after k_norm and RoPE, or int8 (lily.kernels.kv_int8: uint8 rows of D codes
and a scale, the dots in fp16 on the decoded codes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import next_power_of_2
from lily.kernels.kv_int8 import KV8_PAD_JIT, is_kv8, kv8_half, kv8_row_scales, kv8_store_row, kv_head_dim
from lily.kernels import pdl
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import perm64
from lily.kernels.shared_memory import max_shared_bytes

# Triton's interpreter mishandles bf16 tl.dot: upcast there; bf16 tensor cores on the GPU.
UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def norm_rope_head(row_ptr, base, is_q, q_gain_ptr, k_gain_ptr, inv_freq_ptr, pos, eps, D: tl.constexpr,
                   ROT: tl.constexpr):
    """The head at row_ptr + base of the fused projection after its RMSNorm (q's or k's gain) and partial NeoX
    RoPE at position pos: fp32 [D]."""
    d = tl.arange(0, D)
    HALF: tl.constexpr = ROT // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    partner = tl.where(d < ROT, partner, d)
    x = tl.load(row_ptr + base + d)
    xp = tl.load(row_ptr + base + partner)
    gain = tl.where(is_q, tl.load(q_gain_ptr + d), tl.load(k_gain_ptr + d)).to(tl.float32)
    gain_p = tl.where(is_q, tl.load(q_gain_ptr + partner), tl.load(k_gain_ptr + partner)).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    x = x * rstd * gain
    xp = xp * rstd * gain_p
    f = tl.load(inv_freq_ptr + (d % HALF), mask=d < ROT, other=0.0)
    ang = pos.to(tl.float32) * f
    sign = tl.where(d < HALF, -1.0, 1.0)
    return tl.where(d < ROT, x * tl.cos(ang) + sign * xp * tl.sin(ang), x)


@triton.jit
def load_queries(q_ptr, first, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, scale, UPCAST: tl.constexpr,
                 KV8: tl.constexpr = False):
    """The G query heads at rows first.. of q [heads, D], times scale, as the dot takes them ([GP, D]: bf16, fp16
    against an int8 cache's decoded codes, fp32 under UPCAST)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (first + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0) * scale
    if not UPCAST:
        if KV8:
            q = q.to(tl.float16)
        else:
            q = q.to(tl.bfloat16)
    return q


@triton.jit
def attend_span(qd, k_cache_ptr, v_cache_ptr, row0, kvh, start, end, HKV: tl.constexpr, D: tl.constexpr,
                GP: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr, KV8: tl.constexpr = False):
    """Online softmax of the (scaled) queries qd [GP, D] over cache rows row0 + [start, end) of KV head kvh
    (cache [rows, HKV, D]): (running max [GP], sum [GP], unnormalised output [GP, D]).
    KV8: an int8 cache (qd fp16): its codes decoded to fp16 (exact), K's scales on the scores' columns, V's folded
    into the probabilities relative to the block's largest (so they stay in fp16's range) and applied after.
    (Measured slower on the H200, and dropped: the next block's loads issued ahead, whose registers spilled, and
    the dots transposed so the decoded tiles were their first operands: decode-h200-20261204-kv-int8.json.)"""
    d = tl.arange(0, D)
    RS: tl.constexpr = D + KV8_PAD_JIT if KV8 else D
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < end
        row = ((row0 + t.to(tl.int64)) * HKV + kvh) * RS
        off = row[:, None] + d[None, :]
        if KV8:
            k = kv8_half(tl.load(k_cache_ptr + off, mask=tmask[:, None], other=128), not UPCAST)
            v = kv8_half(tl.load(v_cache_ptr + off, mask=tmask[:, None], other=128), not UPCAST)
        else:
            k = tl.load(k_cache_ptr + off, mask=tmask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + off, mask=tmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(qd, tl.trans(k))                                          # [GP, BT] fp32
        if KV8:
            s = s * kv8_row_scales(k_cache_ptr, row, tmask, D)[None, :]
        m_new, p, alpha, l = softmax_update(s, tmask, m, l)
        if KV8:
            vs = kv8_row_scales(v_cache_ptr, row, tmask, D)
            vmax = tl.maximum(tl.max(vs, 0), 1e-30)
            p = p * (vs / vmax)[None, :]
        if not UPCAST:
            if KV8:
                p = p.to(tl.float16)
            else:
                p = p.to(tl.bfloat16)
        pv = tl.dot(p, v)
        if KV8:
            pv = pv * vmax
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, l, acc


@triton.jit
def softmax_update(s, tmask, m, l):
    """A block's scores s [GP, BT] (keys outside tmask masked) into the online softmax's running max m and sum l:
    (new max, the block's unnormalised probabilities, the factor on what came before, new sum)."""
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return m_new, p, alpha, l * alpha + tl.sum(p, 1)


@triton.jit
def store_kv(k_cache_ptr, v_cache_ptr, row, k, v, D: tl.constexpr, KV8: tl.constexpr):
    """A token's K and V rows of one head (fp32 [D]) into the caches at (token, head) row `row`."""
    d = tl.arange(0, D)
    if KV8:
        kv8_store_row(k_cache_ptr + row * (D + KV8_PAD_JIT), k, D)
        kv8_store_row(v_cache_ptr + row * (D + KV8_PAD_JIT), v, D)
    else:
        tl.store(k_cache_ptr + row * D + d, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + row * D + d, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def attn_prep_kernel(proj_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, q_gain_ptr, k_gain_ptr,
                     inv_freq_ptr, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, GDC: tl.constexpr,
                     KV8: tl.constexpr = False):
    pid = tl.program_id(0)
    wait_prior(GDC)
    pos = tl.load(pos_ptr)
    d = tl.arange(0, D)
    is_q = pid < HQ
    kvh = pid - HQ
    base = tl.where(is_q, pid * 2 * D, HQ * 2 * D + kvh * D)
    y = norm_rope_head(proj_ptr, base, is_q, q_gain_ptr, k_gain_ptr, inv_freq_ptr, pos, eps, D, ROT)
    if is_q:
        tl.store(q_out_ptr + pid * D + d, y)
    else:
        v = tl.load(proj_ptr + HQ * 2 * D + HKV * D + kvh * D + d)
        store_kv(k_cache_ptr, v_cache_ptr, pos.to(tl.int64) * HKV + kvh, y, v, D, KV8)


@triton.jit
def attn_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, part_acc_ptr, part_ml_ptr, scale,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, BT: tl.constexpr, NSPLIT: tl.constexpr, UPCAST: tl.constexpr,
                      GDC: tl.constexpr, LONG_MIN: tl.constexpr = 0, BT_LONG: tl.constexpr = 0,
                      KV8: tl.constexpr = False):
    """grid (Hkv, NSPLIT): split `split` of the context for the G query heads of KV head kvh, in blocks of BT keys,
    or of BT_LONG where a split holds at least LONG_MIN keys (LONG_MIN 0: never)."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    wait_prior(GDC)
    length = tl.load(pos_ptr) + 1
    per = tl.cdiv(tl.cdiv(length, NSPLIT), BT) * BT
    start = split * per
    end = tl.minimum(start + per, length)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < G
    qd = load_queries(q_ptr, kvh * G, G, GP, D, scale, UPCAST, KV8)
    if LONG_MIN > 0 and per >= LONG_MIN:
        m, l, acc = attend_span(qd, k_cache_ptr, v_cache_ptr, 0, kvh, start, end, HKV, D, GP, BT_LONG, UPCAST, KV8)
    else:
        m, l, acc = attend_span(qd, k_cache_ptr, v_cache_ptr, 0, kvh, start, end, HKV, D, GP, BT, UPCAST, KV8)
    h = kvh * G + g
    tl.store(part_acc_ptr + (split * HQ + h)[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    tl.store(part_ml_ptr + (split * HQ + h) * 2, m, mask=gmask)
    tl.store(part_ml_ptr + (split * HQ + h) * 2 + 1, l, mask=gmask)


@triton.jit
def attn_combine_kernel(part_acc_ptr, part_ml_ptr, proj_ptr, o_ptr,
                        HQ: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr,
                        DB: tl.constexpr, GDC: tl.constexpr):
    """grid (HQ, D / DB): all splits of DB dims of one head in one tile (no serial loop over the splits)."""
    h = tl.program_id(0)
    d = tl.program_id(1) * DB + tl.arange(0, DB)
    wait_prior(GDC)
    # (the batched step's merge_splits, written out: the gate's load among the partials' loads, as this kernel
    # always had it; ptxas sm_90 schedules the batch-1 kernel exactly as before)
    s = tl.arange(0, NS_P2)
    smask = s < NSPLIT
    ms = tl.load(part_ml_ptr + (s * HQ + h) * 2, mask=smask, other=float("-inf"))
    ls = tl.load(part_ml_ptr + (s * HQ + h) * 2 + 1, mask=smask, other=0.0)
    a = tl.load(part_acc_ptr + (s * HQ + h)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    gate = tl.load(proj_ptr + h * 2 * D + D + d)
    mx = tl.max(ms, 0)
    w = tl.where(ms > float("-inf"), tl.exp(ms - mx), 0.0)
    acc = tl.sum(a * w[:, None], 0)
    den = tl.sum(ls * w, 0)
    tl.store(o_ptr + perm64(h * D + d), acc / den * tl.sigmoid(gate))   # PERM64 for o_proj


# -- launchers ---------------------------------------------------------------------------------------------

def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """inv_freq_j = theta^(-2j / rotary_dim), computed as Hugging Face does (fp32)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return (1.0 / (theta ** exps)).to(device)


# splits a KV head for split-K, read at each launch (None: the scratch's n_split); at most SPLITS_MAX (the scratch
# holds that many partials, 16 KB a split at the full model's 16 heads of 256)
SPLITS: int | None = None
SPLITS_MAX = 256
# split-K's (keys a block, warps), read at each launch (None: the caller's block_t and num_warps)
SPLIT_TILE: tuple[int, int] | None = None
# (keys a split at least, keys a block): a split that long walks its keys in blocks of that many (the kernel has
# both loops and picks at run time, so one graph serves every context); None: block_t everywhere. Read at each
# launch. H200, alternating rounds: 470.3 -> 474.3 and 470.0 -> 474.3 tok/s at 128K, 4K unchanged (664.1 / 664.3);
# blocks of 64 everywhere had cost 4K a little (665.7 -> 663.8, 64 keys a split there)
# (benchmarks/results/decode-h200-20261203-attn-split-tile.json)
LONG_SPAN: tuple[int, int] | None = (256, 64)
# split-K's pipeline stages (Triton's default, the H200's), and where a program may have less shared memory than
# they ask (138 KiB compiled for sm_86 / sm_89, over those cards' 99 KiB; two stages 74 KiB):
# lily.kernels.shared_memory
SPLIT_STAGES = 3
SPLIT_THREE_STAGES_BYTES = 140 * 1024


def split_stages(device) -> int:
    """num_stages of the split-K kernel on `device`."""
    return SPLIT_STAGES if max_shared_bytes(device) >= SPLIT_THREE_STAGES_BYTES else min(SPLIT_STAGES, 2)


# an int8 cache splits each KV head's context this many times more than the scratch's n_split (SPLITS unset): its
# loop decodes the codes, so it wants more programs an SM to hide the loads behind. H200, 128K, alternating rounds:
# 372.6 -> 412.5 tok/s at twice, 399.3 at four times; 4K unchanged (630.6 / 633.4)
KV8_SPLIT_FACTOR = 2


class AttentionScratch:
    """Per-model scratch of the decode attention (reused by every layer): partials for up to
    max(n_split, SPLITS_MAX) splits."""

    def __init__(self, hq: int, head_dim: int, n_split: int, device):
        self.n_split = n_split
        cap = max(n_split, SPLITS_MAX)
        self.q = torch.empty(hq * head_dim, dtype=torch.float32, device=device)
        self.part_acc = torch.empty(cap, hq, head_dim, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(cap, hq, 2, dtype=torch.float32, device=device)


def attention_decode(proj: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     q_gain: torch.Tensor, k_gain: torch.Tensor, inv_freq: torch.Tensor, eps: float,
                     hq: int, scratch: AttentionScratch, out: torch.Tensor, block_t: int = 32,
                     num_warps: int = 4) -> None:
    """Append this token's K/V at cache row pos[0] and write the gated attention output [Hq * D] to out
    (in PERM64 order, o_proj's input layout).
    k_cache, v_cache: [max_seq, Hkv, D] for this layer (bf16), or int8 rows (lily.kernels.kv_int8); pos: int32
    [1] on the device."""
    hkv, dim, kv8 = k_cache.shape[1], kv_head_dim(k_cache), is_kv8(k_cache)
    rot = inv_freq.numel() * 2
    attn_prep_kernel[(hq + hkv,)](proj, scratch.q, k_cache, v_cache, pos, q_gain, k_gain, inv_freq, eps,
                                  HQ=hq, HKV=hkv, D=dim, ROT=rot, GDC=pdl.gdc(out), KV8=kv8, num_warps=num_warps,
                                  **pdl.launch_opts(out, "attn"))
    g = hq // hkv
    ns = SPLITS or min(scratch.n_split * (KV8_SPLIT_FACTOR if kv8 else 1), scratch.part_acc.shape[0])
    if ns > scratch.part_acc.shape[0]:
        raise ValueError(f"attention_decode: {ns} splits, the scratch holds {scratch.part_acc.shape[0]}")
    bt, warps = SPLIT_TILE or (block_t, num_warps)
    long_min, bt_long = LONG_SPAN or (0, 0)
    attn_split_kernel[(hkv, ns)](scratch.q, k_cache, v_cache, pos, scratch.part_acc, scratch.part_ml,
                                 dim ** -0.5, HQ=hq, HKV=hkv, D=dim, G=g, GP=max(16, next_power_of_2(g)),
                                 BT=bt, NSPLIT=ns, UPCAST=UPCAST_DOT, GDC=pdl.gdc(out), LONG_MIN=long_min,
                                 BT_LONG=bt_long, KV8=kv8, num_warps=warps, num_stages=split_stages(out.device),
                                 **pdl.launch_opts(out, "attn"))
    db = min(dim, 64)
    attn_combine_kernel[(hq, dim // db)](scratch.part_acc, scratch.part_ml, proj, out, HQ=hq, D=dim, NSPLIT=ns,
                                         NS_P2=next_power_of_2(ns), DB=db,
                                         GDC=pdl.gdc(out), num_warps=num_warps, **pdl.launch_opts(out, "attn"))


# -- plain torch reference ---------------------------------------------------------------------------------

def rmsnorm_rope_reference(x: torch.Tensor, gain: torch.Tensor, pos: int, inv_freq: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """x [heads, D] -> RMSNorm(x) * gain, then NeoX RoPE on the first 2 * len(inv_freq) dims."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain.float()
    rot = inv_freq.numel() * 2
    ang = pos * inv_freq.float()
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    xr = x[:, :rot]
    rotated = torch.cat([-xr[:, rot // 2:], xr[:, : rot // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, x[:, rot:]], -1)


def attention_decode_reference(q: torch.Tensor, gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, gate [Hq, D] (q already normed and roped); k, v [L, Hkv, D] (the cache including this token)
    -> sigmoid(gate) * softmax(q k^T / sqrt(D)) v, flattened [Hq * D]; fp32."""
    hq, dim = q.shape
    g = hq // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)       # [Hq, L, D]
    vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    att = torch.softmax((q.float()[:, None, :] @ kk.transpose(1, 2)) * dim ** -0.5, -1)   # [Hq, 1, L]
    return ((att @ vv)[:, 0] * torch.sigmoid(gate.float())).reshape(-1)
