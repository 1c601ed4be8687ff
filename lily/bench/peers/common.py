"""The command line every peer subprocess shares: parse, build the engine, run the contract, write JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

from lily.bench import contract


def peer_main(name: str, build, argv: list[str] | None = None) -> int:
    """`build(args) -> (engine, vocab, info)`; the rows and info go to --out as JSON."""
    p = argparse.ArgumentParser(prog=f"python -m lily.bench.peers.{name}_peer")
    p.add_argument("--checkpoint", required=True, help="an MLX 4-bit checkpoint directory")
    p.add_argument("--contexts", default="256,4096")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--max-drift", type=float, default=contract.MAX_DRIFT)
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole process, load included")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="activation dtype (float32 for exact cross-checks on the CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {"engine": name, "ok": False, "rows": [], "info": {"python": platform.python_version()}}
    try:
        t0 = time.perf_counter()
        engine, vocab, info = build(args)
        result["info"].update(info)
        result["load_s"] = time.perf_counter() - t0
        contract.log(f"[{engine.name}] loaded in {result['load_s']:.1f} s: {info}")
        rows = contract.measure_matrix(engine, contract.parse_contexts(args.contexts), args.decode_steps,
                                       args.rounds, vocab, retries=args.retries,
                                       time_budget_s=max(args.time_budget - result["load_s"], 1.0)
                                       if args.time_budget else None)
        result["engine"] = engine.name
        result["rows"] = [r.to_json() for r in rows]
        result["ok"] = True
    except Exception as e:  # the parent reports the peer as failed with this line, and keeps going
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit("run a specific peer: python -m lily.bench.peers.mlx_peer | hf_peer")
