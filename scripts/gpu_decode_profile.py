"""One decode step of the full-size random model, eagerly, for Nsight Compute (ncu) to read kernel by kernel.

    ncu --profile-from-start off --clock-control none --launch-count 30 --csv --page raw \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        python3 scripts/gpu_decode_profile.py --context 4096 > ncu.csv
    python3 scripts/gpu_decode_profile.py --table ncu.csv

The step runs once to compile and warm, then once more between cudaProfilerStart / Stop: ncu serialises the
launches and flushes the caches before each, so each kernel is read alone and cold, as the step reads its
weights. `--table` turns ncu's CSV into one line a kernel name (time, DRAM and SM throughput, occupancy, the
warp stall reasons that cost most).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

# per kernel: (column title, ncu raw metric), in the order printed
COLUMNS = [("us", "gpu__time_duration.sum"), ("dram%", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
           ("sm%", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
           ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active"), ("regs", "launch__registers_per_thread"),
           ("grid", "launch__grid_size"), ("block", "launch__block_size"),
           ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
           ("Minst", "smsp__inst_executed.sum")]
STALL = re.compile(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")


def step(context: int) -> None:
    import torch

    from lily.config import FULL
    from lily.model.fast import FastModel
    from lily.synthetic import random_weights

    dev = torch.device("cuda")
    fast = FastModel(FULL, random_weights(FULL, seed=1, device=dev), device=dev, use_graph=False)
    st = fast.new_state(max_seq=context + 16)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for t in (st.k_cache, st.v_cache, st.conv_state):
        t.normal_(generator=gen)
    st.rec_state.normal_(generator=gen).mul_(0.05)
    st.pos = context
    st.pos_dev.fill_(context)
    fast.next_tok.fill_(123)
    fast._launch_step(st)                    # compiles every kernel
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fast._launch_step(st)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def table(path: str) -> None:
    """ncu's --page raw CSV: a header of metric names, a row of units, then one row a kernel; printed per
    kernel name and grid (mean over its launches), in order of total time."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = {name: i for i, name in enumerate(rows[head])}
    groups: dict = defaultdict(list)
    for r in rows[head + 2:]:
        if not r[0].strip().isdigit():
            continue
        vals = {}
        for name, i in cols.items():
            try:
                vals[name] = float(r[i].replace(",", ""))
            except (ValueError, IndexError):
                pass
        key = (r[cols["Kernel Name"]].split("(")[0][:30], vals.get("launch__grid_size", 0))
        groups[key].append(vals)
    stall_cols = [(m.group(1), name) for name in cols if (m := STALL.match(name))]
    total = sum(v.get("gpu__time_duration.sum", 0) for g in groups.values() for v in g)
    print(f"{len(stall_cols)} stall metrics; kernel time in all {total / 1e3:.1f} us")
    print(f"{'kernel':30s} {'n':>4s} " + " ".join(f"{t:>8s}" for t, _ in COLUMNS) + "  top stalls (cycles an issue)")
    order = sorted(groups, key=lambda k: -sum(v.get("gpu__time_duration.sum", 0) for v in groups[k]))
    for key in order:
        g = groups[key]
        def mean(metric):
            xs = [v[metric] for v in g if metric in v]
            return sum(xs) / len(xs) if xs else float("nan")
        scale = {"gpu__time_duration.sum": 1e-3, "smsp__inst_executed.sum": 1e-6}
        stalls = sorted(((mean(name), short) for short, name in stall_cols), reverse=True)[:4]
        print(f"{key[0]:30s} {len(g):4d} " + " ".join(f"{mean(m) * scale.get(m, 1):8.1f}" for _, m in COLUMNS)
              + "  " + ", ".join(f"{n} {v:.1f}" for v, n in stalls))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--table", metavar="CSV", help="print ncu's CSV (--page details) as a table and exit")
    args = ap.parse_args()
    if args.table:
        table(args.table)
    else:
        step(args.context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
