"""The prefill's fused-dequant GEMMs alone, at full shapes, for a profiler (ncu) or a quick timing.

Runs the grouped expert GEMMs (lily/kernels/moe_grouped_gemm.py) of one layer for T tokens routed at random,
and the dense 4-bit GEMM (lily/kernels/q4_gemm.py) of the GDN input projection for the same T rows, a few
times each after a warm-up, and prints each one's time (CUDA events) with its TFLOP/s and weight GB/s.

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --tokens 256,4096
    ncu --clock-control none --kernel-name regex:_moe_gate_up --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 scripts/gpu_moe_profile.py --tokens 4096 --reps 2
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OUT", tempfile.mkdtemp())  # gpu_prefill_check opens its log at import

import torch
import triton

import lily.kernels.moe_grouped_gemm as MG
from lily.kernels.q4_gemm import q_gemm
from gpu_prefill_check import rand_qt  # noqa: E402  (scripts/ is on sys.path when a script runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slot-dtypes", default="bfloat16",
                    help="comma list of MG.SLOT_DTYPE values to time (float32: the earlier per-slot rows)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    E, k, H, I = args.experts, 8, 2048, 512
    gate, up = (rand_qt((E, I, H), 4, dev, H ** -0.5) for _ in range(2))
    down = rand_qt((E, H, I), 4, dev, I ** -0.5)
    dense = rand_qt((12288, H), 4, dev, H ** -0.5)
    expert_bytes = sum(t.weight.nbytes + t.scales.nbytes + t.biases.nbytes for t in (gate, up, down))
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        top, idx = torch.randn(T, E, device=dev).softmax(-1).topk(k)
        tw = (top / top.sum(-1, keepdim=True)).reshape(-1).contiguous()
        out = torch.zeros(T, H, device=dev)
        plan = MG.moe_plan(idx, E)
        runs = {
            "moe": (lambda: MG.moe_grouped(x, plan, tw, gate, up, down, out), 2 * T * k * 3 * I * H, expert_bytes),
            "dense_q_gemm": (lambda: q_gemm(x, dense), 2 * T * dense.shape[0] * H,
                             dense.weight.nbytes + dense.scales.nbytes + dense.biases.nbytes),
        }
        for name, (fn, flop, nbytes), slot in [(n, r, d) for n, r in runs.items()
                                               for d in (args.slot_dtypes.split(",") if n == "moe" else ["-"])]:
            if slot != "-":
                MG.SLOT_DTYPE = getattr(torch, slot)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=0, rep=args.reps) if args.reps > 2 else float("nan")
            if args.reps <= 2:
                for _ in range(args.reps):
                    fn()
                torch.cuda.synchronize()
            print(f"T={T:6d} {name:13s} {slot:8s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s  {nbytes / ms / 1e6:7.1f} GB/s "
                  f"(blocks {[g[0] for g in plan.block_groups()]})", flush=True)


if __name__ == "__main__":
    main()
