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


def qt(g, *shape, bits=4, scale=None):
    """A random weight [..., out, in] (std scale, default in^-0.5) quantized to MLX format, on DEV."""
    from lily.quant import quantize
    w = torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)
    return quantize(w.to(torch.bfloat16), bits=bits).to(DEV)


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


def elem_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each element's error over the reference's RMS (a single vector: each output of a GEMV is a row
    of one; an element relative to itself is ill-conditioned near zero), float64 on the CPU."""
    a, b = out.double().cpu(), ref.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite output (an unwritten poisoned element?)"
    return (a - b).abs() / b.pow(2).mean().sqrt().clamp_min(1e-30)


def assert_worst(errs: torch.Tensor, bound: float, what: str) -> None:
    """The worst of per-row (or per-element) errors within `bound` (a measured level with margin); the
    offending row is named. With LILY_MEASURE_FILE set, the worst is also appended there (test id, what,
    worst), which is how the bounds' measurements over many seeds were taken."""
    worst = float(errs.max())
    if os.environ.get("LILY_MEASURE_FILE"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(os.environ["LILY_MEASURE_FILE"], "a") as f:
            f.write(f"{test}\t{what.split(':')[-1].strip()}\t{worst:.3e}\n")
    at = tuple(int(i) for i in torch.unravel_index(errs.argmax(), errs.shape)) if errs.dim() else ()
    assert worst <= bound, (f"{what}: row {at} is off by {worst:.2e} (relative), over {bound:.1e}; "
                            f"median {float(errs.median()):.1e}")


def typical_row_err(out: torch.Tensor, ref: torch.Tensor, row_dims: int = 1) -> torch.Tensor:
    """Each row's error over the reference's typical (RMS) row norm, not its own: for outputs whose rows
    can be near zero (a gated delta output row, S^T q), where a row's relative error has a heavy tail."""
    a, b = out.double().cpu(), ref.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite output (an unwritten poisoned element?)"
    lead = a.shape[:a.dim() - row_dims]
    d, r = (a - b).reshape(*lead, -1).norm(dim=-1), b.reshape(*lead, -1).norm(dim=-1)
    return d / r.pow(2).mean().sqrt().clamp_min(1e-30)


def assert_rows_within(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str, row_dims: int = 1,
                       typical: bool = False) -> None:
    """Every row (the last `row_dims` dims: a position's head, a head's key row) within `bound` relative
    error (typical: relative to the reference's RMS row norm); row_dims=0: every element within `bound`
    of the reference's RMS."""
    if row_dims == 0:
        errs = elem_err(out, ref)
    else:
        errs = typical_row_err(out, ref, row_dims) if typical else row_rel(out, ref, row_dims)
    assert_worst(errs, bound, what)
