"""Where a decode GEMV's time goes, launch by launch: the same 4-bit GEMV (lily.kernels.quant_gemv) with its input
prologue as the decode step uses it (RMSNorm; the GDN output's gated norm) and without one (x as stored), its
codes dotted in fp16 pairs or in fp32, its weights hot in L2 (one copy) or not (8 copies in turn), against a
launch that does nothing. Each row: 40 launches one after another in a CUDA graph, the median of 9 replays'
time a launch. Differences between rows price the prologue, the weight stream and the launch itself.

    python3 scripts/gpu_gemv_prologue.py            (an NVIDIA GPU; writes $OUT/gemv-prologue.json)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from lily.config import FULL
from lily.kernels import quant_gemv as QG
from lily.quant import quantize

LAUNCHES = 40
REPLAYS = 9


@triton.jit
def nothing_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def time_graph(launch) -> float:
    """Seconds a launch: LAUNCHES launches in one CUDA graph, the median of REPLAYS replays."""
    launch(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAUNCHES):
            launch(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / LAUNCHES)
    return statistics.median(times)


def main() -> int:
    dev = torch.device("cuda")
    c = FULL
    gen = torch.Generator(device=dev).manual_seed(0)
    H = c.hidden_size
    shapes = {"gdn_in": (c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads, H),
              "out_proj": (H, c.linear_value_dim)}
    results: dict = {"env": {"torch": torch.__version__, "triton": triton.__version__,
                             "gpu": torch.cuda.get_device_name(), "git_rev": os.environ.get("LILY_GIT_REVISION", "?"),
                             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                     "launches_a_graph": LAUNCHES, "rows": {}}
    flag = torch.empty(1024, device=dev)
    results["rows"]["nothing (1 program)"] = time_graph(lambda i: nothing_kernel[(1,)](flag)) * 1e6
    results["rows"]["nothing (528 programs)"] = time_graph(lambda i: nothing_kernel[(528,)](flag)) * 1e6
    keep = QG.HALF_DOT
    try:
        for name, (n, k) in shapes.items():
            lins = [QG.PackedLinear(quantize((torch.randn(n, k, generator=gen, device=dev) * k ** -0.5)
                                             .to(torch.bfloat16), bits=4)) for _ in range(8)]
            x, z = torch.randn(k, generator=gen, device=dev), torch.randn(k, generator=gen, device=dev)
            gain = torch.rand(k, generator=gen, device=dev) + 0.5
            hd = c.linear_value_head_dim
            ss = (x.reshape(-1, 1, hd) ** 2).sum(-1)
            ng = torch.rand(hd, generator=gen, device=dev) + 0.5
            out, res = torch.empty(n, device=dev), torch.randn(n, device=dev)
            out2 = torch.empty(n, device=dev)
            modes = {"x as stored": {},
                     "RMSNorm prologue": {"norm_gain": gain}}
            if k == c.linear_value_dim:
                modes["gated norm prologue"] = {"gated_norm": (z, ss, ng, hd)}
                modes["gated norm prologue, residual + h_p epilogue"] = {"gated_norm": (z, ss, ng, hd),
                                                                         "residual": res, "out2": out2}
            for half in (True, False):
                QG.HALF_DOT = half
                for mode, kw in modes.items():
                    o = res if "residual" in kw else out
                    for copies in (1, 8):
                        def launch(i, kw=kw, o=o, copies=copies):
                            QG.gemv(lins[i % copies], x, o, perm_x=True, eps=1e-6, **kw)
                        us = time_graph(launch) * 1e6
                        label = f"{name} [{n}x{k}] {mode}, {'fp16-pair' if half else 'fp32'} dot, " \
                                f"{'weights in L2' if copies == 1 else '8 weight copies'}"
                        results["rows"][label] = us
                        print(f"  {label:110s} {us:7.2f} us  {lins[0].nbytes / us / 1e3:6.0f} GB/s", flush=True)
            del lins
    finally:
        QG.HALF_DOT = keep
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gemv-prologue.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n== us a launch ==")
    for label, us in results["rows"].items():
        print(f"{us:7.2f}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
