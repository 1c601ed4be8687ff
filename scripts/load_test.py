#!/usr/bin/env python3
"""A bounded loopback load generator for `lily serve`: N concurrent streaming chat clients.

Every request must end one of two ways: a complete stream (a role chunk, content, a chunk with a
finish_reason, then `data: [DONE]`) or a clean refusal (429/503 with an OpenAI-shaped error). Anything
else (a 5xx, a cut stream, an error chunk, a timeout) is counted as a failure. Prints requests/s and
p50/p99 latency; --json writes the whole result.

    python scripts/load_test.py --url http://127.0.0.1:8000 --model NAME --clients 64
    python scripts/load_test.py --serve-synthetic --clients 64 --json benchmarks/results/load-tiny-cpu.json
    python scripts/load_test.py --serve-synthetic --device cuda --backend fast --clients 64

--serve-synthetic builds the tiny random checkpoint, starts `lily serve` on it (default: CPU, reference
backend) on a free loopback port, runs the load, and also checks the server's resident memory (from
/proc) before, at the peak of, and after the load. Memory must return to its idle level: the host's
RSS (--serve-synthetic), and, when the server reports it in /metrics (CUDA), the GPU memory in live
tensors minus what the prefix cache holds (the cache may legitimately fill up during the load).
"Idle" is read after a small warm-up round, so one-time allocations (kernels, the pooled state and
its graph) count as idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))
REFUSALS = (429, 503)
RSS_SLACK_MIB = 64      # above idle still "back to idle": allocator caches, a few grown buffers
DEVICE_SLACK_MIB = 32   # GPU tensors (beyond the prefix cache's) still alive after the load
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass
class Outcome:
    kind: str            # "ok" | "refused" | "failed" | "timeout"
    status: int | None
    latency_s: float
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class LoadResult:
    clients: int
    requests: int
    max_tokens: int
    wall_s: float
    ok: int
    refused: int
    failed: int
    timeouts: int
    requests_per_s: float
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    failures: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
            and isinstance(err["message"], str) and bool(err["message"]))


def check_stream(lines: list[str]) -> str:
    """'' when the SSE lines are one complete chat completion stream, else what is wrong."""
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return "the stream did not end with data: [DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    if any("error" in c for c in chunks):
        return f"error chunk: {next(c for c in chunks if 'error' in c)}"
    by_choice: dict[int, list[dict]] = {}   # (a request with n > 1 streams each choice's chunks by its index)
    for c in chunks:
        for choice in c.get("choices") or []:
            by_choice.setdefault(choice.get("index", 0), []).append(choice)
    if not by_choice:
        return "no choice in the stream"
    for i, choices in sorted(by_choice.items()):
        if choices[0]["delta"].get("role") != "assistant":
            return f"choice {i}: the first chunk has no assistant role"
        finishes = [ch["finish_reason"] for ch in choices]
        if finishes.count(None) != len(finishes) - 1 or finishes[-1] not in ("stop", "length", "tool_calls"):
            return f"choice {i}: finish reasons {finishes[-3:]}: expected exactly one, in its last chunk"
    return ""


def _has_text(data: str) -> bool:
    """Whether one chunk carries generated text (answer or reasoning)."""
    try:
        choices = json.loads(data).get("choices") or [{}]
    except ValueError:
        return False
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, timeout: float,
                      rng: random.Random) -> Outcome:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31)}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    dt = time.perf_counter() - t0
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = None
                    if r.status_code in REFUSALS and is_openai_error(parsed):
                        return Outcome("refused", r.status_code, dt)
                    return Outcome("failed", r.status_code, dt, detail=raw[:200].decode("utf-8", "replace"))
                lines = []
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {") and _has_text(line[6:]):
                        ttft = time.perf_counter() - t0
                    if line:
                        lines.append(line)
        dt = time.perf_counter() - t0
        problem = check_stream(lines)
        return Outcome("failed" if problem else "ok", 200, dt, ttft, problem)
    except TimeoutError:
        return Outcome("timeout", None, time.perf_counter() - t0, detail=f"no complete answer in {timeout}s")
    except httpx.HTTPError as e:
        return Outcome("failed", None, time.perf_counter() - t0, detail=f"{type(e).__name__}: {e}")


async def run_load_async(url: str, model: str, clients: int = 64, requests_per_client: int = 1,
                         max_tokens: int = 8, timeout: float = 120.0, api_key: str | None = None,
                         seed: int | None = None) -> LoadResult:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    start = asyncio.Event()

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def worker(i: int) -> list[Outcome]:
            r = random.Random(rng.random() + i)
            await start.wait()  # everyone starts together: the queue really fills
            return [await one_request(client, url, model, max_tokens, timeout, r) for _ in range(requests_per_client)]

        tasks = [asyncio.create_task(worker(i)) for i in range(clients)]
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        start.set()
        outcomes = [o for res in await asyncio.gather(*tasks) for o in res]
        wall = time.perf_counter() - t0

    ok = [o for o in outcomes if o.kind == "ok"]
    bad = [o for o in outcomes if o.kind in ("failed", "timeout")]
    return LoadResult(
        clients=clients, requests=len(outcomes), max_tokens=max_tokens, wall_s=round(wall, 3),
        ok=len(ok), refused=sum(o.kind == "refused" for o in outcomes),
        failed=sum(o.kind == "failed" for o in outcomes), timeouts=sum(o.kind == "timeout" for o in outcomes),
        requests_per_s=round(len(ok) / wall, 3) if wall > 0 else 0.0,
        latency_p50_s=_round(percentile([o.latency_s for o in ok], 50)),
        latency_p99_s=_round(percentile([o.latency_s for o in ok], 99)),
        ttft_p50_s=_round(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 50)),
        ttft_p99_s=_round(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 99)),
        failures=[f"{o.kind} {o.status}: {o.detail}" for o in bad][:20])


def run_load(*args, **kwargs) -> LoadResult:
    return asyncio.run(run_load_async(*args, **kwargs))


def _round(x):
    return None if x is None else round(x, 4)


# -- a server to load (used by --serve-synthetic and by the tests) -----------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RSSSampler:
    """The peak resident memory of a process, sampled every `every` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, RuntimeError):
                return
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class LilyServer:
    """`lily serve --model DIR` on a free loopback port, its output in a log file; a context manager."""

    def __init__(self, model_dir, *extra: str, log_path: Path | None = None, startup_timeout: float = 180,
                 device: str = "cpu", backend: str = "reference"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="lily-serve-", suffix=".log")[1])
        self.cmd = [sys.executable, "-m", "lily", "serve", "--model", str(model_dir), "--port", str(self.port),
                    "--device", device, "--backend", backend, *extra]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LilyServer":
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"lily serve did not come up in {self.startup_timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """GET /metrics as {name{labels}: value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=10).text)


def idle_metrics(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once no request waits or runs (the last read if that does not happen in `timeout`)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url, api_key)
        if (m.get("lily_queue_depth") == 0 and m.get("lily_requests_running") == 0) or time.time() > deadline:
            return m
        time.sleep(0.1)


def device_memory(m: dict[str, float]) -> dict[str, int] | None:
    """The GPU memory gauges of one /metrics read (bytes), or None where the server reports none (CPU)."""
    if "lily_device_memory_allocated_bytes" not in m:
        return None
    return {"allocated": int(m["lily_device_memory_allocated_bytes"]),
            "reserved": int(m.get("lily_device_memory_reserved_bytes", 0)),
            "prefix_cache": int(m.get("lily_prefix_cache_bytes", 0))}


def memory_report(idle: dict[str, float], after: dict[str, float], rss_idle: int | None = None,
                  rss_peak: int | None = None, rss_after: int | None = None, rss_slack_mib: float = RSS_SLACK_MIB,
                  device_slack_mib: float = DEVICE_SLACK_MIB, expect_device: bool = False) -> tuple[dict, list[str]]:
    """(the memory section of the result, what did not return to idle). idle/after are /metrics reads.
    GPU: allocated minus the prefix cache's bytes must come back within the slack (the reserved pool of
    torch's caching allocator is reported, not judged: it keeps freed blocks for reuse by design)."""
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    report, problems = {}, []
    if rss_idle is not None:
        report.update(rss_idle_mib=mib(rss_idle), rss_peak_mib=mib(rss_peak or 0), rss_after_mib=mib(rss_after))
        if rss_after > rss_idle + rss_slack_mib * 2**20:
            problems.append(f"host RSS {mib(rss_after)} MiB after the load vs {mib(rss_idle)} MiB idle "
                            f"(slack {rss_slack_mib} MiB)")
    report.update(queue_depth_after=after.get("lily_queue_depth"), running_after=after.get("lily_requests_running"))
    d0, d1 = device_memory(idle), device_memory(after)
    if d0 is not None and d1 is not None:
        own0, own1 = d0["allocated"] - d0["prefix_cache"], d1["allocated"] - d1["prefix_cache"]
        report.update(device_allocated_idle_mib=mib(d0["allocated"]), device_allocated_after_mib=mib(d1["allocated"]),
                      device_reserved_idle_mib=mib(d0["reserved"]), device_reserved_after_mib=mib(d1["reserved"]),
                      prefix_cache_idle_mib=mib(d0["prefix_cache"]), prefix_cache_after_mib=mib(d1["prefix_cache"]),
                      device_beyond_cache_idle_mib=mib(own0), device_beyond_cache_after_mib=mib(own1))
        if own1 > own0 + device_slack_mib * 2**20:
            problems.append(f"GPU memory beyond the prefix cache {mib(own1)} MiB after the load vs {mib(own0)} MiB "
                            f"idle (slack {device_slack_mib} MiB)")
    elif expect_device:
        problems.append("the server reports no GPU memory in /metrics (lily_device_memory_allocated_bytes)")
    if after.get("lily_queue_depth") or after.get("lily_requests_running"):
        problems.append(f"the engine is not idle after the load: {report['queue_depth_after']} queued, "
                        f"{report['running_after']} running")
    report["returned_to_idle"] = not problems
    return report, problems


def settle_rss(pid: int, seconds: float = 3.0) -> int:
    """RSS once it stops falling (the allocator returning freed memory), at most `seconds` of waiting."""
    last = rss_bytes(pid)
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.25)
        now = rss_bytes(pid)
        if now >= last:
            return now
        last = now
    return last


def serve_synthetic_and_load(args) -> tuple[LoadResult, list[str]]:
    from lily.synthetic import make_synthetic

    with tempfile.TemporaryDirectory(prefix="lily-load-") as tmp:
        ckpt = make_synthetic("tiny", Path(tmp) / "ckpt", seed=args.seed or 0)
        extra = ["--max-queue", str(args.max_queue), "--max-seq", str(args.max_seq), "--served-model-name", "tiny"]
        log_path = Path(args.server_log) if args.server_log else Path(tmp) / "serve.log"
        with LilyServer(ckpt, *extra, log_path=log_path, device=args.device, backend=args.backend,
                        startup_timeout=args.startup_timeout) as server:
            # a first small round so one-time allocations are part of "idle"
            run_load(server.url, "tiny", clients=args.warmup_clients, max_tokens=args.max_tokens, seed=1)
            idle_m = idle_metrics(server.url)
            idle = settle_rss(server.proc.pid)
            with RSSSampler(server.proc.pid) as sampler:
                result = run_load(server.url, "tiny", args.clients, args.requests_per_client, args.max_tokens,
                                  args.timeout, seed=args.seed)
            after_m = idle_metrics(server.url)
            after = settle_rss(server.proc.pid)
            result.server = {"checkpoint": "lily make-synthetic tiny", "backend": args.backend, "device": args.device,
                             "max_queue": args.max_queue, "max_seq": args.max_seq, "stream": True}
            result.memory, problems = memory_report(idle_m, after_m, idle, sampler.peak, after, args.rss_slack_mib,
                                                    args.device_slack_mib, args.device.startswith("cuda"))
    return result, problems


def url_load(args) -> tuple[LoadResult, list[str]]:
    url = args.url.rstrip("/")
    if args.warmup_clients:
        run_load(url, args.model, args.warmup_clients, 1, args.max_tokens, args.timeout, args.api_key, seed=1)
    idle_m = idle_metrics(url, args.api_key)
    result = run_load(url, args.model, args.clients, args.requests_per_client, args.max_tokens, args.timeout,
                      args.api_key, args.seed)
    result.memory, problems = memory_report(idle_m, idle_metrics(url, args.api_key),
                                            device_slack_mib=args.device_slack_mib)
    return result, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (loopback addresses only)")
    target.add_argument("--serve-synthetic", action="store_true",
                        help="start lily serve on a fresh tiny synthetic checkpoint and load that")
    p.add_argument("--device", default="cpu", help="the server's --device (with --serve-synthetic; default cpu)")
    p.add_argument("--backend", default="reference", choices=("reference", "fast"),
                   help="the server's --backend (with --serve-synthetic; fast needs --device cuda)")
    p.add_argument("--max-seq", type=int, default=512, help="the server's --max-seq (with --serve-synthetic)")
    p.add_argument("--server-log", help="keep the server's output in this file (with --serve-synthetic)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds the server may take to come up")
    p.add_argument("--model", default="tiny", help="the model id to send (with --url)")
    p.add_argument("--api-key", default=os.environ.get("LILY_API_KEY"))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue (with --serve-synthetic)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--warmup-clients", type=int, default=4, help="clients of the round before idle is read")
    p.add_argument("--rss-slack-mib", type=float, default=RSS_SLACK_MIB, help="host RSS above idle still idle")
    p.add_argument("--device-slack-mib", type=float, default=DEVICE_SLACK_MIB,
                   help="GPU tensors (beyond the prefix cache) above idle still idle")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    for name in ("clients", "requests_per_client", "max_tokens", "max_queue", "max_seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.url:
        host = httpx.URL(args.url).host
        if host not in ("127.0.0.1", "localhost", "::1"):
            p.error(f"--url {args.url}: this load generator only targets loopback addresses")
        result, problems = url_load(args)
    else:
        result, problems = serve_synthetic_and_load(args)
    result.machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    print(f"{result.requests} requests from {result.clients} clients in {result.wall_s:.2f}s: "
          f"{result.ok} ok, {result.refused} refused (429/503), {result.failed} failed, {result.timeouts} timed out")
    print(f"requests/s {result.requests_per_s:.2f}  latency p50 {_fmt(result.latency_p50_s)}  "
          f"p99 {_fmt(result.latency_p99_s)}  first token p50 {_fmt(result.ttft_p50_s)}  p99 {_fmt(result.ttft_p99_s)}")
    mem = result.memory
    if "rss_idle_mib" in mem:
        print("server RSS MiB: idle {rss_idle_mib}, peak {rss_peak_mib}, after {rss_after_mib}".format(**mem))
    if "device_allocated_idle_mib" in mem:
        print("server GPU MiB: allocated idle {device_allocated_idle_mib}, after {device_allocated_after_mib} "
              "(prefix cache {prefix_cache_idle_mib} -> {prefix_cache_after_mib}); reserved idle "
              "{device_reserved_idle_mib}, after {device_reserved_after_mib}".format(**mem))
    for f in result.failures:
        print("FAILED:", f)
    for problem in problems:
        print("MEMORY:", problem)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0 if result.failed == 0 and result.timeouts == 0 and not problems else 1


def _fmt(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


if __name__ == "__main__":
    sys.exit(main())
