"""The engine: backends (reference, fast), sampling, the generation loop, the prefix cache, the worker."""

from __future__ import annotations

import inspect

import torch

BACKENDS = ("auto", "reference", "fast")


class DeviceError(ValueError):
    """A device or backend this machine cannot run: one line for the user."""


def resolve(device: str | torch.device = "auto", backend: str = "auto") -> tuple[torch.device, str]:
    """The device and backend to run on: device "auto" means CUDA when present, else CPU; backend "auto"
    means fast on CUDA, reference elsewhere. DeviceError for what this machine cannot do."""
    if backend not in BACKENDS:
        raise DeviceError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(f"device {device!r}: not a device (expected cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {device}: lily runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {device}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if backend == "auto":
        backend = "fast" if device.type == "cuda" else "reference"
    if backend == "fast" and device.type != "cuda":
        raise DeviceError("the fast backend runs on CUDA only; use --backend reference on the CPU")
    return device, backend


def load_backend(model_dir, device: str | torch.device = "auto", backend: str = "auto", max_seq: int | None = None,
                 progress=None, **options):
    """Open a checkpoint directory on a device with the chosen backend (`resolve` says which).

    `max_seq` is passed to backends that preallocate per-sequence state, `progress` (a
    lily.checkpoint progress callback) to backends whose from_dir takes one, and so are the other
    `options` that are not None (the fast backend's max_batch, memory_fraction, state_bytes, reserve_bytes).
    """
    device, backend = resolve(device, backend)
    if backend == "fast":
        from lily.engine.fast_backend import FastBackend as cls
    else:
        from lily.engine.reference_backend import ReferenceBackend as cls
    kwargs = {}
    accepted = inspect.signature(cls.from_dir).parameters
    if max_seq is not None and "max_seq" in accepted:
        kwargs["max_seq"] = max_seq
    if progress is not None and "progress" in accepted:
        kwargs["progress"] = progress
    kwargs.update({k: v for k, v in options.items() if v is not None and k in accepted})
    return cls.from_dir(model_dir, device, **kwargs)
