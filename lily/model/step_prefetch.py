"""The decode step's L2 prefetch schedule: which weights to request, and after which kernel.

Each kernel of the step (FastModel.step_plan) has weights that do not depend on the chain: its projection,
the router, the shared expert, the GDN state of the last step. Their prefetch (lily/kernels/l2_prefetch)
is launched on a side stream once kernel k - distance has finished, so it runs beside the kernels between
and kernel k finds them in L2; the routed experts' gate, up and down rows are requested once the router
has finished. Launches that start at the same point share one table and one launch. Inside the step's
CUDA graph the side stream is a branch that joins at the step's end.

LILY_L2_PREFETCH chooses it: "0" (off), or a comma list of distance=K (kernels ahead, >= 2: at 1 the
prefetch would start with its kernel), chunk=BYTES, block=N (chunks a program), routed=0|1, state=0|1 (the GDN state),
lm_head=BYTES (of lm_head's first rows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from lily.kernels.l2_prefetch import BLOCK, CHUNK_BYTES, chunk_table, l2_prefetch, supported, tensor_region


@dataclass(frozen=True)
class PrefetchMode:
    distance: int = 0          # 0: off
    chunk: int = CHUNK_BYTES
    block: int = BLOCK         # chunks a program
    routed: bool = True
    state: bool = True
    lm_head: int = 16 << 20

    @property
    def on(self) -> bool:
        return self.distance > 0


def parse(spec: str) -> PrefetchMode:
    """LILY_L2_PREFETCH's value -> the mode."""
    spec = spec.strip().lower()
    if spec in ("", "0", "off", "none"):
        return PrefetchMode()
    mode = PrefetchMode(distance=2)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in ("1", "on"):
            continue
        key, _, val = item.partition("=")
        try:
            if key == "distance":
                mode = replace(mode, distance=int(val))
            elif key in ("chunk", "block"):
                mode = replace(mode, **{key: int(val)})
            elif key in ("routed", "state"):
                mode = replace(mode, **{key: val not in ("0", "false", "no")})
            elif key == "lm_head":
                mode = replace(mode, lm_head=int(val))
            else:
                raise ValueError(item)
        except ValueError:
            raise ValueError(f"LILY_L2_PREFETCH: cannot read {item!r}; expected 0, or a comma list of "
                             "distance=K, chunk=BYTES, block=N, routed=0|1, state=0|1, lm_head=BYTES") from None
    if mode.distance < 2 or mode.chunk <= 0 or mode.chunk % 16 or mode.block < 1 or mode.block & (mode.block - 1):
        raise ValueError(f"LILY_L2_PREFETCH: distance must be >= 2, chunk a positive multiple of 16 and block a "
                         f"power of two ({spec!r})")
    return mode


MODE = parse(os.environ.get("LILY_L2_PREFETCH", "0"))


def set_mode(spec: str) -> PrefetchMode:
    """Switch the mode (A/B runs in one process; graphs captured before keep theirs). Returns the previous."""
    global MODE
    old, MODE = MODE, parse(spec)
    return old


def _linear(lin) -> list:
    return [tensor_region(lin.w), tensor_region(lin.s), tensor_region(lin.b)]


def _expert(lin, e: int) -> list:
    return [tensor_region(lin.w[e]), tensor_region(lin.s[e]), tensor_region(lin.b[e])]


def _routed(lin) -> list:
    """Expert 0's rows with the stride from one expert to the next."""
    return [tensor_region(t[0], t[1].data_ptr() - t[0].data_ptr()) for t in (lin.w, lin.s, lin.b)]


def kernel_regions(fast, st, mode: PrefetchMode) -> list[tuple[str, list, list]]:
    """(kernel class, static regions, routed regions) for each kernel of fast.step_plan(st), in step order."""
    out = [("embed", [], [])]
    gi = ai = 0
    for kind, mix, moe, *_ in fast.layers:
        if kind == "full_attention":
            out += [("attn_qkv", _linear(mix.qkv), []), ("attn_core", [], []), ("attn_o", _linear(mix.o_proj), [])]
            ai += 1
        else:
            state = [tensor_region(st.rec_state[gi])] if mode.state else []
            out += [("gdn_in", _linear(mix.in_proj) + [tensor_region(mix.conv_w)], []), ("gdn_core", state, []),
                    ("gdn_out", _linear(mix.out_proj), [])]
            gi += 1
        ex, E = moe.experts, moe.experts.n_experts
        out += [("moe_router", _linear(moe.router), []),
                ("moe_gate_up", _expert(ex.gate, E) + _expert(ex.up, E),
                 _routed(ex.gate) + _routed(ex.up) if mode.routed else []),
                ("moe_down", _expert(ex.down, E), _routed(ex.down) if mode.routed else [])]
    lm = fast.lm_head
    rows = min(lm.n, mode.lm_head // max(1, lm.w[0].numel() * lm.w.element_size()))
    head = [tensor_region(lm.w[:rows]), tensor_region(lm.s[:rows]), tensor_region(lm.b[:rows])] if rows else []
    out += [("lm_head", head, []), ("greedy", [], [])]
    return out


class StepPrefetch:
    """The prefetch launches of one state's decode step: tables built once (before graph capture: they are
    device tensors the graph reads), launched around the step's kernels by run()."""

    def __init__(self, fast, st, mode: PrefetchMode | None = None):
        self.mode = mode or MODE
        self.top_k = fast.config.num_experts_per_tok
        self.norm_topk = fast.config.norm_topk_prob
        self.logits = fast.moe_scratch.logits
        plan = fast.step_plan(st)
        regions = kernel_regions(fast, st, self.mode)
        names = [p[0] for p in plan]
        if [r[0] for r in regions] != names:
            raise AssertionError("the prefetch schedule's kernels differ from the step plan's")
        static: dict[int, list] = {}
        routed: dict[int, list] = {}
        router = None
        for k, (name, stat, rout) in enumerate(regions):
            if name == "moe_router":
                router = k
            if stat:
                static.setdefault(max(k - self.mode.distance, -1), []).extend(stat)
            if rout:
                routed.setdefault(router, []).extend(rout)
        dev = fast.device
        # after kernel k (-1: the step's start): [(table, routed)]
        self.after: dict[int, list] = {}
        for k, regs in static.items():
            self.after.setdefault(k, []).append((chunk_table(regs, self.mode.chunk, dev), False))
        for k, regs in routed.items():
            self.after.setdefault(k, []).append((chunk_table(regs, self.mode.chunk, dev), True))
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    @staticmethod
    def wanted(fast) -> bool:
        return MODE.on and fast.device.type == "cuda" and supported(fast.device)

    def _launch(self, k: int, main) -> None:
        jobs = self.after.get(k)
        if not jobs:
            return
        ev = torch.cuda.Event()
        ev.record(main)
        self.side.wait_event(ev)
        with torch.cuda.stream(self.side):
            for table, routed in jobs:
                l2_prefetch(table, self.logits if routed else None, self.top_k if routed else 0, self.norm_topk,
                            block=self.mode.block)

    def run(self, plan) -> None:
        """Launch the plan's kernels on the current stream with the prefetches beside them."""
        main = torch.cuda.current_stream()
        self._launch(-1, main)
        for k, (_, _, _, launch) in enumerate(plan):
            launch()
            self._launch(k, main)
        main.wait_stream(self.side)
