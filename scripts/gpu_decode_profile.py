"""One decode step of the full-size random model, eagerly, for Nsight Compute (ncu) to read kernel by kernel.

    ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \\
        --metrics smsp__inst_executed.sum,dram__bytes_read.sum \\
        python3 scripts/gpu_decode_profile.py --context 4096 > ncu.csv
    python3 scripts/gpu_decode_profile.py --table ncu.csv [--json summary.json]

(all 263 kernels of the step: about 2 minutes on an H200; `--launch-count N` keeps the first N).

The step runs once to compile and warm, then once more between cudaProfilerStart / Stop: ncu serialises the
launches and flushes the caches before each, so each kernel is read alone and cold, as the step reads its
weights. `--table` turns ncu's CSV into one line a kernel name (time, DRAM and SM throughput, occupancy, the
warp stall reasons that cost most).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict

# per kernel: (column title, ncu raw metric), in the order printed
COLUMNS = [("us", "gpu__time_duration.sum"), ("dram%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
           ("sm%", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
           ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active"), ("regs", "launch__registers_per_thread"),
           ("grid", "launch__grid_size"), ("block", "launch__block_size"),
           ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
           ("Minst", "smsp__inst_executed.sum")]
# warp instructions the H200 can issue a microsecond: 132 SMs x 4 schedulers x 1.98 GHz (the boost clock ncu
# ran at with --clock-control none)
ISSUE_PER_US = 132 * 4 * 1980.0
STALL = re.compile(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")


def step(context: int) -> None:
    import torch

    from gpu_decode_check import fill_state  # (scripts/ is on sys.path when a script runs)
    from lily.config import FULL
    from lily.model.fast import FastModel
    from lily.synthetic import random_weights

    dev = torch.device("cuda")
    fast = FastModel(FULL, random_weights(FULL, seed=1, device=dev), device=dev, use_graph=False)
    st = fast.new_state(max_seq=context + 16)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    fill_state(st, context, gen)
    fast.next_tok.fill_(123)
    fast._launch_step(st)                    # compiles every kernel
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fast._launch_step(st)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def table(path: str, json_path: str | None = None) -> None:
    """ncu's --page raw CSV: a header of metric names, a row of units, then one row a kernel; printed per
    kernel name and grid (mean over its launches), in order of total time; with json_path also written there
    (per group: launches, total us, DRAM GB/s, the issue floor: warp instructions over the SMs' schedulers)."""
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
    summary = {"kernels": sum(len(g) for g in groups.values()), "kernel_us": total / 1e3, "groups": []}
    scale = {"gpu__time_duration.sum": 1e-3, "smsp__inst_executed.sum": 1e-6}   # ns -> us, -> millions
    for key in order:
        g = groups[key]

        def mean(metric):
            xs = [v[metric] for v in g if metric in v]
            return sum(xs) / len(xs) if xs else float("nan")
        stalls = sorted(((mean(name), short) for short, name in stall_cols), reverse=True)[:4]
        print(f"{key[0]:30s} {len(g):4d} " + " ".join(f"{mean(m) * scale.get(m, 1):8.1f}" for _, m in COLUMNS)
              + "  " + ", ".join(f"{n} {v:.1f}" for v, n in stalls))
        us = sum(v.get("gpu__time_duration.sum", 0) for v in g) / 1e3
        summary["groups"].append({
            "kernel": key[0], "grid": key[1], "launches": len(g), "us": us,
            "dram_GBps": sum(v.get("dram__bytes_read.sum", 0) for v in g) / us / 1e3 if us else 0.0,
            **{t: mean(m) * scale.get(m, 1) for t, m in COLUMNS if t not in ("grid", "us")},
            "issue_floor_us": sum(v.get("smsp__inst_executed.sum", 0) for v in g) / ISSUE_PER_US,
            "top_stalls": {n: v for v, n in stalls}})
    summary["issue_floor_us"] = sum(x["issue_floor_us"] for x in summary["groups"])
    print(f"issue floor of the whole: {summary['issue_floor_us']:.0f} us (warp instructions / "
          f"{ISSUE_PER_US:.0f} a microsecond)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--table", metavar="CSV", help="print ncu's CSV (--page raw) as a table and exit")
    ap.add_argument("--json", metavar="PATH", help="with --table: the table as JSON too")
    args = ap.parse_args()
    if args.table:
        table(args.table, args.json)
    else:
        step(args.context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
