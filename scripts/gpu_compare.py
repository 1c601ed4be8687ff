"""What the GPU check scripts share: the relative error every check reports."""

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; NaN when a holds a non-finite value (so a check on it fails)."""
    a, b = a.double().flatten(), b.double().flatten()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
