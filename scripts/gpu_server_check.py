#!/usr/bin/env python3
"""The serving engine's fast path on a GPU, in one process: requests run through lily.engine.generation
exactly as the server's worker runs them (after `lily serve`'s own warm-up), on the tiny synthetic
checkpoint. Checks that

  - no request captures a decode graph or allocates a state: the warm-up's state is slot 0 of the slot
    pool, and a lone request gets it back (the graph-capture count stays where the warm-up left it);
  - back-to-back greedy requests, and a prefix-cache hit, give the tokens of a fresh state
    (`generate_greedy`, the device-side loop on a newly allocated state);
  - GPU memory in live tensors, minus the prefix cache's, is back to its idle level afterwards;

and measures what a request used to pay before its first decode step (allocating a max_seq state and
capturing its graph) against the first-token latency now. Writes --json, prints a short table last.

    python3 scripts/gpu_server_check.py --device cuda --json $OUT/server-engine.json
    python3 scripts/gpu_server_check.py --device cpu --requests 2 --max-tokens 3     (a dry run: interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MIB = 2**20


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def run_request(backend, tok, prompt, n, cache, GenerationRequest, SamplingParams, generate):
    """(tokens, Finished, seconds to the first emitted text, seconds in all) for one greedy request."""
    req = GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=SamplingParams(temperature=0.0))
    events, first = [], []
    t0 = time.perf_counter()

    def emit(e):
        if not first and getattr(e, "tokens", None):
            first.append(time.perf_counter() - t0)
        events.append(e)
    done = generate(backend, tok, req, emit, cache)
    sync(backend.device)
    total = time.perf_counter() - t0
    return [t.token for e in events if hasattr(e, "tokens") for t in e.tokens], done, first[0] if first else None, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", help="a checkpoint directory (default: a fresh tiny synthetic one)")
    p.add_argument("--max-seq", type=int, default=2048, help="the backend's state size, as `lily serve --max-seq`")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--device-slack-mib", type=float, default=32.0)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cpu":  # the dry run: Triton kernels in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from lily.engine.fast_backend import FastBackend
    from lily.engine.generation import GenerationRequest, generate
    from lily.engine.prefix_cache import PrefixCache
    from lily.engine.sampling import SamplingParams
    from lily.server.main import _warm_up
    from lily.synthetic import make_synthetic
    from lily.tokenizer import Tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="lily-engine-check-")
    model_dir = Path(args.model) if args.model else make_synthetic("tiny", Path(tmp.name) / "ckpt", seed=5)
    t0 = time.perf_counter()
    backend = FastBackend.from_dir(model_dir, args.device, max_seq=args.max_seq)
    tok = Tokenizer.from_dir(model_dir)
    dev = backend.device
    load_s = time.perf_counter() - t0
    captures = [0]
    real_capture = backend.model._capture

    def counting_capture(st):
        captures[0] += 1
        real_capture(st)
    backend.model._capture = counting_capture
    rng = random.Random(0)
    vocab = min(tok.vocab_size, backend.config.vocab_size) - 16   # clear of the special tokens at the top
    cache = PrefixCache(4, 1 << 30, backend.clone_state, backend.state_nbytes)

    t0 = time.perf_counter()
    _warm_up(backend)                          # what `lily serve` does before it listens
    sync(dev)
    warmup_s = time.perf_counter() - t0
    slot0_graph = backend.pool.states[0].graph
    captures_after_warmup = captures[0]
    idle_alloc = allocated(dev)

    problems, rows = [], []
    captures_in_requests = 0   # (the oracle's fresh states capture their own graphs: not counted)

    def request(i, kind, prompt):
        nonlocal captures_in_requests
        before = captures[0]
        toks, done, ttft, total = run_request(backend, tok, prompt, args.max_tokens, cache, GenerationRequest,
                                              SamplingParams, generate)
        captures_in_requests += captures[0] - before
        want = backend.generate_greedy(prompt, args.max_tokens)
        rows.append({"request": i, "kind": kind, "cached_tokens": done.cached_tokens,
                     "ttft_ms": None if ttft is None else ttft * 1e3, "total_ms": total * 1e3,
                     "decode_tok_s": done.decode_steps / done.decode_s if done.decode_s else None,
                     "same_as_fresh_state": toks == want, "captures": captures[0] - before})
        if toks != want:
            problems.append(f"request {i} ({kind}): tokens differ from a fresh state's: {toks[:8]}.. vs {want[:8]}..")
        return toks, done

    prompt, toks = [], []
    for i in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens + rng.randrange(8))]
        toks, _ = request(i, "new prompt", prompt)
    # a follow-up that extends the last conversation (prompt + what was fed of the answer + a new turn):
    # served from the prefix cache, copied into the pooled state
    follow = prompt + toks[:-1] + [rng.randrange(vocab) for _ in range(5)]
    _, done = request(args.requests, "prefix-cache hit", follow)
    if done.cached_tokens == 0:
        problems.append("the follow-up found nothing in the prefix cache")
    reused = backend.pool.free == backend.pool.n_slots and backend.pool.states[0].graph is slot0_graph
    if captures_in_requests:
        problems.append(f"{captures_in_requests} graph capture(s) during requests (want 0: the pooled state's graph)")
    if not reused:
        problems.append("the slots are not all free after the requests, or slot 0 lost the warm-up's graph")

    # what each request paid before the pool: a new max_seq state and its graph, before the first decode step
    sync(dev)
    t0 = time.perf_counter()
    st = backend.model.new_state(backend.max_seq)
    sync(dev)
    alloc_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    backend.prepare_state(st)
    sync(dev)
    capture_ms = (time.perf_counter() - t0) * 1e3
    state_mib = backend.state_nbytes(st) / MIB
    del st
    sync(dev)

    after_alloc = allocated(dev)
    beyond_cache = after_alloc - cache.nbytes - idle_alloc
    if dev.type == "cuda" and beyond_cache > args.device_slack_mib * MIB:
        problems.append(f"GPU memory beyond the prefix cache grew {beyond_cache / MIB:.1f} MiB over idle")
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": str(model_dir),
        "max_seq": backend.max_seq, "graphs": backend.model.use_graph, "load_s": load_s, "warmup_s": warmup_s,
        "requests": rows, "captures_at_warmup": captures_after_warmup, "captures_in_requests": captures_in_requests,
        "pool_reused_warmup_state": reused, "pool_free": backend.pool.free,
        "per_request_cost_before_pool_ms": {"allocate_state": alloc_ms, "capture_graph": capture_ms,
                                            "state_mib": state_mib},
        "device_allocated_idle_mib": idle_alloc / MIB, "device_allocated_after_mib": after_alloc / MIB,
        "prefix_cache_mib": cache.nbytes / MIB, "device_beyond_cache_growth_mib": beyond_cache / MIB,
        "problems": problems, "ok": not problems,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"engine on {result['device']} (graphs {result['graphs']}, max_seq {backend.max_seq}): warm-up "
          f"{warmup_s:.2f}s, {captures_after_warmup} capture(s) there, {captures_in_requests} in requests")
    print(f"{'req':>3} {'kind':<17} {'cached':>6} {'ttft ms':>8} {'total ms':>9} {'tok/s':>7} {'fresh=':>6}")
    for r in rows:
        tps = f"{r['decode_tok_s']:.0f}" if r["decode_tok_s"] else "-"
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        print(f"{r['request']:>3} {r['kind']:<17} {r['cached_tokens']:>6} {ttft:>8} {r['total_ms']:>9.1f} "
              f"{tps:>7} {str(r['same_as_fresh_state']):>6}")
    print(f"before the pool each request also paid: allocate a {state_mib:.0f} MiB state {alloc_ms:.1f} ms + "
          f"capture its graph {capture_ms:.1f} ms")
    print(f"GPU allocated MiB: idle {idle_alloc / MIB:.1f}, after {after_alloc / MIB:.1f} "
          f"(prefix cache {cache.nbytes / MIB:.1f})")
    for problem in problems:
        print("PROBLEM:", problem)
    print("engine check:", "OK" if not problems else "FAILED")
    tmp.cleanup()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
