"""The prefill's fused-dequant GEMMs alone, at full shapes, for a profiler (ncu) or a quick timing.

Runs the grouped expert GEMMs (lily/kernels/moe_grouped_gemm.py) of one layer for T tokens routed at random,
and the dense 4-bit GEMM (lily/kernels/q4_gemm.py) of the GDN input projection for the same T rows, a few
times each after a warm-up, and prints each one's time (CUDA events) with its TFLOP/s and weight GB/s.

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --tokens 256,4096
    ncu --clock-control none --kernel-name regex:_moe_gate_up --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 scripts/gpu_moe_profile.py --tokens 4096 --reps 2

--dense-ab instead A/Bs the predequantized path's bf16 GEMM (q_gemm past SMALL_M rows): the pointer
kernel against the persistent TMA kernel (q4_gemm.BF16_GEMM_TMA) at a few tiles, for the prefill's large
projections (N, K) at M = 2048, 4096, 8192 rows: ms and TFLOP/s of the whole q_gemm (its weight
dequantization, timed alone too, included) and the worst row's relative difference of each TMA result
from the pointer kernel's.

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --dense-ab

--wgmma-ab A/Bs the grouped MoE on the Triton kernels and on the warpgroup-MMA ones
(lily/kernels/moe_wgmma.py, MG.WGMMA_MOE; in natural column order and permuted, MW.PERMUTED_K_MAX_BLOCK), routed experts
and the shared expert's one-expert plan, each against the plain-torch reference, and times them.

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --wgmma-ab --tokens 256,333,4096,8192

--dense-wgmma-ab times a prompt's dense 4-bit GEMMs at --tokens rows on each path q_gemm has: the fused
Triton kernel, the predequantized bf16 GEMM, and moe_wgmma's dense mode at a few tiles.

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --dense-wgmma-ab --tokens 128,256,384,512,768,1024

--skinny-stages / --skinny-splits time the dense mode at a decode batch's rows (--tokens) by its cp.async depth /
by the parts K is split into, each launch in a CUDA graph, for the GEMMs the batched step sends there (the GDN
in-projection, attention's q|k|v, lm_head).

    PYTHONPATH=$PWD python3 scripts/gpu_moe_profile.py --skinny-splits 1,2,4,8 --tokens 1,8,16,32
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OUT", tempfile.mkdtemp())  # gpu_prefill_check opens its log at import

import torch
import triton

import lily.kernels.moe_grouped_gemm as MG
import lily.kernels.q4_gemm as QG
from lily.kernels.q4_gemm import q_gemm
from gpu_prefill_check import rand_qt  # noqa: E402  (scripts/ is on sys.path when a script runs)


# (N, K, accumulate): in_proj_qkvz and qkv_proj store bf16; out_proj and o_proj add into the fp32 residual
DENSE_SHAPES = [(12288, 2048, False), (8192, 2048, False), (2048, 4096, True)]
DENSE_ROWS = (2048, 4096, 8192)
# (BF16_TMA_TILES, BF16_TMA_EPILOGUE_SPLIT); None: the pointer kernel (BF16_GEMM_TMA off)
DENSE_VARIANTS = [None, ((128, 256, 64, 8, 3), 2), ((128, 256, 64, 8, 3), 1), ((128, 128, 64, 4, 4), 2),
                  ((256, 128, 64, 8, 3), 2), ((128, 256, 64, 8, 4), 2)]


def dense_ab(dev, reps: int) -> None:
    """The bf16 GEMM of q_gemm's predequantized path, pointer kernel vs TMA kernel (see the docstring)."""
    chosen = QG.BF16_GEMM_TMA, QG.BF16_TMA_TILES, QG.BF16_TMA_EPILOGUE_SPLIT
    for N, K, accumulate in DENSE_SHAPES:
        w = rand_qt((N, K), 4, dev, K ** -0.5)
        for M in DENSE_ROWS:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            residual = torch.randn(M, N, device=dev)
            out = residual.clone() if accumulate else torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            dq_ms = triton.testing.do_bench(lambda: QG.dequantize_bf16(w, QG._scratch(N * K, dev).view(N, K)),
                                            rep=reps)
            print(f"M={M:5d} N={N:5d} K={K:5d} {'acc fp32' if accumulate else 'bf16'}: dequantize alone "
                  f"{dq_ms:.3f} ms", flush=True)
            pointer = None
            for variant in DENSE_VARIANTS:
                QG.BF16_GEMM_TMA = variant is not None
                if variant is not None:
                    QG.BF16_TMA_TILES, QG.BF16_TMA_EPILOGUE_SPLIT = variant
                if accumulate:
                    out.copy_(residual)
                else:
                    out.fill_(float("nan"))
                try:
                    q_gemm(x, w, out=out, accumulate=accumulate)
                    result = (out - residual if accumulate else out).float()
                    ms = triton.testing.do_bench(lambda: q_gemm(x, w, out=out, accumulate=accumulate), rep=reps)
                except Exception as ex:  # a tile that does not fit (shared memory) is reported, not fatal
                    print(f"    {str(variant):28s} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                if pointer is None:
                    pointer = result
                diff = float(((result - pointer).norm(dim=1) / pointer.norm(dim=1)).max())
                print(f"    {'pointer ' + str(QG.BF16_TILES) if variant is None else 'tma ' + str(variant):34s} "
                      f"{ms:7.3f} ms {2 * M * N * K / ms / 1e9:7.1f} TFLOP/s  row diff vs pointer {diff:.1e}",
                      flush=True)
    QG.BF16_GEMM_TMA, QG.BF16_TMA_TILES, QG.BF16_TMA_EPILOGUE_SPLIT = chosen


# A prompt's dense 4-bit GEMMs: ((N, K), how many a forward, output): GDN in_proj_qkvz (bf16), in_proj_ba
# (fp32), out_proj (added into the fp32 residual) x 30 layers; attention qkv_proj, o_proj x 10
PROMPT_DENSE = [((12288, 2048), 30, "bf16"), ((64, 2048), 30, "fp32"), ((2048, 4096), 30, "acc"),
                ((9216, 2048), 10, "bf16"), ((2048, 4096), 10, "acc")]
DENSE_WGMMA_TILES = [(64, 4, 4, 128), (64, 4, 4, 64), (128, 8, 4, 128), (64, 4, 3, 256), (128, 8, 3, 256),
                     (64, 4, 6, 128), (64, 4, 4, 32)]


def dense_wgmma_ab(dev, rows: list[int]) -> None:
    """A prompt's dense 4-bit GEMMs (PROMPT_DENSE) at M rows by path: the fused Triton kernel, the
    predequantized bf16 GEMM, and lily/kernels/moe_wgmma.py's dense mode by DENSE_TILES; ms a prompt
    (do_bench each GEMM, times its count) and the worst relative error against the fp32 product."""
    import lily.kernels.moe_wgmma as MW
    saved = QG.WGMMA_DENSE, QG.PREDEQUANT_MIN_M, QG.WGMMA_DENSE_MAX_M, MW.DENSE_TILES
    ws = {shape: rand_qt(shape, 4, dev, shape[1] ** -0.5) for shape, _, _ in PROMPT_DENSE}

    def prompt_ms(M: int, xs: dict) -> tuple[float, float]:
        total, worst = 0.0, 0.0
        for (N, K), count, kind in PROMPT_DENSE:
            w, x = ws[(N, K)], xs[K]
            out = torch.randn(M, N, device=dev) if kind != "bf16" else torch.empty(M, N, device=dev,
                                                                                   dtype=torch.bfloat16)
            fn = lambda: q_gemm(x, w, out=out, accumulate=kind == "acc")   # noqa: E731
            if kind != "acc":
                fn()
                ref = x.float() @ w.dequantize().float().T
                worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
            total += count * triton.testing.do_bench(fn, warmup=10, rep=40)
        return total, worst

    paths = [("fused", False, 1 << 30, None), ("predequant", False, 1, None)]
    paths += [(f"wgmma{t}", True, 1 << 30, t) for t in DENSE_WGMMA_TILES]
    for M in rows:
        xs = {K: torch.randn(M, K, device=dev).to(torch.bfloat16) for K in (2048, 4096)}
        line = []
        for name, on, predequant, tiles in paths:
            QG.WGMMA_DENSE, QG.PREDEQUANT_MIN_M, QG.WGMMA_DENSE_MAX_M = on, predequant, 1 << 30
            if tiles is not None:
                MW.DENSE_TILES = tiles
            ms, err = prompt_ms(M, xs)
            line.append(f"{name}={ms:.3f} ms ({err:.0e})")
        print(f"M={M:5d}  " + "  ".join(line), flush=True)
    QG.WGMMA_DENSE, QG.PREDEQUANT_MIN_M, QG.WGMMA_DENSE_MAX_M, MW.DENSE_TILES = saved


# the decode batch's dense 4-bit GEMMs that take moe_wgmma's dense mode at few rows: (name, N, K)
SKINNY_DENSE = [("gdn in-projection", 12352, 2048), ("attention q|k|v", 9216, 2048), ("lm_head", 248320, 2048),
                ("gdn out-projection", 2048, 4096)]


def skinny_sweep(dev, rows: list[int], knob: str, values: list[int]) -> None:
    """moe_wgmma's dense mode at few rows (a decode batch) by one knob: "stages", its cp.async depth (STAGES - 2
    steps of 64 codes in flight a program), or "split", the parts of K (`dense`'s split, summed in order by each
    tile's last part); us a launch in a CUDA graph, and the worst relative error against the fp32 product
    (outputs poisoned first)."""
    import lily.kernels.moe_wgmma as MW
    from gpu_batch_check import graphed_us
    counts = QG._arrival_counts(dev)
    for name, N, K in SKINNY_DENSE:
        w = rand_qt((N, K), 4, dev, K ** -0.5)
        wd = w.dequantize().float()
        for M in rows:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            ref = x.float() @ wd.T
            out = torch.empty(M, N, device=dev)
            line = []
            for v in values:
                kw = {"stages": v} if knob == "stages" else {"split": v, "counts": counts}
                out.fill_(float("nan"))
                MW.dense(x, w, out, accumulate=False, **kw)
                err = ((out - ref).norm() / ref.norm()).item()
                us = graphed_us(lambda: MW.dense(x, w, out, accumulate=False, **kw), replays=7)
                line.append(f"{v}: {us:7.2f} us ({err:.0e})")
            # the Triton split-K path (q_gemm's where the dense mode is not taken), as the baseline
            fused = lambda: QG._fused(x, w, out, False, QG.split_k(M, N, K, dev))   # noqa: E731
            line.append(f"split-K: {graphed_us(fused, replays=7):7.2f} us")
            print(f"{name:18s} M={M:3d} {knob} " + "  ".join(line) + f"  (dense_splits: {MW.dense_splits(M, N, K, 132)})",
                  flush=True)
        del wd


def random_experts(dev, E: int, H: int = 2048, I: int = 512):
    """A layer's random 4-bit experts (gate, up [E, I, H], down [E, H, I]) and their bytes."""
    gate, up = (rand_qt((E, I, H), 4, dev, H ** -0.5) for _ in range(2))
    down = rand_qt((E, H, I), 4, dev, I ** -0.5)
    return gate, up, down, sum(t.weight.nbytes + t.scales.nbytes + t.biases.nbytes for t in (gate, up, down))


def random_routing(dev, T: int, E: int, k: int = 8, H: int = 2048):
    """T random bf16 rows and their routing: (x, topk weights [T, k] renormalised, topk ids [T, k])."""
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    top, idx = torch.randn(T, E, device=dev).softmax(-1).topk(k)
    return x, top / top.sum(-1, keepdim=True), idx


def row_errors(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's distance from want over the median norm of the reference's rows."""
    return (got - want).norm(dim=1) / ref.norm(dim=1).median()


def wgmma_ab(dev, tokens: list[int], reps: int) -> None:
    """The grouped MoE on the Triton kernels and on the warpgroup-MMA ones (MG.WGMMA_MOE), each against
    the plain-torch reference (worst row's relative error over the median row's scale) and timed; then the
    shared expert's one-expert plan (fp32 atomics into the output) the same way. The warpgroup-MMA kernels
    twice: in the natural column order and permuted (moe_wgmma.PERMUTED_K_MAX_BLOCK, "wgmma-pk")."""
    import lily.kernels.moe_wgmma as MW
    saved = MG.WGMMA_MOE, MW.PERMUTED_K_MAX_BLOCK
    E, H = 256, 2048
    gate, up, down, nbytes = random_experts(dev, E)
    for T in tokens:
        x, top, idx = random_routing(dev, T, E)
        cases = [("routed", MG.moe_plan(idx, E), idx, top, (gate, up, down)),
                 ("shared", MG.identity_plan(T, dev), torch.zeros(T, 1, dtype=torch.long, device=dev),
                  torch.rand(T, 1, device=dev) + 0.5,
                  tuple(MG.QuantTensor(t.weight[:1], t.scales[:1], t.biases[:1], 4) for t in (gate, up, down)))]
        for name, plan, ids, wts, (g, u, d) in cases:
            tw = wts.reshape(-1).float().contiguous()
            ref = MG.moe_grouped_reference(x, ids, wts, g, u, d).float()
            got = {}
            for label, on, permuted in (("triton", False, False), ("wgmma", True, False), ("wgmma-pk", True, True)):
                MG.WGMMA_MOE, MW.PERMUTED_K_MAX_BLOCK = on, 128 if permuted else 0
                base = torch.randn(T, H, device=dev)
                out = base.clone()
                MG.moe_grouped(x, plan, tw, g, u, d, out)
                got[label] = out - base
                row_err = row_errors(got[label], ref, ref)
                scratch = torch.zeros(T, H, device=dev)
                ms = triton.testing.do_bench(lambda: MG.moe_grouped(x, plan, tw, g, u, d, scratch), warmup=3, rep=reps)
                print(f"T={T:6d} {name} {label:8s} {ms:8.3f} ms "
                      f"{(nbytes if name == 'routed' else nbytes / E) / ms / 1e6:7.1f} GB/s  "
                      f"worst row err {row_err.max().item():.2e} (median {row_err.median().item():.2e})  "
                      f"blocks {[bg[0] for bg in plan.block_groups()]}", flush=True)
            for label in ("wgmma", "wgmma-pk"):
                diff = row_errors(got[label], got["triton"], ref).max().item()
                print(f"T={T:6d} {name} {label} vs triton worst row {diff:.2e}", flush=True)
    MG.WGMMA_MOE, MW.PERMUTED_K_MAX_BLOCK = saved


def wgmma_sweep(dev, tokens: list[int], reps: int) -> None:
    """Each block size's (BW, warps, STAGES) candidates of lily/kernels/moe_wgmma.py, one block list at a
    time on those kernels (the others on Triton): worst row error against the reference, and time."""
    import lily.kernels.moe_wgmma as MW
    E, H = 256, 2048
    gate, up, down, _ = random_experts(dev, E)
    chosen = dict(MW.GATE_UP_TILES), dict(MW.DOWN_TILES)
    cands = {128: [(64, 4, 4), (128, 8, 4), (256, 8, 3), (256, 8, 4)],
             64: [(64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 4)],
             32: [(64, 4, 4), (64, 4, 6), (128, 8, 4)],
             16: [(64, 4, 4), (64, 4, 3), (64, 4, 6), (128, 8, 4)]}
    for T in tokens:
        x, top, idx = random_routing(dev, T, E)
        tw = top.reshape(-1).contiguous()
        plan = MG.moe_plan(idx, E)
        ref = MG.moe_grouped_reference(x, idx, top, gate, up, down).float()
        for kind in ("gate_up", "down"):
            for bm in [g[0] for g in plan.block_groups()]:
                for cfg in [None] + cands[bm]:
                    MW.GATE_UP_TILES = {bm: cfg} if cfg is not None and kind == "gate_up" else {}
                    MW.DOWN_TILES = {bm: cfg} if cfg is not None and kind == "down" else {}
                    out = torch.zeros(T, H, device=dev)   # (moe_grouped adds into it)
                    MG.moe_grouped(x, plan, tw, gate, up, down, out)
                    err = row_errors(out, ref, ref).max().item()
                    scratch = torch.zeros(T, H, device=dev)
                    ms = triton.testing.do_bench(lambda: MG.moe_grouped(x, plan, tw, gate, up, down, scratch),
                                                 warmup=3, rep=reps)
                    print(f"T={T:6d} {kind:7s} block {bm:3d} {str(cfg):14s} {ms:8.3f} ms  worst row err {err:.2e}",
                          flush=True)
    MW.GATE_UP_TILES, MW.DOWN_TILES = chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slot-dtypes", default="bfloat16",
                    help="comma list of MG.SLOT_DTYPE values to time (float32: the earlier per-slot rows)")
    ap.add_argument("--dense-ab", action="store_true", help="A/B the dense bf16 GEMM (pointer vs TMA) instead")
    ap.add_argument("--wgmma-ab", action="store_true",
                    help="A/B the grouped MoE on the Triton and the warpgroup-MMA kernels instead")
    ap.add_argument("--dense-wgmma-ab", action="store_true",
                    help="time a prompt's dense 4-bit GEMMs (--tokens rows) fused, predequantized and on the "
                         "Hopper dense mode by tile instead")
    ap.add_argument("--wgmma-sweep", action="store_true",
                    help="time the warpgroup-MMA kernels' tile candidates a block size at a time instead")
    ap.add_argument("--skinny-stages", default="",
                    help="comma list of cp.async depths: time moe_wgmma's dense mode at --tokens rows (a decode "
                         "batch) with each instead")
    ap.add_argument("--skinny-splits", default="",
                    help="comma list of parts of K: time moe_wgmma's dense mode at --tokens rows with each instead")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.dense_ab:
        dense_ab(dev, args.reps)
        return
    if args.dense_wgmma_ab:
        dense_wgmma_ab(dev, [int(t) for t in args.tokens.split(",")])
        return
    if args.wgmma_sweep:
        wgmma_sweep(dev, [int(t) for t in args.tokens.split(",")], args.reps)
        return
    for knob, values in (("stages", args.skinny_stages), ("split", args.skinny_splits)):
        if values:
            skinny_sweep(dev, [int(t) for t in args.tokens.split(",")], knob, [int(v) for v in values.split(",")])
    if args.skinny_stages or args.skinny_splits:
        return
    if args.wgmma_ab:
        wgmma_ab(dev, [int(t) for t in args.tokens.split(",")], args.reps)
        return
    E, k, H, I = args.experts, 8, 2048, 512
    gate, up, down, expert_bytes = random_experts(dev, E, H, I)
    dense = rand_qt((12288, H), 4, dev, H ** -0.5)
    for T in (int(t) for t in args.tokens.split(",")):
        x, top, idx = random_routing(dev, T, E, k, H)
        tw = top.reshape(-1).contiguous()
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
            for _ in range(3 if args.reps > 2 else 3 + args.reps):  # a few runs (for ncu) or a warm-up
                fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=0, rep=args.reps) if args.reps > 2 else float("nan")
            print(f"T={T:6d} {name:13s} {slot:8s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s  {nbytes / ms / 1e6:7.1f} GB/s "
                  f"(blocks {[g[0] for g in plan.block_groups()]})", flush=True)


if __name__ == "__main__":
    main()
