"""The tensor-core batch-1 GEMV (lily.kernels.gemv_mma) against today's CUDA-core GEMV (lily.kernels.quant_gemv)
at the decode step's shapes: correctness against the fp32 product with the dequantized weight, and time over
rotating weight copies (L2 cannot hold them), each path's launches back to back in a CUDA graph, with the
RMSNorm prologue and x in PERM64 order as the step gives it. Tiles: gemv_mma's (rows, warps, programs an SM).
Writes $OUT/gemv-mma.json and prints a table.

    python3 scripts/gpu_gemv_mma.py [shape,...] [--tiles 64x4x4,128x4x2,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_check import git_rev, rand_qt  # noqa: E402
from gpu_gemv_tc_probe import shapes, timed  # noqa: E402
from lily.kernels import gemv_mma as GM  # noqa: E402
from lily.kernels import quant_gemv as QG  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="?", default=None)
    ap.add_argument("--tiles", default="64x4x4,64x4x3,128x4x2,32x2x6,16x1x6")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(time.time()) % 1000)
    res = {"env": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                   "gpu": torch.cuda.get_device_name(), "git_rev": git_rev(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "what": __doc__.strip().splitlines()[0], "seed": gen.initial_seed(), "rows": {}}
    wanted = args.shapes.split(",") if args.shapes else None
    print(f"{'shape':18s} {'N':>7s} {'K':>5s} {'path':>14s} {'us':>8s} {'GB/s':>7s} {'rel_err':>9s}", flush=True)
    for name, (n, k) in shapes().items():
        if wanted and name not in wanted:
            continue
        copies = 1 if name == "lm_head" else max(2, int(160e6 // (n * k * 0.5625)))
        ws = [rand_qt((n, k), 4, dev, gen) for _ in range(copies)]
        lins = [QG.PackedLinear(w) for w in ws]
        mb = lins[0].nbytes / 1e6
        x = torch.randn(k, device=dev, generator=gen) * 2
        gain = (torch.rand(k, device=dev, generator=gen) + 0.5).to(torch.bfloat16)
        p = QG.perm64_index(k, dev)
        xp, gp = x[p].contiguous(), gain[p].contiguous()
        ref = QG.gemv_reference(ws[0], QG.rmsnorm_reference(x, gain, 1e-6))
        out = torch.empty(n, device=dev)
        entries = [("gemv", None, lambda: [QG.gemv(l, xp, out, norm_gain=gp, perm_x=True) for l in lins])]
        for t in tiles:
            entries.append((f"mma_{t[0]}x{t[1]}x{t[2]}", t,
                            lambda t=t: [GM.gemv_mma(l.w, l.s, l.b, xp, out, norm_gain=gp, perm_x=True, tile=t)
                                         for l in lins]))
        for path, t, run in entries:
            row = {"N": n, "K": k, "MB": mb}
            try:
                out.fill_(float("nan"))
                if t is None:
                    QG.gemv(lins[0], xp, out, norm_gain=gp, perm_x=True)
                else:
                    GM.gemv_mma(lins[0].w, lins[0].s, lins[0].b, xp, out, norm_gain=gp, perm_x=True, tile=t)
                torch.cuda.synchronize()
                row["rel_err"] = float((out - ref).norm() / ref.norm())
                us = timed(run, copies) * 1e6
                row.update(us=us, GBps=mb * 1e3 / us)
            except Exception as e:  # noqa: BLE001 - a tile that fails at a shape is recorded, not fatal
                row["error"] = str(e)[:300]
            res["rows"][f"{name}/{path}"] = row
            print(f"{name:18s} {n:7d} {k:5d} {path:>14s} "
                  + (f"{row['us']:8.2f} {row['GBps']:7.0f} {row['rel_err']:9.2e}" if "us" in row
                     else f"ERROR {row['error'][:100]}"), flush=True)
        del ws, lins
        torch.cuda.empty_cache()
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "gemv-mma.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
