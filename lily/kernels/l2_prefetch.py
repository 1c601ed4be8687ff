"""L2 prefetch of the next decode stage's weights, issued by the stage before it.

A decode kernel on a few MB of weights is latency-bound (../shared/PERF.md: each stage's dependent chain costs
3-5 us before its weights stream), so HBM sits half idle while the step walks its ~260 stages. But most of
the next stage's bytes do not depend on anything this stage computes: a projection's weights, the GDN state
of the step before, the shared expert; the routed experts' down weights are known once gate_up has routed.
So a kernel requests them into L2 as it starts (`prefetch.global.L2`, fire and forget: no registers, no
wait), and the next kernel finds them there.

Each kernel that takes part gets up to MAX_REGIONS byte ranges (`kernel_args`): the flattened 128-byte lines
of all ranges are dealt to its programs, BLOCK lines a program at a time. PF_MODE: 0 off (the interpreter,
or nothing to do), 1 the PTX prefetch, 2 a test mode that counts each line instead (an atomic add of 1 to the
first int32 of the line), so the tests see that every line of every range is requested exactly once.

Which stages prefetch is chosen per kernel family (LILY_PREFETCH: a comma list of FAMILIES, "1"/"all" or
"0"); the decode step (lily.model.fast) decides what each family's next stage reads.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.kernels.pdl import INTERPRET

LINE = 128          # bytes a prefetch requests (an L2 line; the jit functions below spell both out)
BLOCK = 256         # lines a program requests at a time
MAX_REGIONS = 6
# the stages that request the next stage's bytes (the decode step's kernel families, lily.kernels.pdl's names)
FAMILIES = ("attn_in", "attn", "attn_out", "gdn_in", "gdn", "gdn_out", "router", "gate_up", "down")
DEFAULT = "all"


def parse(spec: str) -> frozenset[str]:
    """LILY_PREFETCH's value -> the families whose kernels prefetch."""
    spec = spec.strip().lower()
    if spec in ("1", "all"):
        return frozenset(FAMILIES)
    if spec in ("0", "", "none"):
        return frozenset()
    names = frozenset(n.strip() for n in spec.split(",") if n.strip())
    unknown = names - set(FAMILIES)
    if unknown:
        raise ValueError(f"LILY_PREFETCH: unknown kernel families {sorted(unknown)}; expected a comma list of "
                         f"{', '.join(FAMILIES)}, or 1 / all / 0")
    return names


MODE = parse(os.environ.get("LILY_PREFETCH", DEFAULT))


def set_mode(spec: str) -> frozenset[str]:
    """Switch the prefetching families (A/B runs in one process; graphs captured before keep theirs).
    Returns the previous set."""
    global MODE
    old, MODE = MODE, parse(spec)
    return old


def describe(mode: frozenset[str] | None = None) -> str:
    mode = MODE if mode is None else mode
    return ",".join(f for f in FAMILIES if f in mode) or "0"


def active(family: str | None) -> bool:
    assert family is None or family in FAMILIES, family
    return family in MODE


# the test mode (PF_MODE 2) for kernels launched while it is set: the tests switch it on
COUNT_LINES = False


def regions_of(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Each tensor as one byte range (it must be contiguous)."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("a prefetch range must be a contiguous tensor")
        out.append((t, t.numel() * t.element_size()))
    return out


def pf_mode(family: str | None, like: torch.Tensor, wanted: bool = True) -> int:
    """A launch's PF_MODE: 2 in the test mode, 1 if it has something to request (`wanted`), `family`
    prefetches and `like` is on a CUDA device outside the interpreter, else 0."""
    if COUNT_LINES:
        return 2
    return 1 if wanted and family in MODE and like.is_cuda and not INTERPRET else 0


def kernel_args(regions, like: torch.Tensor, family: str | None = None, more: bool = False) -> dict:
    """The kernels' prefetch arguments pf0, pfn0, ... pf5, pfn5, PF_MODE for `regions` [(tensor, bytes)]
    (pf_mode; more: the kernel requests more than these, so it is on even without them). `like`: any tensor
    of the launch, standing in for the unused ranges."""
    regions = list(regions or ())
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"{len(regions)} prefetch ranges: at most {MAX_REGIONS}")
    mode = pf_mode(family, like, bool(regions) or more)
    if mode == 0:
        regions = []
    args = {}
    for i in range(MAX_REGIONS):
        t, n = regions[i] if i < len(regions) else (like, 0)
        args[f"pf{i}"], args[f"pfn{i}"] = t, n
    args["PF_MODE"] = mode
    return args


@triton.jit
def request_lines(addr, ok, PF_MODE: tl.constexpr):
    """Request the lines at byte addresses addr (int8 pointers) where ok: into L2 (1), or count them (2)."""
    if PF_MODE == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if PF_MODE == 2:
        tl.atomic_add(addr.to(tl.pointer_type(tl.int32)), 1, mask=ok)


@triton.jit
def _line_addr(i, c, p, n_lines):
    """Byte address of flattened line i where range p (its first flattened line c) holds it (int8 pointers)."""
    return p.to(tl.pointer_type(tl.int8)) + (tl.minimum(i - c, n_lines - 1)).to(tl.int64) * 128


@triton.jit
def request_ranges(pid, nprog, pf0, pfn0, pf1, pfn1, pf2, pfn2, pf3, pfn3, pf4, pfn4, pf5, pfn5, PF_MODE: tl.constexpr):
    """This program's share of the ranges' lines: flattened line i (range after range) goes to program
    (i // BLOCK) % nprog."""
    if PF_MODE != 0:
        l0 = tl.cdiv(pfn0, 128)
        l1 = tl.cdiv(pfn1, 128)
        l2 = tl.cdiv(pfn2, 128)
        l3 = tl.cdiv(pfn3, 128)
        l4 = tl.cdiv(pfn4, 128)
        l5 = tl.cdiv(pfn5, 128)
        c1 = l0
        c2 = c1 + l1
        c3 = c2 + l2
        c4 = c3 + l3
        c5 = c4 + l4
        total = c5 + l5
        lanes = tl.arange(0, 256)
        for start in range(pid * 256, total, nprog * 256):
            i = start + lanes
            addr = _line_addr(i, 0, pf0, l0)
            addr = tl.where(i >= c1, _line_addr(i, c1, pf1, l1), addr)
            addr = tl.where(i >= c2, _line_addr(i, c2, pf2, l2), addr)
            addr = tl.where(i >= c3, _line_addr(i, c3, pf3, l3), addr)
            addr = tl.where(i >= c4, _line_addr(i, c4, pf4, l4), addr)
            addr = tl.where(i >= c5, _line_addr(i, c5, pf5, l5), addr)
            ok = i < total
            addr = tl.where(ok, addr, pf0.to(tl.pointer_type(tl.int8)))  # past the end: a line already asked for
            request_lines(addr, ok, PF_MODE)


@triton.jit
def request_experts(pid, nprog, sel_e, sl, SLOTS: tl.constexpr, w, s, b, WB: tl.constexpr, SB: tl.constexpr,
                    PF_MODE: tl.constexpr):
    """This program's share of the words (WB bytes an expert), scales and biases (SB bytes each) of the experts
    sel_e[slot] for slots < SLOTS (sel_e, sl: [TP2] register tensors, as moe_decode.route_topk gives them):
    expert e's ranges start at e * WB and e * SB; flattened line i goes to program (i // 256) % nprog."""
    if PF_MODE != 0:
        LW: tl.constexpr = (WB + 127) // 128
        LS: tl.constexpr = (SB + 127) // 128
        LPE: tl.constexpr = LW + 2 * LS
        lanes = tl.arange(0, 256)
        for start in range(pid * 256, SLOTS * LPE, nprog * 256):
            i = start + lanes
            ok = i < SLOTS * LPE
            slot = i // LPE
            j = i % LPE
            e = tl.sum(tl.where(sl[None, :] == slot[:, None], sel_e[None, :], 0), 1).to(tl.int64)
            aw = w.to(tl.pointer_type(tl.int8)) + e * WB + tl.minimum(j, LW - 1).to(tl.int64) * 128
            a_s = s.to(tl.pointer_type(tl.int8)) + e * SB + tl.minimum(tl.maximum(j - LW, 0), LS - 1).to(tl.int64) * 128
            a_b = b.to(tl.pointer_type(tl.int8)) + e * SB + tl.minimum(tl.maximum(j - LW - LS, 0), LS - 1).to(tl.int64) * 128
            addr = tl.where(j < LW, aw, tl.where(j < LW + LS, a_s, a_b))
            addr = tl.where(ok, addr, w.to(tl.pointer_type(tl.int8)))
            request_lines(addr, ok, PF_MODE)
