"""Shared by the kernel tests: the device they run on, fresh random tensors, and the relative error."""

from __future__ import annotations

import os

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def new_generator() -> torch.Generator:
    """A generator with a fresh random seed (reported by gen.initial_seed() when a check fails)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def randn(g, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def rel(a, b) -> float:
    a, b = a.double().flatten().cpu(), b.double().flatten().cpu()
    assert torch.isfinite(a).all(), "non-finite output (an unwritten poisoned element?)"
    return float((a - b).norm() / b.norm())


def gdn_inputs(gen, T, Hk, Hv, dk, dv):
    """Model-like inputs of the chunked gated delta rule: SiLU-ish conv output y, gate projections b and a
    (beta = sigmoid(b) in (0, 1)), A = exp(A_log) in [1, 16], dt_bias."""
    y = randn(gen, T, 2 * Hk * dk + Hv * dv, dtype=torch.bfloat16)
    b, a = randn(gen, T, Hv), randn(gen, T, Hv)
    A_log = torch.log(torch.rand(Hv, generator=gen) * 15 + 1).to(DEV)
    dt_bias = randn(gen, Hv, scale=0.5, dtype=torch.bfloat16)
    return y, b, a, A_log, dt_bias
