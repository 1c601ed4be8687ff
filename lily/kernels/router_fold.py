"""The MoE router folded into the out-projection before it: the decode step's router launch goes away.

The router reads RMSNorm(h) * gain, and RMSNorm's 1/rms is one scalar, so
    logits = W_r (rstd(h) * gain * h) = rstd(h) * z,   z = sum_r W_r[:, r] * gain[r] * h[r].
z is a sum over the rows r of the residual stream, and each row of h is produced by exactly one program of
the out-projection (attention's o_proj or the GDN's out_proj, residual added in its epilogue). So each of
those programs adds its rows' share of z (E + 1 values: the router's E rows and the shared-expert gate's)
into z with atomics, and moe_gate_up multiplies by rstd, which it computes anyway for its own input. z must
be zero before the out-projection: moe_down, the MoE's last launch (after gate_up has read z), zeroes it.

The weights are the router's 8-bit codes exactly (RouterColumns: transposed at load, so a row of the
residual stream reads one contiguous run of E + 1 codes, with its group's scales and biases): the same
weights as the router GEMV, summed in another order (atomics: the order varies from run to run on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.quant import unpack

ALIGN = 16   # a row's codes start 16-byte aligned


class RouterColumns:
    """The 8-bit router stack [E + 1, H] (quant_gemv.PackedLinear: router rows, then the shared-expert gate) seen
    by the rows of its input: codes uint8 [H, stride] (code of expert e at column e), scales and biases fp32
    [H / 64, stride]; gain fp32 [H] (the post-attention RMSNorm's, natural order)."""

    def __init__(self, router, gain: torch.Tensor):
        if router.bits != 8:
            raise ValueError(f"the folded router expects 8-bit router weights, not {router.bits}-bit")
        n, k = router.n, router.k
        self.n_logits, self.hidden = n, k
        self.stride = cdiv(n, ALIGN) * ALIGN
        dev = router.w.device
        codes = unpack(router.w, 8)                                                 # [E + 1, H] int32
        self.codes = torch.zeros(k, self.stride, dtype=torch.uint8, device=dev)
        self.codes[:, :n] = codes.t().to(torch.uint8)
        self.scales = torch.zeros(k // 64, self.stride, dtype=torch.float32, device=dev)
        self.biases = torch.zeros_like(self.scales)
        self.scales[:, :n] = router.s.float().t()
        self.biases[:, :n] = router.b.float().t()
        self.gain = gain.to(dev, torch.float32).contiguous()
        self.np2 = next_power_of_2(n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.biases))


@triton.jit
def add_router_share(h_rows, rows, rmask, z_ptr, codes_ptr, s_ptr, b_ptr, gain_ptr,
                     NZ: tl.constexpr, NZP: tl.constexpr, STRIDE: tl.constexpr):
    """z[e] += sum over `rows` of W_r[e, row] * gain[row] * h_rows (h_rows: those rows of the residual stream,
    fp32 [BN]; rows may span groups of 64)."""
    e = tl.arange(0, NZP)[None, :]
    m = rmask[:, None] & (e < NZ)
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(codes_ptr + r64 * STRIDE + e, mask=m, other=0).to(tl.float32)
    soff = (r64 // 64) * STRIDE + e
    w = tl.load(s_ptr + soff, mask=m, other=0.0) * q + tl.load(b_ptr + soff, mask=m, other=0.0)
    v = tl.where(rmask, h_rows * tl.load(gain_ptr + rows, mask=rmask, other=0.0), 0.0)
    share = tl.sum(w * v[:, None], axis=0)
    ee = tl.arange(0, NZP)
    tl.atomic_add(z_ptr + ee, share, mask=ee < NZ, sem="relaxed")


def router_fold_reference(router_qt, gain: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """z = W_r (gain * h) in fp32 (the router's logits are z * rstd(h))."""
    return router_qt.dequantize(torch.float32) @ (gain.float() * h.float())
