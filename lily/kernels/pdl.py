"""Programmatic dependent launch (Hopper+): let a decode kernel start while the previous one finishes.

Every decode kernel takes a GDC constexpr. With it set, the kernel first requests what cannot depend on the
previous kernel (a GEMV's weight tile, the GDN state of an earlier step, the MoE down's routing from the
router's logits two launches back), then `gdc_wait` (the previous grid has finished and its writes are
visible), then `gdc_launch_dependents` (the next kernel may start its own prefetch; since this comes after
the wait, anything two launches back is complete by then). Inside a CUDA graph the programmatic launches
become programmatic edges. Off under the interpreter and on pre-Hopper GPUs.

Which launches are programmatic is chosen per kernel family (LILY_PDL, a comma list of FAMILIES; "1" or
"all": every family; "0": none; "moe": gate_up, the old name; "gemv": every GEMV call site). Every kernel
waits and triggers (GDC) as soon as any family is on, so a programmatic launch may follow a normal one.
More programmatic launches are not always faster: at an early revision every launch programmatic ran
slower than none (393 against 406 tok/s, benchmarks/results/decode-h200-pdl.json), and today it runs slower
than DEFAULT's families; scripts/gpu_decode_ab.sh measures them (`set_mode` switches them in one process).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the decode step's kernels in step order; the 4-bit / 8-bit GEMV's call sites are families of their own
FAMILIES = ("embed", "attn_in", "attn", "attn_out", "gdn_in", "gdn", "gdn_out", "router", "gate_up", "down",
            "lm_head", "greedy",
            # the batched decode step's (lily.model.fast_batch): its norms, Triton skinny GEMMs (the Hopper dense
            # mode's Gluon launches stay plain), GEMVs over the rows, GDN conv and state steps, attention, MoE rows
            "rows_norm", "rows_gemm", "rows_gemv", "rows_conv", "rows_gdn", "rows_attn", "rows_gate_up", "rows_down")
BATCHED = tuple(f for f in FAMILIES if f.startswith("rows_"))
ALIASES = {"moe": ("gate_up",), "gemv": ("attn_in", "attn_out", "gdn_in", "gdn_out", "router", "lm_head"),
           "rows": BATCHED}
# H200, triton 3.6, torch 2.11, alternating rounds in one process (benchmarks/results/decode-h200-20261202-pdl*.json):
# against gate_up alone, gdn,gdn_out,gate_up decoded 576 against 552 tok/s at 4K (590 / 566 at 256, 528 / 505
# at 32K); every GEMV call site and the router added to it lost. With the routing's top-k on int32 keys (cheaper
# for a self-routing down too) the down launch and attention's three gained in two runs on two machines: 646.0 ->
# 651.3 (down) -> 654.4 (and attention) tok/s at 4K, 458.9 -> 461.0 -> 462.9 at 128K
# (benchmarks/results/decode-h200-20261203-pdl-down-attn.json); the in-projection (gdn_in) still loses (643 -> 631),
# and embed, lm_head and greedy change nothing (within 0.1 %, decode-h200-20261203-pdl-ends.json).
# The batched step (H100, same method, batch-h100-20261206-pdl-rows.json): the GDN conv and state steps and the
# MoE rows' gate_up and down took 2 / 8 / 32 rows from 2.39 / 4.57 / 10.72 to 2.24 / 4.40 / 10.60 ms a step;
# every rows_* family at once (the norms, skinny GEMMs, GEMVs over the rows and attention too) 2.17 / 4.46 / 10.78.
# Of those, the GEMVs over the rows (2-4 rows only) gain alone: H200, 2 / 4 rows 2.045 / 2.913 -> 1.998 / 2.852 ms
# a step; attention alone loses (2.054 / 2.927) (batch-h200-20261206-pdl-rows-gemv.json).
DEFAULT = "attn,gdn,gdn_out,gate_up,down,rows_conv,rows_gdn,rows_gemv,rows_gate_up,rows_down"


def parse(spec: str) -> frozenset[str]:
    """LILY_PDL's value -> the families whose launches are programmatic."""
    spec = spec.strip().lower()
    if spec in ("1", "all"):
        return frozenset(FAMILIES)
    if spec in ("0", "", "none"):
        return frozenset()
    names = set()
    for n in filter(None, (n.strip() for n in spec.split(","))):
        names.update(ALIASES.get(n, (n,)))
    unknown = names - set(FAMILIES)
    if unknown:
        raise ValueError(f"LILY_PDL: unknown kernel families {sorted(unknown)}; expected a comma list of "
                         f"{', '.join(FAMILIES)}, or 1 / all / 0")
    return frozenset(names)


MODE = parse(os.environ.get("LILY_PDL", DEFAULT))


def set_mode(spec: str) -> frozenset[str]:
    """Switch the programmatic families (for A/B runs in one process; graphs captured before keep theirs).
    Returns the previous set."""
    global MODE
    old, MODE = MODE, parse(spec)
    return old


def describe(mode: frozenset[str] | None = None) -> str:
    mode = MODE if mode is None else mode
    return ",".join(f for f in FAMILIES if f in mode) or "0"


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


def gdc(t: torch.Tensor) -> bool:
    """A kernel's GDC constexpr: wait and trigger (any family programmatic on a capable device)."""
    return bool(MODE) and _capable(t)


def active(t: torch.Tensor, family: str | None) -> bool:
    """Whether `family`'s launches on t's device are programmatic (None: a launch outside the families)."""
    assert family is None or family in FAMILIES, family
    return family in MODE and _capable(t)


def launch_opts(t: torch.Tensor, family: str | None) -> dict:
    return {"launch_pdl": True} if active(t, family) else {}


def kernel_args(t: torch.Tensor, family: str | None) -> dict:
    """A launch's GDC constexpr and launch option, for kernels that wait only when they belong to a family (the
    batched step's, whose kernels prefill also launches): {} for none, so a plain launch compiles no wait."""
    if not family or not gdc(t):
        return {}
    return {"GDC": True, **launch_opts(t, family)}


@triton.jit
def wait_prior(GDC: tl.constexpr):
    """Wait for the previous kernel, then allow the next one to start (no-op unless GDC)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
