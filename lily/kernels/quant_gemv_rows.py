"""The decode GEMV over a few input rows (a small decode batch's dense projections): out[m] = W x_m for m < M,
each weight tile loaded and its codes decoded once for all M rows.

A batch of 2-4 sequences reads every dense weight once a step, as one sequence does; on tensor cores (q_gemm's
skinny tiles, weights dequantized to bf16 in registers) that step's projections took twice the batch-1 GEMVs'
time at 2 rows (benchmarks/results/batch-h200-20261203-half-dot.json: 1.47 ms against 0.71 for one row). Here
the batch-1 GEMV's loop (lily.kernels.quant_gemv: persistent programs, the next tile in flight during this
one's arithmetic) runs with every row's x in registers: a tile's codes are decoded once (at 4 bits in fp16
pairs, lily.kernels.half_dot.half_dot_rows) and only the FMAs repeat a row.

Inputs in natural order (x [M, K], rows `x_stride` apart, bf16 or fp32). X_MODE 0: x as stored; 1: RMSNorm(x)
* gain (the block's pre-norm, fused: each row's 1/rms applied to its sums). Out fp32 [M, N] (`out_stride`),
stored, or added to in place (ACCUMULATE: the residual stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.half_dot import half_dot_rows, pair_rows_constraints, pair_rows_ptx, x_scale, x_word_pairs
from lily.kernels.host_math import cdiv
from lily.kernels import pdl
from lily.kernels.pdl import INTERPRET, wait_prior
from lily.kernels import quant_gemv
from lily.kernels.quant_gemv import (PackedLinear, code_value, pick_block, rmsnorm_reference, sm_count,
                                     split_halves, weight_tile, x_codes, x_codes_with_sums, x_groups, x_prologue)

# the most rows a launch takes (x per code position is held for every row: registers grow with M); the batched
# decode step sends buckets up to this many rows here (lily.model.fast_batch)
MAX_ROWS = 4
# (weight rows a block, programs an SM, warps) by (input rows, weight family): "narrow" (the in-projections, K < 4096),
# "wide" K >= 4096 (the out-projections), "head" N >= 65536 (the lm_head), "8bit" (the router). H200 sweep at 2 and 4
# rows, each candidate in a CUDA graph, the family's launches a step summed (scripts/gpu_batch_check.py
# --sweep-gemv-rows, benchmarks/results/batch-h200-20261203-gemv-rows.json): one program an SM of 8 warps and
# big blocks for the 4-bit projections (their x rows' registers: 168 at 2 rows and 238 at 4 on 4 warps at K=2048,
# ptxas sm_90); 1 and 3 rows (no graph bucket of their own) take 2's and 4's.
BLOCKS: dict[tuple[int, str], tuple[int, int, int]] = {
    (1, "narrow"): (32, 1, 8), (2, "narrow"): (32, 1, 8), (3, "narrow"): (32, 1, 8), (4, "narrow"): (32, 1, 8),
    (1, "wide"): (16, 1, 8), (2, "wide"): (16, 1, 8), (3, "wide"): (16, 1, 8), (4, "wide"): (16, 1, 8),
    (1, "head"): (16, 2, 8), (2, "head"): (16, 2, 8), (3, "head"): (16, 2, 4), (4, "head"): (16, 2, 4),
    (1, "8bit"): (2, 4, 4), (2, "8bit"): (2, 4, 4), (3, "8bit"): (2, 4, 4), (4, "8bit"): (2, 4, 4),
}


def family(n: int, k: int, bits: int) -> str:
    """The BLOCKS family of a [n, k] weight of `bits` bits."""
    if bits != 4:
        return "8bit"
    return "wide" if k >= 4096 else "head" if n >= 65536 else "narrow"


def pick_rows_block(m: int, n: int, k: int, bits: int) -> tuple[int, int, int]:
    """(weight rows a block, programs an SM, warps) for m input rows (under the interpreter, quant_gemv's)."""
    if INTERPRET:
        return pick_block(n, k, bits)
    return BLOCKS[(m, family(n, k, bits))]


@triton.jit
def _row_input(x_ptr, gain_ptr, eps, word, wmask, g, gmask, K: tl.constexpr, BITS: tl.constexpr,
               X_MODE: tl.constexpr, HALF_DOT: tl.constexpr, NGP: tl.constexpr, WPG: tl.constexpr,
               SUMS_FROM_CODES: tl.constexpr = False):
    """One input row as the dot takes it: (x per code position (HALF_DOT: x_word_pairs), the group sums of x
    [1, NGP] (the bias term), the factor for the row's sums (its 1/rms with X_MODE 1, and the pair dot's scale)).
    SUMS_FROM_CODES: the sums from the dot's own loads of x, as the batch-1 GEMV's (quant_gemv.SUMS_FROM_CODES),
    so each row's result stays that GEMV's bit for bit."""
    if SUMS_FROM_CODES:
        xc, xsum, ssq, amax = x_codes_with_sums(x_ptr, gain_ptr, word, wmask, False, X_MODE, NGP)
        x0, x1, x2, x3, x4, x5, x6, x7 = xc
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = x_codes(x_ptr, gain_ptr, x_ptr, x_ptr, eps, word, wmask, False, X_MODE, 1,
                                                 1, BITS, HALF_DOT)
        kg = g[:, None] * 64 + tl.arange(0, 64)[None, :]
        xg, rawg = x_prologue(kg, gmask[:, None], x_ptr, gain_ptr, x_ptr, x_ptr, eps, X_MODE, 1, 1, False)
        xsum = tl.sum(xg, axis=1)[None, :]                                           # [1, NGP]
        ssq = tl.sum(tl.sum(rawg * rawg, 1), 0)
        amax = tl.max(tl.max(tl.abs(xg), 1), 0)
    factor = 1.0
    if X_MODE == 1:
        factor = tl.rsqrt(ssq / K + eps)
    if HALF_DOT:
        xs = x_scale(amax)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, xs)
        xsum = xsum * xs
        factor = factor / xs
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = x_groups(x0, x1, x2, x3, x4, x5, x6, x7, NGP, WPG)
    return (x0, x1, x2, x3, x4, x5, x6, x7), xsum, factor


@triton.jit
def _code_values(w, BITS: tl.constexpr):
    """The fp32 dot's code values of words w (quant_gemv.code_value, each code times 2^its shift), decoded once
    for every row: a tuple of 8 (the last 4 unused at 8 bits). (quant_gemv.dot_codes stays its own interleaved
    sequence: written through these two helpers it took the 8-bit router's GEMV from 128 to 150 registers, ptxas
    sm_90.)"""
    PER: tl.constexpr = 32 // BITS
    lo, hi = split_halves(w)
    out = ()
    for j in tl.static_range(8):
        if j < PER:
            out = out + (code_value(lo, hi, j, BITS),)
        else:
            out = out + (out[0],)
    return out


@triton.jit
def _codes_dot(c, x, BITS: tl.constexpr):
    """sum_j c_j * x_j (quant_gemv.dot_codes' order) of decoded codes c and one row's x (8 each)."""
    q = c[0] * x[0]
    q += c[1] * x[1]
    q += c[2] * x[2]
    q += c[3] * x[3]
    if BITS == 4:
        q += c[4] * x[4]
        q += c[5] * x[5]
        q += c[6] * x[6]
        q += c[7] * x[7]
    return q


@triton.jit
def q_gemv_rows_kernel(out_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr, N, eps, x_stride, out_stride,
                       M: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                       X_MODE: tl.constexpr, ACCUMULATE: tl.constexpr, HALF_DOT: tl.constexpr, ASM: tl.constexpr,
                       ROWS_PTX: tl.constexpr, ROWS_CONSTRAINTS: tl.constexpr,
                       SUMS_FROM_CODES: tl.constexpr = False, GDC: tl.constexpr = False):
    """Persistent over blocks of BN weight rows (program p: blocks p, p + P, ...); every input row's x built once
    a program; the next block's tile requested before this block's arithmetic. GDC: the first tile requested
    before waiting on the previous kernel (lily.kernels.pdl)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    WPR: tl.constexpr = K // PER
    NG: tl.constexpr = K // 64
    NGP: tl.constexpr = triton.next_power_of_2(NG)
    g = tl.arange(0, NGP)
    gmask = g < NG
    word = tl.arange(0, NGP * WPG)[None, :]                                          # a row, one contiguous run
    wmask = word < WPR
    rr = tl.arange(0, BN)
    rows = pid * BN + rr
    w, s, b = weight_tile(w_ptr, s_ptr, b_ptr, rows, rows < N, word, wmask, g, gmask, WPR, NG)
    wait_prior(GDC)                      # x (and the residual added to) come from the previous kernels
    xs = ()
    xsums = ()
    factors = ()
    for m in tl.static_range(M):
        xm, xsum, factor = _row_input(x_ptr + m * x_stride, gain_ptr, eps, word, wmask, g, gmask, K, BITS, X_MODE,
                                      HALF_DOT, NGP, WPG, SUMS_FROM_CODES)
        xs = xs + (xm,)
        xsums = xsums + (xsum,)
        factors = factors + (factor,)
    for blk in range(pid, tl.cdiv(N, BN), nprog):
        rows = blk * BN + rr
        rmask = rows < N
        nrows = (blk + nprog) * BN + rr
        w_n, s_n, b_n = weight_tile(w_ptr, s_ptr, b_ptr, nrows, nrows < N, word, wmask, g, gmask, WPR, NG)
        res = ()
        for m in tl.static_range(M):
            if ACCUMULATE:
                res = res + (tl.load(out_ptr + m * out_stride + rows, mask=rmask, other=0.0),)
            else:
                res = res + (0.0,)
        sf = s.to(tl.float32)
        bias = b.to(tl.float32)
        if HALF_DOT:
            sums = half_dot_rows(w, xs, M, ASM, ROWS_PTX, ROWS_CONSTRAINTS)
            bias += 8.0 * sf             # the pair dot is of code - 8
        else:
            codes = _code_values(tl.reshape(w, [BN, NGP, WPG]), BITS)
        if ACCUMULATE:
            tl.debug_barrier()   # in place: every row's residual read before any write
        for m in tl.static_range(M):
            if HALF_DOT:
                q = tl.reshape(sums[m], [BN, NGP, WPG // 2])
            else:
                q = _codes_dot(codes, xs[m], BITS)
            acc = tl.sum(sf * tl.sum(q, axis=2) + bias * xsums[m], axis=1) * factors[m] + res[m]
            tl.store(out_ptr + m * out_stride + rows, acc, mask=rmask)
        w, s, b = w_n, s_n, b_n


def gemv_rows(lin: PackedLinear, x: torch.Tensor, out: torch.Tensor, *, norm_gain: torch.Tensor | None = None,
              eps: float = 1e-6, accumulate: bool = False, block: tuple[int, int] | None = None,
              num_warps: int | None = None, pdl_family: str | None = None) -> torch.Tensor:
    """out[m] (fp32 [M, N]) = W @ prologue(x[m]) for each of x's M rows (1..MAX_ROWS; bf16 or fp32, natural
    order); norm_gain: the prologue is RMSNorm(x[m]) * norm_gain; accumulate: out[m] += instead of =.
    block = (weight rows per block, programs per SM), default pick_rows_block's; pdl_family: the
    lily.kernels.pdl family whose launches are programmatic."""
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv_rows takes 1..{MAX_ROWS} input rows, got {M}")
    if K != lin.k or out.shape != (M, lin.n) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"gemv_rows: x {tuple(x.shape)} and out {tuple(out.shape)} against a [{lin.n}, {lin.k}] "
                         "weight (rows contiguous)")
    if out.dtype != torch.float32:
        raise ValueError(f"gemv_rows writes fp32, got out of {out.dtype}")
    half = quant_gemv.HALF_DOT and lin.bits == 4
    bn, per_sm, warps = pick_rows_block(M, lin.n, lin.k, lin.bits)
    if block is not None:
        bn, per_sm = block
    grid = (min(cdiv(lin.n, bn), sm_count(out.device) * per_sm),)
    q_gemv_rows_kernel[grid](out, lin.w, lin.s, lin.b, x, norm_gain if norm_gain is not None else out, lin.n, eps,
                             x.stride(0), out.stride(0), M=M, K=lin.k, BITS=lin.bits, BN=bn,
                             X_MODE=1 if norm_gain is not None else 0, ACCUMULATE=accumulate, HALF_DOT=half,
                             ASM=half and not INTERPRET, ROWS_PTX=pair_rows_ptx(M) if half else "",
                             ROWS_CONSTRAINTS=pair_rows_constraints(M) if half else "",
                             SUMS_FROM_CODES=quant_gemv.SUMS_FROM_CODES and half, num_warps=num_warps or warps,
                             **pdl.kernel_args(out, pdl_family))
    return out


def gemv_rows_reference(w: torch.Tensor, x: torch.Tensor, norm_gain: torch.Tensor | None = None,
                        eps: float = 1e-6) -> torch.Tensor:
    """Plain torch, fp32: prologue(x) @ w^T for a dequantized weight w [N, K] (quant.dequantize)."""
    x = x.float()
    if norm_gain is not None:
        x = rmsnorm_reference(x, norm_gain, eps)
    return x @ w.float().T
