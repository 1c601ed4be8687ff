"""Dense GEMM against an MLX affine-quantized weight (prefill projections), two ways (three on Hopper).

y[M, N] = x[M, K] @ w[N, K]^T with w[n, k] = scales[n, k // 64] * q[n, k] + biases[n, k // 64] and q the
LSB-first code in weight[n, k // (32 / bits)].
- Fused (short prompts): the codes are unpacked and scaled in registers, turned into a bf16 tile and fed to
  tl.dot (tensor cores); the dequantized matrix never exists in memory.
- Predequantized (M >= PREDEQUANT_MIN_M): the weight is dequantized once into a reused bf16 scratch matrix and
  multiplied by a plain bf16 GEMM (a pointer kernel, or with BF16_GEMM_TMA a persistent kernel over TMA
  descriptors); the extra memory traffic (~5 bytes a weight) is small against the work of
  thousands of rows, and the tensor cores run the plain GEMM faster (H200: 553 vs 364 TFLOP/s at 4K rows).
- On Hopper GPUs, 4-bit GEMMs of WGMMA_DENSE_MIN_M .. WGMMA_DENSE_MAX_M rows, and of fewer rows against a
  weight tall enough to fill the GPU, go to lily/kernels/moe_wgmma.py's dense mode (warpgroup MMA, the weight
  dequantized in registers).

Works for 4-bit (projections, lm_head) and 8-bit (router, shared-expert gate) weights. The weight stays in
the checkpoint's MLX layout: no repacking at load.

Epilogues: store (bf16 or fp32 output), or add into an fp32 output in place (the residual stream: each
output element belongs to exactly one program, so no atomics are needed).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lily.kernels import pdl
from lily.kernels.host_math import cdiv
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import sm_count
from lily.quant import QuantTensor

try:
    from lily.kernels import moe_wgmma
except ImportError:   # a Triton without Gluon's Hopper API (pyproject allows older ones): Triton kernels only
    moe_wgmma = None

# Triton 3.9's interpreter computes bf16 tl.dot wrongly; under TRITON_INTERPRET the kernels upcast to fp32
# (exact on the CPU). On the GPU the bf16 tensor-core path is used.
UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"
# 4-bit tiles dequantized two codes an instruction in bf16x2 PTX (below) on the GPU; the interpreter, which
# cannot run inline assembly, takes the fp32 path. LILY_FAST_DEQUANT=0 forces the fp32 path (an A/B switch).
FAST_DEQUANT = tl.constexpr(not UPCAST_DOT and os.environ.get("LILY_FAST_DEQUANT", "1") != "0")


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc += a @ b for bf16 tiles (fp32 accumulate); shared by the prefill kernels."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def mma_nt(a, b, acc, UPCAST: tl.constexpr):
    """acc += a @ b^T for bf16 tiles a [M, K], b [N, K] (b's K contiguous in the shared-memory copy)."""
    return mma(a, tl.trans(b), acc, UPCAST)


@triton.jit
def unpack_codes(words, BITS: tl.constexpr):
    """[R, W] int32 words -> [R, W, 32/BITS] codes (LSB first: code s of word w is column w*32/BITS + s).

    The codes of a word are put side by side with tl.join, which keeps the new axis inside the thread, so
    a thread holds 8 (4-bit) consecutive columns: the dequantized tile then reaches shared memory in
    16-byte stores (ptxas sm_90: STS.128; unpacking by broadcast shifts + reshape gave one 16-bit store
    an element, and by per-column word gathers, replicated loads)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        c0 = words & MASK
        c1 = (words >> 4) & MASK
        c2 = (words >> 8) & MASK
        c3 = (words >> 12) & MASK
        c4 = (words >> 16) & MASK
        c5 = (words >> 20) & MASK
        c6 = (words >> 24) & MASK
        c7 = (words >> 28) & MASK
        # index (d1, d2, d3) of the joined axes is code 4*d1 + 2*d2 + d3 (a join appends the last axis)
        r = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    else:
        c0 = words & MASK
        c1 = (words >> 8) & MASK
        c2 = (words >> 16) & MASK
        c3 = (words >> 24) & MASK
        r = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # (d1, d2) is code 2*d1 + d2
    return r


# One 4-bit word (8 codes, LSB first) -> 8 bf16 weights scale * code + bias in four bf16x2 registers, in
# column order. The masks put codes (0, 4), (1, 5), (2, 6), (3, 7) side by side in the two halves of a
# register; OR-ing 0x4300 makes each half the bf16 number 128 + code (exact: 7 mantissa bits); an fma
# by 1 and -128 leaves the code exactly, a second fma scale * code + bias rounds once (the fp32 path
# rounds to fp32 first, then to bf16: the two differ only where that double rounding does), and byte
# permutes put the pairs in column order. ~2.4 instructions a weight against ~5.5 on the fp32 path.
_Q4_BF16_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, one, m128;
mov.b32 one, 0x3F803F80;
mov.b32 m128, 0xC300C300;
lop3.b32 t0, $4, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t1, $4, 4;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t2, $4, 8;
lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t3, $4, 12;
lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, m128;
fma.rn.bf16x2 t1, t1, one, m128;
fma.rn.bf16x2 t2, t2, one, m128;
fma.rn.bf16x2 t3, t3, one, m128;
fma.rn.bf16x2 t0, t0, $12, $16;
fma.rn.bf16x2 t1, t1, $12, $16;
fma.rn.bf16x2 t2, t2, $12, $16;
fma.rn.bf16x2 t3, t3, $12, $16;
prmt.b32 $0, t0, t1, 0x5410;
prmt.b32 $1, t2, t3, 0x5410;
prmt.b32 $2, t0, t1, 0x7632;
prmt.b32 $3, t2, t3, 0x7632;
}
""")


@triton.jit
def _in_thread_x8(v):
    """[R, W] -> [R, W, 2, 2, 2], v repeated along three joined axes: the 8 copies stay in one thread, in
    register order (a broadcast would spread them over threads, and the tile would then reach shared
    memory one element at a time)."""
    v2 = tl.join(v, v)
    v4 = tl.join(v2, v2)
    return tl.join(v4, v4)


@triton.jit
def _dequant_q4_bf16(words, scale, bias, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """[BLOCK_N, W] int32 words, [BLOCK_N] bf16 scale and bias -> [BLOCK_N, W * 8] bf16 (see _Q4_BF16_ASM)."""
    s = tl.broadcast_to(scale[:, None], (BLOCK_N, W))
    b = tl.broadcast_to(bias[:, None], (BLOCK_N, W))
    out = tl.inline_asm_elementwise(
        _Q4_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [_in_thread_x8(words), _in_thread_x8(s), _in_thread_x8(b)], dtype=tl.bfloat16, is_pure=True, pack=8)
    return tl.reshape(out, (BLOCK_N, W * 8))


@triton.jit
def dequant_tile(w_ptr, s_ptr, b_ptr, n_idx, k0, KP, KG, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """[BLOCK_N, BLOCK_K] bf16 tile of w: weight rows n_idx (int64 [BLOCK_N], in range), columns
    k0 .. k0+BLOCK_K, which must be one quantization group (BLOCK_K == 64). KP: packed words a row, KG:
    groups a row (arguments, so Triton knows their divisibility and loads 16 bytes a thread)."""
    return dequant_rows(w_ptr + n_idx * KP, s_ptr + n_idx * KG, b_ptr + n_idx * KG, k0, BITS, BLOCK_K, BLOCK_N)


@triton.jit
def dequant_rows(w_rows, s_rows, b_rows, k0, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """dequant_tile from each row's own pointers ([BLOCK_N] each: its packed words, scales and biases), so a
    tile may gather rows of different matrices (the grouped MoE's gate and up rows in one tile)."""
    PER: tl.constexpr = 32 // BITS
    j = tl.arange(0, BLOCK_K // PER)
    words = tl.load(w_rows[:, None] + (k0 // PER + j)[None, :])
    g = k0 // 64
    if (FAST_DEQUANT and BITS == 4 and s_rows.dtype.element_ty == tl.bfloat16
            and b_rows.dtype.element_ty == tl.bfloat16):
        w = _dequant_q4_bf16(words, tl.load(s_rows + g), tl.load(b_rows + g), BLOCK_N, BLOCK_K // PER)
    else:
        # A code becomes a float without an int->float conversion (those issue at a fraction of the FMA
        # rate): the field OR-ed into the mantissa of 2^23 is exactly 2^23 + code, and one subtraction
        # leaves the code.
        codes = tl.reshape(unpack_codes(words, BITS), (BLOCK_N, BLOCK_K)) | 0x4B000000
        scale = tl.load(s_rows + g).to(tl.float32)
        bias = tl.load(b_rows + g).to(tl.float32)
        q = codes.to(tl.float32, bitcast=True) - 8388608.0
        w = (q * scale[:, None] + bias[:, None]).to(tl.bfloat16)
    return w


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, in grouped order: programs that share weight columns run
    close together (L2 reuse)."""
    return tile_in_group_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def tile_in_group_order(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number `tile`: GROUP_M row blocks walk the column blocks
    together, so tiles run close in time share their weight columns (L2 reuse)."""
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _q_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                   M, N, K, KP, KG, stride_xm, stride_ym, K_SPLIT,
                   BITS: tl.constexpr, ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr = False,
                   GDC: tl.constexpr = False):
    """y = x @ w^T over K columns [split * K_SPLIT, +K_SPLIT) of program_id(1)'s split; with SPLIT, the fp32
    partial goes to part[split], else to y (the epilogue). LAST_SUMS: the tile's last split to finish sums
    the partials (an arrival count a tile, count_ptr, zero between calls: that program sets it back), else
    _split_k_sum_kernel does, one launch later; either way in split order, so the result is the same bit for
    bit whichever split finished first. GDC: waits on the previous kernel first (lily.kernels.pdl; x and the
    residual come from it, and the arrival counts are the previous GEMM's until it ends)."""
    wait_prior(GDC)
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_safe = tl.where(n_ok, offs_n, 0).to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo, k_hi = 0, K
    if SPLIT:  # (unsplit, the loop keeps its plain bounds, which the pipeliner handles best)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None], other=0.0).to(tl.bfloat16)
        w = dequant_tile(w_ptr, s_ptr, b_ptr, n_safe, k0, KP, KG, BITS, BLOCK_K, BLOCK_N)
        acc = mma_nt(x, w, acc, UPCAST)

    ok = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT:
        part_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs + split * M * N, acc, mask=ok)
        if LAST_SUMS:
            # every thread's partial is stored before the count goes up (the barrier, then a release at GPU
            # scope); the last to arrive reads the others' through L2 after its acquire
            tile = tl.program_id(0)
            splits = tl.num_programs(1)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, splits):
                    acc += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                if ACCUMULATE:
                    acc += tl.load(y_ptrs, mask=ok, other=0.0)
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if ACCUMULATE:
            acc += tl.load(y_ptrs, mask=ok, other=0.0)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_k_sum_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLITS, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over the splits of part[split] (in split order: the result does not depend on which split
    finished first), plus y itself with ACCUMULATE."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    y_ptrs = y_ptr + (i // N) * stride_ym + i % N
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=ok, other=0.0)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, out_ptr, N, KP, KG, stride_out,
                    BITS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """out[n, k] = bf16 dequantized w for a [BLOCK_N, GROUPS * 64] tile (rows past N are not written)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_safe = tl.where(n_ok, offs_n, 0).to(tl.int64)
    for i in tl.static_range(GROUPS):
        k0 = (tl.program_id(1) * GROUPS + i) * 64
        w = dequant_tile(w_ptr, s_ptr, b_ptr, n_safe, k0, KP, KG, BITS, 64, BLOCK_N)
        tl.store(out_ptr + n_safe[:, None] * stride_out + (k0 + tl.arange(0, 64))[None, :], w,
                 mask=n_ok[:, None])


@triton.jit
def _gemm_nt_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = x @ w^T for bf16 x [M, K] and w [N, K] (K a multiple of BLOCK_K), the same epilogues."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = mma_nt(tl.load(x_ptrs), tl.load(w_ptrs), acc, UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=ok, other=0.0)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_tile(y_desc, acc, m0, n0, ACCUMULATE: tl.constexpr):
    """y[m0:, n0:] = acc (or += acc) for one [BLOCK_M, y block columns] piece; the descriptor clips rows
    past M and columns past N, and reads zeros there."""
    if ACCUMULATE:
        acc += y_desc.load([m0, n0])
    y_desc.store([m0, n0], acc.to(y_desc.dtype))


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its left and right [BLOCK_M, BLOCK_N / 2] halves."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _gemm_nt_tma_kernel(x_desc, w_desc, y_desc, M, N, K, programs,
                        ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        EPILOGUE_SPLIT: tl.constexpr):
    """_gemm_nt_kernel as a persistent kernel over TMA descriptors: `programs` programs walk the output tiles
    in grouped order, each taking every programs-th tile; the loop nest is flattened, so the next tile's
    first loads are in flight during this tile's epilogue. The epilogue stores the tile in EPILOGUE_SPLIT
    column pieces (y_desc's block), which keeps its shared-memory buffer small. (Triton 3.6's warp
    specialization does not apply to this loop on sm_90: tl.range(warp_specialize=True) built the same
    SASS.)"""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, programs, flatten=True):
        pid_m, pid_n = tile_in_group_order(tile, num_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = mma_nt(x_desc.load([m0, k0]), w_desc.load([n0, k0]), acc, UPCAST)
        if EPILOGUE_SPLIT == 1:
            _store_tile(y_desc, acc, m0, n0, ACCUMULATE)
        elif EPILOGUE_SPLIT == 2:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            _store_tile(y_desc, left, m0, n0, ACCUMULATE)
            _store_tile(y_desc, right, m0, n0 + BLOCK_N // 2, ACCUMULATE)
        else:
            tl.static_assert(EPILOGUE_SPLIT == 4)
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            q0, q1 = _halves(left, BLOCK_M, BLOCK_N // 2)
            q2, q3 = _halves(right, BLOCK_M, BLOCK_N // 2)
            _store_tile(y_desc, q0, m0, n0, ACCUMULATE)
            _store_tile(y_desc, q1, m0, n0 + BLOCK_N // 4, ACCUMULATE)
            _store_tile(y_desc, q2, m0, n0 + BLOCK_N // 2, ACCUMULATE)
            _store_tile(y_desc, q3, m0, n0 + 3 * BLOCK_N // 4, ACCUMULATE)


# Launch choices, module-level so scripts/gpu_prefill_check.py can sweep them on the GPU (its tune part).
# Fused path tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill-sized M, and for a short prompt
# (M <= SMALL_M), where the weight streams through few rows and more, smaller programs keep more loads in
# flight:
DENSE_LARGE = (256, 128, 8, 3)
DENSE_SMALL = (64, 64, 4, 4)
SMALL_M = 512
# From PREDEQUANT_MIN_M rows on, the weight is first dequantized into a bf16 scratch matrix (a few us of
# memory traffic) and multiplied by a plain bf16 GEMM (tiles BF16_TILES = (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages)), which the tensor cores run faster than a tile dequantized on the way in.
PREDEQUANT_MIN_M = 512   # H200 crossover with the bf16x2 dequantization (prefill-h200-20261130-dequant.json)
PREDEQUANT_MAX_WEIGHTS = 8192 * 4096   # the largest projection is 8192 x 2048; lm_head stays fused
BF16_TILES = (256, 128, 64, 8, 3)
BF16_SMALL = (64, 64, 64, 4, 4)
# Past SMALL_M rows, with BF16_GEMM_TMA the bf16 GEMM is the persistent TMA kernel (_gemm_nt_tma_kernel,
# one program an SM) with tiles BF16_TMA_TILES = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) and
# its epilogue in BF16_TMA_EPILOGUE_SPLIT column pieces (more where shared memory needs them); where x or
# out cannot be a TMA descriptor (a base or row stride not a multiple of 16 bytes) the pointer kernel
# runs. H200 (scripts/gpu_moe_profile.py --dense-ab, prefill-h200-20261201-dense-tma.json): 15-25 % faster
# than the pointer kernel from 4K rows (M=4096, N=12288, K=2048: 0.379 -> 0.305 ms), equal at 2K.
BF16_GEMM_TMA = True
# On Hopper, a 4-bit GEMM of WGMMA_DENSE_MIN_M .. WGMMA_DENSE_MAX_M rows runs on warpgroup MMA with the
# weights dequantized in registers (lily/kernels/moe_wgmma.py's dense mode) rather than the fused kernel
# (each tile turned into bf16 in shared memory first) or the predequantized GEMM. H200, a prompt's dense
# GEMMs (benchmarks/results/prefill-h200-20261201-dense-wgmma.json): 128 rows 3.33 -> 2.92 ms, 256 4.26 ->
# 3.24, 512 5.56 -> 4.31, 1024 7.82 -> 7.31 in the first run; re-runs at 256 rows scattered (3.7-4.8 ms
# against 4.2-4.4 fused: the GEMMs alone are short and their weights stay in L2), and the end-to-end bench
# decided: a 256-token prompt 11,769 -> 12,293 tok/s. Fewer rows stay on the split-K path.
WGMMA_DENSE = True
WGMMA_DENSE_MIN_M = 65
WGMMA_DENSE_MAX_M = 1024
# Fewer rows (a decode batch, a prompt's last short chunk) go there too when the weight has enough rows for
# a wave of the kernel's 64-row programs: 1 to 16 rows, the kernel streams the weights faster than the split-K
# path (benchmarks/results/gemv-tc-probe-h200-20261202.json, H200: the GDN in-projection 12352 x 2048 at 8 rows
# 19.6 -> 14.9 us, attention's q|k|v 9216 x 2048 16.0 -> 14.5, lm_head 229 -> 143); with fewer programs than SMs
# it is slower (2048 x 4096: 10.7 -> 24.6 us), so those stay on the split-K path.
WGMMA_DENSE_SKINNY_PROGRAMS_PER_SM = 1
# ... and there K is split over more programs (moe_wgmma.dense_splits: the batched step 1-2 % faster at 8-16 rows),
# the parts summed in order by each tile's last part to finish (the same sum whichever part ends first).
WGMMA_DENSE_SPLIT = True
# A short, deep weight (the GDN out-projection, 2048 x 4096: 32 programs unsplit) goes there too when its tiles
# times dense_splits' parts fill that wave: WGMMA_DENSE_SKINNY_SPLIT. H100 (benchmarks/results/
# batch-h100-20261206-skinny-split.json): in 8 parts 7.7 us a launch at 8 rows against the split-K path's 9.8, the
# batched step at 4K 4.85 -> 4.78 ms at 8 rows and 12.14 -> 11.81 at 32.
WGMMA_DENSE_SKINNY_SPLIT = True
BF16_TMA_TILES = (128, 256, 64, 8, 3)
BF16_TMA_EPILOGUE_SPLIT = 2
SM90_SHARED_BYTES = 232448   # shared memory one program may have on the H200 (227 KiB)
_SCRATCH: dict = {}
_COUNTS: dict = {}
# A split GEMM's partials are summed by each output tile's last split to finish (an arrival count a tile) rather
# than by a kernel after it: one launch fewer a split GEMM (the batched decode step has 120 of them). The same
# sum in the same order either way. H200, the batched step at 4K: 3.58 -> 3.40 ms at 2 rows, 4.23 -> 4.05 at 4,
# 5.52 -> 5.34 at 8 (benchmarks/results/batch-h200-20261202-last-sums.json).
SPLIT_K_LAST_SUMS = True
ARRIVAL_COUNTS = 1 << 16   # output tiles a split GEMM may have to be summed so (more: the sum kernel)


# A skinny GEMM (the batched decode step's few rows) has few output tiles, each a long walk over K: one
# program an SM or less, bound by the latency of its loads. From SPLIT_K_MAX_M rows down, K is split so that
# about SPLIT_K_PROGRAMS_PER_SM programs an SM run, each over at least SPLIT_K_MIN_GROUPS groups of 64, and
# the fp32 partials are summed in a fixed order by a second small kernel.
SPLIT_K_MAX_M = 64
SPLIT_K_PROGRAMS_PER_SM = 4
SPLIT_K_MIN_GROUPS = 4
# More rows than that, but fewer output tiles than SPLIT_K_FEW_TILES, split too: a short prompt's router
# (257 columns, 8-bit, so not on the Hopper dense path) is 20 tiles at 256 rows, each a walk over all of
# K = 2048 (~21 us a layer on the H200, most of the GPU idle). 0: only the row bound decides.
SPLIT_K_FEW_TILES = 32
GPU_SMS = 132  # the H200's SMs: under the interpreter the splits are chosen as on the GPU


def gpu_sms(device) -> int:
    """The device's SMs; under the interpreter GPU_SMS, so launches are shaped as on the GPU."""
    return sm_count(device) if torch.device(device).type == "cuda" else GPU_SMS


def splits_for(programs: int, K: int, device, per_sm: int | None = None, min_groups: int | None = None) -> int:
    """Splits of K that bring `programs` output tiles to about `per_sm` (default SPLIT_K_PROGRAMS_PER_SM)
    programs an SM, each over at least `min_groups` (default SPLIT_K_MIN_GROUPS) groups of 64 (1: none)."""
    sms = gpu_sms(device)
    per_sm = SPLIT_K_PROGRAMS_PER_SM if per_sm is None else per_sm
    min_groups = SPLIT_K_MIN_GROUPS if min_groups is None else min_groups
    want = cdiv(per_sm * sms, max(1, programs))
    return max(1, min(want, (K // 64) // min_groups))


def split_k(M: int, N: int, K: int, device, bits: int = 4) -> int:
    """Splits of K for the fused path's tiles at M rows of a `bits`-bit weight (1: none)."""
    BM, BN, _, _ = _config(M, N, bits)
    tiles = cdiv(M, BM) * cdiv(N, BN)
    if M > SPLIT_K_MAX_M and tiles >= SPLIT_K_FEW_TILES:
        return 1
    return splits_for(tiles, K, device,
                      min_groups=SPLIT_K_MIN_GROUPS_8BIT if bits == 8 and M <= SPLIT_K_MAX_M else None)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) at up to 16 rows and up to 64 (decode batches, tiny prompts)
SKINNY_TILES = (16, 64, 4, 4)
MID_TILES = (64, 128, 4, 4)
# The same for the 8-bit router (257 x 2048: a handful of output tiles at these rows), and the groups of 64 a
# split of its K takes at least (SPLIT_K_MIN_GROUPS for the others). Narrower tiles, more programs: H100, the
# batched step at 4K (benchmarks/results/batch-h100-20261206-router-tiles.json, `scripts/gpu_batch_check.py
# --sweep-tiles router`) 4.78 -> 4.70 ms at 8 rows, 7.03 -> 6.95 at 16, 11.75 -> 11.21 at 32 against the shared
# tiles; the least split 4 stayed the best of 4 / 2 / 1.
SKINNY_TILES_8BIT = (16, 32, 4, 4)
MID_TILES_8BIT = (16, 32, 4, 4)
SPLIT_K_MIN_GROUPS_8BIT = SPLIT_K_MIN_GROUPS


def _config(M: int, N: int, bits: int = 4) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the fused path for M rows of a `bits`-bit weight;
    BLOCK_K is one quantization group."""
    if M <= 16:
        return SKINNY_TILES_8BIT if bits == 8 else SKINNY_TILES
    if M <= 64:
        return MID_TILES_8BIT if bits == 8 else MID_TILES
    return DENSE_SMALL if M <= SMALL_M else DENSE_LARGE


def dequantize_bf16(w: QuantTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 matrix [N, K] of a 2-D 4/8-bit group-64 weight (each element rounded once from fp32)."""
    N, K = w.shape
    if out is None:
        out = torch.empty(N, K, device=w.weight.device, dtype=torch.bfloat16)
    groups = 4 if K % 256 == 0 else 1
    _dequant_kernel[(cdiv(N, 64), K // (64 * groups))](
        w.weight.view(torch.int32), w.scales, w.biases, out, N, K * w.bits // 32, K // 64, out.stride(0),
        BITS=w.bits, BLOCK_N=64, GROUPS=groups, num_warps=4)
    return out


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor with contiguous rows can be a TMA descriptor: base and row stride multiples of 16
    bytes."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _epilogue_split(out: torch.Tensor, accumulate: bool) -> int:
    """Column pieces of the TMA kernel's epilogue: BF16_TMA_EPILOGUE_SPLIT, doubled (up to 4) while the
    pipeline's stages and the epilogue's piece buffers (a store, and with accumulate a load) overflow shared
    memory."""
    BM, BN, BK, _, stages = BF16_TMA_TILES
    pipeline = stages * (BM + BN) * BK * 2
    split = BF16_TMA_EPILOGUE_SPLIT
    while split < 4 and pipeline + (1 + accumulate) * BM * BN // split * out.element_size() > SM90_SHARED_BYTES:
        split *= 2
    return split


def _gemm_nt_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (+)= x @ w^T by _gemm_nt_tma_kernel; x [M, K], w [N, K] bf16 and out [M, N], all _tma_ready."""
    (M, K), N = x.shape, w.shape[0]
    BM, BN, BK, warps, stages = BF16_TMA_TILES
    split = _epilogue_split(out, accumulate)
    programs = min(cdiv(M, BM) * cdiv(N, BN), gpu_sms(x.device))
    _gemm_nt_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]),
        TensorDescriptor.from_tensor(out, [BM, BN // split]), M, N, K, programs,
        ACCUMULATE=accumulate, UPCAST=UPCAST_DOT, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8,
        EPILOGUE_SPLIT=split, num_warps=warps, num_stages=stages)


def _scratch(n: int, device) -> torch.Tensor:
    """A reused bf16 buffer of at least n elements (prefill runs its GEMMs one after another)."""
    key = str(device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, device=device, dtype=torch.bfloat16)
    return buf[:n]


def _dense_splits(M: int, N: int, K: int, device) -> int:
    """The parts of K the Hopper dense mode takes for M rows of an [N, K] weight (1: unsplit)."""
    return moe_wgmma.dense_splits(M, N, K, gpu_sms(device)) if WGMMA_DENSE_SPLIT else 1


def _takes_wgmma_dense(x: torch.Tensor, w: QuantTensor, out: torch.Tensor) -> bool:
    """Whether q_gemm sends this GEMM to the Hopper dense mode (WGMMA_DENSE; never under the interpreter):
    WGMMA_DENSE_MIN_M .. WGMMA_DENSE_MAX_M rows, or fewer where the weight's rows (with
    WGMMA_DENSE_SKINNY_SPLIT, times the parts of K) fill a wave of programs."""
    if not WGMMA_DENSE or moe_wgmma is None or UPCAST_DOT or w.bits != 4:
        return False
    (M, K), N = x.shape, w.shape[0]
    if WGMMA_DENSE_MIN_M <= M <= WGMMA_DENSE_MAX_M:
        rows_ok = True
    elif 1 <= M < WGMMA_DENSE_MIN_M:
        programs = N // moe_wgmma.DENSE_TILES[0]
        if WGMMA_DENSE_SKINNY_SPLIT:
            programs *= _dense_splits(M, N, K, x.device)
        rows_ok = programs >= WGMMA_DENSE_SKINNY_PROGRAMS_PER_SM * gpu_sms(x.device)
    else:
        rows_ok = False
    return rows_ok and moe_wgmma.dense_fits(x, w, out)


def _check_operands(x: torch.Tensor, w: QuantTensor) -> tuple[int, int, int]:
    """(M, N, K) of x [M, K] @ w^T, w a 2-D 4/8-bit group-64 QuantTensor [N, K]."""
    *lead, N, K = w.shape
    if lead or w.group_size != 64 or w.bits not in (4, 8):
        raise ValueError(f"q_gemm needs a 2-D 4/8-bit group-64 weight, got shape {w.shape} bits {w.bits}")
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"q_gemm: x is {tuple(x.shape)}, expected [M, {K}] with contiguous rows")
    return x.shape[0], N, K


def _takes_predequant(M: int, N: int, K: int) -> bool:
    BKb = (BF16_SMALL if M <= SMALL_M else BF16_TILES)[2]
    return M >= PREDEQUANT_MIN_M and N * K <= PREDEQUANT_MAX_WEIGHTS and K % BKb == 0


def _arrival_counts(device) -> torch.Tensor:
    """int32 zeros [ARRIVAL_COUNTS] for LAST_SUMS' arrival counts, one buffer a device for good (CUDA graphs
    keep its address; the GEMMs of a stream run one after another, and each leaves its counts at zero)."""
    key = str(device)
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(ARRIVAL_COUNTS, device=device, dtype=torch.int32)
    return _COUNTS[key]


def _fused(x: torch.Tensor, w: QuantTensor, out: torch.Tensor, accumulate: bool, n_split: int,
           keep_parts: bool = False, pdl_family: str | None = None):
    """The fused kernel over n_split parts of K: with one part it writes out (accumulate: adds); with more,
    the partials are summed into out by each tile's last split (SPLIT_K_LAST_SUMS) or a kernel after it, or
    with keep_parts returned, fp32 [parts, M, N] unsummed (the parts actually made: no empty one)."""
    (M, K), N = x.shape, w.shape[0]
    BM, BN, warps, stages = _config(M, N, w.bits)
    k_split = cdiv(K // 64, max(1, n_split)) * 64
    n_split = cdiv(K, k_split)   # (no empty split)
    part = torch.empty(n_split, M, N, device=x.device, dtype=torch.float32) if n_split > 1 else out
    tiles = cdiv(M, BM) * cdiv(N, BN)
    last_sums = n_split > 1 and SPLIT_K_LAST_SUMS and not keep_parts and tiles <= ARRIVAL_COUNTS
    counts = _arrival_counts(x.device) if last_sums else part
    _q_gemm_kernel[(tiles, n_split)](x, w.weight.view(torch.int32), w.scales, w.biases, out, part, counts,
                                     M, N, K, K * w.bits // 32, K // 64, x.stride(0), out.stride(0), k_split,
                                     BITS=w.bits, ACCUMULATE=accumulate, UPCAST=UPCAST_DOT,
                                     BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=64, GROUP_M=8, SPLIT=n_split > 1,
                                     LAST_SUMS=last_sums, num_warps=warps, num_stages=stages,
                                     **pdl.kernel_args(out, pdl_family))
    if n_split > 1 and not keep_parts and not last_sums:
        _split_k_sum_kernel[(cdiv(M * N, 1024),)](part, out, M, N, out.stride(0), n_split,
                                                  ACCUMULATE=accumulate, BLOCK=1024, num_warps=4)
    return part if keep_parts and n_split > 1 else None


def q_gemm(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None, accumulate: bool = False,
           out_dtype: torch.dtype = torch.bfloat16, splits: int | None = None,
           pdl_family: str | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ w^T, w a QuantTensor [N, K] (4- or 8-bit, group 64).

    With accumulate=True, `out` (fp32 [M, N]) is updated in place: out += x @ w^T. splits: how many parts
    K is split into on the fused path (default `split_k`'s choice). pdl_family: the lily.kernels.pdl family
    whose launches of the fused Triton kernel are programmatic (the other paths launch plainly).
    """
    M, N, K = _check_operands(x, w)
    if out is None:
        if accumulate:
            raise ValueError("q_gemm: accumulate=True needs an out tensor")
        out = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"q_gemm: out is {tuple(out.shape)}, expected [{M}, {N}] with contiguous rows")
    if _takes_wgmma_dense(x, w, out):
        split = _dense_splits(M, N, K, x.device)
        moe_wgmma.dense(x, w, out, accumulate, split=split, counts=_arrival_counts(x.device) if split > 1 else None)
        return out
    if _takes_predequant(M, N, K):
        BMb, BNb, BKb, warps_b, stages_b = BF16_SMALL if M <= SMALL_M else BF16_TILES
        wd = dequantize_bf16(w, _scratch(N * K, x.device).view(N, K))
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if BF16_GEMM_TMA and M > SMALL_M and _tma_ready(xb) and _tma_ready(out):
            _gemm_nt_tma(xb, wd, out, accumulate)
            return out
        grid = (cdiv(M, BMb) * cdiv(N, BNb),)
        _gemm_nt_kernel[grid](xb, wd, out, M, N, K, xb.stride(0), wd.stride(0), out.stride(0),
                              ACCUMULATE=accumulate, UPCAST=UPCAST_DOT, BLOCK_M=BMb, BLOCK_N=BNb, BLOCK_K=BKb,
                              GROUP_M=8, num_warps=warps_b, num_stages=stages_b)
        return out
    _fused(x, w, out, accumulate, split_k(M, N, K, x.device, w.bits) if splits is None else splits,
           pdl_family=pdl_family)
    return out


def q_gemm_parts(x: torch.Tensor, w: QuantTensor) -> torch.Tensor | None:
    """Where q_gemm(x, w, out_dtype=fp32) splits K on the fused path: its fp32 partial products [S, M, N],
    unsummed; their sum in split order (0 + part[0] + part[1] + ...) is that q_gemm's result bit for
    bit. For a consumer that sums them as it reads them (moe_topk: one launch fewer). None where q_gemm
    would not split (call it instead)."""
    M, N, K = _check_operands(x, w)
    n_split = split_k(M, N, K, x.device, w.bits)
    if n_split < 2 or _takes_predequant(M, N, K):
        return None
    out = torch.empty(M, N, device=x.device, dtype=torch.float32)
    if _takes_wgmma_dense(x, w, out):
        return None
    part = _fused(x, w, out, False, n_split, keep_parts=True)
    return part if part is not None else out[None]   # (K too short to split after all: out is the product)


def q_gemm_reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """fp32 x @ dequant(w)^T."""
    return x.float() @ w.dequantize(torch.float32).T


@triton.jit
def _rmsnorm_kernel(x_ptr, g_ptr, y_ptr, yp_ptr, M, stride_x, stride_y, eps, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    PERMUTED: tl.constexpr, GDC: tl.constexpr = False):
    wait_prior(GDC)                      # x comes from the previous kernel
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < M
    r = tl.where(ok, r, 0).to(tl.int64)
    d = tl.arange(0, K)
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :]).to(tl.float32)
    yf = x * tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)[:, None] * tl.load(g_ptr + d).to(tl.float32)[None, :]
    y = yf.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r[:, None] * stride_y + d[None, :], y, mask=ok[:, None])
    if PERMUTED == 1:  # natural column d = 16 q + 8 h + 4 e + s of a 64-group at 16 s + 8 h + 2 q + e (perm_k_index)
        m = d % 64
        at = d - m + 16 * (m % 4) + 8 * ((m // 8) % 2) + 2 * (m // 16) + (m // 4) % 2
        tl.store(yp_ptr + r[:, None] * K + at[None, :], y, mask=ok[:, None])
    if PERMUTED == 2:  # fp32 in quant_gemv's PERM64 order (an involution inside each 64-group)
        at = (d // 64) * 64 + (d % 8) * 8 + (d // 8) % 8
        tl.store(yp_ptr + r[:, None] * K + at[None, :], yf, mask=ok[:, None])


def rmsnorm_rows(x: torch.Tensor, gain: torch.Tensor, eps: float, permuted_copy: bool = False,
                 perm64_copy: bool = False, pdl_family: str | None = None):
    """The projections' input: bf16 RMSNorm(x) * gain of the fp32 residual rows x [M, K] (K a power of 2).
    permuted_copy: also the same rows with each 64-group's columns in lily.kernels.moe_wgmma.perm_k_index
    order (the Hopper MoE kernels' cheaper order for small blocks), as a second [M, K] tensor: (y, y_p).
    perm64_copy: instead, the second tensor is fp32 (before the bf16 rounding) in quant_gemv's PERM64 order
    (the decode MoE kernels' input order, lily.kernels.moe_union). pdl_family: the lily.kernels.pdl family whose
    launches are programmatic."""
    M, K = x.shape
    if (gain.shape != (K,) or x.stride(1) != 1 or K & (K - 1) or ((permuted_copy or perm64_copy) and K % 64)
            or (permuted_copy and perm64_copy)):
        raise ValueError(f"rmsnorm_rows: x {tuple(x.shape)}, gain {tuple(gain.shape)}, one permuted copy at most")
    y = torch.empty(M, K, device=x.device, dtype=torch.bfloat16)
    if perm64_copy:
        yp = torch.empty(M, K, device=x.device, dtype=torch.float32)
    else:
        yp = torch.empty_like(y) if permuted_copy else y
    bm = max(1, min(16, 4096 // K))
    _rmsnorm_kernel[(cdiv(M, bm),)](x, gain, y, yp, M, x.stride(0), y.stride(0), eps, K=K, BLOCK_M=bm,
                                    PERMUTED=2 if perm64_copy else int(permuted_copy), num_warps=4,
                                    **pdl.kernel_args(y, pdl_family))
    return (y, yp) if permuted_copy or perm64_copy else y
