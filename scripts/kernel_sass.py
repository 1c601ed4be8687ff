#!/usr/bin/env python3
"""A decode kernel compiled for sm_90 on any machine, no GPU needed: its registers, spilled bytes and shared
memory, and from its SASS (cuobjdump, which Triton ships) the instructions a thread before and inside its main
loop and its bar.sync. The decode GEMVs' time follows their instructions a thread (a variant with 1.40x the
instructions took 1.43x the time, benchmarks/results/decode-h200-20261203-gemv-gluon.json), so this is the first
look at a change to them, before the GPU.

    python3 scripts/kernel_sass.py                          # every launch below
    python3 scripts/kernel_sass.py gdn_in out_proj          # some of them
    python3 scripts/kernel_sass.py gdn_in SUMS_FROM_CODES=False EVEN_N=False     # constexprs overridden
    python3 scripts/kernel_sass.py gate_up --keep DIR       # also DIR/<launch>.{ttgir,ptx,sass}
    python3 scripts/kernel_sass.py rows_gdn_in M=4          # the batched step's GEMV over 4 rows

Launches: the full model's decode GEMVs as lily.model.fast launches them (gdn_in, attn_qkv, out_proj, lm_head:
quant_gemv.q_gemv_kernel with quant_gemv.pick_block's block, the pair dot, x in PERM64 order, programmatic
where LILY_PDL's default makes them so), the MoE's gate_up and down (moe_decode), and the batched step's GEMVs
over its rows (rows_*: quant_gemv_rows at quant_gemv_rows.BLOCKS' block, MAX_ROWS rows or M=...). Built for 8 rows
(2026-12-07, MAX_ROWS 8 and an 8-output pair PTX) that kernel spilled, 776 bytes a thread at rows_gdn_in's
32-row blocks and 608 at 8-row ones, every row's x held in registers: the 8-row bucket stays on the GEMMs. Pointers are taken as
16-byte aligned, as the launcher's specialisation sees the model's tensors. The numbers are this Triton's:
the GPU machine's may differ.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lily.config import FULL  # noqa: E402
from lily.kernels import moe_decode as MD  # noqa: E402
from lily.kernels import quant_gemv as QG  # noqa: E402
from lily.kernels import quant_gemv_rows as QR  # noqa: E402
from lily.kernels.half_dot import pair_rows_constraints, pair_rows_ptx  # noqa: E402

GEMV_PTRS = {"out_ptr": "*fp32", "res_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
             "x_ptr": "*fp32", "gain_ptr": "*bf16", "z_ptr": "*fp32", "ss_ptr": "*fp32", "conv_w_ptr": "*fp32",
             "conv_state_ptr": "*bf16", "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "tmask_ptr": "*i32",
             "out2_ptr": "*fp32", "N": "i32", "eps": "fp32"}
MOE_PTRS = {"act_ptr": "*fp32", "route_e_ptr": "*i32", "route_w_ptr": "*fp32", "logits_ptr": "*fp32",
            "hp_ptr": "*fp32", "h_ptr": "*fp32", "gain_p_ptr": "*bf16", "eps": "fp32", "gw": "*i32", "gs": "*bf16",
            "gb": "*bf16", "uw": "*i32", "us": "*bf16", "ub": "*bf16", "dw": "*i32", "ds": "*bf16", "db": "*bf16",
            "n_valid_ptr": "*i32"}


def gemv_launch(n: int, k: int, **over) -> tuple:
    bn, _, warps = QG.pick_block(n, k, 4)
    cfg = dict(K=k, BITS=4, BN=bn, X_MODE=0, HEAD_DIM=1, NB=1, PERM_X=True, OUT2_LO=0, OUT2_HI=0, ADD_RES=False,
               CONV_ROWS=0, CONV_K=2, CONV_KP=2, ARGMAX=False, TOKEN_MASK=False, GDC=True, HALF_DOT=True, ASM=True,
               SUMS_FROM_CODES=True, EVEN_N=n % bn == 0)
    cfg.update(over)
    return QG.q_gemv_kernel, GEMV_PTRS, cfg, warps, QG.HALF_DOT_REGS.get("maxnreg", 128)


ROWS_PTRS = {**GEMV_PTRS, "x_ptr": "*bf16", "x_stride": "i32", "out_stride": "i32"}


def gemv_rows_launch(n: int, k: int, rows: int, bits: int = 4, **over) -> tuple:
    """quant_gemv_rows' kernel over `rows` input rows, its block from quant_gemv_rows.BLOCKS."""
    bn, _, warps = QR.BLOCKS[(rows, QR.family(n, k, bits))]
    half = bits == 4
    cfg = dict(M=rows, K=k, BITS=bits, BN=bn, X_MODE=0, ACCUMULATE=False, HALF_DOT=half, ASM=half,
               ROWS_PTX=pair_rows_ptx(rows) if half else "", ROWS_CONSTRAINTS=pair_rows_constraints(rows) if half else "",
               SUMS_FROM_CODES=half, GDC=True)
    cfg.update(over)
    return QR.q_gemv_rows_kernel, ROWS_PTRS, cfg, warps, None


def launches(rows: int = QR.MAX_ROWS) -> dict:
    """Every launch by name; `rows`: the GEMVs over rows' input rows."""
    c = FULL
    gdn_rows = c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads
    qkv_rows = c.num_attention_heads * 2 * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
    moe = dict(E=c.num_experts, E_P2=triton.next_power_of_2(c.num_experts), TOPK=c.num_experts_per_tok,
               NORM_TOPK=c.norm_topk_prob, H=c.hidden_size, I=c.moe_intermediate_size, BITS=4, GDC=True, ROWS=False,
               HALF_DOT=True, ASM=True, KEY32=True, PAIRS=True)
    return {
        "gdn_in": gemv_launch(gdn_rows, c.hidden_size, X_MODE=1, CONV_ROWS=c.linear_conv_dim,
                              CONV_K=c.linear_conv_kernel_dim, CONV_KP=triton.next_power_of_2(c.linear_conv_kernel_dim),
                              GDC=False),
        "attn_qkv": gemv_launch(qkv_rows, c.hidden_size, X_MODE=1, GDC=False),
        "out_proj": gemv_launch(c.hidden_size, c.linear_value_dim, ADD_RES=True, OUT2_HI=c.hidden_size),
        "lm_head": gemv_launch(c.vocab_size, c.hidden_size, X_MODE=1, ARGMAX=True, TOKEN_MASK=True, GDC=False),
        # the batched step's GEMVs over its rows (quant_gemv_rows), MAX_ROWS rows unless M=... is given
        "rows_gdn_in": gemv_rows_launch(gdn_rows, c.hidden_size, rows, X_MODE=1),
        "rows_out_proj": gemv_rows_launch(c.hidden_size, c.linear_value_dim, rows, ACCUMULATE=True),
        "rows_router": gemv_rows_launch(c.num_experts, c.hidden_size, rows, bits=8, X_MODE=1),
        "rows_lm_head": gemv_rows_launch(c.vocab_size, c.hidden_size, rows, X_MODE=1),
        "gate_up": (MD.moe_gate_up_kernel, MOE_PTRS,
                    dict(moe, TP2=triton.next_power_of_2(c.num_experts_per_tok + 1), BN=MD.GATE_UP_BLOCK[0], AHEAD=1),
                    4, None),
        "down": (MD.moe_down_kernel, MOE_PTRS,
                 dict(moe, TP2=triton.next_power_of_2(c.num_experts_per_tok), BN=MD.DOWN_BLOCK[0], ROUTE_SELF=True),
                 4, None),
    }


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn, ptrs: dict, constexprs: dict, num_warps: int, maxnreg: int | None):
    """triton.compile for sm_90 with the kernel's pointer arguments 16-byte aligned; the compiled kernel."""
    sig = {n: ptrs.get(n, "constexpr") for n in fn.arg_names}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass_stats(sass: str) -> dict:
    """Instructions and bar.sync of a kernel's SASS, in all and inside its longest loop (the span of its longest
    backward branch); 'before_loop' counts from the entry to the loop."""
    ins = [(int(m.group(1), 16), line) for line in sass.splitlines()
           for m in [re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", line)] if m]
    loops = []
    for addr, line in ins:
        m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    out = {"instructions": len(ins), "bar_sync": sum("BAR.SYNC" in l for _, l in ins),
           "spill_instructions": sum(("STL" in l or "LDL" in l) for _, l in ins)}
    if loops:
        start, end = max(loops, key=lambda se: se[1] - se[0])
        body = [l for a, l in ins if start <= a <= end]
        out.update(loop=len(body), loop_bar_sync=sum("BAR.SYNC" in l for l in body),
                   before_loop=sum(1 for a, _ in ins if a < start))
    return out


def stats(name: str, over: dict | None = None, keep: str | None = None) -> dict:
    over = dict(over or {})
    fn, ptrs, cfg, warps, maxnreg = launches(over.pop("M", QR.MAX_ROWS))[name]
    warps = over.pop("num_warps", warps)
    cfg = {**cfg, **over}
    k = compile_sm90(fn, ptrs, cfg, warps, maxnreg)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (Path(keep) / f"{name}.{ext}").write_text(k.asm[ext])
        (Path(keep) / f"{name}.sass").write_text(sass)
    return {"launch": name, "warps": warps, "registers": int(usage.get("REG", 0)),
            "stack_bytes": int(usage.get("STACK", 0)), "shared_bytes": k.metadata.shared, **sass_stats(sass)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="launch names and NAME=VALUE constexpr overrides")
    ap.add_argument("--keep", help="write each launch's TTGIR, PTX and SASS into this directory")
    a = ap.parse_args()
    names = [x for x in a.args if "=" not in x] or list(launches())
    over = {k: ast.literal_eval(v) for k, v in (x.split("=", 1) for x in a.args if "=" in x)}
    unknown = set(names) - set(launches())
    if unknown:
        raise SystemExit(f"unknown launches {sorted(unknown)}; expected some of {', '.join(launches())}")
    cols = ("launch", "warps", "registers", "stack_bytes", "shared_bytes", "instructions", "before_loop", "loop",
            "bar_sync", "loop_bar_sync", "spill_instructions")
    print(" ".join(f"{c:>12}" for c in cols))
    for name in names:
        row = stats(name, over, a.keep)
        print(" ".join(f"{row.get(c, '-'):>12}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
