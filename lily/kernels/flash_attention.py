"""Causal flash attention for prefill (gated full-attention layers), continuing after a cached prefix.

Three launches per layer:
1. `write_kv_prefill`: k_norm (RMSNorm, gain) + partial NeoX RoPE on the new keys, stored with the new
   values into the layer's KV cache at positions pos0 .. pos0+T-1 (the layout the decode step reads).
   Every kernel reads pos0 from the device (an int32 [1] tensor), so a captured prefill graph serves any
   position; given a Python int, the wrappers put it there. Rows at or past the cache's end are neither
   written nor read (only a padded graph chunk's padding rows get there).
2. `flash_attention_prefill`: q_norm + RoPE (and the softmax scale) applied to the raw q_proj rows into a
   scratch [T, Hq*HD] (`_rope_q_kernel`), then per (query block, query head) online-softmax attention over
   cache rows 0 .. pos0+t (GQA: query head h reads KV head h // (Hq / Hkv)), and the output gate
   sigmoid(gate) applied on the way out. (Norm and RoPE inside the attention kernel cost it its registers:
   at head_dim 256 ptxas spilled 1-3 KB a thread, sm_90.) Query, key and value tiles arrive by TMA.

An int8 cache (lily.kernels.kv_int8) is written quantized a row at a time; the attention decodes the rows it
reads into a bf16 copy first (one pass a layer a chunk) and runs on that. (Decoding each tile inside the
attention loop, where the tiles are read once per query block, halved its speed at a 128K prompt on the H200:
12.6K against 27.5K tok/s.)

q_proj rows are per head [query (head_dim) | gate (head_dim)]. RoPE rotates dims [0, rot) with halves of
rot/2 (rotate_half); the angle pos * inv_freq[j] is formed in fp64 and rounded once to fp32, as the
reference computes it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lily.kernels.host_math import cdiv
from lily.kernels.kv_int8 import KV8_PAD_JIT, is_kv8, kv8_codes, kv8_dequantize_rows, kv8_scale, kv_head_dim
from lily.kernels.q4_gemm import UPCAST_DOT, mma
from lily.kernels.shared_memory import max_shared_bytes


@triton.jit
def _rope_cos_sin(pos, inv_freq_ptr, HALF: tl.constexpr):
    """cos and sin [R, HALF] of the NeoX RoPE angles pos[r] * inv_freq. The angle is formed in fp64 and
    rounded once to fp32, as the reference computes it (matters at 100K+ positions)."""
    freq = tl.load(inv_freq_ptr + tl.arange(0, HALF))
    ang = (pos.to(tl.float64)[:, None] * freq.to(tl.float64)[None, :]).to(tl.float32)
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def _norm_rope_rows(src_ptr, src_off, cos, sin, gain_ptr, eps, scale, HD: tl.constexpr, ROT: tl.constexpr):
    """scale * RMSNorm(gain) of rows src_ptr + src_off[r] [R, HD] with partial NeoX RoPE (cos, sin from
    _rope_cos_sin) on the first ROT dims, as three parts: the whole row (right past ROT), the rotated first and
    second halves of [0, ROT). The halves are loaded apart from the whole row (L1 hits) rather than gathered a
    partner column a thread: the gather made the q rotation ~6x slower (H200, 8K rows: 238 -> 41 us)."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HD)
    j = tl.arange(0, HALF)
    src = src_ptr + src_off[:, None]
    x = tl.load(src + d[None, :]).to(tl.float32)
    x1 = tl.load(src + j[None, :]).to(tl.float32)
    x2 = tl.load(src + HALF + j[None, :]).to(tl.float32)
    r = (tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps) * scale)[:, None]
    x1 = x1 * r * tl.load(gain_ptr + j).to(tl.float32)[None, :]
    x2 = x2 * r * tl.load(gain_ptr + HALF + j).to(tl.float32)[None, :]
    x = x * r * tl.load(gain_ptr + d).to(tl.float32)[None, :]
    return x, x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_rope_store(src_ptr, src_off, dst_ptr, dst_off, ok, cos, sin, gain_ptr, eps, scale,
                     HD: tl.constexpr, ROT: tl.constexpr):
    """Rows dst_ptr + dst_off[r] = _norm_rope_rows of rows src_ptr + src_off[r], stored where ok[r]."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HD)
    j = tl.arange(0, HALF)
    x, y1, y2 = _norm_rope_rows(src_ptr, src_off, cos, sin, gain_ptr, eps, scale, HD, ROT)
    dst = dst_ptr + dst_off[:, None]
    ty = dst_ptr.dtype.element_ty
    tl.store(dst + d[None, :], x.to(ty), mask=ok[:, None] & (d >= ROT)[None, :])
    tl.store(dst + j[None, :], y1.to(ty), mask=ok[:, None])
    tl.store(dst + HALF + j[None, :], y2.to(ty), mask=ok[:, None])


@triton.jit
def _kv8_store_rows(dst_ptr, row_off, ok, x, amax, HD: tl.constexpr):
    """Rows x [R, HD] (fp32) quantized with their max |x| [R] into int8 cache rows at byte offsets row_off."""
    d = tl.arange(0, HD)
    tl.store(dst_ptr + row_off[:, None] + d[None, :], kv8_codes(x, amax[:, None]), mask=ok[:, None])
    tl.store((dst_ptr + row_off + HD).to(tl.pointer_type(tl.float32)), kv8_scale(amax), mask=ok)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, gain_ptr, inv_freq_ptr, kc_ptr, vc_ptr, T, pos_ptr, max_seq, stride_k, stride_v,
                     eps, HKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr, BLOCK_T: tl.constexpr,
                     KV8: tl.constexpr = False):
    """K head h of rows t: k_norm + RoPE into k_cache, and v copied, at pos0 + t (KV8: quantized rows)."""
    pos0 = tl.load(pos_ptr).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (t < T) & (pos0 + t < max_seq)  # (a padded graph chunk's last rows may pass the cache's end)
    ts = tl.where(ok, t, 0).to(tl.int64)
    d = tl.arange(0, HD)
    h = tl.program_id(1)
    cos, sin = _rope_cos_sin(pos0 + ts, inv_freq_ptr, ROT // 2)
    v = tl.load(v_ptr + ts[:, None] * stride_v + h * HD + d[None, :])
    if KV8:
        HALF: tl.constexpr = ROT // 2
        j = tl.arange(0, HALF)
        dst = ((pos0 + ts) * HKV + h) * (HD + KV8_PAD_JIT)
        x, y1, y2 = _norm_rope_rows(k_ptr, ts * stride_k + h * HD, cos, sin, gain_ptr, eps, 1.0, HD, ROT)
        # the row's largest |value| over its three parts, then each part's codes where the bf16 path stores it
        amax = tl.maximum(tl.max(tl.where((d >= ROT)[None, :], tl.abs(x), 0.0), 1),
                          tl.maximum(tl.max(tl.abs(y1), 1), tl.max(tl.abs(y2), 1)))
        krow = kc_ptr + dst[:, None]
        tl.store(krow + d[None, :], kv8_codes(x, amax[:, None]), mask=ok[:, None] & (d >= ROT)[None, :])
        tl.store(krow + j[None, :], kv8_codes(y1, amax[:, None]), mask=ok[:, None])
        tl.store(krow + HALF + j[None, :], kv8_codes(y2, amax[:, None]), mask=ok[:, None])
        tl.store((kc_ptr + dst + HD).to(tl.pointer_type(tl.float32)), kv8_scale(amax), mask=ok)
        v = v.to(tl.float32)
        _kv8_store_rows(vc_ptr, dst, ok, v, tl.max(tl.abs(v), 1), HD)
    else:
        dst = ((pos0 + ts) * HKV + h) * HD
        _norm_rope_store(k_ptr, ts * stride_k + h * HD, kc_ptr, dst, ok, cos, sin, gain_ptr, eps, 1.0, HD, ROT)
        tl.store(vc_ptr + dst[:, None] + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _rope_q_kernel(qg_ptr, gain_ptr, inv_freq_ptr, q_ptr, T, pos_ptr, stride_qg, eps, scale,
                   HQ: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr, BLOCK_T: tl.constexpr):
    """q [T, HQ*HD] = RMSNorm + RoPE of head h's query half of qg, times scale (the attention kernel's
    softmax scale, in the exp2 domain)."""
    pos0 = tl.load(pos_ptr).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    ts = tl.where(ok, t, 0).to(tl.int64)
    h = tl.program_id(1)
    cos, sin = _rope_cos_sin(pos0 + ts, inv_freq_ptr, ROT // 2)
    _norm_rope_store(qg_ptr, ts * stride_qg + h * 2 * HD, q_ptr, (ts * HQ + h) * HD, ok, cos, sin, gain_ptr,
                     eps, scale, HD, ROT)


@triton.jit
def _attend(q, k_desc, v_desc, kvh, n0, hi, qpos, m_i, l_i, acc, HD: tl.constexpr,
            BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) of the online softmax; MASK: the causal and cache-end masks (the
    blocks on the diagonal), else every key is seen by every query."""
    k = k_desc.load([n0, kvh * HD])   # [BN, HD]
    s = mma(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), dtype=tl.float32), UPCAST)
    if MASK:
        # rows of the cache at or past hi hold anything (NaN in the tests): masked out of s, zeroed in v
        kpos = n0 + tl.arange(0, BLOCK_N)
        s = tl.where((kpos[None, :] <= qpos[:, None]) & (kpos < hi)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = v_desc.load([n0, kvh * HD])
    if MASK:
        v = tl.where((kpos < hi)[:, None], v, 0.0)
    acc = mma(p.to(tl.bfloat16), v, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _flash_attn_kernel(q_desc, k_desc, v_desc, qg_ptr, o_ptr, T, pos_ptr, max_seq, stride_qg, stride_o,
                       HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                       SPLIT_MASK: tl.constexpr):
    pos0 = tl.load(pos_ptr)
    # query blocks last to first: the longest rows of a causal prompt start first, not in the last wave
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (HQ // HKV)
    t = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = t < T
    ts = tl.where(ok, t, 0).to(tl.int64)
    qpos = pos0 + t
    d = tl.arange(0, HD)
    q = q_desc.load([mb * BLOCK_M, h * HD])   # (rows past T read as zeros)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HD), dtype=tl.float32)
    # keys past the block's last query are masked anyway; past the cache's end only padding rows would look
    hi = tl.minimum(pos0 + tl.minimum(mb * BLOCK_M + BLOCK_M, T), max_seq)
    # key blocks at or before the block's first query are seen by every query of it: no mask there
    lo = tl.minimum(pos0 + mb * BLOCK_M + 1, hi) // BLOCK_N * BLOCK_N if SPLIT_MASK else 0
    for n0 in range(0, lo, BLOCK_N):
        m_i, l_i, acc = _attend(q, k_desc, v_desc, kvh, n0, hi, qpos, m_i, l_i, acc, HD, BLOCK_N, UPCAST, False)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend(q, k_desc, v_desc, kvh, n0, hi, qpos, m_i, l_i, acc, HD, BLOCK_N, UPCAST, True)
    gate = tl.load(qg_ptr + ts[:, None] * stride_qg + h * 2 * HD + HD + d[None, :]).to(tl.float32)
    o = acc / l_i[:, None] * tl.sigmoid(gate)
    tl.store(o_ptr + ts[:, None] * stride_o + h * HD + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=ok[:, None])


def rope_inv_freq(rot: int, theta: float, device) -> torch.Tensor:
    """inv_freq_j = theta^(-2j/rot), j < rot/2, in fp64 as the reference computes it; the kernels form
    the angle pos * inv_freq in fp64 and round it once to fp32."""
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot))


def position_tensor(pos0: int | torch.Tensor, device) -> torch.Tensor:
    """pos0 as the kernels read it: an int32 [1] tensor on the device (a tensor is passed through)."""
    if isinstance(pos0, torch.Tensor):
        if pos0.dtype != torch.int32 or pos0.numel() != 1 or pos0.device != torch.device(device):
            raise ValueError(f"pos0 must be an int32 [1] tensor on {device}, got {pos0.dtype} {tuple(pos0.shape)}")
        return pos0
    return torch.full((1,), pos0, dtype=torch.int32, device=device)


def write_kv_prefill(k: torch.Tensor, v: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int | torch.Tensor,
                     eps: float = 1e-6) -> None:
    """k, v [T, Hkv*HD] raw projections; k_cache, v_cache [max_seq, Hkv, HD] of one layer (or its int8 rows),
    written at pos0 .. pos0+T-1 (K after k_norm and RoPE). pos0: an int, or an int32 [1] device tensor (then
    the caller has checked that pos0 + T fits the cache)."""
    T = k.shape[0]
    max_seq, Hkv, HD = k_cache.shape[0], k_cache.shape[1], kv_head_dim(k_cache)
    if (k.shape != (T, Hkv * HD) or v.shape != k.shape or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or k.stride(1) != 1 or v.stride(1) != 1):
        raise ValueError(f"write_kv_prefill: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if not isinstance(pos0, torch.Tensor) and pos0 + T > max_seq:
        raise ValueError(f"prompt of {pos0 + T} tokens does not fit the KV cache of {max_seq} positions")
    BT = 16
    _write_kv_kernel[(cdiv(T, BT), Hkv)](k, v, k_norm, inv_freq, k_cache, v_cache, T,
                                         position_tensor(pos0, k.device), max_seq,
                                         k.stride(0), v.stride(0), eps,
                                         HKV=Hkv, HD=HD, ROT=2 * inv_freq.numel(), BLOCK_T=BT,
                                         KV8=is_kv8(k_cache), num_warps=4)


# (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_MASK: the causal mask only on the diagonal key blocks)
# for head_dim > 128 and for smaller heads; module-level so scripts/gpu_prefill_check.py can sweep them
# (its tune part checks each against the reference).
# H200 (benchmarks/results/prefill-h200-20261201-attention-tma.json, one layer): a 4K chunk after 2K 0.731
# ms, 8K after 4K 2.27, 8K after 24K 7.19 (535 TFLOP/s); (64, 64, 4, 3) within 1 % at 4K, 6-12 % behind
# at 8K; 3 stages of 128 x 64 overflow shared memory.
TILES_WIDE = (128, 64, 8, 2, True)
TILES = (64, 64, 4, 2, False)
# head_dim > 128 where a program may have less shared memory than TILES_WIDE asks (112 KiB compiled for sm_86 /
# sm_89, over those cards' 99 KiB; these 72 KiB): lily.kernels.shared_memory.
TILES_WIDE_SMALL = (64, 64, 4, 3, True)
TILES_WIDE_BYTES = 115 * 1024


def tiles(head_dim: int, device) -> tuple[int, int, int, int, bool]:
    """The attention's (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_MASK) for head_dim on `device`."""
    if head_dim <= 128:
        return TILES
    return TILES_WIDE if max_shared_bytes(device) >= TILES_WIDE_BYTES else TILES_WIDE_SMALL


def flash_attention_prefill(qg: torch.Tensor, q_norm: torch.Tensor, inv_freq: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int | torch.Tensor,
                            num_heads: int, eps: float = 1e-6, out: torch.Tensor | None = None,
                            decoded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """qg [T, Hq*2*HD] (q_proj output, per head [query | gate]); caches [max_seq, Hkv, HD] (or int8 rows)
    already holding positions 0 .. pos0+T-1 (pos0: an int or an int32 [1] device tensor). Returns the gated
    attention output bf16 [T, Hq*HD]. decoded: with an int8 cache, bf16 [max_seq, Hkv, HD] buffers for its rows
    decoded (default: allocated a call; a captured graph passes buffers that outlive it, one pair a state, not
    a pair a layer a graph)."""
    T = qg.shape[0]
    max_seq, Hkv, HD = k_cache.shape[0], k_cache.shape[1], kv_head_dim(k_cache)
    if qg.shape[1] != num_heads * 2 * HD or qg.stride(1) != 1 or num_heads % Hkv:
        raise ValueError(f"flash_attention_prefill: qg {tuple(qg.shape)} does not fit {num_heads} heads of {HD}")
    if out is None:
        out = torch.empty(T, num_heads * HD, device=qg.device, dtype=torch.bfloat16)
    pos = position_tensor(pos0, qg.device)
    q = torch.empty(T, num_heads * HD, device=qg.device, dtype=torch.bfloat16)
    BT = 16
    _rope_q_kernel[(cdiv(T, BT), num_heads)](qg, q_norm, inv_freq, q, T, pos, qg.stride(0), eps,
                                             1.4426950408889634 / math.sqrt(HD),   # exp2 domain
                                             HQ=num_heads, HD=HD, ROT=2 * inv_freq.numel(), BLOCK_T=BT,
                                             num_warps=4)
    BM, BN, warps, stages, split_mask = tiles(HD, qg.device)
    if is_kv8(k_cache):
        # the rows this chunk reads, decoded (all max_seq of them for a position on the device: a graph's)
        rows = max_seq if isinstance(pos0, torch.Tensor) or decoded is not None else min(pos0 + T, max_seq)
        k_cache, v_cache = (kv8_dequantize_rows(cache, pos, T, rows, None if decoded is None else decoded[i])
                            for i, cache in enumerate((k_cache, v_cache)))
        max_seq = rows
    kv = k_cache.view(max_seq, Hkv * HD), v_cache.view(max_seq, Hkv * HD)
    _flash_attn_kernel[(cdiv(T, BM), num_heads)](
        TensorDescriptor.from_tensor(q, [BM, HD]), TensorDescriptor.from_tensor(kv[0], [BN, HD]),
        TensorDescriptor.from_tensor(kv[1], [BN, HD]), qg, out, T, pos, max_seq, qg.stride(0), out.stride(0),
        HQ=num_heads, HKV=Hkv, HD=HD, BLOCK_M=BM, BLOCK_N=BN, UPCAST=UPCAST_DOT, SPLIT_MASK=split_mask,
        num_warps=warps, num_stages=stages)
    return out


def norm_rope_reference(x: torch.Tensor, gain: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                        eps: float = 1e-6) -> torch.Tensor:
    """x [T, H, HD] -> fp32 RMSNorm(x) * gain with NeoX RoPE on the first 2*len(inv_freq) dims."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain.float()
    rot = 2 * inv_freq.numel()
    ang = (pos.double()[:, None] * inv_freq.double()[None, :]).float()
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    r = x[..., :rot]
    half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], -1)
    return torch.cat([r * cos + half * sin, x[..., rot:]], -1)


def attention_reference(qg: torch.Tensor, q_norm: torch.Tensor, inv_freq: torch.Tensor,
                        k_all: torch.Tensor, v_all: torch.Tensor, pos0: int, num_heads: int,
                        eps: float = 1e-6) -> torch.Tensor:
    """fp32 gated causal attention of T new queries over k_all/v_all [pos0+T, Hkv, HD] (K already normed
    and roped). Returns [T, Hq*HD]."""
    T = qg.shape[0]
    L, Hkv, HD = k_all.shape
    qg = qg.float().reshape(T, num_heads, 2 * HD)
    q = norm_rope_reference(qg[..., :HD], q_norm, torch.arange(pos0, pos0 + T, device=qg.device), inv_freq, eps)
    rep = num_heads // Hkv
    k = k_all.float().repeat_interleave(rep, 1)
    v = v_all.float().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HD)
    mask = torch.arange(L, device=qg.device)[None, :] <= torch.arange(pos0, pos0 + T, device=qg.device)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v)
    return (o * torch.sigmoid(qg[..., HD:])).reshape(T, num_heads * HD)
