"""Programmatic dependent launch (Hopper+): let a decode kernel start while the previous one finishes.

Every decode kernel takes a GDC constexpr. With it set, the kernel first requests what cannot depend on the
previous kernel (a GEMV's weight tile, the GDN state of an earlier step), then `gdc_wait` (the previous
grid has finished and its writes are visible), then `gdc_launch_dependents` (the next kernel may start its
own prefetch; since this comes after the wait, anything two launches back is complete by then). Launches
pass `launch_pdl=True`; inside a CUDA graph these become programmatic edges. Off under the interpreter
and on pre-Hopper GPUs.

Every launch: LILY_PDL=1; only the MoE gate_up launch: LILY_PDL=moe (the default); none: LILY_PDL=0: measured on the H200 (triton 3.6, torch 2.11, CUDA 13) the whole
decode graph ran at 393 tok/s with it against 406 without (benchmarks/results/decode-h200-pdl.json), although
kernel classes replayed alone sped up (gdn_out 226 -> 164 us); whether the graph keeps the programmatic edges
is the first thing to check before trying again.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ENABLED = os.environ.get("LILY_PDL", "moe") == "1"
# LILY_PDL=moe (the default): only the MoE gate_up launch is programmatic (it loads h and builds its x while
# the router GEMV runs; the router, launched normally, lets it start after its own wait). H200, 4K context,
# same machine: 612.6 tok/s against 594.9 with LILY_PDL=0 (scripts/gpu_decode_ab.sh at f20b30c).
MOE_ONLY = os.environ.get("LILY_PDL", "moe") == "moe"


_SUPPORTED: bool | None = None


def supported() -> bool:
    """This Triton has the launch option and the griddepcontrol ops."""
    global _SUPPORTED
    if _SUPPORTED is None:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            _SUPPORTED = ("launch_pdl" in CUDAOptions.__dataclass_fields__
                          and hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents"))
        except Exception:  # noqa: BLE001 - no NVIDIA backend: no PDL
            _SUPPORTED = False
    return _SUPPORTED


def _capable(t: torch.Tensor) -> bool:
    """t's device can launch programmatically (Hopper or later, this Triton, not the interpreter)."""
    return not INTERPRET and t.is_cuda and supported() and torch.cuda.get_device_capability(t.device)[0] >= 9


def active(t: torch.Tensor) -> bool:
    """Whether launches on t's device use programmatic dependent launch."""
    return ENABLED and _capable(t)


def launch_opts(t: torch.Tensor) -> dict:
    return {"launch_pdl": True} if active(t) else {}


def moe_active(t: torch.Tensor) -> bool:
    """LILY_PDL=moe (or 1): the router triggers and the gate_up launch is programmatic."""
    return (ENABLED or MOE_ONLY) and _capable(t)


@triton.jit
def wait_prior(GDC: tl.constexpr):
    """Wait for the previous kernel, then allow the next one to start (no-op unless GDC)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
