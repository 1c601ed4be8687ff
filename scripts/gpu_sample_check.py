#!/usr/bin/env python3
"""lily.kernels.sample on the GPU at the real vocabulary (248,320): the kernels' tokens against their torch
reference, then the time a batch's pick takes, device and host, per kind of row.

Rows: greedy, an unfiltered draw, top-k 20 + top-p 0.95 (Qwen's suggested setting), top-p 0.95 over peaked logits
(the nucleus inside the window) and over flat ones (past it: the race above winners not kept), at 1, 8 and 32
rows. Timed: the pick alone on the logits of a decode step (CUDA events over 50 calls, median), beside the argmax
the greedy rows took before; and the host's time to queue it. Writes $OUT/sample-check.json, prints a table last.

    OUT=out python3 scripts/gpu_sample_check.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lily.config import FULL  # noqa: E402
from lily.kernels.sample import RowSampling, sample_rows, sample_rows_reference  # noqa: E402

KINDS = {
    "greedy": dict(temperature=0.0),
    "unfiltered": dict(temperature=1.0),
    "top-k 20, top-p 0.95": dict(temperature=0.7, top_k=20, top_p=0.95),
    "top-p 0.95, peaked": dict(temperature=1.0, top_p=0.95),
    "top-p 0.95, flat": dict(temperature=1.0, top_p=0.95),
}


def logits_for(kind: str, rows: int, vocab: int) -> torch.Tensor:
    scale = 0.02 if "flat" in kind else 3.0
    return torch.randn(rows, vocab, device="cuda") * scale


def check(vocab: int) -> dict:
    """Mixed rows of every kind, several times over: the kernels' tokens against the reference's."""
    out = {"rows": 0, "mismatches": []}
    for trial in range(4):
        picks, rows = [], []
        for kind, knobs in KINDS.items():
            for _ in range(3):
                picks.append(RowSampling(key=random.getrandbits(64), **knobs))
                rows.append(logits_for(kind, 1, vocab))
        logits = torch.cat(rows)
        got = sample_rows(logits, picks, out=torch.full((len(picks),), -7, dtype=torch.int32, device="cuda"))
        want = sample_rows_reference(logits, picks)
        out["rows"] += len(picks)
        for i, (g, w) in enumerate(zip(got.tolist(), want.tolist())):
            if g != w:
                out["mismatches"].append({"trial": trial, "row": i, "kernel": g, "reference": w,
                                          "pick": picks[i].__dict__})
    return out


def timed(fn, reps: int = 50) -> tuple[float, float]:
    """(median device us from CUDA events, median host us to queue it)."""
    dev, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b) * 1e3)
    return statistics.median(dev), statistics.median(host)


def main() -> int:
    vocab = FULL.vocab_size
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": vocab,
              "git": os.environ.get("LILY_GIT_REVISION", "")}
    import triton
    result["triton"] = triton.__version__
    result["check"] = check(vocab)
    timings = []
    for rows in (1, 8, 32):
        base = logits_for("peaked", rows, vocab)
        d, h = timed(lambda: base.argmax(-1).to(torch.int32))
        timings.append({"rows": rows, "kind": "argmax (the greedy pick before)", "device_us": d, "host_us": h})
        for kind, knobs in KINDS.items():
            logits = logits_for(kind, rows, vocab)
            picks = [RowSampling(key=random.getrandbits(64), **knobs) for _ in range(rows)]
            d, h = timed(lambda: sample_rows(logits, picks))
            timings.append({"rows": rows, "kind": kind, "device_us": d, "host_us": h})
    result["timings"] = timings
    (out_dir / "sample-check.json").write_text(json.dumps(result, indent=1))
    ok = not result["check"]["mismatches"]
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}")
    print(f"kernels against the reference: {result['check']['rows'] - len(result['check']['mismatches'])}/"
          f"{result['check']['rows']} rows the same token {'OK' if ok else 'FAILED'}")
    print(f"{'rows':>4}  {'kind':34s} {'device us':>10} {'host us':>9}")
    for t in timings:
        print(f"{t['rows']:4d}  {t['kind']:34s} {t['device_us']:10.1f} {t['host_us']:9.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
