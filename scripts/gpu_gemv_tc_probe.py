"""How fast can the decode step's 4-bit projections stream on tensor cores? A probe, not a kernel check.

Times, at the decode step's real shapes and over rotating weight copies (so L2 cannot hold them):
- `gemv` (lily.kernels.quant_gemv, CUDA cores: today's batch-1 path) at 1 row;
- `q_gemm` (lily.kernels.q4_gemm: today's batched-step path) at R rows;
- the Hopper wgmma kernel of lily.kernels.moe_wgmma in its dense mode (weights dequantized in registers as
  the A operand, cp.async-fed) at R rows (one 16-row token block for up to 16), by cp.async depth.
The wgmma kernel dequantizes to bf16 (scale and bias folded in: prefill's precision), so this measures its
streaming speed only; a decode kernel on this structure would keep the codes exact and scale per group in fp32.
Writes JSON to $OUT/gemv-tc-probe.json and prints a table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch
import triton

from gpu_decode_check import git_rev, rand_qt, time_replays  # noqa: E402
from lily.config import FULL
from lily.kernels import moe_wgmma as MW
from lily.kernels import quant_gemv as QG
from lily.kernels.q4_gemm import q_gemm


def shapes() -> dict[str, tuple[int, int]]:
    c = FULL
    return {"gdn_in": (c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads, c.hidden_size),
            "attn_qkv": (c.attn_q_dim + 2 * c.attn_kv_dim, c.hidden_size),
            "gdn_out": (c.hidden_size, c.linear_value_dim),
            "experts_gate_up_9": (9 * 2 * c.moe_intermediate_size, c.hidden_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def timed(run, copies: int) -> float:
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    return min(time_replays(g.replay, 10)) / copies


STAGES = (4, 6, 8)


def gdn_decode_sweep(dev, gen, res) -> None:
    """gdn_decode alone over 8 rotating layer states: value columns a program (BV) x warps."""
    from lily.kernels import gdn_decode as GD
    from lily.kernels.host_math import next_power_of_2
    c = FULL
    hv, hk, dk, dv = c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    n_proj = 2 * hk * dk + 2 * hv * dv + 2 * hv
    copies = 8
    states = [torch.randn(hv, dk, dv, device=dev, generator=gen) * 0.05 for _ in range(copies)]
    projs = [torch.randn(n_proj, device=dev, generator=gen) for _ in range(copies)]
    a_log, dt_bias = torch.rand(hv, device=dev), torch.rand(hv, device=dev)
    norm = torch.rand(dv, device=dev) + 0.5
    out = torch.empty(hv * dv, device=dev)
    for bv in (32, 16, 8):
        for warps in (4, 2, 1):
            o = torch.empty(hv * dv, device=dev)
            ss = torch.empty(hv, dv // bv, device=dev)
            count = torch.zeros(hv, dtype=torch.int32, device=dev)
            def run(bv=bv, warps=warps, o=o, ss=ss, count=count):
                for st, pr in zip(states, projs):
                    GD.gdn_decode_kernel[(hv, dv // bv)](pr, st, a_log, dt_bias, norm, o, ss, count, out, dk ** -0.5,
                                                         1e-6, HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
                                                         NBP=next_power_of_2(dv // bv), L2_EPS=GD.L2_EPS, GDC=False,
                                                         num_warps=warps)
            t = timed(run, copies)
            res["rows"][f"gdn_decode/bv{bv}/w{warps}"] = {"us": t * 1e6, "programs": hv * dv // bv}
            print(f"gdn_decode BV {bv:2d} warps {warps}: {t * 1e6:6.2f} us ({hv * dv // bv} programs)", flush=True)


def main() -> int:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16").split(",")]
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    res = {"env": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                   "gpu": torch.cuda.get_device_name(), "git_rev": git_rev(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "what": __doc__.strip().splitlines()[0], "rows": {}}
    print(f"{'shape':18s} {'N':>7s} {'K':>5s} {'MB':>6s} {'path':>12s} {'R':>3s} {'us':>8s} {'GB/s':>7s}", flush=True)
    for name, (n, k) in shapes().items():
        if wanted and name not in wanted:
            continue
        copies = 1 if name == "lm_head" else max(2, int(160e6 // (n * k * 0.5625)))
        ws = [rand_qt((n, k), 4, dev, gen) for _ in range(copies)]
        lins = [QG.PackedLinear(w) for w in ws]
        mb = lins[0].nbytes / 1e6
        out = torch.empty(max(rows_list), n, device=dev)
        xs = torch.randn(max(rows_list), k, device=dev)
        gain = torch.rand(k, device=dev) + 0.5
        entries = []
        entries.append(("gemv", 1, lambda: [QG.gemv(l, xs[0], out[0], norm_gain=gain, perm_x=True) for l in lins]))
        for r in rows_list:
            xb = xs[:r].to(torch.bfloat16).contiguous()
            entries.append(("q_gemm", r, lambda xb=xb, r=r: [q_gemm(xb, w, out[:r]) for w in ws]))
            if n % MW.DENSE_TILES[0] == 0 and k % 64 == 0:
                for st in STAGES:
                    entries.append((f"wgmma_dense_s{st}", r,
                                    lambda xb=xb, r=r, st=st: [MW.dense(xb, w, out[:r], False, stages=st)
                                                               for w in ws]))
        for path, r, run in entries:
            try:
                t = timed(run, copies)
                row = {"N": n, "K": k, "MB": mb, "rows": r, "us": t * 1e6, "GBps": mb * 1e6 / t / 1e9}
            except Exception as e:  # noqa: BLE001 - a path that fails at a shape is recorded, not fatal
                row = {"N": n, "K": k, "rows": r, "error": str(e)[:300]}
            res["rows"][f"{name}/{path}/{r}"] = row
            print(f"{name:18s} {n:7d} {k:5d} {mb:6.1f} {path:>12s} {r:3d} "
                  + (f"{row['us']:8.1f} {row['GBps']:7.0f}" if "us" in row else f"ERROR {row['error'][:80]}"),
                  flush=True)
        del ws, lins
        torch.cuda.empty_cache()
    gdn_decode_sweep(dev, gen, res)
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "gemv-tc-probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
