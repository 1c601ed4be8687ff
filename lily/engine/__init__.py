"""The engine: backends (reference, fast), sampling, the generation loop, the prefix cache, the worker."""

from __future__ import annotations

import inspect

import torch

BACKENDS = ("auto", "reference", "fast")


def load_backend(model_dir, device: str | torch.device = "auto", backend: str = "auto", max_seq: int | None = None,
                 progress=None):
    """Open a checkpoint directory on a device with the chosen backend.

    device "auto" means CUDA when present, else CPU; backend "auto" means fast on CUDA, reference
    elsewhere. `max_seq` is passed to backends that preallocate per-sequence state, `progress` (a
    lily.checkpoint progress callback) to backends whose from_dir takes one.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available on this machine")
    if backend == "auto":
        backend = "fast" if device.type == "cuda" else "reference"
    if backend == "fast":
        if device.type != "cuda":
            raise ValueError("the fast backend runs on CUDA only; use --backend reference on the CPU")
        from lily.engine.fast_backend import FastBackend as cls
    else:
        from lily.engine.reference_backend import ReferenceBackend as cls
    kwargs = {}
    accepted = inspect.signature(cls.from_dir).parameters
    if max_seq is not None and "max_seq" in accepted:
        kwargs["max_seq"] = max_seq
    if progress is not None and "progress" in accepted:
        kwargs["progress"] = progress
    return cls.from_dir(model_dir, device, **kwargs)
