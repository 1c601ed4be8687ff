#!/usr/bin/env python3
"""Every Triton launch of a full-size prefill chunk, decode step and batched decode step compiled for a GPU this
machine need not have: the shared memory each program asks, against what one program may have on that card. No GPU
needed.

    python3 scripts/shared_memory_check.py                      # sm_86 (RTX 3090, A10, A40) at 99 KiB
    python3 scripts/shared_memory_check.py --arch 89 --tokens 64,4096 --steps prefill
    python3 scripts/shared_memory_check.py --arch 90 --limit 232448

The model runs on meta tensors of the full model's shapes (lily.config.FULL, weights never made) with every
kernel launch recorded instead of run, so each launch is seen with the constexprs and tiles the launchers pick
for the card's shared memory (lily.kernels.shared_memory: `--limit` stands for the card's, through
LILY_MAX_SHARED_BYTES); each distinct launch is then compiled for the architecture (ptxas, shipped with Triton)
and its shared memory read from the compiled kernel. A launch over the limit is one Triton refuses to load on
that card (OutOfResources), which sends every prompt through the decode step (lily.model.fast
prefill_kernels_fit). The numbers are this Triton's: another version may ask a little more or less.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

from lily.checkpoint.layout import expected_tensors  # noqa: E402
from lily.config import FULL, ModelConfig  # noqa: E402
from lily.kernels.shared_memory import SMALL_CARD_BYTES  # noqa: E402
from lily.quant import QuantTensor  # noqa: E402

OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def meta_weights(c: ModelConfig) -> dict:
    """The checkpoint dict of `c` as meta tensors (shapes and dtypes only)."""
    out = {}
    for spec in expected_tensors(c).values():
        if spec.quantized:
            *lead, rows, cols = spec.shape
            groups = (*lead, rows, cols // c.group_size)
            out[spec.key] = QuantTensor(torch.empty(*lead, rows, cols * spec.bits // 32, dtype=torch.uint32,
                                                    device="meta"),
                                        torch.empty(groups, dtype=torch.bfloat16, device="meta"),
                                        torch.empty(groups, dtype=torch.bfloat16, device="meta"), spec.bits,
                                        c.group_size)
        else:
            out[spec.key] = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return out


STEPS = ("prefill", "decode", "batch")
BATCH_ROWS = (2, 4, 8, 16, 32)


def model_launches(tokens: list[int], steps: tuple[str, ...] = STEPS, config: ModelConfig = FULL) -> list[tuple]:
    """The distinct (kernel, args, kwargs) launched, in first-launch order (kernels recorded, not run), by a prefill
    of each of `tokens` tokens ("prefill"), a decode step after the longest of them ("decode") and the batched
    decode step at each of BATCH_ROWS rows ("batch")."""
    from lily.kernels.sample import RowSampling, sample_rows
    from lily.model import fast_prefill
    from lily.model.fast import FastModel, FastState
    from lily.model.fast_batch import BatchedDecode
    from lily.model.slots import SlotPool

    seen: dict = {}
    real_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__qualname__, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        seen.setdefault(key, (self, args, kwargs))

    JITFunction.run = record
    try:
        weights = meta_weights(config)
        if "prefill" in steps:
            fused = fast_prefill.with_fused_projections(config, weights)
            for t in tokens:
                state = FastState(config, t + 16, "meta")
                fast_prefill.prefill_forward(config, fused, state, torch.zeros(t, dtype=torch.long, device="meta"),
                                             logits="last")
        if "decode" in steps or "batch" in steps:
            model = FastModel(config, weights, device="meta")
            max_seq = max(tokens) + 64
            if "decode" in steps:
                state = model.new_state(max_seq=max_seq)
                state.pos = max(tokens)
                model._launch_step(state)
                # the draw of sampled rows (temperature, top-k, top-p) over the full vocabulary
                draws = [RowSampling(temperature=1.0, top_k=20, top_p=0.95, key=1)] * 8
                sample_rows(torch.empty(len(draws), config.vocab_size, device="meta"), draws, use_kernel=True)
            if "batch" in steps:
                batch = BatchedDecode(model, SlotPool(config, max(BATCH_ROWS), max_seq, "meta"))
                for rows in BATCH_ROWS:
                    batch._step(rows)
    finally:
        JITFunction.run = real_run
    return list(seen.values())


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, arch: int):
    """`fn` compiled for sm_<arch> as this launch would specialise it (pointers taken as 16-byte aligned, as the
    model's tensors are)."""
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values.get(p.name, p.default if p.default is not inspect.Parameter.empty else None)
        if p.is_constexpr or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        else:
            signature[p.name] = mangle_type(v)
            if signature[p.name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={k: kwargs[k] for k in OPTIONS if k in kwargs})


def shared_memory_table(arch: int, limit: int, tokens: list[int], steps: tuple[str, ...] = STEPS) -> list[dict]:
    """One row a distinct launch: kernel, its tiles, the shared memory it asks compiled for sm_<arch>, with the
    launchers picking tiles for a card of `limit` bytes a program."""
    old = os.environ.get("LILY_MAX_SHARED_BYTES")
    os.environ["LILY_MAX_SHARED_BYTES"] = str(limit)
    try:
        launches = model_launches(tokens, steps)
    finally:
        if old is None:
            os.environ.pop("LILY_MAX_SHARED_BYTES")
        else:
            os.environ["LILY_MAX_SHARED_BYTES"] = old
    rows = []
    for fn, args, kwargs in launches:
        k = compile_launch(fn, args, kwargs, arch)
        tiles = {n: kwargs[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BV", *OPTIONS) if n in kwargs}
        rows.append({"kernel": fn.fn.__name__, "tiles": tiles, "shared_bytes": k.metadata.shared,
                     "fits": k.metadata.shared <= limit})
    return rows


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=86, help="compute capability, e.g. 80, 86, 89, 90 (default 86)")
    ap.add_argument("--limit", type=int, default=SMALL_CARD_BYTES,
                    help=f"shared memory one program may have on the card, bytes (default {SMALL_CARD_BYTES})")
    ap.add_argument("--tokens", default="64,4096", help="prompt lengths whose chunks to compile (default 64,4096)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"which of {', '.join(STEPS)} (default all)")
    ap.add_argument("--json", help="also write the rows, the arguments and the versions to this JSON file")
    a = ap.parse_args()
    steps = tuple(a.steps.split(","))
    if set(steps) - set(STEPS):
        raise SystemExit(f"--steps: expected some of {', '.join(STEPS)}")
    rows = shared_memory_table(a.arch, a.limit, [int(t) for t in a.tokens.split(",")], steps)
    for r in rows:
        print(f"{r['kernel']:28s} {r['shared_bytes'] / 1024:7.1f} KiB  {'ok ' if r['fits'] else 'OVER'}  {r['tiles']}")
    over = [r["kernel"] for r in rows if not r["fits"]]
    if a.json:
        Path(a.json).write_text(json.dumps({
            "what": f"every launch of lily's {', '.join(steps)} at the full model's shapes compiled for sm_{a.arch} "
                    f"(no GPU), the launchers picking tiles for {a.limit} bytes of shared memory a program",
            "command": " ".join(["python3", "scripts/shared_memory_check.py", *sys.argv[1:]]),
            "env": {"triton": triton.__version__, "torch": torch.__version__, "git_rev": _git_rev()},
            "arch": a.arch, "limit_bytes": a.limit, "tokens": a.tokens, "rows": rows, "over": over}, indent=1) + "\n")
    print(f"sm_{a.arch}, {a.limit / 1024:.0f} KiB a program: {len(rows) - len(over)} of {len(rows)} launches fit"
          + (f"; over: {', '.join(over)}" if over else ""))
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
