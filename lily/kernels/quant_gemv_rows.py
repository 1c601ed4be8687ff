"""The decode batch's projections at a few rows: y[r] = W x[r] for R <= ROWS_MAX rows, each weight read once.

The skinny GEMM (lily.kernels.q4_gemm's split-K path) takes a few rows on the tensor cores, but a
projection there is many short programs over slices of K whose partial sums meet in a second round
trip: at 2 to 8 rows the batched step's 121 GEMMs cost ~1.4 ms whatever the row count, twice the
batch-1 GEMVs over the same weights. This is the batch-1 GEMV's structure (lily.kernels.quant_gemv)
with R input rows:

- Persistent programs, each taking blocks of BN whole weight rows; the next block's words are requested
  before this block's arithmetic.
- A block's codes are turned into floats once and used for all R rows (the float trick of quant_gemv:
  the field OR-ed into 2^23's mantissa; here one FMA removes 2^23 and the field's shift together, so
  the rows' x need no pre-scaling), then per row one FMA a code.
- x[r] is read for each block (the rows sit in L1): in the PERM64 layout (quant_gemv's group-transposed
  order; perm_x=True) a code position's x is a contiguous run, so the loads are 16-byte vectors in the
  words' own layout; natural order gathers them one by one.
- w = scale * q + bias per group of 64: y = sum_g scale_g * (q . x)_g + bias_g * (sum of x)_g, the group
  sums of each row's x taken once per program.
Epilogues: store (fp32 or bf16), or add into an fp32 output in place (the residual stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.quant_gemv import INTERPRET, sm_count
from lily.quant import QuantTensor

# Up to this many rows the batched step's projections take this kernel (more: the skinny GEMM).
ROWS_MAX = 8


@triton.jit
def _code(word, j: tl.constexpr, BITS: tl.constexpr):
    """Code j (LSB first) of each word as an exact float: the field OR-ed into the mantissa of 2^23 reads
    2^23 + code * 2^shift; one FMA by 2^-shift and -2^(23 - shift) leaves the code."""
    PER: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PER // 2
    SHIFT: tl.constexpr = (j % HALF) * BITS
    if j < HALF:
        src = word
    else:
        src = word >> 16
    field = (src & (((1 << BITS) - 1) << SHIFT)) | 0x4B000000
    return field.to(tl.float32, bitcast=True) * (1.0 / (1 << SHIFT)) - (8388608.0 / (1 << SHIFT))


@triton.jit
def q_gemv_rows_kernel(out_ptr, w_ptr, s_ptr, b_ptr, x_ptr, N, stride_x, stride_out,
                       K: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
                       PERM_X: tl.constexpr, ACCUMULATE: tl.constexpr):
    """out[r, n] (+)= sum_k w[n, k] x[r, k] for r < ROWS; program p takes row blocks p, p + P, ... of BN rows.
    Every tensor of the loop is [BN, K / codes-a-word], the words' shape, so all share one layout: a group's
    scale and bias are gathered a word, and x is read through a pointer broadcast along the block's rows
    (a [1, words] tensor would get a layout of its own, and a conversion through shared memory each use)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    WPR: tl.constexpr = K // PER
    NG: tl.constexpr = K // 64
    word = tl.broadcast_to(tl.arange(0, WPR)[None, :], [BN, WPR])
    grp = word // WPG
    rr = tl.arange(0, BN)
    # x of code position j for each word: x_ptr + r * stride_x + xk[j]
    xk = ()
    for j in tl.static_range(PER):
        if PERM_X:   # x_p[64 g + WPG j + c] = x[64 g + PER c + j]
            xk = xk + (grp * 64 + j * WPG + word % WPG,)
        else:
            xk = xk + (word * PER + j,)
    # each row's sum of x over each word's codes (the bias term), once a program
    xw = ()
    for r in tl.static_range(ROWS):
        t = tl.load(x_ptr + r * stride_x + xk[0]).to(tl.float32)
        for j in tl.static_range(1, PER):
            t += tl.load(x_ptr + r * stride_x + xk[j]).to(tl.float32)
        xw = xw + (t,)
    first = tl.minimum(pid * BN + rr, N - 1).to(tl.int64)
    w = tl.load(w_ptr + first[:, None] * WPR + word)
    s = tl.load(s_ptr + first[:, None] * NG + grp)
    b = tl.load(b_ptr + first[:, None] * NG + grp)
    nblk = tl.cdiv(N, BN)
    for blk in range(pid, nblk, nprog):
        rows = blk * BN + rr
        rmask = rows < N
        # the next block's tile, in flight during this block's arithmetic
        nrows = tl.minimum((blk + nprog) * BN + rr, N - 1).to(tl.int64)
        w_n = tl.load(w_ptr + nrows[:, None] * WPR + word)
        s_n = tl.load(s_ptr + nrows[:, None] * NG + grp)
        b_n = tl.load(b_ptr + nrows[:, None] * NG + grp)
        # code position outermost: one code tensor live and a partial sum a row
        qs = ()
        for j in tl.static_range(PER):
            c = _code(w, j, BITS)
            nq = ()
            for r in tl.static_range(ROWS):
                xv = tl.load(x_ptr + r * stride_x + xk[j]).to(tl.float32)
                if j == 0:
                    nq = nq + (c * xv,)
                else:
                    nq = nq + (qs[r] + c * xv,)
            qs = nq
        sf = s.to(tl.float32)
        bf = b.to(tl.float32)
        for r in tl.static_range(ROWS):
            acc = tl.sum(sf * qs[r] + bf * xw[r], axis=1)
            y_ptrs = out_ptr + r * stride_out + rows
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=rmask, other=0.0)
            tl.store(y_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask)
        w, s, b = w_n, s_n, b_n


def pick_block(n: int, k: int, bits: int, rows: int) -> tuple[int, int, int]:
    """(weight rows a block, programs an SM, warps): 8 warps over blocks of 4 words a thread (ptxas sm_90 at
    bf16 x: 80 registers at 2 rows, 128 at 4, 248 at 8). Under the interpreter big blocks and two programs."""
    if INTERPRET:
        return min(64, next_power_of_2(n)), 2, 4
    return max(1, 1024 * bits // k), (2 if rows <= 4 else 1), 8


def fits(x: torch.Tensor, w: QuantTensor) -> bool:
    """Whether gemv_rows takes x @ w^T: a 2-D group-64 4/8-bit weight, K a power of two, few rows."""
    N, K = w.shape[-2:]
    return (w.weight.dim() == 2 and w.group_size == 64 and w.bits in (4, 8) and K >= 64 and K & (K - 1) == 0
            and x.dim() == 2 and x.shape[1] == K and x.stride(1) == 1 and 0 < x.shape[0] <= ROWS_MAX)


def perm_x_fits(w: QuantTensor) -> bool:
    """Whether gemv_rows takes this weight with a PERM64-ordered input: 4-bit, group 64, K a power of two."""
    K = w.shape[-1]
    return w.weight.dim() == 2 and w.bits == 4 and w.group_size == 64 and K >= 64 and K & (K - 1) == 0


def gemv_rows(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None, accumulate: bool = False,
              out_dtype: torch.dtype = torch.float32, perm_x: bool = False,
              block: tuple[int, int] | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w^T (or out += that, fp32, with accumulate) for M <= ROWS_MAX rows; x fp32 or
    bf16, in the PERM64 layout with perm_x (4-bit only). block = (weight rows a block, programs an SM)."""
    if not fits(x, w):
        raise ValueError(f"gemv_rows: x {tuple(x.shape)}, w {tuple(w.shape)} {w.bits}-bit")
    if perm_x and w.bits != 4:
        raise ValueError("the PERM64 input layout is for 4-bit weights")
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("gemv_rows: accumulate=True needs an out tensor")
        out = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"gemv_rows: out is {tuple(out.shape)}, expected [{M}, {N}] with contiguous rows")
    bn, per_sm, warps = pick_block(N, K, w.bits, M)
    if block is not None:
        bn, per_sm = block
    grid = (max(1, min(cdiv(N, bn), sm_count(x.device) * per_sm)),)
    q_gemv_rows_kernel[grid](out, w.weight.view(torch.int32), w.scales, w.biases, x, N, x.stride(0), out.stride(0),
                             K=K, BITS=w.bits, BN=bn, ROWS=M, PERM_X=perm_x, ACCUMULATE=accumulate,
                             num_warps=num_warps or warps)
    return out
