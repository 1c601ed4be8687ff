#!/usr/bin/env python3
"""Many streams at once through `lily serve`, end to end: the load benchmark of continuous batching.

For each concurrency level C (default 1, 4, 8, 16, 32, 64) the official openai client streams 2C requests
(at least 4), C at a time, each with its own prompt of --prompt-tokens random token ids (distinct, no shared
prefix) and --max-tokens generated tokens (greedy, or drawn with --temperature / --top-p / --top-k; end-of-text
ignored, so every stream has its full length),
through /v1/completions of a `lily serve` process started here. Per level:
  aggregate output tok/s   all streams' output tokens / the level's wall time (prefills included)
  per-stream tok/s         a stream's tokens after its first / the time from its first token to its last
  decode-phase tok/s       C x the median per-stream tok/s (what the decoding batch delivers while full)
  TTFT p50 / p99           submit to first token
  inter-token p50 / p99    the gaps between a stream's text chunks after its first (one token each), all
                           streams' together; and the longest (a running stream held back, e.g. by a prefill)
and the GPU memory (nvidia-smi, sampled) against the server's --gpu-memory-fraction budget.
With --batch1-bench (a `lily bench` JSON of the same checkpoint at a --prompt-tokens context) the lone
stream (C=1) is held to it: per-stream tok/s within 5 % of the bench's decode tok/s, TTFT p50 within 10 % of
the bench's prefill time plus one decode step. --time-budget skips the levels that would start after it.
Writes --json (the plot beside it, when matplotlib is there; else draw it afterwards with
`python3 scripts/serve_bench.py --plot-only RESULT.json`) and prints a table last.

    python3 scripts/serve_bench.py --model DIR --json $OUT/serve-bench.json [--batch1-bench BENCH.json]
    python3 scripts/serve_bench.py --make-full /tmp/lily-full --json $OUT/serve-bench.json   (H200: 19.5 GB)
    python3 scripts/serve_bench.py --tiny      (a dry run on the CPU: the tiny model, the reference backend,
                                                concurrency 1,2, 16-token prompts, 4 tokens each)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

from load_test import LilyServer, metrics, percentile  # noqa: E402


class GpuMemory:
    """nvidia-smi's memory.used (MiB), sampled every `every` seconds while in the context: (peak, total)."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak, self.total = every, 0, None
        self._stop = threading.Event()

    def read(self) -> tuple[int, int] | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
                                  "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                 capture_output=True, text=True, timeout=10).stdout.split(",")
            return int(out[0]), int(out[1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _run(self):
        while not self._stop.wait(self.every):
            got = self.read()
            if got:
                self.peak, self.total = max(self.peak, got[0]), got[1]

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def one_stream(client, model: str, prompt: list[int], max_tokens: int, sampling: dict | None = None) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens, gaps = 0, []
    # the token ids go in extra_body, which the client sends as it is: as `prompt=` the openai client (3.57)
    # walks the 4096-int list through its parameter transforms first, 40-140 ms before the request leaves
    # (measured against a mock transport), which a TTFT measured here would count as the server's
    sampling = dict(sampling or {"temperature": 0.0})
    extra = {"prompt": prompt, "ignore_eos": True}
    if "top_k" in sampling:   # (not an OpenAI parameter: the client sends it in the body as it is)
        extra["top_k"] = sampling.pop("top_k")
    stream = await client.completions.create(model=model, prompt="", max_tokens=max_tokens, **sampling,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if last is not None:
                gaps.append(now - last)
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"start": t0, "first": first, "last": last or end, "end": end, "tokens": tokens, "gaps": gaps}


async def run_level(url: str, model: str, concurrency: int, n: int, prompt_tokens: int, max_tokens: int,
                    vocab: int, seed: int, sampling: dict | None = None) -> list[dict]:
    import openai
    import random

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(n)]

    async def limited(p):
        async with gate:
            return await one_stream(client, model, p, max_tokens, sampling)
    try:
        return await asyncio.gather(*(limited(p) for p in prompts))
    finally:
        await client.close()


def summarise(concurrency: int, rows: list[dict], max_tokens: int) -> dict:
    wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    out = sum(r["tokens"] for r in rows)
    per_stream = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in rows
                  if r["first"] and r["tokens"] > 1 and r["last"] > r["first"]]
    ttft = [r["first"] - r["start"] for r in rows if r["first"]]
    gaps = [g for r in rows for g in r["gaps"]]
    med = percentile(per_stream, 50)
    return {"concurrency": concurrency, "requests": len(rows), "output_tokens": out, "wall_s": wall,
            "aggregate_tok_s": out / wall, "per_stream_tok_s_p50": med,
            "per_stream_tok_s_mean": sum(per_stream) / len(per_stream) if per_stream else None,
            "decode_phase_tok_s": concurrency * med if med else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "itl_max_s": percentile(gaps, 100),
            "short_streams": sum(r["tokens"] != max_tokens for r in rows)}


def plot(result: dict, png: Path) -> None:
    from matplotlib.figure import Figure

    levels = result["levels"]
    if not levels:
        print("(no level ran: nothing to plot)")
        return
    cs = [lv["concurrency"] for lv in levels]
    fig = Figure(figsize=(12.8, 5.0), dpi=100, layout="constrained")
    gpu = result["machine"].get("gpu")
    fig.suptitle(f"lily serve, {result['prompt_tokens']}-token prompts, {result['max_tokens']} tokens each"
                 + (f" ({gpu})" if gpu else ""))
    a, b = fig.subplots(1, 2)
    a.plot(cs, [lv["aggregate_tok_s"] for lv in levels], "o-", label="aggregate output (prefills included)")
    a.plot(cs, [lv["decode_phase_tok_s"] or 0 for lv in levels], "s--", label="decode phase (C x per-stream)")
    a.plot(cs, [lv["per_stream_tok_s_p50"] or 0 for lv in levels], "^:", label="per stream (p50)")
    a.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="output tok/s")
    b.plot(cs, [lv["ttft_p50_s"] for lv in levels], "o-", label="TTFT p50")
    b.plot(cs, [lv["ttft_p99_s"] for lv in levels], "s--", label="TTFT p99")
    if all(lv.get("itl_p99_s") for lv in levels):   # (runs before the gaps were recorded have none)
        b.plot(cs, [lv["itl_p99_s"] for lv in levels], "^:", label="inter-token p99")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="seconds")
    for ax in (a, b):
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(png)


def batch1_targets(bench_json: Path, context: int) -> dict:
    """What the lone stream is held to, from a `lily bench` result: the decode tok/s at `context`, and the TTFT
    a request of that prompt should see (the bench's prefill through the first token, plus one decode step)."""
    data = json.loads(Path(bench_json).read_text())
    rows = [r for r in data["engines"]["lily"]["rows"] if r.get("context") == context and r.get("decode_tok_s")]
    if not rows:
        raise SystemExit(f"{bench_json}: no lily row at context {context}")
    r = rows[0]
    if r.get("refused"):   # (its numbers still say where the lone stream should be; the refusal is kept beside them)
        print(f"note: the bench refused its {context} row ({r['refused']}); comparing with it anyway", flush=True)
    return {"bench": str(bench_json), "context": context, "decode_tok_s": r["decode_tok_s"],
            "prefill_tok_s": r["prefill_tok_s"], "bench_refused": r.get("refused"),
            "ttft_s": context / r["prefill_tok_s"] + 1 / r["decode_tok_s"]}


def compare_lone_stream(level: dict, targets: dict) -> dict:
    """The Must's two conditions on the C=1 level."""
    per, ttft = level["per_stream_tok_s_p50"] or 0.0, level["ttft_p50_s"]
    out = {"per_stream_vs_bench": per / targets["decode_tok_s"], "ttft_vs_bench": ttft / targets["ttft_s"]}
    out["per_stream_within_5pct"] = out["per_stream_vs_bench"] >= 0.95
    out["ttft_within_10pct"] = out["ttft_vs_bench"] <= 1.10
    return out


def server_slots(log_path: Path) -> dict | None:
    """The slot pool the server chose (its log's 'N sequence slots of M tokens (X GiB)' line)."""
    import re

    m = re.search(r"(\d+) sequence slots of (\d+) tokens \(([\d.]+) GiB\)", log_path.read_text(errors="replace"))
    return {"slots": int(m[1]), "max_seq": int(m[2]), "GiB": float(m[3])} if m else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=False)
    src.add_argument("--model", help="a checkpoint directory")
    src.add_argument("--make-full", metavar="DIR", help="use (making it first if absent) the full-size synthetic model")
    src.add_argument("--make-tiny", metavar="DIR", help="the tiny synthetic model")
    p.add_argument("--tiny", action="store_true",
                   help="a dry run on the CPU: the tiny model (in --make-tiny DIR or a temporary one), the reference "
                        "backend, concurrency 1,2, 16-token prompts, 4 tokens each")
    p.add_argument("--plot-only", metavar="JSON", help="draw a result file next to it and exit")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", default="1,4,8,16,32,64")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="each request's (0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.35,
                   help="the server's budget (weights, prefill scratch, prefix cache, slots); checked against the peak")
    p.add_argument("--batch1-bench", metavar="JSON", help="a `lily bench` result the lone stream is held to")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds from the start: a level that would start later is skipped (and marked)")
    p.add_argument("--json", help="write the result here (and the plot beside it when matplotlib is present)")
    p.add_argument("--server-log", help="the server's output (default: beside --json)")
    p.add_argument("serve_args", nargs="*", help="more `lily serve` arguments, after --")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return 0
    t_start = time.perf_counter()
    if args.tiny:
        import tempfile

        args.device, args.concurrency, args.prompt_tokens, args.max_tokens = "cpu", "1,2", 16, 4
        if not (args.model or args.make_tiny):
            args.make_tiny = tempfile.mkdtemp(prefix="lily-serve-bench-tiny-")
        args.json = args.json or os.path.join(os.environ.get("OUT", "out"), "serve-bench-tiny.json")
    levels = [int(x) for x in args.concurrency.split(",")]
    sampling = {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p is not None else {}),
                **({"top_k": args.top_k} if args.top_k is not None else {})}
    targets = batch1_targets(Path(args.batch1_bench), args.prompt_tokens) if args.batch1_bench else None
    t0 = time.perf_counter()
    if args.model:
        model_dir = Path(args.model)
    else:
        from lily.synthetic import make_synthetic
        model_dir = Path(args.make_full or args.make_tiny or "")
        if not str(model_dir):
            p.error("give --model DIR, --make-full DIR, --make-tiny DIR or --tiny")
        if not (model_dir / "config.json").is_file():
            print(f"making the {'full' if args.make_full else 'tiny'} synthetic model in {model_dir} ...", flush=True)
            make_synthetic("full" if args.make_full else "tiny", model_dir, seed=1,
                           device="cuda" if args.device.startswith("cuda") else "cpu")
    make_s = time.perf_counter() - t0
    config = json.loads((model_dir / "config.json").read_text())
    vocab = min(248044, (config.get("text_config") or config)["vocab_size"] - 16)
    log_path = Path(args.server_log or (Path(args.json).with_suffix(".server.log") if args.json else "serve-bench.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    backend = "fast" if args.device.startswith("cuda") else "reference"
    serve = ["--max-batch", str(max(levels)), "--max-queue", str(4 * max(levels)),
             "--max-seq", str(args.prompt_tokens + args.max_tokens + 16), "--served-model-name", "bench",
             "--gpu-memory-fraction", str(args.gpu_memory_fraction), *args.serve_args]
    result = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "sampling": sampling,
              "serve_args": serve,
              "model": str(model_dir), "make_s": make_s, "levels": [], "skipped_levels": [],
              "machine": {"python": platform.python_version(), "host": platform.node(),
                          "git": os.environ.get("LILY_GIT_REVISION", "")}}
    if targets:
        result["batch1_targets"] = targets
    mem = GpuMemory() if args.device.startswith("cuda") else None
    idle = mem.read() if mem else None
    t0 = time.perf_counter()
    with LilyServer(model_dir, *serve, log_path=log_path, startup_timeout=900, device=args.device,
                    backend=backend) as server:
        result["startup_s"] = time.perf_counter() - t0
        result["server_slots"] = server_slots(log_path)
        # what a field the requests leave out samples with (the checkpoint's generation_config.json)
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as r:
            result["server_sampling_defaults"] = json.load(r)["data"][0].get("default_sampling_params")
        print(f"lily serve up in {result['startup_s']:.1f}s ({log_path}); slots {result['server_slots']}", flush=True)
        asyncio.run(run_level(server.url, "bench", 2, 2, args.prompt_tokens, 8, vocab, seed=0, sampling=sampling))   # warm-up
        with (mem or _nothing()):
            for i, c in enumerate(levels):
                if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
                    result["skipped_levels"].append(c)
                    print(f"C={c:3d}: skipped (past the time budget of {args.time_budget:.0f}s)", flush=True)
                    continue
                if mem:
                    mem.peak = 0                       # this level's own peak
                before = metrics(server.url)
                rows = asyncio.run(run_level(server.url, "bench", c, max(2 * c, 4), args.prompt_tokens,
                                             args.max_tokens, vocab, seed=100 + i, sampling=sampling))
                level = summarise(c, rows, args.max_tokens)
                after = metrics(server.url)
                # the level's share of the server's counters (gauges, such as the last request's speed, are not
                # differences); prefill pieces run one at a time, so their tokens over their seconds is the
                # prefill speed the level got
                level["server"] = {k: after.get(k, 0) - before.get(k, 0) for k in after
                                   if k.startswith(("lily_prefill", "lily_decode", "lily_generation"))
                                   and k.endswith(("_total", "_count", "_sum"))}
                sv = level["server"]
                if sv.get("lily_prefill_seconds_total"):
                    sv["prefill_tok_s"] = sv.get("lily_prefill_tokens_total", 0) / sv["lily_prefill_seconds_total"]
                if mem:
                    level["gpu_memory_peak_mib"] = mem.peak
                if c == 1 and targets:
                    level["vs_batch1_bench"] = compare_lone_stream(level, targets)
                result["levels"].append(level)
                print(f"C={c:3d}: {level['aggregate_tok_s']:8.0f} tok/s in all, {level['decode_phase_tok_s'] or 0:8.0f} "
                      f"decode phase, {level['per_stream_tok_s_p50'] or 0:6.1f}/stream, TTFT p50 "
                      f"{level['ttft_p50_s']:.3f}s p99 {level['ttft_p99_s']:.3f}s, inter-token p50 "
                      f"{1e3 * (level['itl_p50_s'] or 0):.1f} ms p99 {1e3 * (level['itl_p99_s'] or 0):.1f} max "
                      f"{1e3 * (level['itl_max_s'] or 0):.0f} [{time.perf_counter() - t_start:.0f}s]", flush=True)
        result["server_metrics"] = {k: v for k, v in metrics(server.url).items() if k.startswith("lily_device")}
    if mem:
        result["gpu_memory"] = {"idle_mib": idle[0] if idle else None, "peak_mib": max(
            [lv.get("gpu_memory_peak_mib", 0) for lv in result["levels"]] + [mem.peak]), "total_mib": mem.total,
            "budget_mib": args.gpu_memory_fraction * mem.total if mem.total else None}
        g = result["gpu_memory"]
        g["within_budget"] = bool(mem.total and g["peak_mib"] <= g["budget_mib"])
        result["machine"]["gpu"] = _gpu_name()
    result["total_s"] = time.perf_counter() - t_start
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        try:
            plot(result, Path(args.json).with_suffix(".png"))
        except ImportError:
            print(f"(no matplotlib here: draw it with `python3 scripts/serve_bench.py --plot-only {args.json}`)")
        except Exception as e:  # noqa: BLE001 - the JSON is written; a plot that fails is not a failed run
            print(f"(the plot failed: {type(e).__name__}: {e})")
    print(f"\n{'C':>4} {'reqs':>5} {'agg tok/s':>10} {'decode-phase':>12} {'per-stream':>10} {'TTFT p50':>9} {'p99':>8}"
          f"{' ITL p99 ms':>11} {'max':>5}{' GPU MiB':>9}")
    for lv in result["levels"]:
        print(f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['aggregate_tok_s']:>10.0f} "
              f"{lv['decode_phase_tok_s'] or 0:>12.0f} {lv['per_stream_tok_s_p50'] or 0:>10.1f} "
              f"{lv['ttft_p50_s']:>9.3f} {lv['ttft_p99_s']:>8.3f} {1e3 * (lv.get('itl_p99_s') or 0):>10.1f} "
              f"{1e3 * (lv.get('itl_max_s') or 0):>5.0f}{lv.get('gpu_memory_peak_mib', 0):>9}")
    problems = []
    if result["skipped_levels"]:
        problems.append(f"levels {result['skipped_levels']} skipped for time")
    lone = next((lv for lv in result["levels"] if lv["concurrency"] == 1 and "vs_batch1_bench" in lv), None)
    if lone:
        v, t = lone["vs_batch1_bench"], targets
        print(f"lone stream vs lily bench at {t['context']}: {lone['per_stream_tok_s_p50']:.1f} tok/s against "
              f"{t['decode_tok_s']:.1f} ({v['per_stream_vs_bench']:.3f}x, must be >= 0.95); TTFT p50 "
              f"{lone['ttft_p50_s']:.3f}s against {t['ttft_s']:.3f}s ({v['ttft_vs_bench']:.3f}x, must be <= 1.10)")
    if mem:
        g = result["gpu_memory"]
        print(f"GPU memory: peak {g['peak_mib']} MiB of {g['total_mib']} (budget {g['budget_mib'] or 0:.0f}, "
              f"{'within' if g['within_budget'] else 'OVER'}); slots {result['server_slots']}")
        if not g["within_budget"]:
            problems.append("GPU memory over the budget")
    short = sum(lv["short_streams"] for lv in result["levels"])
    if short:
        problems.append(f"{short} stream(s) ended before {args.max_tokens} tokens")
    print(f"PROBLEMS: {'; '.join(problems)}" if problems else f"ok ({result['total_s']:.0f}s)")
    return 1 if problems else 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return ""


if __name__ == "__main__":
    sys.exit(main())
