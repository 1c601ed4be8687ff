#!/usr/bin/env python3
"""The host's share of a prefill: the Python and torch work of lily.model.fast_prefill.prefill_forward at the
full model's shapes, with every Triton launch replaced by a counter and every tensor on torch's meta device
(shapes only), so no GPU is needed and nothing is computed. A short prompt is bound by this work (the GPU
waits for the next launch), so it is what to shrink there.

    python3 scripts/prefill_host_cost.py [--tokens 256] [--profile]

Prints the milliseconds a prefill spends on the host (excluding Triton's own launcher, which costs ~10-20 us a
launch on top), the launches by kernel, and with --profile the functions that take the most of it. Meta
tensors make torch's elementwise operations dearer than on a GPU, so the total is an upper bound."""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout's lily
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

from lily.checkpoint.layout import expected_tensors  # noqa: E402
from lily.config import FULL  # noqa: E402
from lily.model import fast_prefill  # noqa: E402
from lily.model.fast import FastState  # noqa: E402
from lily.quant import QuantTensor  # noqa: E402

LAUNCHES: collections.Counter = collections.Counter()


def _count_launch(self, *args, grid, warmup, **kwargs):
    LAUNCHES[self.fn.__name__] += 1


def meta_weights(config) -> dict:
    """The checkpoint's weights (with the fused projections) as meta tensors of the right shapes and dtypes."""
    meta = torch.device("meta")
    w = {}
    for key, spec in expected_tensors(config).items():
        if spec.quantized:
            *lead, out, inp = spec.shape
            groups = (*lead, out, inp // config.group_size)
            w[key] = QuantTensor(torch.empty(*lead, out, inp * spec.bits // 32, dtype=torch.uint32, device=meta),
                                 torch.empty(groups, dtype=torch.bfloat16, device=meta),
                                 torch.empty(groups, dtype=torch.bfloat16, device=meta), spec.bits, config.group_size)
        else:
            w[key] = torch.empty(spec.shape, dtype=spec.dtype, device=meta)
    return fast_prefill.with_fused_projections(config, w)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    triton.runtime.jit.JITFunction.run = _count_launch
    weights = meta_weights(FULL)
    state = FastState(FULL, max(args.tokens, 1) + 1, torch.device("meta"))
    ids = torch.empty(args.tokens, dtype=torch.long, device="meta")

    def prefill():
        state.pos = 0
        fast_prefill.prefill_forward(FULL, weights, state, ids)

    prefill()
    times = []
    for _ in range(args.rounds):
        LAUNCHES.clear()
        t = time.perf_counter()
        prefill()
        times.append(time.perf_counter() - t)
    print(f"{args.tokens}-token prefill: {min(times) * 1e3:.1f} ms on the host (best of {args.rounds}), "
          f"{sum(LAUNCHES.values())} launches")
    for name, n in LAUNCHES.most_common():
        print(f"  {n:4d}  {name}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        prefill()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
