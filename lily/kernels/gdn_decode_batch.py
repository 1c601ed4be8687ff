"""Gated DeltaNet decode for B sequences at once, each on its own slot's state (the batched decode step).

After the batched in-projection GEMM, proj [B, conv_dim + Hv*dv (z) + Hv (b) + Hv (a)] fp32 (row b is
sequence b; slots[b] says which slot's state it owns), two launches:
  conv:  grid (B, C / BC): y = silu(causal depthwise conv over [the slot's last K-1 pre-conv rows | this
         row]); the slot's conv state shifts by one; y replaces the row's q|k|v in proj (in place).
  step:  grid (B, Hv, dv / BV): q and k L2-normalised (value head j reads key head j // (Hv / Hk)), q times
         dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), then on the slot's state (updated
         in fp32, stored fp32 or bf16): S = exp(g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q   for BV
         of the head's dv columns.
Rows b >= n_valid (a CUDA graph's padding up to its batch-size bucket) read and write no state.
The gated RMSNorm of o with z follows as in prefill (gated_rmsnorm), or inside the step's launch
(`gdn_step_norm_rows`: as the batch-1 gdn_decode, the last of a head's dv / BV programs to finish normalises the
head), then the out-projection (q_gemm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.gdn_decode import gated_head_norm
from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.pdl import wait_prior
L2_EPS = 1e-6


@triton.jit
def conv_step_rows_kernel(proj_ptr, conv_w_ptr, state_ptr, slots_ptr, n_valid_ptr, proj_stride,
                          C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
                          GDC: tl.constexpr = False):
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        slot = tl.load(slots_ptr + b).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        j = tl.arange(0, KP)
        st = state_ptr + slot * ((K - 1) * C)                  # the slot's [K-1, C] rows, oldest first
        row = proj_ptr + b * proj_stride
        old = tl.load(st + j[None, :] * C + c[:, None], mask=cm[:, None] & (j < K - 1)[None, :], other=0.0)
        nxt = tl.load(st + (j[None, :] + 1) * C + c[:, None], mask=cm[:, None] & (j < K - 2)[None, :], other=0.0)
        w = tl.load(conv_w_ptr + c[:, None] * K + j[None, :], mask=cm[:, None] & (j < K)[None, :], other=0.0)
        wait_prior(GDC)                  # the slot's conv state and the weights above are older: the row is not
        m = tl.load(row + c, mask=cm, other=0.0)
        win = tl.where((j == K - 1)[None, :], m[:, None], old.to(tl.float32))
        y = tl.sum(win * w, axis=1)
        new = tl.where((j == K - 2)[None, :], m[:, None], nxt.to(tl.float32))
        tl.debug_barrier()   # a state row is read by one thread and rewritten by another: all reads first
        tl.store(st + j[None, :] * C + c[:, None], new.to(state_ptr.dtype.element_ty),
                 mask=cm[:, None] & (j < K - 1)[None, :])
        tl.store(row + c, y * tl.sigmoid(y), mask=cm)


@triton.jit
def gdn_step_rows_kernel(proj_ptr, state_ptr, a_log_ptr, dt_bias_ptr, o_ptr, slots_ptr, n_valid_ptr, proj_stride,
                         q_scale, norm_ptr, ss_ptr, count_ptr, x_ptr, eps,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BV: tl.constexpr, L2_EPS: tl.constexpr, NORM: tl.constexpr, NBP: tl.constexpr,
                         GDC: tl.constexpr = False):
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        j = tl.program_id(1)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        KEY: tl.constexpr = HK * DK
        CONV: tl.constexpr = 2 * KEY + HV * DV
        kh = j // (HV // HK)
        dk = tl.arange(0, DK)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        row = proj_ptr + b * proj_stride
        sp = state_ptr + (slot * HV + j) * (DK * DV) + dk[:, None] * DV + cols[None, :]
        S = tl.load(sp).to(tl.float32)   # the slot's state from its previous step: requested before the wait
        wait_prior(GDC)                  # the row's q|k|v (conv'd), z, b, a come from the previous kernels
        q = tl.load(row + kh * DK + dk)
        k = tl.load(row + KEY + kh * DK + dk)
        v = tl.load(row + 2 * KEY + j * DV + cols)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + L2_EPS) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + L2_EPS)
        beta = tl.sigmoid(tl.load(row + CONV + HV * DV + j))
        a = tl.load(row + CONV + HV * DV + HV + j) + tl.load(dt_bias_ptr + j)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        S = S * tl.exp(-tl.exp(tl.load(a_log_ptr + j)) * softplus)
        u = beta * (v - tl.sum(S * k[:, None], 0))
        S += k[:, None] * u[None, :]
        tl.store(sp, S.to(state_ptr.dtype.element_ty))             # fp32, or rounded to a bf16 state
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + (b * HV + j) * DV + cols, o)
        if NORM:
            # the gated RMSNorm needs the whole head: the last of its NB programs to finish (an acq_rel counter a
            # (row, head)) normalises all DV outputs into x (bf16) and sets the counter back for the next step
            NB: tl.constexpr = DV // BV
            head = b * HV + j
            tl.store(ss_ptr + head * NB + tl.program_id(2), tl.sum(o * o, 0))
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + head, 1) == NB - 1:
                tl.debug_barrier()
                xv = gated_head_norm(o_ptr + head * DV, ss_ptr + head * NB, row + CONV + j * DV, norm_ptr, eps, NB,
                                     NBP, DV)
                tl.store(x_ptr + head * DV + tl.arange(0, DV), xv.to(x_ptr.dtype.element_ty))
                tl.store(count_ptr + head, 0)


def conv_step_rows(proj: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                   n_valid: torch.Tensor, block: int = 256) -> None:
    """proj fp32 [B, >= C] (rows contiguous); conv_w fp32 [C, K]; conv_state [slots, K-1, C] (one GDN layer of
    the slot pool); slots, n_valid int32 on the device. Updates proj[:, :C] and the slots' conv states."""
    C, K = conv_w.shape
    B = proj.shape[0]
    if proj.stride(1) != 1 or conv_state.shape[1:] != (K - 1, C) or not conv_state.is_contiguous():
        raise ValueError(f"conv_step_rows: proj {tuple(proj.shape)}, conv_w {tuple(conv_w.shape)}, "
                         f"conv_state {tuple(conv_state.shape)}")
    conv_step_rows_kernel[(B, cdiv(C, block))](proj, conv_w, conv_state, slots, n_valid, proj.stride(0),
                                               C=C, K=K, KP=next_power_of_2(K), BC=block,
                                               **pdl.kernel_args(proj, "rows_conv"))


def gdn_step_rows(proj: torch.Tensor, rec_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  slots: torch.Tensor, n_valid: torch.Tensor, hk: int, out: torch.Tensor | None = None,
                  block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """proj fp32 [B, conv'd q|k|v | z | b | a]; rec_state fp32 or bf16 [slots, Hv, dk, dv] (one GDN layer of the
    slot pool), updated in place for the valid rows; returns o fp32 [B, Hv, dv] (rows >= n_valid unwritten)."""
    _, hv, dk, dv = rec_state.shape
    B = proj.shape[0]
    bv = min(dv, block_v)
    if out is None:
        out = torch.empty(B, hv, dv, dtype=torch.float32, device=proj.device)
    gdn_step_rows_kernel[(B, hv, dv // bv)](proj, rec_state, a_log, dt_bias, out, slots, n_valid, proj.stride(0),
                                            dk ** -0.5, out, out, out, out, 0.0,
                                            HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, L2_EPS=L2_EPS, NORM=False, NBP=1,
                                            num_warps=num_warps, **pdl.kernel_args(out, "rows_gdn"))
    return out


class StepNormScratch:
    """gdn_step_norm_rows' buffers for up to `rows` rows, shared by the layers of a step (each launch leaves its
    counters at zero): o fp32 [rows, Hv, dv], the slices' sums of squares, one arrival counter a (row, head)."""

    def __init__(self, rows: int, hv: int, dv: int, device, block_v: int = 32):
        nb = dv // min(dv, block_v)
        self.block_v = block_v
        self.o = torch.empty(rows, hv, dv, dtype=torch.float32, device=device)
        self.ss = torch.empty(rows, hv, nb, dtype=torch.float32, device=device)
        self.count = torch.zeros(rows, hv, dtype=torch.int32, device=device)


def gdn_step_norm_rows(proj: torch.Tensor, rec_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       slots: torch.Tensor, n_valid: torch.Tensor, hk: int, norm_gain: torch.Tensor, eps: float,
                       scratch: StepNormScratch, num_warps: int = 4) -> torch.Tensor:
    """gdn_step_rows, then gated_rmsnorm of its output with the row's z (proj's Hv*dv columns after q|k|v), in
    one launch: returns bf16 [B, Hv*dv] = gain * rmsnorm(o) * silu(z) per head (rows >= n_valid unwritten)."""
    _, hv, dk, dv = rec_state.shape
    B = proj.shape[0]
    bv = min(dv, scratch.block_v)
    if (scratch.o.shape[0] < B or scratch.o.shape[1:] != (hv, dv) or scratch.ss.shape[2] != dv // bv
            or norm_gain.shape != (dv,)):
        raise ValueError(f"gdn_step_norm_rows: scratch {tuple(scratch.o.shape)} for {B} rows of [{hv}, {dv}], "
                         f"gain {tuple(norm_gain.shape)}")
    x = torch.empty(B, hv * dv, dtype=torch.bfloat16, device=proj.device)
    gdn_step_rows_kernel[(B, hv, dv // bv)](proj, rec_state, a_log, dt_bias, scratch.o, slots, n_valid,
                                            proj.stride(0), dk ** -0.5, norm_gain, scratch.ss, scratch.count, x, eps,
                                            HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, L2_EPS=L2_EPS, NORM=True,
                                            NBP=next_power_of_2(dv // bv), num_warps=num_warps,
                                            **pdl.kernel_args(x, "rows_gdn"))
    return x


# -- plain torch references -------------------------------------------------------------------------------

def conv_step_rows_reference(m: torch.Tensor, conv_w: torch.Tensor, states: list[torch.Tensor]):
    """m [B, C] pre-conv rows, states[b] [K-1, C] -> (y [B, C], new states), one causal conv step + SiLU a row."""
    from lily.kernels.quant_gemv import conv_step_reference

    out = [conv_step_reference(m[b], conv_w, states[b]) for b in range(m.shape[0])]
    return torch.stack([y for y, _ in out]), [s for _, s in out]


def gdn_step_rows_reference(y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, states: list[torch.Tensor],
                            a_log: torch.Tensor, dt_bias: torch.Tensor, hk: int):
    """y [B, conv_dim] (after the conv), b, a [B, Hv], states[r] [Hv, dk, dv] -> (o [B, Hv, dv], new states),
    one token a row through the project's gated delta recurrence."""
    from lily.kernels.gated_delta import gated_delta_recurrent
    from lily.kernels.gdn_chunked import gdn_inputs_reference

    hv, dk, dv = states[0].shape
    outs, new = [], []
    for r in range(y.shape[0]):
        q, k, v, g, beta = gdn_inputs_reference(y[r:r + 1], b[r:r + 1], a[r:r + 1], a_log, dt_bias, hk, hv, dk, dv)
        o, s = gated_delta_recurrent(q, k, v, g, beta, states[r])
        outs.append(o[0])
        new.append(s)
    return torch.stack(outs), new
