"""Chunked gated delta rule for prefill (WY / UT form, 64-token chunks, fp32 state).

Computes the recurrence of lily/kernels/gated_delta.py (S = exp(g) S; u = v - S^T k; S += beta k u^T;
o = S^T q) a chunk at a time, starting from the decode state and leaving the final state in its place.

Inputs come straight from the model: the conv output y [T, 2*Hk*dk + Hv*dv] (q | k | v, SiLU applied),
and the raw gate projections b, a [T, Hv]. The kernels do the rest on the way in: L2 norm of q and k
(q also scaled by dk^-0.5), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); value head j
reads key head j // (Hv / Hk).

1. `_gdn_prep_kernel`, parallel over (chunk, value head): within the chunk, with c the cumulative
   log-decay, solve the unit lower-triangular system (I + A) X = RHS, A[i, j] = beta_i exp(c_i - c_j)
   k_i.k_j for j < i, by inverting (I + A) with dots (16x16 blocks, then merged; PREP_PRECISION); write
   W = X for RHS = beta exp(c) k and U = X for RHS = beta v, c itself, and the decayed causal
   QK[t, i] = (q_t . k_i) exp(c_t - c_i) (i <= t), which the scan would otherwise recompute per dv block.
2. The walk over the chunks in order, S [dk, BV] in registers, one program per (value head, dv block):
   new_v = U - W S;  o = exp(c) q S + QK new_v;  S = exp(c_last) S + (k exp(c_last - c))^T new_v.
   Either in one kernel (`_gdn_scan_kernel`), or split (SCAN_SPLIT): `_gdn_states_kernel` walks only the
   state (keeps S at each chunk start, overwrites U with new_v) and `_gdn_output_kernel`, parallel over
   (chunk, head, dv block), forms o; the serial path is then two small dots a chunk.
A third small kernel applies the output's gated RMSNorm: gain * rmsnorm(o) * silu(z), per head.

Launch choices are module-level so scripts/gpu_prefill_check.py can sweep them on the GPU (its
gdn_sweep section) and keep the fastest variant that passes its accuracy bar.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv
from lily.kernels.q4_gemm import UPCAST_DOT as _UPCAST  # the interpreter's bf16 dots are wrong: upcast there

CHUNK = 64

# input_precision of the triangular-inverse dots in the prep kernel (k k^T and q k^T are exact bf16
# dots whatever this says). "tf32x3" runs on the tensor cores at ~fp32 accuracy; plain "tf32" is ~1e-3 a
# product, enough on typical inputs, but the inverse diverges on a strongly coupled chunk (near-identical
# keys, beta ~ 1, slow decay: a repeated token; a CPU emulation gave rel err ~10 vs 3e-3), so it is not
# the default. "ieee" is fp32 on the FMA units (67 ms of a 4K prefill on the H200 for the 30 layers).
PREP_PRECISION = "tf32x3"
PREP_WARPS = 4        # H200 sweep at a 4K prompt (scripts/gpu_prefill_check.py gdn_sweep, f20b30c)
# How the prep kernel inverts (I + A): "blocked" (16-row blocks: forward substitution in fp32 on the four
# diagonal blocks, block forward substitution for the six below them, W and U a row block at a time) or
# "products" (nilpotent-power products on 64x64 tiles, _unit_lower_inverse: ~19 MFLOP a program).
PREP_ALGO = "blocked"
SCAN_SPLIT = False    # True: walk the state alone and form the output in a parallel kernel (slower there)
SCAN_BV = 32          # dv columns a walking program owns: Hv * dv / SCAN_BV programs walk the chunks
SCAN_WARPS = 8        # (ptxas, sm_90: 4 warps spill ~2 KB a thread in the single scan, 8 warps ~0.5 KB)
SCAN_STAGES = 2       # > 1 lets Triton prefetch the next chunk's loads (shared memory permitting)
OUT_BV = 64           # dv columns an output-kernel program forms (SCAN_SPLIT)
OUT_WARPS = 8
PRECISIONS = ("ieee", "tf32x3", "tf32")
ALGOS = ("blocked", "products")


def _apply_override() -> None:
    """LILY_GDN_TILES (JSON of the names above) overrides the launch choices: how a sweep's choice
    (scripts/gpu_prefill_check.py gdn_sweep) reaches a later process on the same machine."""
    raw = os.environ.get("LILY_GDN_TILES")
    if not raw:
        return
    for name, value in json.loads(raw).items():
        if name not in ("PREP_ALGO", "PREP_PRECISION", "PREP_WARPS", "SCAN_SPLIT", "SCAN_BV", "SCAN_WARPS",
                        "SCAN_STAGES"):
            raise ValueError(f"LILY_GDN_TILES: unknown setting {name!r}")
        globals()[name] = value


_apply_override()


@triton.jit
def _l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower A [C, C] (fp32), C = 64, every dot at input_precision PREC.

    The 16x16 diagonal blocks D = I + N (N nilpotent, N^16 = 0) are inverted together as
    (I - N)(I + N^2)(I + N^4)(I + N^8); then the blocks are merged as flash-linear-attention's solve_tril
    does, which for the block-nilpotent M = D^-1 (A - N) is (I - M + M^2 - M^3) D^-1 (M^4 = 0).
    (A 16-row blocked variant with smaller tiles measured slower on the H200: 115 ms vs 67 ms, ieee.)"""
    B: tl.constexpr = 16
    rows = tl.arange(0, C)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same_block = (rows[:, None] // B) == (rows[None, :] // B)
    n1 = tl.where(same_block, A, 0.0)
    off = A - n1  # the blocks below the diagonal
    # written so each power dies as soon as it has been used (fewer live 64x64 tiles: less spilling)
    n2 = tl.dot(n1, n1, input_precision=PREC)
    dinv = tl.dot(eye - n1, eye + n2, input_precision=PREC)
    n4 = tl.dot(n2, n2, input_precision=PREC)
    dinv = tl.dot(dinv, eye + n4, input_precision=PREC)
    n8 = tl.dot(n4, n4, input_precision=PREC)
    dinv = tl.dot(dinv, eye + n8, input_precision=PREC)
    m = tl.dot(dinv, off, input_precision=PREC)
    p = eye - m  # I - m + m^2 - m^3 by Horner: I - m (I - m (I - m))
    p = eye - tl.dot(m, p, input_precision=PREC)
    p = eye - tl.dot(m, p, input_precision=PREC)
    return tl.dot(p, dinv, input_precision=PREC)


@triton.jit
def _dot_exact(a, b, BF16_MMA: tl.constexpr):
    """a @ b^T for raw rows of y. bf16 products are exact in fp32, so on the GPU the bf16 tensor-core dot
    is exact here; the interpreter (which gets bf16 dots wrong) and an fp32 y take the fp32 route."""
    if BF16_MMA:
        return tl.dot(a, tl.trans(b))
    else:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="tf32x3")


@triton.jit
def _chunk_gates(b_ptr, a_ptr, alog_ptr, dtb_ptr, t64, ok, h, stride_ba, C: tl.constexpr):
    """beta = sigmoid(b) and the cumulative log-decay c over one chunk's C rows (rows past T: beta = 0)."""
    b = tl.load(b_ptr + t64 * stride_ba + h, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t64 * stride_ba + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.where(ok, tl.sigmoid(b), 0.0)
    x = a + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    # rows past the end get g = 0: they carry the last decay, so no exponent below is positive
    g = tl.where(ok, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)
    return beta, tl.cumsum(g, 0)


@triton.jit
def _gdn_prep_kernel(y_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr, qk_ptr,
                     T, stride_y, stride_ba,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, PREC: tl.constexpr, BF16_MMA: tl.constexpr):
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    t = chunk * C + tl.arange(0, C)
    ok = t < T
    t64 = t.to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    beta, gc = _chunk_gates(b_ptr, a_ptr, alog_ptr, dtb_ptr, t64, ok, h, stride_ba, C)

    # q and k stay raw: their L2 norms are row scales, applied to the dots' results (rk, rq), so the
    # k k^T and q k^T dots see the bf16 inputs themselves and are exact. QK is finished and stored before
    # the inverse, and k is loaded again after it, so fewer tiles stay live across the inverse.
    row_y = y_ptr + t64[:, None] * stride_y
    k_ptrs = row_y + HK * DK + kh * DK + dk[None, :]
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
    kf = k.to(tl.float32)
    rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))  # 0 above the diagonal
    A = _dot_exact(k, k, BF16_MMA) * (beta * rk)[:, None] * rk[None, :] * decay
    A = tl.where(rows[:, None] > rows[None, :], A, 0.0)  # strictly lower
    q = tl.load(row_y + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    rq = tl.rsqrt(tl.sum(qf * qf, axis=1) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    qk = _dot_exact(q, k, BF16_MMA) * rq[:, None] * rk[None, :] * decay
    base = t64[:, None] * HV + h
    tl.store(qk_ptr + base * C + rows[None, :], qk, mask=ok[:, None])
    tl.store(gc_ptr + t64 * HV + h, gc, mask=ok)

    inv = _unit_lower_inverse(A, C, PREC)
    # W = inv diag(beta exp(c) rk) k, U = inv diag(beta) v: the row scales go on inv's columns
    kf = tl.load(k_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.dot(inv * (beta * tl.exp(gc) * rk)[None, :], kf)
    tl.store(w_ptr + base * DK + dk[None, :], w, mask=ok[:, None])
    v = tl.load(row_y + 2 * HK * DK + h * DV + dv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    u = tl.dot(inv * beta[None, :], v)
    tl.store(u_ptr + base * DV + dv[None, :], u, mask=ok[:, None])


@triton.jit
def _slot_block(slot, row0, i: tl.constexpr, j: tl.constexpr, T, B: tl.constexpr, C: tl.constexpr, HV: tl.constexpr):
    """Pointers and row mask of block (i, j) [B, B] of a program's 64 x 64 slot of the QK output (row t of
    the slot at slot + t * HV * C)."""
    r = tl.arange(0, B)
    t = row0 + i * B + r
    return slot + t.to(tl.int64)[:, None] * (HV * C) + j * B + r[None, :], (t < T)[:, None]


@triton.jit
def _diag_blocks_inverse(slot, row0, T, B: tl.constexpr, C: tl.constexpr, HV: tl.constexpr):
    """(I + A_ii)^-1 for the slot's four diagonal blocks of A (strictly lower), written over them: forward
    substitution in fp32 on the four at once, a [4, B, B] tile (one step a row for all four blocks). Y (the
    inverse's strictly lower part) starts as -A; row r becomes -(A_r + A_r Y), whose terms use only the
    rows above r, already done (rows 0 and 1 are done from the start)."""
    blk = tl.arange(0, C // B)[:, None, None]
    r = tl.arange(0, B)
    t = row0 + blk * B + r[None, :, None]
    ptrs = slot + t.to(tl.int64) * (HV * C) + blk * B + r[None, None, :]
    ok = t < T
    Y = -tl.load(ptrs, mask=ok, other=0.0)
    for s in tl.static_range(2, B):
        at_s = r[None, :, None] == s
        n_s = tl.sum(tl.where(at_s, Y, 0.0), axis=1)  # -A_s: row s is not done yet
        y_s = n_s + tl.sum(n_s[:, :, None] * Y, axis=1)
        Y = tl.where(at_s, y_s[:, None, :], Y)
    tl.store(ptrs, Y + tl.where(r[None, :, None] == r[None, None, :], 1.0, 0.0), mask=ok)


@triton.jit
def _gdn_prep_blocked_kernel(y_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr, qk_ptr,
                             T, stride_y, stride_ba,
                             HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             C: tl.constexpr, PREC: tl.constexpr, BF16_MMA: tl.constexpr):
    """_gdn_prep_kernel's outputs with (I + A)^-1 formed in 16-row blocks (PREP_ALGO "blocked").

    The program's own 64 x 64 slot of the QK output is its scratch (QK is written there last): A goes in
    (one exact bf16 dot of the chunk's keys, as in the products kernel; zero on and above the diagonal),
    its diagonal blocks are inverted in place by forward substitution (_diag_blocks_inverse, fp32), the
    blocks below them are formed by block forward substitution, X_ij = -D_i sum_{j <= m < i} A_im X_mj
    (D_i = X_ii), 16x16x16 dots at PREC, and written over A_ij; then W and U are the products kernel's two
    dots with that inverse. (Taking the ten A blocks from 16-row key blocks directly kept each key block in
    MMA operand layout across the ten dots: ptxas, sm_90, 255 registers and ~500 bytes of spills.)"""
    tl.static_assert(C == 64, "the blocked prep is written out for four 16-row blocks")
    B: tl.constexpr = 16
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    rows = tl.arange(0, C)
    row0 = chunk * C
    t = row0 + rows
    ok = t < T
    t64 = t.to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    beta, gc = _chunk_gates(b_ptr, a_ptr, alog_ptr, dtb_ptr, t64, ok, h, stride_ba, C)
    tl.store(gc_ptr + t64 * HV + h, gc, mask=ok)
    row_y = y_ptr + t64[:, None] * stride_y
    k_ptrs = row_y + HK * DK + kh * DK + dk[None, :]
    slot = qk_ptr + h * C
    slot_ptrs = slot + t64[:, None] * (HV * C) + rows[None, :]

    # A into the slot (rows past T are not written: they read back as 0, as beta = 0 makes them anyway)
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
    kf = k.to(tl.float32)
    rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    decay = tl.exp(tl.where(rows[:, None] > rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
    tl.store(slot_ptrs, _dot_exact(k, k, BF16_MMA) * (beta * rk)[:, None] * rk[None, :] * decay, mask=ok[:, None])
    tl.debug_barrier()  # (every thread's part of A written before any thread reads a block of it)
    _diag_blocks_inverse(slot, row0, T, B, C, HV)
    tl.debug_barrier()

    # the blocks below the diagonal, a diagonal of blocks at a time
    p, m = _slot_block(slot, row0, 0, 0, T, B, C, HV)
    D0 = tl.load(p, mask=m, other=0.0)
    p, m = _slot_block(slot, row0, 1, 1, T, B, C, HV)
    D1 = tl.load(p, mask=m, other=0.0)
    p, m = _slot_block(slot, row0, 2, 2, T, B, C, HV)
    D2 = tl.load(p, mask=m, other=0.0)
    p, m = _slot_block(slot, row0, 3, 3, T, B, C, HV)
    D3 = tl.load(p, mask=m, other=0.0)
    p10, m10 = _slot_block(slot, row0, 1, 0, T, B, C, HV)
    p21, m21 = _slot_block(slot, row0, 2, 1, T, B, C, HV)
    p32, m32 = _slot_block(slot, row0, 3, 2, T, B, C, HV)
    p20, m20 = _slot_block(slot, row0, 2, 0, T, B, C, HV)
    p31, m31 = _slot_block(slot, row0, 3, 1, T, B, C, HV)
    p30, m30 = _slot_block(slot, row0, 3, 0, T, B, C, HV)
    A10 = tl.load(p10, mask=m10, other=0.0)
    A21 = tl.load(p21, mask=m21, other=0.0)
    A32 = tl.load(p32, mask=m32, other=0.0)
    A20 = tl.load(p20, mask=m20, other=0.0)
    A31 = tl.load(p31, mask=m31, other=0.0)
    A30 = tl.load(p30, mask=m30, other=0.0)
    X10 = -tl.dot(D1, tl.dot(A10, D0, input_precision=PREC), input_precision=PREC)
    X21 = -tl.dot(D2, tl.dot(A21, D1, input_precision=PREC), input_precision=PREC)
    X32 = -tl.dot(D3, tl.dot(A32, D2, input_precision=PREC), input_precision=PREC)
    X20 = -tl.dot(D2, tl.dot(A21, X10, acc=tl.dot(A20, D0, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    X31 = -tl.dot(D3, tl.dot(A32, X21, acc=tl.dot(A31, D1, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    X30 = tl.dot(A31, X10, acc=tl.dot(A30, D0, input_precision=PREC), input_precision=PREC)
    X30 = -tl.dot(D3, tl.dot(A32, X20, acc=X30, input_precision=PREC), input_precision=PREC)
    tl.debug_barrier()  # (every A block read before any is written over)
    tl.store(p10, X10, mask=m10)
    tl.store(p21, X21, mask=m21)
    tl.store(p32, X32, mask=m32)
    tl.store(p20, X20, mask=m20)
    tl.store(p31, X31, mask=m31)
    tl.store(p30, X30, mask=m30)
    tl.debug_barrier()

    # W = inv diag(beta exp(c) rk) k, U = inv diag(beta) v (tf32 dots, as in the products kernel), with the
    # scales on the rows of k and v (the inverse goes to the dots as loaded), 64 columns at a time
    inv = tl.load(slot_ptrs, mask=ok[:, None], other=0.0)
    sw = (beta * tl.exp(gc) * rk)[:, None]
    base = t64[:, None] * HV + h
    WK: tl.constexpr = min(DK, 64)
    WV: tl.constexpr = min(DV, 64)
    for d0 in tl.static_range(0, DK, WK):
        cols = d0 + tl.arange(0, WK)
        kd = tl.load(row_y + HK * DK + kh * DK + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(w_ptr + base * DK + cols[None, :], tl.dot(inv, kd * sw), mask=ok[:, None])
    for d0 in tl.static_range(0, DV, WV):
        cols = d0 + tl.arange(0, WV)
        vd = tl.load(row_y + 2 * HK * DK + h * DV + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(u_ptr + base * DV + cols[None, :], tl.dot(inv, vd * beta[:, None]), mask=ok[:, None])

    # QK over the slot, once every thread has read the inverse from it
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)  # loaded again: no key tile stays live across the rest
    q = tl.load(row_y + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    rq = tl.rsqrt(tl.sum(qf * qf, axis=1) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    decay = tl.exp(tl.where(rows[:, None] >= rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
    qk = _dot_exact(q, k, BF16_MMA) * rq[:, None] * rk[None, :] * decay
    tl.debug_barrier()
    tl.store(slot_ptrs, qk, mask=ok[:, None])


@triton.jit
def _chunk_rows(y_ptr, gc_ptr, chunk, T, stride_y, h, kh,
                HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, C: tl.constexpr):
    """One chunk's normed keys, decay to its end exp(c_last - c) and exp(c_last) (rows past T: zero keys)."""
    rows = tl.arange(0, C)
    t = chunk * C + rows
    ok = t < T
    t64 = t.to(tl.int64)
    k = tl.load(y_ptr + t64[:, None] * stride_y + HK * DK + kh * DK + tl.arange(0, DK)[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    last = tl.minimum(chunk * C + C, T) - 1
    gc_last = tl.load(gc_ptr + last.to(tl.int64) * HV + h)
    gc = tl.load(gc_ptr + t64 * HV + h, mask=ok, other=0.0)
    gc = tl.where(ok, gc, gc_last)
    return _l2norm_rows(k) * tl.exp(gc_last - gc)[:, None], gc, tl.exp(gc_last), ok, t64


@triton.jit
def _gdn_scan_kernel(y_ptr, w_ptr, u_ptr, gc_ptr, qk_ptr, s_ptr, o_ptr, T, stride_y,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    kh = h // (HV // HK)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    s_ptrs = s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S = tl.load(s_ptrs)  # [DK, BV] fp32
    q_scale = 1.0 / tl.sqrt(DK * 1.0)
    for chunk in range(0, tl.cdiv(T, C)):
        k_tail, gc, decay_all, ok, t64 = _chunk_rows(y_ptr, gc_ptr, chunk, T, stride_y, h, kh, HK, HV, DK, C)
        base = t64[:, None] * HV + h
        w = tl.load(w_ptr + base * DK + dk[None, :], mask=ok[:, None], other=0.0)
        u = tl.load(u_ptr + base * DV + dv[None, :], mask=ok[:, None], other=0.0)
        qk = tl.load(qk_ptr + base * C + rows[None, :], mask=ok[:, None], other=0.0)
        q = tl.load(y_ptr + t64[:, None] * stride_y + kh * DK + dk[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        q = _l2norm_rows(q) * (q_scale * tl.exp(gc))[:, None]
        new_v = u - tl.dot(w, S)  # [C, BV]: beta * (v - decayed-state prediction)
        o = tl.dot(qk, new_v, acc=tl.dot(q, S))
        tl.store(o_ptr + base * DV + dv[None, :], o, mask=ok[:, None])
        S = tl.dot(tl.trans(k_tail), new_v, acc=decay_all * S)
    tl.store(s_ptrs, S)


@triton.jit
def _gdn_states_kernel(y_ptr, w_ptr, u_ptr, gc_ptr, s_ptr, h_ptr, T, stride_y,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       C: tl.constexpr, BV: tl.constexpr):
    """The serial part alone: keeps S at each chunk start in h [chunks, Hv, DK, DV], new_v in place of U."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    kh = h // (HV // HK)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    s_ptrs = s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S = tl.load(s_ptrs)  # [DK, BV] fp32
    for chunk in range(0, tl.cdiv(T, C)):
        k_tail, gc, decay_all, ok, t64 = _chunk_rows(y_ptr, gc_ptr, chunk, T, stride_y, h, kh, HK, HV, DK, C)
        base = t64[:, None] * HV + h
        w = tl.load(w_ptr + base * DK + dk[None, :], mask=ok[:, None], other=0.0)
        u_ptrs = u_ptr + base * DV + dv[None, :]
        u = tl.load(u_ptrs, mask=ok[:, None], other=0.0)
        tl.store(h_ptr + ((chunk * HV + h).to(tl.int64) * DK + dk[:, None]) * DV + dv[None, :], S)
        new_v = u - tl.dot(w, S)
        tl.store(u_ptrs, new_v, mask=ok[:, None])
        S = tl.dot(tl.trans(k_tail), new_v, acc=decay_all * S)
    tl.store(s_ptrs, S)


@triton.jit
def _gdn_output_kernel(y_ptr, nv_ptr, gc_ptr, qk_ptr, h_ptr, o_ptr, T, stride_y,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       C: tl.constexpr, BV: tl.constexpr):
    """o = exp(c) q S_chunk_start + QK new_v, for one (chunk, value head, dv block)."""
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (HV // HK)
    rows = tl.arange(0, C)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    t = chunk * C + rows
    ok = t < T
    t64 = t.to(tl.int64)
    base = t64[:, None] * HV + h
    gc = tl.load(gc_ptr + t64 * HV + h, mask=ok, other=0.0)
    q = tl.load(y_ptr + t64[:, None] * stride_y + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    q = _l2norm_rows(q.to(tl.float32)) * ((1.0 / tl.sqrt(DK * 1.0)) * tl.exp(gc))[:, None]
    S = tl.load(h_ptr + ((chunk * HV + h).to(tl.int64) * DK + dk[:, None]) * DV + dv[None, :])
    qk = tl.load(qk_ptr + base * C + rows[None, :], mask=ok[:, None], other=0.0)
    new_v = tl.load(nv_ptr + base * DV + dv[None, :], mask=ok[:, None], other=0.0)
    o = tl.dot(qk, new_v, acc=tl.dot(q, S))
    tl.store(o_ptr + base * DV + dv[None, :], o, mask=ok[:, None])


@triton.jit
def _gated_rmsnorm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, T, stride_z, stride_out, eps,
                          HV: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    t = tl.where(ok, t, 0).to(tl.int64)
    c = tl.arange(0, HV * DV)  # (head, dim) flattened; a row is HV heads of DV
    o = tl.load(o_ptr + t[:, None] * (HV * DV) + c[None, :]).to(tl.float32)
    z = tl.load(z_ptr + t[:, None] * stride_z + c[None, :]).to(tl.float32)
    gain = tl.load(w_ptr + c % DV).to(tl.float32)
    o3 = tl.reshape(o, (BLOCK_T, HV, DV))
    r = tl.rsqrt(tl.sum(o3 * o3, axis=2) / DV + eps)  # [BLOCK_T, HV]
    y = tl.reshape(o3 * r[:, :, None], (BLOCK_T, HV * DV)) * gain[None, :] * (z * tl.sigmoid(z))
    tl.store(out_ptr + t[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def _check_inputs(y, b, a, state, Hk) -> None:
    T = y.shape[0]
    Hv, dk, dv = state.shape
    if (y.shape[1] != 2 * Hk * dk + Hv * dv or b.shape != (T, Hv) or a.shape != (T, Hv)
            or b.stride() != a.stride() or b.stride(1) != 1 or y.stride(1) != 1
            or state.dtype != torch.float32 or not state.is_contiguous() or Hv % Hk):
        raise ValueError(f"gdn_chunked_prefill: y {tuple(y.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}, "
                         f"state {tuple(state.shape)} {state.dtype} disagree")
    if PREP_PRECISION not in PRECISIONS:
        raise ValueError(f"gdn_chunked: PREP_PRECISION {PREP_PRECISION!r} is not one of {PRECISIONS}")


def gdn_prep(y, b, a, A_log, dt_bias, Hk: int, Hv: int, dk: int, dv: int, out=None):
    """The prep kernel alone: (W [T,Hv,dk], U [T,Hv,dv], c [T,Hv], QK [T,Hv,64]), all fp32.

    `out` may hold those four buffers (the tests pass them poisoned)."""
    T = y.shape[0]
    dev = y.device
    if out is None:
        out = (torch.empty(T, Hv, dk, device=dev, dtype=torch.float32),
               torch.empty(T, Hv, dv, device=dev, dtype=torch.float32),
               torch.empty(T, Hv, device=dev, dtype=torch.float32),
               torch.empty(T, Hv, CHUNK, device=dev, dtype=torch.float32))
    w, u, gc, qk = out
    if PREP_ALGO not in ALGOS:
        raise ValueError(f"gdn_chunked: PREP_ALGO {PREP_ALGO!r} is not one of {ALGOS}")
    kernel = _gdn_prep_blocked_kernel if PREP_ALGO == "blocked" else _gdn_prep_kernel
    kernel[(cdiv(T, CHUNK), Hv)](
        y, b, a, A_log, dt_bias, w, u, gc, qk, T, y.stride(0), b.stride(0),
        HK=Hk, HV=Hv, DK=dk, DV=dv, C=CHUNK, PREC=PREP_PRECISION, BF16_MMA=y.dtype == torch.bfloat16 and not _UPCAST,
        num_warps=PREP_WARPS, num_stages=1)
    return out


def gdn_chunked_prefill(y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, state: torch.Tensor, num_key_heads: int) -> torch.Tensor:
    """y [T, 2*Hk*dk + Hv*dv] conv output; b, a [T, Hv]; state [Hv, dk, dv] fp32, updated in place.

    Returns o fp32 [T, Hv, dv] (before the gated norm)."""
    _check_inputs(y, b, a, state, num_key_heads)
    T = y.shape[0]
    Hv, dk, dv = state.shape
    Hk = num_key_heads
    w, u, gc, qk = gdn_prep(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    o = torch.empty(T, Hv, dv, device=y.device, dtype=torch.float32)
    BV = min(dv, SCAN_BV)
    shapes = dict(HK=Hk, HV=Hv, DK=dk, DV=dv, C=CHUNK)
    if not SCAN_SPLIT:
        _gdn_scan_kernel[(Hv, dv // BV)](y, w, u, gc, qk, state, o, T, y.stride(0), **shapes, BV=BV,
                                         num_warps=SCAN_WARPS, num_stages=SCAN_STAGES)
        return o
    n_chunks = cdiv(T, CHUNK)
    h = torch.empty(n_chunks, Hv, dk, dv, device=y.device, dtype=torch.float32)
    _gdn_states_kernel[(Hv, dv // BV)](y, w, u, gc, state, h, T, y.stride(0), **shapes, BV=BV,
                                       num_warps=SCAN_WARPS, num_stages=SCAN_STAGES)
    BO = min(dv, OUT_BV)
    _gdn_output_kernel[(n_chunks, Hv, dv // BO)](y, u, gc, qk, h, o, T, y.stride(0), **shapes, BV=BO,
                                                 num_warps=OUT_WARPS)
    return o


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, dv] (any float), z [T, Hv*dv] -> bf16 [T, Hv*dv]: weight * rmsnorm(o) * silu(z) per head."""
    T, Hv, dv = o.shape
    if z.shape != (T, Hv * dv) or z.stride(1) != 1 or weight.shape != (dv,) or not o.is_contiguous():
        raise ValueError(f"gated_rmsnorm: o {tuple(o.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(T, Hv * dv, device=o.device, dtype=torch.bfloat16)
    bt = max(1, min(32, 4096 // (Hv * dv)))
    _gated_rmsnorm_kernel[(cdiv(T, bt),)](o, z, weight, out, T, z.stride(0), out.stride(0), eps,
                                          HV=Hv, DV=dv, BLOCK_T=bt, num_warps=4)
    return out


def gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk: int, Hv: int, dk: int, dv: int):
    """The model's preprocessing in fp32: (q, k, v, g, beta) as gated_delta_recurrent takes them."""
    T = y.shape[0]
    y = y.float()
    q = y[:, :Hk * dk].reshape(T, Hk, dk)
    k = y[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    v = y[:, 2 * Hk * dk:].reshape(T, Hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return q, k, v, g, beta


def gated_rmsnorm_reference(o, z, weight, eps: float = 1e-6):
    T, Hv, dv = o.shape
    o = o.float()
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.nn.functional.silu(z.float().reshape(T, Hv, dv))).reshape(T, Hv * dv)


def gdn_prep_reference(y, b, a, A_log, dt_bias, Hk: int, Hv: int, dk: int, dv: int, chunk: int = CHUNK):
    """What the prep kernel writes, in plain torch (fp64): (W, U, c, QK) as gdn_prep returns them.

    Per chunk and value head, with c the cumulative log-decay from the chunk start, the system
    (I + strictly_lower(beta_i exp(c_i - c_j) k_i.k_j)) X = RHS is solved for RHS = beta exp(c) k (W)
    and RHS = beta v (U); QK[t, i] = (q_t . k_i) exp(c_t - c_i) for i <= t, zero elsewhere."""
    T = y.shape[0]
    q, k, v, g, beta = (x.double() for x in gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv))
    rep = Hv // Hk
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)   # [T, Hv, dk]
    f64 = dict(dtype=torch.float64, device=y.device)
    w, u, gc = torch.empty(T, Hv, dk, **f64), torch.empty(T, Hv, dv, **f64), torch.empty(T, Hv, **f64)
    qk = torch.zeros(T, Hv, chunk, **f64)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        c = g[s:e].cumsum(0).T                                   # [Hv, n]
        qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [Hv, n, d]
        bc = beta[s:e].T
        causal = torch.ones(n, n, dtype=torch.bool, device=y.device).tril()
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        system = torch.eye(n, **f64) + ((kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]).tril(-1)
        solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w[s:e] = solve((bc * c.exp())[:, :, None] * kc).transpose(0, 1)
        u[s:e] = solve(bc[:, :, None] * vc).transpose(0, 1)
        gc[s:e] = c.T
        qk[s:e, :, :n] = ((qc @ kc.transpose(1, 2)) * decay).transpose(0, 1)
    return w, u, gc, qk
