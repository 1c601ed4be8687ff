"""Gated DeltaNet, one decode token: L2 norms, gates, the fp32 state update and the output, in one launch.

Input is the fused in-projection buffer [qkv (after the conv step + SiLU, done in quant_gemv's epilogue) |
z | b | a]. A program owns value head j and a BV-wide slice of its dv columns, so the state [dk, dv] of
one head is split over dv / BV programs (more of the chip streams the 2 MiB-a-layer state). The gated
RMSNorm gain * rmsnorm(o) * silu(z) needs the whole head: each program writes its raw slice and sum of
squares, and the head's last program to finish (an atomic counter) normalises the head and writes the
out_proj input in PERM64 order.

  S = exp(g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q
  q, k L2-normalised per key head (eps added to the sum of squares), q scaled by dk^-0.5,
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); value head j reads key head j // (Hv / Hk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import next_power_of_2
from lily.kernels import pdl
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import perm64

L2_EPS = 1e-6


@triton.jit
def gated_head_norm(o_ptr, ss_ptr, z_ptr, norm_ptr, eps, NB: tl.constexpr, NBP: tl.constexpr, DV: tl.constexpr):
    """One head's gated RMSNorm, fp32 [DV] = gain * rmsnorm(o) * silu(z), from its outputs o_ptr[:DV] and the NB
    partial sums of squares ss_ptr[:NB] its programs wrote (read through L2: other programs' stores), z at z_ptr."""
    d = tl.arange(0, DV)
    nb = tl.arange(0, NBP)
    o_all = tl.load(o_ptr + d, cache_modifier=".cg")
    ss = tl.sum(tl.load(ss_ptr + nb, mask=nb < NB, other=0.0, cache_modifier=".cg"), 0)
    z = tl.load(z_ptr + d)
    return o_all * tl.rsqrt(ss / DV + eps) * tl.load(norm_ptr + d) * (z * tl.sigmoid(z))


@triton.jit
def gdn_decode_kernel(proj_ptr, state_ptr, a_log_ptr, dt_bias_ptr, norm_ptr, o_ptr, ss_ptr, count_ptr, x_ptr,
                      q_scale, eps,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, NBP: tl.constexpr, L2_EPS: tl.constexpr, GDC: tl.constexpr):
    j = tl.program_id(0)
    vb = tl.program_id(1)
    NB: tl.constexpr = DV // BV
    KEY: tl.constexpr = HK * DK
    CONV: tl.constexpr = 2 * KEY + HV * DV
    kh = j // (HV // HK)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    sp = state_ptr + j * (DK * DV) + dk[:, None] * DV + cols[None, :]
    S = tl.load(sp).to(tl.float32)       # this layer's state from the previous step: safe before the wait
    wait_prior(GDC)
    q = tl.load(proj_ptr + kh * DK + dk)
    k = tl.load(proj_ptr + KEY + kh * DK + dk)
    v = tl.load(proj_ptr + 2 * KEY + j * DV + cols)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + L2_EPS) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + L2_EPS)
    b = tl.load(proj_ptr + CONV + HV * DV + j)
    a = tl.load(proj_ptr + CONV + HV * DV + HV + j) + tl.load(dt_bias_ptr + j)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    alpha = tl.exp(-tl.exp(tl.load(a_log_ptr + j)) * softplus)
    beta = tl.sigmoid(b)
    S = S * alpha                                                        # [DK, BV]
    u = beta * (v - tl.sum(S * k[:, None], 0))
    S += k[:, None] * u[None, :]
    tl.store(sp, S.to(state_ptr.dtype.element_ty))                    # fp32, or rounded to a bf16 state
    o = tl.sum(S * q[:, None], 0)
    tl.store(o_ptr + j * DV + cols, o)
    tl.store(ss_ptr + j * NB + vb, tl.sum(o * o, 0))
    # The gated RMSNorm needs the whole head: the last of the head's NB programs to finish (an acq_rel
    # counter) applies it to all DV outputs and resets the counter for the next step.
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + j, 1)
    if done == NB - 1:
        tl.debug_barrier()
        d = tl.arange(0, DV)
        x = gated_head_norm(o_ptr + j * DV, ss_ptr + j * NB, proj_ptr + CONV + j * DV, norm_ptr, eps, NB, NBP, DV)
        tl.store(x_ptr + perm64(j * DV + d), x)                       # PERM64: out_proj's input layout
        tl.store(count_ptr + j, 0)


# (value columns a program, warps), read at each launch; None: pick_bv's columns and the caller's warps. H200,
# alternating rounds against (32, 4): (64, 4) 666.7 / (16, 4) 662.2 / (128, 8) 657.0 against 665.4 tok/s at 4K,
# a whole head a program normed in its registers (no counter, code at 0f8d90f) included
# (benchmarks/results/decode-h200-20261203-gdn-tile.json)
TILE: tuple[int, int] | None = None


def pick_bv(dv: int) -> int:
    return min(dv, 32)


class GDNScratch:
    """Per-model scratch of the GDN decode step (shared by all layers)."""

    def __init__(self, hv: int, dv: int, device):
        self.o = torch.empty(hv * dv, dtype=torch.float32, device=device)
        self.ss = torch.empty(hv, max(1, dv // 8), dtype=torch.float32, device=device)   # TILE down to 8 columns
        self.count = torch.zeros(hv, dtype=torch.int32, device=device)   # reset by the kernel itself


def gdn_decode(proj: torch.Tensor, state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               norm_gain: torch.Tensor, eps: float, scratch: GDNScratch, out: torch.Tensor, hk: int,
               num_warps: int = 4) -> None:
    """proj fp32 [2*Hk*dk + Hv*dv (conv'd) | Hv*dv (z) | Hv (b) | Hv (a)]; state [Hv, dk, dv] (fp32, or bf16:
    read into fp32, updated there, stored rounded) updated in place; writes out fp32 [Hv*dv] = gain * rmsnorm(o)
    * silu(z) per head, in PERM64 order."""
    hv, dk, dv = state.shape
    bv, num_warps = TILE or (pick_bv(dv), num_warps)
    if dv % bv or dv // bv > scratch.ss.shape[1]:
        raise ValueError(f"gdn_decode: {bv} value columns a program for dv={dv} (scratch for {scratch.ss.shape[1]})")
    gdn_decode_kernel[(hv, dv // bv)](proj, state, a_log, dt_bias, norm_gain, scratch.o, scratch.ss, scratch.count,
                                      out, dk ** -0.5, eps, HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
                                      NBP=next_power_of_2(dv // bv), L2_EPS=L2_EPS, GDC=pdl.gdc(out),
                                      num_warps=num_warps, **pdl.launch_opts(out, "gdn"))


def gdn_decode_reference(y: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, hk: int,
                         norm_gain: torch.Tensor, eps: float):
    """One token from the conv output y [2*Hk*dk + Hv*dv] -> (gated-normed output [Hv*dv], new state),
    through the project's plain-torch gated delta rule."""
    from lily.kernels.gated_delta import gated_delta_recurrent
    from lily.kernels.quant_gemv import gated_rmsnorm_reference

    hv, dk, dv = state.shape
    y = y.float()
    q = y[: hk * dk].reshape(1, hk, dk)
    k = y[hk * dk: 2 * hk * dk].reshape(1, hk, dk)
    v = y[2 * hk * dk:].reshape(1, hv, dv)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * dk ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    o, new_state = gated_delta_recurrent(q, k, v, g[None], beta[None], state)
    return gated_rmsnorm_reference(o.reshape(-1), z, norm_gain, dv, eps), new_state
