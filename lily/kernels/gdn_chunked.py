"""Chunked gated delta rule for prefill (WY / UT form, 64-token chunks, fp32 state).

Computes the recurrence of lily/kernels/gated_delta.py (S = exp(g) S; u = v - S^T k; S += beta k u^T;
o = S^T q) a chunk at a time, starting from the decode state and leaving the final state in its place.

Inputs come straight from the model: the conv output y [T, 2*Hk*dk + Hv*dv] (q | k | v, SiLU applied),
and the raw gate projections b, a [T, Hv]. The kernels do the rest on the way in: L2 norm of q and k
(q also scaled by dk^-0.5), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); value head j
reads key head j // (Hv / Hk).

1. The prep, parallel over (chunk, value head): within the chunk, with c the cumulative log-decay, solve
   the unit lower-triangular system (I + A) X = RHS, A[i, j] = beta_i exp(c_i - c_j) k_i.k_j for j < i,
   by inverting (I + A); write W = X for RHS = beta exp(c) k and U = X for RHS = beta v, c itself, and
   the decayed causal QK[t, i] = (q_t . k_i) exp(c_t - c_i) (i <= t), which the scan would otherwise
   recompute per dv block. Two ways to invert (PREP_ALGO), their dots at PREP_PRECISION:
   "blocked" (`_gdn_prep_blocked_kernel`): the four 16x16 diagonal blocks by forward substitution in fp32,
   the six below them by block forward substitution (batched 16x16x16 dots, a block diagonal at a time);
   "products" (`_gdn_prep_kernel`): products of nilpotent powers on 64x64 tiles (`_unit_lower_inverse`,
   11 dots of 64x64x64), whose large intermediate powers lose accuracy on strongly coupled chunks.
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
from lily.kernels.shared_memory import max_shared_bytes
from lily.kernels.q4_gemm import UPCAST_DOT as _UPCAST  # the interpreter's bf16 dots are wrong: upcast there

CHUNK = 64

# input_precision of the triangular-inverse dots in the prep kernel (k k^T and q k^T are exact bf16
# dots whatever this says; W and U are tf32 dots). "tf32x3" runs on the tensor cores at ~fp32 accuracy;
# plain "tf32" is ~1e-3 a product, enough on typical inputs, but the products inverse diverges on a
# strongly coupled chunk (near-identical keys, beta ~ 1, slow decay: a repeated token; a CPU emulation
# gave rel err ~10 vs 3e-3), and the blocked one loses ~5x (emulated: W rows 7e-2 vs 1.5e-2), so it is
# not the default. "ieee" is fp32 on the FMA units (67 ms of a 4K prefill on the H200 for the 30 layers
# with the products algorithm; the blocked one's dots are 16x16x16).
PREP_PRECISION = "tf32x3"
PREP_WARPS = 4        # H200 sweep at a 4K prompt (scripts/gpu_prefill_check.py gdn_sweep, f20b30c)
# How the prep kernel inverts (I + A) (module docstring, step 1): "blocked" (16x16 blocks: forward
# substitution in fp32 on the diagonal ones, block forward substitution below; ptxas, sm_90: no spills)
# or "products" (nilpotent-power products on 64x64 tiles, ~19 MFLOP a program; 255 registers and spills).
PREP_ALGO = "blocked"
# A cap on the prep kernel's registers a thread (ptxas's maxnreg; None: no cap). H200 sweep at a 4K prompt
# (gdn_sweep): blocked prep 0.206 ms a layer uncapped, 0.190 at 168, 0.188 at 128 (4 programs an SM; the
# products prep took 0.611).
PREP_MAXNREG = 128
SCAN_SPLIT = False    # True: walk the state alone and form the output in a parallel kernel (slower there)
SCAN_BV = 32          # dv columns a walking program owns: Hv * dv / SCAN_BV programs walk the chunks
SCAN_WARPS = 8        # (ptxas, sm_90: 4 warps spill ~2 KB a thread in the single scan, 8 warps ~0.5 KB)
SCAN_STAGES = 2       # > 1 lets Triton prefetch the next chunk's loads (shared memory permitting)
# A prompt chunk of at most SCAN_SHORT_MAX_T tokens walks with (warps, stages) SCAN_SHORT instead: H200, a
# 256-token prompt as a graph (interleaved replays, median of 15, 49c1433) 17.82 -> 17.60 ms with (4, 1); the
# sweep at 256 (gdn_sweep) had the walk 28 -> 22 us a layer. A 4K prompt keeps (8, 2) (its sweep's choice).
SCAN_SHORT_MAX_T = 256
SCAN_SHORT = (4, 1)
# The walk's stages where a program may have less shared memory than two stages ask (112 KiB compiled for
# sm_86 / sm_89, over those cards' 99 KiB; one stage 88 KiB): lily.kernels.shared_memory.
SCAN_TWO_STAGES_BYTES = 115 * 1024
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
        if name not in ("PREP_ALGO", "PREP_PRECISION", "PREP_WARPS", "PREP_MAXNREG", "SCAN_SPLIT", "SCAN_BV",
                        "SCAN_WARPS", "SCAN_STAGES"):
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
    (An earlier 16-row blocked variant of this function, with smaller tiles, measured slower on the H200:
    115 ms vs 67 ms, ieee. PREP_ALGO "blocked" is another kernel, _gdn_prep_blocked_kernel.)"""
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
def _slot_blocks(slot, n_rows, d: tl.constexpr, e: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                 HV: tl.constexpr):
    """Pointers [C // B, B, B] and mask of the blocks (n + d, n + e), n = 0, 1, ..., of a program's C x C slot
    of the QK output (its row i at slot + i * HV * C); blocks past the chunk and rows from n_rows on masked."""
    n = tl.arange(0, C // B)[:, None, None]
    r = tl.arange(0, B)
    i = (n + d) * B + r[None, :, None]
    return slot + i * (HV * C) + (n + e) * B + r[None, None, :], (i < n_rows) & (n + d < C // B)


@triton.jit
def _slot_load(slot, n_rows, d: tl.constexpr, e: tl.constexpr, B: tl.constexpr, C: tl.constexpr, HV: tl.constexpr):
    p, m = _slot_blocks(slot, n_rows, d, e, B, C, HV)
    return tl.load(p, mask=m, other=0.0)


@triton.jit
def _diag_blocks_inverse(A, B: tl.constexpr, C: tl.constexpr):
    """(I + A_nn)^-1 [C // B, B, B] for the diagonal blocks of A [C, C] (strictly lower, fp32), by forward
    substitution on the four blocks at once (a step a row). Taken from A in registers, the [4, B, B] tile
    keeps the MMA result's rows on their warps (a block to a warp at 4 warps), so the steps' reductions
    stay within warps (ptxas, sm_90: no barriers; 111 when the blocks are loaded back from memory).
    Y (the inverse's strictly lower part) starts as -A_nn; row s becomes -(A_s + A_s Y), whose terms use
    only the rows above s, already done (rows 0 and 1 are done from the start)."""
    blk = tl.arange(0, C // B)
    on_diag = blk[:, None, None, None] == blk[None, None, :, None]
    Y = -tl.sum(tl.where(on_diag, tl.reshape(A, (C // B, B, C // B, B)), 0.0), axis=2)
    r = tl.arange(0, B)
    for s in tl.static_range(2, B):
        at_s = r[None, :, None] == s
        n_s = tl.sum(tl.where(at_s, Y, 0.0), axis=1)  # -A_s: row s is not done yet
        y_s = n_s + tl.sum(n_s[:, :, None] * Y, axis=1)
        Y = tl.where(at_s, y_s[:, None, :], Y)
    return Y + tl.where(r[None, :, None] == r[None, None, :], 1.0, 0.0)


@triton.jit
def _gdn_prep_blocked_kernel(y_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr, qk_ptr,
                             T, stride_y, stride_ba,
                             HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             C: tl.constexpr, PREC: tl.constexpr, BF16_MMA: tl.constexpr):
    """_gdn_prep_kernel's outputs with (I + A)^-1 formed in 16-row blocks (PREP_ALGO "blocked").

    A comes from one exact bf16 dot of the chunk's keys, as in the products kernel; its four diagonal
    blocks are inverted in registers (_diag_blocks_inverse: D_n = (I + A_nn)^-1, fp32). The program's own
    64 x 64 slot of the QK output is its scratch (QK is written there last): A's other blocks and the D_n
    go in, the blocks of the inverse below the diagonal are formed a block diagonal at a time,
    X_{n+d, n} = -D_{n+d} sum_{e < d} A_{n+d, n+e} X_{n+e, n} (X_{n, n} = D_n), batched 16x16x16 dots at
    PREC, and written over A's; then W and U are two dots with the whole inverse (tf32, as in the
    products kernel). Offline ptxas (sm_90) shaped this: A's blocks taken from 16-row key blocks held each
    key block in MMA operand layout across the ten dots (255 registers, ~500 bytes of spills for that
    part alone), the diagonal blocks loaded back from memory cost 111 barriers in the substitution, and
    keys, norms or c reused from the start for QK at the end kept their tiles live all along."""
    tl.static_assert(C == 64, "the blocked prep is written out for four 16-row blocks")
    B: tl.constexpr = 16
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    rows = tl.arange(0, C)
    row0 = chunk * C
    t = row0 + rows
    ok = t < T
    n_rows = T - row0  # rows from n_rows on are past T
    beta, gc = _chunk_gates(b_ptr, a_ptr, alog_ptr, dtb_ptr, t.to(tl.int64), ok, h, stride_ba, C)
    # the chunk's first row of each table (64-bit), then 32-bit offsets within the chunk
    r0 = row0.to(tl.int64)
    y_c = y_ptr + r0 * stride_y + rows[:, None] * stride_y
    slot = qk_ptr + (r0 * HV + h) * C
    slot_rc = rows[:, None] * (HV * C) + rows[None, :]
    tl.store(gc_ptr + r0 * HV + h + rows * HV, gc, mask=ok)
    dk = tl.arange(0, DK)

    # A (strictly lower) into the slot but for its diagonal blocks, which go in inverted: D_n = (I + A_nn)^-1.
    # (Rows past T are not written: they read back as 0, as beta = 0 makes them anyway.)
    k = tl.load(y_c + HK * DK + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    kf = k.to(tl.float32)
    rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    decay = tl.exp(tl.where(rows[:, None] > rows[None, :], gc[:, None] - gc[None, :], float("-inf")))
    A = _dot_exact(k, k, BF16_MMA) * (beta * rk)[:, None] * rk[None, :] * decay  # 0 on and above the diagonal
    tl.store(slot + slot_rc, A, mask=ok[:, None] & (rows[:, None] // B != rows[None, :] // B))
    p, m = _slot_blocks(slot, n_rows, 0, 0, B, C, HV)
    tl.store(p, _diag_blocks_inverse(A, B, C), mask=m)
    tl.debug_barrier()  # (every thread's part written before any thread reads a block of it)

    # the blocks below the diagonal, a diagonal of blocks at a time: X_d[n] = X_{n+d, n} (X_0[n] = D_n) is
    # -D_{n+d} sum_{e < d} A_{n+d, n+e} X_e[n], [4, 16, 16] batched dots at PREC (blocks past the chunk are 0).
    # X_d is written over A's diagonal d once every thread has read what the later diagonals need of it.
    X0 = _slot_load(slot, n_rows, 0, 0, B, C, HV)
    X1 = tl.dot(_slot_load(slot, n_rows, 1, 0, B, C, HV), X0, input_precision=PREC)
    X1 = -tl.dot(_slot_load(slot, n_rows, 1, 1, B, C, HV), X1, input_precision=PREC)
    A21 = _slot_load(slot, n_rows, 2, 1, B, C, HV)  # [n] = A_{n+2, n+1}, on diagonal 1
    A31 = _slot_load(slot, n_rows, 3, 1, B, C, HV)  # on diagonal 2
    A32 = _slot_load(slot, n_rows, 3, 2, B, C, HV)  # on diagonal 1
    tl.debug_barrier()
    p, m = _slot_blocks(slot, n_rows, 1, 0, B, C, HV)
    tl.store(p, X1, mask=m)
    X2 = tl.dot(_slot_load(slot, n_rows, 2, 0, B, C, HV), X0, input_precision=PREC)
    X2 = tl.dot(A21, X1, acc=X2, input_precision=PREC)
    X2 = -tl.dot(_slot_load(slot, n_rows, 2, 2, B, C, HV), X2, input_precision=PREC)
    tl.debug_barrier()
    p, m = _slot_blocks(slot, n_rows, 2, 0, B, C, HV)
    tl.store(p, X2, mask=m)
    X3 = tl.dot(_slot_load(slot, n_rows, 3, 0, B, C, HV), X0, input_precision=PREC)
    X3 = tl.dot(A31, X1, acc=X3, input_precision=PREC)
    X3 = tl.dot(A32, X2, acc=X3, input_precision=PREC)
    X3 = -tl.dot(_slot_load(slot, n_rows, 3, 3, B, C, HV), X3, input_precision=PREC)
    tl.debug_barrier()
    p, m = _slot_blocks(slot, n_rows, 3, 0, B, C, HV)
    tl.store(p, X3, mask=m)
    tl.debug_barrier()

    # W = inv diag(beta exp(c) rk) k, U = inv diag(beta) v (tf32 dots, as in the products kernel), with the
    # scales on the rows of k and v (the inverse goes to the dots as loaded), 64 columns at a time
    inv = tl.load(slot + slot_rc, mask=ok[:, None], other=0.0)
    sw = (beta * tl.exp(gc) * rk)[:, None]
    WK: tl.constexpr = min(DK, 64)
    WV: tl.constexpr = min(DV, 64)
    w_c = w_ptr + (r0 * HV + h) * DK + rows[:, None] * (HV * DK)
    for d0 in tl.static_range(0, DK, WK):
        cols = d0 + tl.arange(0, WK)
        kd = tl.load(y_c + HK * DK + kh * DK + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(w_c + cols[None, :], tl.dot(inv, kd * sw), mask=ok[:, None])
    u_c = u_ptr + (r0 * HV + h) * DV + rows[:, None] * (HV * DV)
    for d0 in tl.static_range(0, DV, WV):
        cols = d0 + tl.arange(0, WV)
        vd = tl.load(y_c + 2 * HK * DK + h * DV + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(u_c + cols[None, :], tl.dot(inv, vd * beta[:, None]), mask=ok[:, None])

    # QK over the slot, once every thread has read the inverse from it. The keys, their norms and c are taken
    # anew (c from gc_ptr): reused from above, their tiles in the dots' layouts stayed live all along.
    k = tl.load(y_c + HK * DK + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    kf = k.to(tl.float32)
    rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    q = tl.load(y_c + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    rq = tl.rsqrt(tl.sum(qf * qf, axis=1) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    gc = tl.load(gc_ptr + r0 * HV + h + rows * HV, mask=ok, other=0.0)  # (rows past T: no decay, no QK)
    decay = tl.exp(tl.where((rows[:, None] >= rows[None, :]) & ok[:, None], gc[:, None] - gc[None, :], float("-inf")))
    qk = _dot_exact(q, k, BF16_MMA) * rq[:, None] * rk[None, :] * decay
    tl.debug_barrier()
    tl.store(slot + slot_rc, qk, mask=ok[:, None])


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
    S = tl.load(s_ptrs).to(tl.float32)  # [DK, BV] (stored fp32 or bf16)
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
    tl.store(s_ptrs, S.to(s_ptr.dtype.element_ty))


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
    S = tl.load(s_ptrs).to(tl.float32)  # [DK, BV] (stored fp32 or bf16)
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
    tl.store(s_ptrs, S.to(s_ptr.dtype.element_ty))


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
            or state.dtype not in (torch.float32, torch.bfloat16) or not state.is_contiguous() or Hv % Hk):
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
        num_warps=PREP_WARPS, num_stages=1, maxnreg=PREP_MAXNREG)
    return out


def scan_shape(T: int, device) -> tuple[int, int]:
    """(warps, stages) of the chunk walk over a T-token chunk on `device`: SCAN_SHORT for a short chunk, else
    (SCAN_WARPS, SCAN_STAGES), one stage where the device's programs have less shared memory than two ask."""
    if T <= SCAN_SHORT_MAX_T:
        return SCAN_SHORT
    stages = SCAN_STAGES
    if stages > 1 and max_shared_bytes(device) < SCAN_TWO_STAGES_BYTES:
        stages = 1
    return SCAN_WARPS, stages


def gdn_chunked_prefill(y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, state: torch.Tensor, num_key_heads: int) -> torch.Tensor:
    """y [T, 2*Hk*dk + Hv*dv] conv output; b, a [T, Hv]; state [Hv, dk, dv] fp32 or bf16 (the walk runs in fp32
    from it and stores it rounded at the end), updated in place.

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
        warps, stages = scan_shape(T, y.device)
        _gdn_scan_kernel[(Hv, dv // BV)](y, w, u, gc, qk, state, o, T, y.stride(0), **shapes, BV=BV,
                                         num_warps=warps, num_stages=stages)
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
