"""scripts/kernel_sass.py: its SASS reading on a hand-made listing (a known answer), and one real launch
compiled for sm_90 on this machine (skipped where Triton's NVIDIA tools are missing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import kernel_sass  # noqa: E402

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   HFMA2 R6, R4, R5, R6 ;
        /*0040*/                   STL [R1], R6 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/               @!P0 BRA 0x30 ;
        /*0070*/                   LDL R6, [R1] ;
        /*0080*/                   BRA 0x70 ;
        /*0090*/                   EXIT ;
"""


def test_sass_stats_counts_the_longest_loop():
    # two backward branches: 0x60 -> 0x30 (4 instructions) and 0x80 -> 0x70 (2): the longer is the loop
    s = kernel_sass.sass_stats(LISTING)
    assert s["instructions"] == 10
    assert s["bar_sync"] == 2
    assert s["spill_instructions"] == 2
    assert s["loop"] == 4 and s["loop_bar_sync"] == 1
    assert s["before_loop"] == 3


def test_sass_stats_without_a_loop():
    s = kernel_sass.sass_stats("\n".join(LISTING.splitlines()[:4]))
    assert s["instructions"] == 3 and "loop" not in s


@pytest.mark.skipif(not os.path.exists(kernel_sass._tool("cuobjdump")) or not os.path.exists(kernel_sass._tool("ptxas")),
                    reason="this Triton has no NVIDIA tools")
def test_a_decode_gemv_compiles_for_sm90_without_a_gpu():
    # in a process of its own: the tests run Triton's interpreter, which cannot compile (the script runs without it)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(kernel_sass.__file__)
    run = subprocess.run([sys.executable, str(script), "out_proj", "rows_router", "M=3"], capture_output=True,
                         text=True, env=env, timeout=600, cwd=script.parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.split()]
    head, row, rows = lines[0], dict(zip(lines[0], lines[1])), dict(zip(lines[0], lines[2]))
    assert head[0] == "launch" and row["launch"] == "out_proj"
    assert 0 < int(row["registers"]) <= 255
    # 16 words a thread a block: at least the pair dot's ~15 instructions a word inside the loop
    assert int(row["loop"]) > 200
    # the batched step's 8-bit router GEMV over 3 rows (M=3 picks its block and leaves out_proj alone)
    assert rows["launch"] == "rows_router" and rows["warps"] == str(kernel_sass.QR.BLOCKS[(3, "8bit")][2])
    assert int(rows["spill_instructions"]) == 0 and int(rows["loop"]) > 0
    assert int(row["instructions"]) > int(row["before_loop"]) + int(row["loop"]) - 1
