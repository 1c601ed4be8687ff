"""Does a prompt's prefill overlap running decodes on the GPU? (device only; a probe for the batched server)

Eight slots hold P-token contexts and decode together (the batched step's graph, each step's logits read back as
the engine worker does); a ninth slot prefills a P-token prompt. Timed: 20 decode steps alone, the prefill alone,
and the prefill launched on a second CUDA stream (from this thread; from a thread of its own; from this thread
with the decode steps on a stream of higher priority, so that the block scheduler hands each freed SM to a
waiting decode kernel before the prefill's next tiles) while decode steps run back to back until it completes.
`gain` = (prefill alone + those steps alone) / the overlapped time: what an engine that ran prefills beside the
decodes would get.

    python3 scripts/gpu_prefill_overlap.py [--prompt 4096] [--rounds 3]     # JSON under $OUT (or ./out)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batch_check import build_full  # noqa: E402

from lily.config import FULL  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    P = args.prompt
    be = build_full(FULL, dev, max_seq=P + 400, max_batch=9)
    states = [be.new_state() for _ in range(9)]
    gen = torch.Generator().manual_seed(0)
    for st in states[:8]:
        be.prefill(torch.randint(0, 200_000, (P,), generator=gen).tolist(), st)
    be.prepare_batches()
    torch.cuda.synchronize()
    tokens, slots = [5] * 8, [st.slot for st in states[:8]]
    prefilling, ids = states[8], torch.randint(0, 200_000, (P,), generator=gen).tolist()
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    urgent = torch.cuda.Stream(priority=-8)   # (mapped onto the device's highest priority)

    def step(stream=main_stream) -> None:
        with torch.cuda.stream(stream):
            be.batch.run(tokens, slots)
        stream.synchronize()                   # the worker reads each step's logits

    def prefill() -> torch.Tensor:
        be.recycle_state(prefilling)
        return be.prefill(ids, prefilling)

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, r

    def overlapped(mode: str) -> tuple[int, torch.Tensor]:
        """Decode steps while the prefill runs on the side stream: how many, and the prefill's logits."""
        threaded = mode == "thread"
        done = threading.Event()
        out = []

        def run() -> None:
            with torch.cuda.stream(side):
                out.append(prefill())
                side.synchronize()
            done.set()
        if threaded:
            th = threading.Thread(target=run)
            th.start()
            finished = done.is_set
        else:
            with torch.cuda.stream(side):
                out.append(prefill())
                ev = torch.cuda.Event()
                ev.record(side)
            finished = ev.query
        n = 0
        while not finished():
            step(urgent if mode == "priority" else main_stream)
            n += 1
        if threaded:
            th.join()
        torch.cuda.synchronize()
        return n, out[0]

    rows = []
    for rnd in range(args.rounds):
        per = timed(lambda: [step() for _ in range(20)])[0] / 20
        alone, want = timed(prefill)
        for mode in ("stream", "thread", "priority"):
            t, (n, got) = timed(lambda: overlapped(mode))
            seq = alone + n * per
            # the prefill beside the decodes computes what it computes alone (same kernels, same state)
            diff = (got - want).abs().max().item()
            rows.append({"round": rnd, "mode": mode, "step_ms": per * 1e3, "prefill_ms": alone * 1e3,
                         "overlapped_ms": t * 1e3, "steps_during": n, "sequential_ms": seq * 1e3, "gain": seq / t,
                         "logits_max_abs_diff": diff, "logits_finite": bool(torch.isfinite(got).all())})
            print(f"round {rnd} {mode}: step {per * 1e3:.2f} ms, prefill {alone * 1e3:.1f} "
                  f"ms; overlapped {t * 1e3:.1f} ms with {n} steps (one after the other {seq * 1e3:.1f} ms): "
                  f"x{seq / t:.2f}; logits against alone: max |diff| {diff:.3g}", flush=True)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "prefill-overlap.json"), "w") as f:
        json.dump({"prompt": P, "gpu": torch.cuda.get_device_name(), "decode_priority": urgent.priority,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
