"""Decode GEMV against an MLX affine-quantized weight (4-bit or 8-bit, group 64): y = W x for one token.

Batch-1 decode is a stream over the weights, so everything here is about reading the packed words once,
wide and coalesced, and keeping the arithmetic per code small enough not to become the bottleneck:

- Persistent programs (a few per SM): program p takes blocks p, p + P, ... of BN whole rows. The input,
  after its prologue, is built once per program and kept in registers, one tensor per code position;
  the next block's words are requested before the current block's arithmetic (a tile always in flight).
- A block's words are addressed as one contiguous run per row ([BN, K / codes-per-word], so the compiler
  spreads the threads along the row and loads 16-byte vectors) and reshaped to [BN, groups, words].
- Codes are turned into floats without int->float conversions (a fraction of the FMA rate on the GPU):
  a field OR-ed into the mantissa of 2^23 is exactly 2^23 + code * 2^shift, and one subtraction leaves
  code * 2^shift; the matching x is pre-scaled by 2^-shift. Each half word gets the exponent once, so a
  code costs about one LOP3, one FADD and one FMA (ptxas sm_90: ~4.3 instructions a code in the loop).
  At 4 bits the default is the same trick in fp16 pairs (lily.kernels.half_dot, HALF_DOT): two codes a
  LOP3, a subtraction and an FMA (692 -> 452 loop instructions at K=2048), x and the products rounded to
  fp16; the lm_head's argmax blocks keep the fp32 dot (not measured with it yet).
- w = scale * q + bias per group of 64, so  sum_k w_k x_k = scale * sum q x + bias * sum x  per group.

The input x is produced in the prologue, which is where neighbouring ops are fused:
X_MODE 0: x as stored; 1: RMSNorm(x) * gain (the pre-norm of a block); 2: the GDN output's gated per-head
RMSNorm, gain * rmsnorm(o) * silu(z), from per-(head, block) sums of squares written by gdn_decode.
Epilogues: plain store, residual add into the fp32 stream (each row belongs to one block, so in place is
safe), the GDN causal conv1d step + SiLU with its conv-state shift (rows < CONV_ROWS), and per-block
(max, argmax) partials for greedy sampling over the lm_head.

The x gather: code j of word c in group g multiplies x[64g + 8c + j], a stride-8 gather that costs far
more load instructions than the weights themselves. So the 4-bit GEMVs read their input in the
"group-transposed" layout PERM64 (x_p[64g + 8j + c] = x[64g + 8c + j], an involution inside each group of
64): each code position j is then a contiguous run. Producers write it directly: the residual-stream
writers keep h and h_p (epilogue OUT2), the GDN / attention / expert-SwiGLU outputs are written permuted,
and the RMSNorm gains are permuted at load. Weights stay in the checkpoint's MLX layout (uint32 viewed as
int32, shared with the prefill kernels); `prepare_concat` only stacks projections that share an input.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.quant import QuantTensor

from lily.kernels import pdl  # noqa: E402
from lily.kernels.half_dot import half_dot_tile, x_scale, x_word_pairs  # noqa: E402
from lily.kernels.pdl import INTERPRET, wait_prior  # noqa: E402

# the 4-bit GEMVs' and MoE decode kernels' codes dot in fp16 pairs (lily.kernels.half_dot); LILY_HALF_DOT=0
# keeps the fp32 path
HALF_DOT = os.environ.get("LILY_HALF_DOT", "1") != "0"
# call sites (gemv's pdl_family: attn_in, attn_out, gdn_in, gdn_out, lm_head; the MoE's gate_up, down) that keep
# the fp32 dot with HALF_DOT on; none by default. The lm_head on the pair dot decoded 602.1 against 594.6 tok/s
# at 4K with the same greedy tokens (bench fidelity: rel logit err 1.63e-3 against 1.52e-3, top-1 100 %); the
# GDN out-projection on the fp32 dot 587.3 against 588.8 (benchmarks/results/decode-h200-20261202-half-dot-off.json)
def parse_half_dot_off(spec: str | None) -> frozenset[str]:
    """LILY_HALF_DOT_OFF's value (None: unset) -> the call sites kept on the fp32 dot."""
    return frozenset(n.strip() for n in (spec or "").split(",") if n.strip())


HALF_DOT_OFF = parse_half_dot_off(os.environ.get("LILY_HALF_DOT_OFF"))
# the pair-dot GEMV's prologue takes the per-group sums, the sum of squares and the largest |x| from the same loads
# as the dot's x (x_codes_with_sums; LILY_GEMV_SUMS=0: a second load of x in a [groups, 64] layout), and with
# whole blocks of rows its tiles load without masks (LILY_GEMV_EVEN=0: masked). Read at each launch. H200,
# alternating rounds: 651.2 -> 657.6 and 650.0 -> 657.8 tok/s at 4K (benchmarks/results/decode-h200-20261203-gemv-
# sums-even.json; ptxas sm_90 at gdn_in: prologue 491 -> 419 instructions a thread, loop 381 -> 370).
SUMS_FROM_CODES = os.environ.get("LILY_GEMV_SUMS", "1") != "0"
EVEN_TILES = os.environ.get("LILY_GEMV_EVEN", "1") != "0"
# its registers a thread, held at 128 so four programs of 4 warps fit an SM (as measured; ptxas sm_90, triton 3.6,
# needs 128 or fewer at every call site's block without the cap, and spills nothing with it)
HALF_DOT_REGS = {} if INTERPRET else {"maxnreg": 128}


@triton.jit
def perm64(k):
    """The PERM64 position of natural index k (and back: it is its own inverse)."""
    return (k // 64) * 64 + (k % 8) * 8 + (k // 8) % 8


@triton.jit
def split_halves(w):
    """The two 16-bit halves of each word with the float trick's exponent (2^23) already set in them."""
    return (w & 0xFFFF) | 0x4B000000, ((w >> 16) & 0xFFFF) | 0x4B000000


@triton.jit
def code_value(w_lo, w_hi, j: tl.constexpr, BITS: tl.constexpr):
    """code j of each word (from split_halves) as a float, times 2^((j % half) * BITS): one AND, one FADD."""
    HALF: tl.constexpr = 16 // BITS
    if j < HALF:
        src = w_lo
    else:
        src = w_hi
    field = src & (0x4B000000 | (((1 << BITS) - 1) << ((j % HALF) * BITS)))
    return field.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def x_prologue(k, kmask, x_ptr, gain_ptr, z_ptr, ss_ptr, eps, X_MODE: tl.constexpr, HEAD_DIM: tl.constexpr,
               NB: tl.constexpr, PERM_X: tl.constexpr):
    """(x as the dot uses it, raw x) at input positions k (any shape): X_MODE 0 raw, 1 x * gain (RMSNorm's
    1/rms is applied by the caller), 2 the GDN output's gated per-head RMSNorm."""
    raw = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
    xk = raw
    if X_MODE == 1:
        xk = raw * tl.load(gain_ptr + k, mask=kmask, other=0.0).to(tl.float32)
    if X_MODE == 2:
        if PERM_X:
            kn = (k // 64) * 64 + (k % 8) * 8 + (k // 8) % 8   # natural index (perm64, inlined)
        else:
            kn = k
        head = kn // HEAD_DIM
        ss = tl.zeros_like(raw)
        for i in tl.static_range(NB):
            ss += tl.load(ss_ptr + head * NB + i, mask=kmask, other=0.0)
        z = tl.load(z_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        gn = tl.load(gain_ptr + kn % HEAD_DIM, mask=kmask, other=0.0).to(tl.float32)
        xk = raw * tl.rsqrt(ss / HEAD_DIM + eps) * gn * (z * tl.sigmoid(z))
    return xk, raw


@triton.jit
def x_codes(x_ptr, gain_ptr, z_ptr, ss_ptr, eps, k_word, kmask, PERM_X: tl.constexpr, X_MODE: tl.constexpr,
            HEAD_DIM: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, RAW: tl.constexpr = False):
    """The dot's x for each code position j of the words at k_word (= g * WPG + c, any shape; kmask: valid
    groups), pre-scaled by 2^-(shift of j) to match code_value (RAW: not scaled): 8 tensors (the last 4
    unused at 8 bits)."""
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    HALF: tl.constexpr = PER // 2
    g = k_word // WPG
    c = k_word % WPG
    out = ()
    for j in tl.static_range(8):
        if j < PER:
            if PERM_X:
                k = g * 64 + j * WPG + c
            else:
                k = k_word * PER + j
            xk, _ = x_prologue(k, kmask, x_ptr, gain_ptr, z_ptr, ss_ptr, eps, X_MODE, HEAD_DIM, NB, PERM_X)
            if RAW:
                out = out + (xk,)
            else:
                out = out + (xk * (1.0 / (1 << ((j % HALF) * BITS))),)
        else:
            out = out + (out[0] * 0.0,)
    return out


@triton.jit
def x_codes_with_sums(x_ptr, gain_ptr, k_word, kmask, PERM_X: tl.constexpr, X_MODE: tl.constexpr,
                      NGP: tl.constexpr):
    """x_codes (4 bits, RAW, X_MODE 0 or 1) for the words k_word ([1, NGP * 8]), with what the prologue needs
    from the same loads: the group sums of x ([1, NGP]), sum of raw x^2 and max |x| (scalars). (A second load
    of x in a [groups, 64] layout for these cost the prologue ~70 instructions a thread: ptxas sm_90, gdn_in.)"""
    g = k_word // 8
    c = k_word % 8
    out = ()
    sq = tl.zeros(k_word.shape, tl.float32)
    xw = tl.zeros(k_word.shape, tl.float32)
    amax = tl.zeros(k_word.shape, tl.float32)
    for j in tl.static_range(8):
        if PERM_X:
            k = g * 64 + j * 8 + c
        else:
            k = k_word * 8 + j
        xk, raw = x_prologue(k, kmask, x_ptr, gain_ptr, x_ptr, x_ptr, 0.0, X_MODE, 1, 1, PERM_X)
        out = out + (xk,)
        sq += raw * raw
        xw += xk
        amax = tl.maximum(amax, tl.abs(xk))
    xsum = tl.sum(tl.reshape(xw, [1, NGP, 8]), axis=2)
    return out, xsum, tl.sum(tl.sum(sq, 1), 0), tl.max(tl.max(amax, 1), 0)


@triton.jit
def dot_codes(w, x0, x1, x2, x3, x4, x5, x6, x7, BITS: tl.constexpr):
    """sum_j code_j(w) * x_j, elementwise over the words (x_j broadcast against w)."""
    lo, hi = split_halves(w)
    q = code_value(lo, hi, 0, BITS) * x0
    q += code_value(lo, hi, 1, BITS) * x1
    q += code_value(lo, hi, 2, BITS) * x2
    q += code_value(lo, hi, 3, BITS) * x3
    if BITS == 4:
        q += code_value(lo, hi, 4, BITS) * x4
        q += code_value(lo, hi, 5, BITS) * x5
        q += code_value(lo, hi, 6, BITS) * x6
        q += code_value(lo, hi, 7, BITS) * x7
    return q


@triton.jit
def x_groups(x0, x1, x2, x3, x4, x5, x6, x7, NGP: tl.constexpr, WPG: tl.constexpr):
    """The fp32 dot's x per code position, [1, NGP * WPG] each, seen as [1, NGP, WPG] (groups of words)."""
    return (tl.reshape(x0, [1, NGP, WPG]), tl.reshape(x1, [1, NGP, WPG]), tl.reshape(x2, [1, NGP, WPG]),
            tl.reshape(x3, [1, NGP, WPG]), tl.reshape(x4, [1, NGP, WPG]), tl.reshape(x5, [1, NGP, WPG]),
            tl.reshape(x6, [1, NGP, WPG]), tl.reshape(x7, [1, NGP, WPG]))


@triton.jit
def weight_tile(w_ptr, s_ptr, b_ptr, rows, rmask, word, wmask, g, gmask, WPR: tl.constexpr, NG: tl.constexpr):
    """Words [BN, NGP * WPG] and scales / biases [BN, NGP] of weight rows `rows` (masked rows and groups: 0)."""
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * WPR + word, mask=rmask[:, None] & wmask, other=0)
    soff = rows.to(tl.int64)[:, None] * NG + g[None, :]
    s = tl.load(s_ptr + soff, mask=rmask[:, None] & gmask[None, :], other=0.0)
    b = tl.load(b_ptr + soff, mask=rmask[:, None] & gmask[None, :], other=0.0)
    return w, s, b


@triton.jit
def q_gemv_kernel(out_ptr, res_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr, z_ptr, ss_ptr,
                  conv_w_ptr, conv_state_ptr, pmax_ptr, pidx_ptr, tmask_ptr, out2_ptr, N, eps,
                  K: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                  X_MODE: tl.constexpr, HEAD_DIM: tl.constexpr, NB: tl.constexpr, PERM_X: tl.constexpr,
                  OUT2_LO: tl.constexpr, OUT2_HI: tl.constexpr,
                  ADD_RES: tl.constexpr, CONV_ROWS: tl.constexpr, CONV_K: tl.constexpr,
                  CONV_KP: tl.constexpr, ARGMAX: tl.constexpr, TOKEN_MASK: tl.constexpr, GDC: tl.constexpr,
                  HALF_DOT: tl.constexpr, ASM: tl.constexpr, SUMS_FROM_CODES: tl.constexpr = False,
                  EVEN_N: tl.constexpr = False):
    """Persistent: program p takes row blocks p, p + P, p + 2P, ... of BN whole rows each. The prologue's x
    (per code position, already scaled) and its group sums are computed once per program and stay in
    registers; the next block's weights are requested before the current block's arithmetic, so a
    program always has a tile in flight while it computes.
    HALF_DOT (4 bits): the codes' dot in fp16 pairs (lily.kernels.half_dot; ASM: its PTX, on the GPU) on each
    thread's even and odd words (the tile split in two, each half's layout that of the other)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    WPR: tl.constexpr = K // PER
    NG: tl.constexpr = K // 64
    NGP: tl.constexpr = triton.next_power_of_2(NG)
    g = tl.arange(0, NGP)
    gmask = g < NG
    # words are addressed as one contiguous run a row ([BN, NGP * WPG], which makes the compiler spread the
    # threads along the row) and then seen as [BN, NGP, WPG] for the per-group sums
    word = tl.arange(0, NGP * WPG)[None, :]                                         # [1, NGP * WPG]
    wmask = word < WPR
    # the first tile is requested before waiting on the previous kernel (weights do not depend on it)
    rr = tl.arange(0, BN)
    rows = pid * BN + rr
    rmask = rows < N
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * WPR + word, mask=rmask[:, None] & wmask, other=0)
    soff = rows.to(tl.int64)[:, None] * NG + g[None, :]
    s = tl.load(s_ptr + soff, mask=rmask[:, None] & gmask[None, :], other=0.0)
    b = tl.load(b_ptr + soff, mask=rmask[:, None] & gmask[None, :], other=0.0)
    wait_prior(GDC)
    # the residual is requested with x, a block ahead in the loop: otherwise an L2 round trip of its own at the
    # end of the chain
    res = residual_rows(rows, rmask, res_ptr, ADD_RES)
    if SUMS_FROM_CODES:
        xc, xsum, ssq, amax = x_codes_with_sums(x_ptr, gain_ptr, word, wmask, PERM_X, X_MODE, NGP)
        x0, x1, x2, x3, x4, x5, x6, x7 = xc
        rstd = tl.rsqrt(ssq / K + eps)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = x_codes(x_ptr, gain_ptr, z_ptr, ss_ptr, eps, word, wmask, PERM_X, X_MODE,
                                                 HEAD_DIM, NB, BITS, HALF_DOT)
        # group sums of the dot's x (the bias term) and sum of raw x^2, any order inside a group
        kg = g[:, None] * 64 + tl.arange(0, 64)[None, :]
        xg, rawg = x_prologue(kg, gmask[:, None], x_ptr, gain_ptr, z_ptr, ss_ptr, eps, X_MODE, HEAD_DIM, NB,
                              PERM_X)
        xsum = tl.sum(xg, axis=1)[None, :]                                           # [1, NG]
        rstd = tl.rsqrt(tl.sum(tl.sum(rawg * rawg, 1), 0) / K + eps)
        amax = tl.max(tl.max(tl.abs(xg), 1), 0)
    unscale = 1.0
    if HALF_DOT:
        # x in fp16 pairs for the even and the odd words, scaled by a power of two (undone on the row sums)
        xs = x_scale(amax)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, xs)
        xsum = xsum * xs
        unscale = 1.0 / xs
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = x_groups(x0, x1, x2, x3, x4, x5, x6, x7, NGP, WPG)
    nblk = tl.cdiv(N, BN)
    for blk in range(pid, nblk, nprog):
        rows = blk * BN + rr
        rmask = rows < N
        # the next block's tile, in flight during this block's arithmetic
        if EVEN_N:
            # whole blocks and whole rows of words: no masks on the tiles (past the last block, this block's
            # tile again: a block index, not a mask a word)
            nxt = tl.where(blk + nprog < nblk, blk + nprog, blk)
            nrows = nxt * BN + rr
            nmask = rmask
            w_n = tl.load(w_ptr + nrows.to(tl.int64)[:, None] * WPR + word)
            noff = nrows.to(tl.int64)[:, None] * NG + g[None, :]
            s_n = tl.load(s_ptr + noff)
            b_n = tl.load(b_ptr + noff)
        else:
            nrows = (blk + nprog) * BN + rr
            nmask = nrows < N
            w_n = tl.load(w_ptr + nrows.to(tl.int64)[:, None] * WPR + word, mask=nmask[:, None] & wmask, other=0)
            noff = nrows.to(tl.int64)[:, None] * NG + g[None, :]
            s_n = tl.load(s_ptr + noff, mask=nmask[:, None] & gmask[None, :], other=0.0)
            b_n = tl.load(b_ptr + noff, mask=nmask[:, None] & gmask[None, :], other=0.0)
        res_n = residual_rows(nrows, nmask, res_ptr, ADD_RES)
        sf = s.to(tl.float32)
        bias = b.to(tl.float32)
        if HALF_DOT:
            q = tl.reshape(half_dot_tile(w, x0, x1, x2, x3, x4, x5, x6, x7, ASM), [BN, NGP, WPG // 2])
            bias += 8.0 * sf             # the dot was of code - 8
        else:
            q = dot_codes(tl.reshape(w, [BN, NGP, WPG]), x0, x1, x2, x3, x4, x5, x6, x7, BITS)
        acc = tl.sum(sf * tl.sum(q, axis=2) + bias * xsum, axis=1) * unscale
        if X_MODE == 1:
            acc = acc * rstd
        gemv_epilogue(acc, rows, rmask, blk, res, out_ptr, conv_w_ptr, conv_state_ptr, pmax_ptr, pidx_ptr, tmask_ptr,
                      out2_ptr, OUT2_LO, OUT2_HI, ADD_RES, CONV_ROWS, CONV_K, CONV_KP, ARGMAX, TOKEN_MASK)
        w, s, b, res = w_n, s_n, b_n, res_n


@triton.jit
def residual_rows(rows, rmask, res_ptr, ADD_RES: tl.constexpr):
    """The residual of rows `rows` (0 without one), requested before gemv_epilogue adds it. Each row belongs to one
    block, so a block's residual may be read before an earlier block's writes (in place). (The conv state and weights
    and the token-mask words read a block ahead too measured slower: 625 against 629 tok/s at 4K with all of
    them early, benchmarks/results/decode-h200-20261203-early-operands.json.)"""
    res = 0.0
    if ADD_RES:
        res = tl.load(res_ptr + rows, mask=rmask, other=0.0)
    return res


@triton.jit
def gemv_epilogue(acc, rows, rmask, blk, res, out_ptr, conv_w_ptr, conv_state_ptr, pmax_ptr, pidx_ptr, tmask_ptr,
                  out2_ptr, OUT2_LO: tl.constexpr, OUT2_HI: tl.constexpr, ADD_RES: tl.constexpr,
                  CONV_ROWS: tl.constexpr, CONV_K: tl.constexpr, CONV_KP: tl.constexpr, ARGMAX: tl.constexpr,
                  TOKEN_MASK: tl.constexpr):
    """Block `blk`'s rows out of the dot (acc) into out; res: residual_rows of its rows."""
    if CONV_ROWS > 0:
        # GDN: rows [0, CONV_ROWS) are conv channels. y = silu(sum_j w[c, j] * window[j]) over the window
        # [state (last K-1 pre-conv rows, oldest first) | this row]; the state then shifts by one. Each channel
        # belongs to one block; all reads happen before the barrier, all writes after it (a value can be
        # held by several threads of the program).
        cm = rmask & (rows < CONV_ROWS)
        jj = tl.arange(0, CONV_KP)
        in_state = cm[:, None] & (jj < CONV_K - 1)[None, :]
        old = tl.load(conv_state_ptr + jj[None, :] * CONV_ROWS + rows[:, None], mask=in_state, other=0.0)
        cw = tl.load(conv_w_ptr + rows[:, None] * CONV_K + jj[None, :], mask=cm[:, None] & (jj < CONV_K)[None, :],
                     other=0.0)
        win = tl.where((jj == CONV_K - 1)[None, :], acc[:, None], old.to(tl.float32))
        y = tl.sum(win * cw, axis=1)
        nxt = tl.load(conv_state_ptr + (jj[None, :] + 1) * CONV_ROWS + rows[:, None],
                      mask=cm[:, None] & (jj < CONV_K - 2)[None, :], other=0.0)
        new = tl.where((jj == CONV_K - 2)[None, :], acc[:, None], nxt.to(tl.float32))
        tl.debug_barrier()
        tl.store(conv_state_ptr + jj[None, :] * CONV_ROWS + rows[:, None],
                 new.to(conv_state_ptr.dtype.element_ty), mask=in_state)
        acc = tl.where(rows < CONV_ROWS, y * tl.sigmoid(y), acc)
    if ADD_RES:
        acc += res
        tl.debug_barrier()   # in place (out == res): every read before any write
    tl.store(out_ptr + rows, acc, mask=rmask)
    if OUT2_HI > OUT2_LO:
        # rows [LO, HI) also go to out2 in the PERM64 layout (the next GEMVs' input)
        m2 = rmask & (rows >= OUT2_LO) & (rows < OUT2_HI)
        tl.store(out2_ptr + perm64(tl.where(m2, rows - OUT2_LO, 0)), acc, mask=m2)
    if ARGMAX:
        ok = rmask
        if TOKEN_MASK:  # a grammar's bitmask (bit r % 32 of word r // 32): banned rows never win the pick
            bits = tl.load(tmask_ptr + rows // 32, mask=rmask, other=0)
            ok = ok & (((bits >> (rows % 32)) & 1) != 0)
        v = tl.where(ok, acc, float("-inf"))
        m = tl.max(v, 0)
        i = tl.min(tl.where(v == m, rows, 2147483647), 0)
        tl.store(pmax_ptr + blk, m)
        tl.store(pidx_ptr + blk, i)


# -- launchers ---------------------------------------------------------------------------------------------

class PackedLinear:
    """A quantized Linear in the kernels' form: int32 words [N, K*bits/32], scales/biases [N, K/64]."""

    def __init__(self, qt: QuantTensor, device=None):
        if qt.group_size != 64:
            raise ValueError(f"group_size {qt.group_size} unsupported: the decode kernels assume 64")
        w = qt.weight if device is None else qt.weight.to(device)
        self.w = (w.view(torch.int32) if w.dtype == torch.uint32 else w.to(torch.int32)).contiguous()
        self.s = (qt.scales if device is None else qt.scales.to(device)).contiguous()
        self.b = (qt.biases if device is None else qt.biases.to(device)).contiguous()
        self.bits = qt.bits
        self.n = self.w.shape[-2]
        self.k = self.w.shape[-1] * 32 // qt.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.s, self.b))


def prepare_concat(parts: list[QuantTensor], device=None) -> PackedLinear:
    """Stack projections that read the same input along the output dim (one launch for all of them)."""
    bits = {p.bits for p in parts}
    if len(bits) != 1:
        raise ValueError(f"cannot stack projections of different widths {sorted(bits)}")
    cat = QuantTensor(torch.cat([p.weight.to(device) for p in parts], -2),
                      torch.cat([p.scales.to(device) for p in parts], -2),
                      torch.cat([p.biases.to(device) for p in parts], -2), parts[0].bits, parts[0].group_size)
    return PackedLinear(cat)


def sm_count(device) -> int:
    """Streaming multiprocessors of the device (1 under the interpreter, where programs run one by one)."""
    if INTERPRET or torch.device(device).type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_block(n: int, k: int, bits: int) -> tuple[int, int, int]:
    """(rows per block, programs per SM, warps) of the persistent GEMV, from the H200 sweep
    (scripts/gpu_decode_check.py tune). Under the interpreter, big blocks and two programs (its cost is
    per operation, not per element; two programs still exercise the block loop)."""
    if INTERPRET:
        return min(512, next_power_of_2(n)), 2, 4
    if k >= 4096:
        return 8, 4, 8
    if n >= 65536:              # lm_head
        return LM_HEAD_BLOCK
    return 8, 4, 4


# the lm_head's (rows a block, programs an SM, warps), read at each launch; its rows a block set how many argmax
# partials it writes (gemv_programs), which the model sizes when it loads. At 122 registers a thread (ptxas sm_90)
# two of its programs fit an SM, so the grid runs as two waves: one wave, (16, 2, 8), measured the same (656.2
# against 654.6 tok/s at 4K, benchmarks/results/decode-h200-20261203-lm-head-router-blocks.json)
LM_HEAD_BLOCK = (16, 4, 8)


def gemv(lin: PackedLinear, x: torch.Tensor, out: torch.Tensor, *, norm_gain=None, eps: float = 1e-6,
         residual: torch.Tensor | None = None, gated_norm=None, conv=None, argmax=None, perm_x: bool = False,
         out2: torch.Tensor | None = None, out2_rows: tuple[int, int] | None = None,
         block: tuple[int, int] | None = None, num_warps: int | None = None,
         token_mask: torch.Tensor | None = None, pdl_family: str | None = None) -> torch.Tensor:
    """out[N] (fp32) = W @ prologue(x) (+ residual), with the optional fused pieces described above.

    gated_norm = (z, ss_partials [H, NB], gain, head_dim); conv = (conv_w fp32 [C, K], conv_state [K-1, C]);
    argmax = (pmax fp32 [blocks], pidx int32 [blocks]); token_mask (int32 [ceil(N/32)], with argmax): rows whose
    bit is 0 are left out of the partials (out keeps every row); perm_x: x (and gain, z) are PERM64-ordered;
    out2: rows out2_rows (default all) are also written to out2 in PERM64 order;
    block = (rows per block, programs per SM). With any kernel family programmatic (lily/kernels/pdl.py) the
    kernel waits and lets the next launch start; its own launch is programmatic when pdl_family (the decode
    step's call site: attn_in, gdn_in, router, ...) is."""
    if perm_x and lin.bits != 4:
        raise ValueError("the PERM64 input layout is for 4-bit weights")
    half_dot = HALF_DOT and lin.bits == 4 and pdl_family not in HALF_DOT_OFF
    bn, per_sm, warps = pick_block(lin.n, lin.k, lin.bits)
    if block is not None:
        bn, per_sm = block
    num_warps = num_warps or warps
    dummy = out
    x_mode, head_dim, nb = 0, 1, 1
    gain, z, ss = dummy, dummy, dummy
    if norm_gain is not None:
        x_mode, gain = 1, norm_gain
    if gated_norm is not None:
        x_mode = 2
        z, ss, gain, head_dim = gated_norm
        nb = ss.shape[-1]
    conv_w, conv_state, conv_rows, conv_k = dummy, dummy, 0, 2
    if conv is not None:
        conv_w, conv_state = conv
        conv_rows, conv_k = conv_w.shape
    pmax, pidx = argmax if argmax is not None else (dummy, dummy)
    lo, hi = (out2_rows or (0, lin.n)) if out2 is not None else (0, 0)
    grid = (min(cdiv(lin.n, bn), sm_count(out.device) * per_sm),)
    q_gemv_kernel[grid](out, residual if residual is not None else dummy, lin.w, lin.s, lin.b, x, gain, z, ss,
                        conv_w, conv_state, pmax, pidx, token_mask if token_mask is not None else pidx,
                        out2 if out2 is not None else dummy, lin.n, eps,
                        K=lin.k, BITS=lin.bits, BN=bn, X_MODE=x_mode, HEAD_DIM=head_dim, NB=nb,
                        PERM_X=perm_x, OUT2_LO=lo, OUT2_HI=hi,
                        ADD_RES=residual is not None, CONV_ROWS=conv_rows, CONV_K=conv_k,
                        CONV_KP=next_power_of_2(conv_k),
                        ARGMAX=argmax is not None, TOKEN_MASK=argmax is not None and token_mask is not None,
                        GDC=pdl.gdc(out), HALF_DOT=half_dot, ASM=not INTERPRET,
                        SUMS_FROM_CODES=SUMS_FROM_CODES and half_dot and x_mode in (0, 1),
                        EVEN_N=EVEN_TILES and lin.n % bn == 0 and lin.k % 64 == 0
                        and next_power_of_2(lin.k // 64) == lin.k // 64,
                        num_warps=num_warps,
                        **(HALF_DOT_REGS if half_dot else {}),
                        **pdl.launch_opts(out, pdl_family))
    return out


def gemv_programs(lin: PackedLinear, block: tuple[int, int] | None = None) -> int:
    """Row blocks of the GEMV: the number of (max, argmax) partials it writes with argmax=."""
    bn = block[0] if block else pick_block(lin.n, lin.k, lin.bits)[0]
    return cdiv(lin.n, bn)


def perm64_index(n: int, device=None) -> torch.Tensor:
    """Index p with x_p = x[p] (PERM64 is an involution, so x = x_p[p] too); n a multiple of 64."""
    k = torch.arange(n, device=device)
    return (k // 64) * 64 + (k % 8) * 8 + (k // 8) % 8


# -- plain torch references -------------------------------------------------------------------------------

def rmsnorm_reference(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain.float()


def gated_rmsnorm_reference(o: torch.Tensor, z: torch.Tensor, gain: torch.Tensor, head_dim: int,
                            eps: float) -> torch.Tensor:
    oh = o.float().reshape(-1, head_dim)
    zh = z.float().reshape(-1, head_dim)
    return (rmsnorm_reference(oh, gain, eps) * torch.nn.functional.silu(zh)).reshape(-1)


def conv_step_reference(m: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor):
    """One causal depthwise conv step + SiLU. conv_state [K-1, C] oldest first -> (y [C], new state)."""
    window = torch.cat([conv_state.float(), m.float()[None]], 0)          # [K, C]
    y = torch.nn.functional.silu((window * conv_w.float().t()).sum(0))
    return y, window[1:]


def gemv_reference(qt: QuantTensor, x: torch.Tensor) -> torch.Tensor:
    return qt.dequantize(torch.float32) @ x.float()
