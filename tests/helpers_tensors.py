"""Shared by the kernel tests: the device they run on, fresh random tensors, and the relative error."""

from __future__ import annotations

import os
import random

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def new_generator() -> torch.Generator:
    """A generator with a fresh seed from the test's seeded `random` (tests/conftest.py), so
    LILY_TEST_SEED repeats it; gen.initial_seed() is in the failure messages too."""
    return torch.Generator().manual_seed(random.getrandbits(32))


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


def row_rel(a: torch.Tensor, b: torch.Tensor, row_dims: int = 1) -> torch.Tensor:
    """The relative error of each row (a row: the last `row_dims` dims, e.g. one position's one head),
    float64 on the CPU, shaped like the leading dims."""
    a, b = a.double().cpu(), b.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite output (an unwritten poisoned element?)"
    lead = a.shape[:a.dim() - row_dims]
    d, r = (a - b).reshape(*lead, -1), b.reshape(*lead, -1)
    return d.norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x cast to bf16 the way the kernels' casts do it here: rounded on the GPU, truncated (the low 16
    bits dropped) by the Triton interpreter."""
    if not INTERPRET:
        return x.to(torch.bfloat16)
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def bf16_level(ref: torch.Tensor, row_dims: int = 1) -> float:
    """The worst row's relative error from casting `ref` once to bf16 (to_bf16): the yardstick of a bf16
    kernel."""
    return float(row_rel(to_bf16(ref), ref, row_dims).max())


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, what: str, factor: float = 3.0, row_dims: int = 1,
                      level: float | None = None, limit: float | None = None) -> None:
    """Every row (not the tensor as a whole) within `factor` x the bf16 level of the reference (or of
    `level`, for a result whose inputs already carry bf16 error), or within `limit` when given (a whole
    path's measured error): one wrong row fails."""
    errs = row_rel(out, ref, row_dims)
    if limit is not None:
        tol, why = limit, "the path's limit"
    else:
        tol, why = factor * (bf16_level(ref, row_dims) if level is None else level), f"{factor}x the bf16 level"
    worst = float(errs.max())
    at = tuple(int(i) for i in torch.unravel_index(errs.argmax(), errs.shape)) if errs.dim() else ()
    assert worst <= tol, (f"{what}: row {at} is off by {worst:.2e} (relative), over {tol:.2e} ({why}); "
                          f"median row {float(errs.median()):.1e}")
