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
