"""Chunked gated delta rule for prefill (WY / UT form, 64-token chunks, fp32 state).

Computes the recurrence of lily/kernels/gated_delta.py (S = exp(g) S; u = v - S^T k; S += beta k u^T;
o = S^T q) a chunk at a time, starting from the decode state and leaving the final state in its place.

Inputs come straight from the model: the conv output y [T, 2*Hk*dk + Hv*dv] (q | k | v, SiLU applied),
and the raw gate projections b, a [T, Hv]. The kernels do the rest on the way in: L2 norm of q and k
(q also scaled by dk^-0.5), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); value head j
reads key head j // (Hv / Hk).

Two launches:
1. `_gdn_prep_kernel`, parallel over (chunk, value head): within the chunk, with c the cumulative
   log-decay, solve the unit lower-triangular system (I + A) X = RHS, A[i, j] = beta_i exp(c_i - c_j)
   k_i.k_j for j < i, by inverting (I + A) in 16x16 blocks (diagonal blocks, then merged); write W = X for RHS = beta exp(c) k and
   U = X for RHS = beta v, plus c itself.
2. `_gdn_scan_kernel`, one program per (value head, dv block), walking the chunks in order with S in
   registers: w = U - W S; o = exp(c) q S + (causal(q k^T * exp(c_t - c_i))) w;
   S = exp(c_last) S + (k exp(c_last - c))^T w.
A third small kernel applies the output's gated RMSNorm: gain * rmsnorm(o) * silu(z), per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inverse_unit_lower16(A):
    """(I + A)^-1 for a strictly lower [16, 16] fp32 A: A^16 = 0, so it is (I - A)(I + A^2)(I + A^4)(I + A^8)
    exactly; fp32 (ieee) dots. Entries of the powers stay below C(15, 8) ~ 6e3 even for identical keys,
    so the rounding stays ~1e-4 at worst (tests/test_kernels_prefill.py has that case)."""
    rows = tl.arange(0, 16)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    a2 = _mm(A, A)
    a4 = _mm(a2, a2)
    inv = _mm(_mm(eye - A, eye + a2), eye + a4)
    return _mm(inv, eye + _mm(a4, a4))


@triton.jit
def _sub_chunk(y_ptr, b_ptr, a_ptr, t0, T, stride_y, stride_ba, h, kh, neg_a, dt_bias,
               HK: tl.constexpr, DK: tl.constexpr):
    """16 rows from t0: normalised k [16, DK], beta and log-decay g [16] (zero past T), row ids."""
    t = t0 + tl.arange(0, 16)
    ok = t < T
    t64 = t.to(tl.int64)
    dk = tl.arange(0, DK)
    b = tl.load(b_ptr + t64 * stride_ba + h, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t64 * stride_ba + h, mask=ok, other=0.0).to(tl.float32)
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(ok, neg_a * softplus, 0.0)
    beta = tl.where(ok, tl.sigmoid(b), 0.0)
    k = tl.load(y_ptr + t64[:, None] * stride_y + HK * DK + kh * DK + dk[None, :], mask=ok[:, None], other=0.0)
    return _l2norm_rows(k.to(tl.float32)), beta, g, t64, ok


@triton.jit
def _a_block(ki, kj, beta_i, gc_i, gc_j):
    """A[i-block, j-block] = beta_i exp(gc_i - gc_j) k_i.k_j for a block strictly below the diagonal."""
    kk = tl.dot(ki, tl.trans(kj), input_precision="ieee")
    return kk * tl.exp(gc_i[:, None] - gc_j[None, :]) * beta_i[:, None]


@triton.jit
def _a_diag(k, beta, gc):
    r = tl.arange(0, 16)
    kk = tl.dot(k, tl.trans(k), input_precision="ieee")
    lower = r[:, None] > r[None, :]
    return tl.where(lower, kk * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)) * beta[:, None], 0.0)


@triton.jit
def _store_rows(w_ptr, u_ptr, y_ptr, t64, ok, h, stride_y, w, xs0, xs1, xs2, xs3, vb0, vb1, vb2, vb3,
                t0, t1, t2, t3, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Rows of one 16-block: W = sum_j T_ij X_j and U = sum_j T_ij (beta v)_j (unused T_ij are zero)."""
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    w = tl.dot(t0, xs0) + tl.dot(t1, xs1) + tl.dot(t2, xs2) + tl.dot(t3, xs3)
    u = tl.dot(t0, vb0) + tl.dot(t1, vb1) + tl.dot(t2, vb2) + tl.dot(t3, vb3)
    base = t64[:, None] * HV + h
    tl.store(w_ptr + base * DK + dk[None, :], w, mask=ok[:, None])
    tl.store(u_ptr + base * DV + dv[None, :], u, mask=ok[:, None])


@triton.jit
def _gdn_prep_kernel(y_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr,
                     T, stride_y, stride_ba,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr):
    """One 64-token chunk of one value head, as four 16-row blocks (all tiles 16 x 16 or 16 x d):
    T = (I + A)^-1 blockwise (diagonal blocks by a finite product, then T_ij = -T_ii sum_m A_im T_mj),
    W = T (beta exp(c) k), U = T (beta v)."""
    tl.static_assert(C == 64, "the chunk is four 16-row blocks")
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    c0 = chunk * C
    k0, be0, g0, r0, ok0 = _sub_chunk(y_ptr, b_ptr, a_ptr, c0, T, stride_y, stride_ba, h, kh, neg_a, dtb, HK, DK)
    k1, be1, g1, r1, ok1 = _sub_chunk(y_ptr, b_ptr, a_ptr, c0 + 16, T, stride_y, stride_ba, h, kh, neg_a, dtb, HK, DK)
    k2, be2, g2, r2, ok2 = _sub_chunk(y_ptr, b_ptr, a_ptr, c0 + 32, T, stride_y, stride_ba, h, kh, neg_a, dtb, HK, DK)
    k3, be3, g3, r3, ok3 = _sub_chunk(y_ptr, b_ptr, a_ptr, c0 + 48, T, stride_y, stride_ba, h, kh, neg_a, dtb, HK, DK)
    # cumulative log-decay from the chunk start
    gc0 = tl.cumsum(g0, 0)
    gc1 = tl.cumsum(g1, 0) + tl.sum(g0)
    gc2 = tl.cumsum(g2, 0) + tl.sum(g0) + tl.sum(g1)
    gc3 = tl.cumsum(g3, 0) + tl.sum(g0) + tl.sum(g1) + tl.sum(g2)
    tl.store(gc_ptr + r0 * HV + h, gc0, mask=ok0)
    tl.store(gc_ptr + r1 * HV + h, gc1, mask=ok1)
    tl.store(gc_ptr + r2 * HV + h, gc2, mask=ok2)
    tl.store(gc_ptr + r3 * HV + h, gc3, mask=ok3)

    t00 = _inverse_unit_lower16(_a_diag(k0, be0, gc0))
    t11 = _inverse_unit_lower16(_a_diag(k1, be1, gc1))
    t22 = _inverse_unit_lower16(_a_diag(k2, be2, gc2))
    t33 = _inverse_unit_lower16(_a_diag(k3, be3, gc3))
    a10 = _a_block(k1, k0, be1, gc1, gc0)
    a20 = _a_block(k2, k0, be2, gc2, gc0)
    a21 = _a_block(k2, k1, be2, gc2, gc1)
    a30 = _a_block(k3, k0, be3, gc3, gc0)
    a31 = _a_block(k3, k1, be3, gc3, gc1)
    a32 = _a_block(k3, k2, be3, gc3, gc2)
    t10 = -_mm(t11, _mm(a10, t00))
    t21 = -_mm(t22, _mm(a21, t11))
    t20 = -_mm(t22, _mm(a20, t00) + _mm(a21, t10))
    t32 = -_mm(t33, _mm(a32, t22))
    t31 = -_mm(t33, _mm(a31, t11) + _mm(a32, t21))
    t30 = -_mm(t33, _mm(a30, t00) + _mm(a31, t10) + _mm(a32, t20))

    dv = tl.arange(0, DV)
    v_off = 2 * HK * DK + h * DV + dv[None, :]
    vb0 = tl.load(y_ptr + r0[:, None] * stride_y + v_off, mask=ok0[:, None], other=0.0).to(tl.float32) * be0[:, None]
    vb1 = tl.load(y_ptr + r1[:, None] * stride_y + v_off, mask=ok1[:, None], other=0.0).to(tl.float32) * be1[:, None]
    vb2 = tl.load(y_ptr + r2[:, None] * stride_y + v_off, mask=ok2[:, None], other=0.0).to(tl.float32) * be2[:, None]
    vb3 = tl.load(y_ptr + r3[:, None] * stride_y + v_off, mask=ok3[:, None], other=0.0).to(tl.float32) * be3[:, None]
    xs0 = k0 * (be0 * tl.exp(gc0))[:, None]
    xs1 = k1 * (be1 * tl.exp(gc1))[:, None]
    xs2 = k2 * (be2 * tl.exp(gc2))[:, None]
    xs3 = k3 * (be3 * tl.exp(gc3))[:, None]
    zero = tl.zeros((16, 16), dtype=tl.float32)
    _store_rows(w_ptr, u_ptr, y_ptr, r0, ok0, h, stride_y, zero, xs0, xs1, xs2, xs3, vb0, vb1, vb2, vb3,
                t00, zero, zero, zero, HK, HV, DK, DV)
    _store_rows(w_ptr, u_ptr, y_ptr, r1, ok1, h, stride_y, zero, xs0, xs1, xs2, xs3, vb0, vb1, vb2, vb3,
                t10, t11, zero, zero, HK, HV, DK, DV)
    _store_rows(w_ptr, u_ptr, y_ptr, r2, ok2, h, stride_y, zero, xs0, xs1, xs2, xs3, vb0, vb1, vb2, vb3,
                t20, t21, t22, zero, HK, HV, DK, DV)
    _store_rows(w_ptr, u_ptr, y_ptr, r3, ok3, h, stride_y, zero, xs0, xs1, xs2, xs3, vb0, vb1, vb2, vb3,
                t30, t31, t32, t33, HK, HV, DK, DV)


@triton.jit
def _gdn_scan_kernel(y_ptr, w_ptr, u_ptr, gc_ptr, s_ptr, o_ptr, T, stride_y,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    kh = h // (HV // HK)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    s_ptrs = s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S = tl.load(s_ptrs)  # [DK, BV] fp32
    q_scale = 1.0 / tl.sqrt(DK * 1.0)
    for chunk in range(0, tl.cdiv(T, C)):
        t = chunk * C + rows
        ok = t < T
        t64 = t.to(tl.int64)
        q = tl.load(y_ptr + t64[:, None] * stride_y + kh * DK + dk[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        q = _l2norm_rows(q) * q_scale
        k = tl.load(y_ptr + t64[:, None] * stride_y + HK * DK + kh * DK + dk[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        k = _l2norm_rows(k)
        base = t64[:, None] * HV + h
        w = tl.load(w_ptr + base * DK + dk[None, :], mask=ok[:, None], other=0.0)
        u = tl.load(u_ptr + base * DV + dv[None, :], mask=ok[:, None], other=0.0)
        last = tl.minimum(chunk * C + C, T) - 1
        gc_last = tl.load(gc_ptr + last.to(tl.int64) * HV + h)
        # rows past the end carry the last decay (as if g = 0 there), so no exponent is positive
        gc = tl.load(gc_ptr + t64 * HV + h, mask=ok, other=0.0)
        gc = tl.where(ok, gc, gc_last)
        new_v = u - tl.dot(w, S)  # [C, BV]: beta * (v - decayed-state prediction)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        o = tl.exp(gc)[:, None] * tl.dot(q, S) + tl.dot(qk, new_v)
        tl.store(o_ptr + base * DV + dv[None, :], o, mask=ok[:, None])
        k_tail = k * tl.exp(gc_last - gc)[:, None]
        S = tl.exp(gc_last) * S + tl.dot(tl.trans(k_tail), new_v)
    tl.store(s_ptrs, S)


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


def gdn_chunked_prefill(y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, state: torch.Tensor, num_key_heads: int) -> torch.Tensor:
    """y [T, 2*Hk*dk + Hv*dv] conv output; b, a [T, Hv]; state [Hv, dk, dv] fp32, updated in place.

    Returns o fp32 [T, Hv, dv] (before the gated norm)."""
    T = y.shape[0]
    Hv, dk, dv = state.shape
    Hk = num_key_heads
    if (y.shape[1] != 2 * Hk * dk + Hv * dv or b.shape != (T, Hv) or a.shape != (T, Hv)
            or b.stride() != a.stride() or b.stride(1) != 1 or y.stride(1) != 1
            or state.dtype != torch.float32 or not state.is_contiguous() or Hv % Hk):
        raise ValueError(f"gdn_chunked_prefill: y {tuple(y.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}, "
                         f"state {tuple(state.shape)} {state.dtype} disagree")
    dev = y.device
    w = torch.empty(T, Hv, dk, device=dev, dtype=torch.float32)
    u = torch.empty(T, Hv, dv, device=dev, dtype=torch.float32)
    gc = torch.empty(T, Hv, device=dev, dtype=torch.float32)
    o = torch.empty(T, Hv, dv, device=dev, dtype=torch.float32)
    n_chunks = triton.cdiv(T, CHUNK)
    _gdn_prep_kernel[(n_chunks, Hv)](y, b, a, A_log, dt_bias, w, u, gc, T, y.stride(0), b.stride(0),
                                     HK=Hk, HV=Hv, DK=dk, DV=dv, C=CHUNK, num_warps=4, num_stages=1)
    BV = min(dv, 32)
    _gdn_scan_kernel[(Hv, dv // BV)](y, w, u, gc, state, o, T, y.stride(0),
                                     HK=Hk, HV=Hv, DK=dk, DV=dv, C=CHUNK, BV=BV, num_warps=4,
                                     num_stages=1)  # fp32 tiles: no room for a pipelined loop
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
    _gated_rmsnorm_kernel[(triton.cdiv(T, bt),)](o, z, weight, out, T, z.stride(0), out.stride(0), eps,
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
