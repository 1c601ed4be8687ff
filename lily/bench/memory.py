"""Load time and peak device memory, measured in a fresh process so nothing else is resident.

Load: the checkpoint's files are read once first (so they sit in the page cache), then
`lily.engine.load_backend` is timed through a device sync. Memory: for each --max-seq m, a state with
room for m tokens, a prefill of the contract's m-token prompt and a few decode steps; the peak
`torch.cuda.max_memory_allocated` is weights + cache + scratch. Run as
`python -m lily.bench.memory --model DIR --device cuda --max-seq 4096,32768,131072 --out FILE`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from lily.bench.contract import log, parse_contexts, synthetic_prompt

DECODE_STEPS = 4


def warm_page_cache(model_dir: Path) -> tuple[int, float]:
    """Read every file of the checkpoint once; returns (bytes, seconds)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(64 << 20):
                    n += len(chunk)
    return n, time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_state(backend, max_seq: int):
    fn = backend.new_state
    try:
        takes = "max_seq" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    return (fn(max_seq=max_seq) if takes else fn()), takes


def measure(model_dir: Path, device: str, backend_kind: str, sizes: list[int],
            deadline_s: float | None = None) -> dict:
    from lily.engine import load_backend

    start = time.perf_counter()
    dev = torch.device(device)
    nbytes, read_s = warm_page_cache(model_dir)
    out: dict = {"checkpoint_bytes": nbytes, "first_read_s": read_s, "backend": backend_kind, "memory": []}

    def load(max_seq: int):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        b = load_backend(model_dir, device, backend_kind, max_seq=max_seq)
        _sync(dev)
        return b, time.perf_counter() - t0

    sizes = sorted(sizes)
    backend, out["load_s"] = load(sizes[0])
    out["load_max_seq"] = sizes[0]
    log(f"[memory] loaded {nbytes / 2**30:.2f} GiB checkpoint in {out['load_s']:.2f} s")
    if dev.type == "cuda":
        out["weights_bytes"] = torch.cuda.memory_allocated(dev)
    rate = None                                          # prefill tok/s seen so far
    for i, m in enumerate(sizes):
        if deadline_s is not None and rate and time.perf_counter() - start + 1.5 * m / rate > deadline_s:
            # (the budget counts from process start, load included)
            out["memory"].append({"max_seq": m, "skipped": "predicted to overrun the time budget"})
            continue
        state, takes = _new_state(backend, m)
        if i > 0 and not takes:                           # state size fixed at load: reload for this size
            del state
            backend = None
            backend, _ = load(m)
            state, takes = _new_state(backend, m)
        if dev.type == "cuda":
            _sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        ids = synthetic_prompt(m - DECODE_STEPS, backend.config.vocab_size)   # fills the state exactly
        t0 = time.perf_counter()
        tok = int(backend.prefill(ids, state).reshape(-1).argmax().item())
        prefill_s = time.perf_counter() - t0
        rate = len(ids) / prefill_s
        for _ in range(DECODE_STEPS):
            tok = int(backend.decode(tok, state).reshape(-1).argmax().item())
        _sync(dev)
        rec = {"max_seq": m, "prefill_s": prefill_s, "state_sized_by": "new_state" if takes else "load"}
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            rec.update(peak_bytes=torch.cuda.max_memory_allocated(dev), device_used_bytes=total - free)
            log(f"[memory] max_seq {m}: peak {rec['peak_bytes'] / 2**30:.2f} GiB")
        out["memory"].append(rec)
        del state
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily.bench.memory")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="auto")
    p.add_argument("--max-seq", default="4096,32768,131072")
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        res = measure(Path(args.model), args.device, args.backend, parse_contexts(args.max_seq, "--max-seq"), args.time_budget)
        res["ok"] = True
    except Exception as e:
        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
