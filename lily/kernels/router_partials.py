"""The MoE router's logits accumulated by the out-projection before it, instead of a launch of their own.

The router reads RMSNorm(h) * gain, h the residual stream the mixer's out-projection has just written. Its
logit r is  rstd * sum_k W_r[r, k] * gain_k * h_k  with rstd = rsqrt(mean(h^2) + eps), a scalar of the whole h.
So each block of the out-projection's output rows k adds its share of the sum for every router row, and of
sum h_k^2, and whoever reads the logits applies rstd. The 8-bit router's columns for a block of 8 rows are
2 words and one scale and bias a router row (~3 KB for the 257 rows), so the epilogue's extra work is small;
the decode step loses the router launch (its ~2.5 us dependent chain) from each of its 40 MoE layers.

The partial sums are added with int64 atomics in fixed point (logits times LOGIT_ONE, sums of squares times
SS_ONE): integer addition does not depend on the order the blocks arrive in, so the logits are the same bits
on every run. The accumulators [router rows + 1] must be zero before the out-projection: the layer's
in-projection zeroes them (quant_gemv's zero=), after the previous step's readers are done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOGIT_ONE = 2.0 ** 32      # a logit's partial sum in fixed point: |partial| < 2^31 fits int64
SS_ONE = 2.0 ** 20         # a sum of squares' partial: h^2 summed over a block, < 2^43 fits


@triton.jit
def router_partials(h, rows, rmask, rw_ptr, rs_ptr, rb_ptr, gain_ptr, racc_ptr, H, R: tl.constexpr,
                    RP: tl.constexpr):
    """Add the block's share of each router logit (rows k of h, natural order; the 8-bit router [R, H / 4]
    words, [R, H / 64] scales and biases, gain [H]) and of sum h^2 to racc (int64 [R + 1], fixed point)."""
    r = tl.arange(0, RP)
    rm = r < R
    x = tl.where(rmask, h * tl.load(gain_ptr + rows, mask=rmask, other=0.0), 0.0)          # [BN]
    m2 = rm[:, None] & rmask[None, :]
    word = tl.load(rw_ptr + r[:, None].to(tl.int64) * (H // 4) + (rows // 4)[None, :], mask=m2, other=0)
    code = ((word >> ((rows % 4) * 8)[None, :]) & 0xFF).to(tl.float32)                       # [RP, BN]
    goff = r[:, None].to(tl.int64) * (H // 64) + (rows // 64)[None, :]
    w = (tl.load(rs_ptr + goff, mask=m2, other=0.0).to(tl.float32) * code
         + tl.load(rb_ptr + goff, mask=m2, other=0.0).to(tl.float32))
    part = tl.sum(w * x[None, :], axis=1)                                                       # [RP]
    tl.atomic_add(racc_ptr + r, (part * 4294967296.0).to(tl.int64), mask=rm, sem="relaxed")
    ss = tl.sum(tl.where(rmask, h * h, 0.0), 0)
    tl.atomic_add(racc_ptr + R, (ss * 1048576.0).to(tl.int64), sem="relaxed")


@triton.jit
def router_logits(racc_ptr, offs, mask, other, R: tl.constexpr, H: tl.constexpr, eps):
    """The logits at offs (where mask, else `other`) from the accumulators: sum * rstd."""
    ss = tl.load(racc_ptr + R).to(tl.float32) * (1.0 / 1048576.0)
    scale = tl.rsqrt(ss / H + eps) * (1.0 / 4294967296.0)
    acc = tl.load(racc_ptr + offs, mask=mask, other=0)
    return tl.where(mask, acc.to(tl.float32) * scale, other)


def router_logits_reference(h: torch.Tensor, router_dequantized: torch.Tensor, gain: torch.Tensor,
                            eps: float) -> torch.Tensor:
    """The router's logits of the residual stream h (fp32): W RMSNorm(h) * gain."""
    h = h.float()
    return router_dequantized.float() @ (h * torch.rsqrt(h.pow(2).mean() + eps) * gain.float())


def decode_accumulators(racc: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """The logits the accumulators hold, as router_logits reads them (host side, for tests and checks)."""
    ss = racc[-1].double() / SS_ONE
    return (racc[:-1].double() / LOGIT_ONE * torch.rsqrt(ss / hidden + eps)).float()
