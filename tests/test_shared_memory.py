"""Cards with 99 KiB of shared memory a program (RTX 3090 / 4090, A10, A40, L4, L40): every launch of a full-size
prefill chunk, decode step and batched decode step compiled for sm_86 without a GPU (scripts/shared_memory_check.py)
asks at most that much with the tiles the launchers pick there, while the H200's tiles would not load on such a card;
and the switch that picks them (lily.kernels.shared_memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lily.kernels import attention_decode, flash_attention, gdn_chunked
from lily.kernels.shared_memory import SMALL_CARD_BYTES, max_shared_bytes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import kernel_sass  # noqa: E402  (where Triton's NVIDIA tools are)

H200_BYTES = 232448
TOOLS = os.path.exists(kernel_sass._tool("ptxas"))


def _table(arch: int, limit: int, tokens: str) -> list[dict]:
    """scripts/shared_memory_check.py's rows, in a process of its own (the tests run Triton's interpreter, which
    cannot compile; the script runs without it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LILY_MAX_SHARED_BYTES")}
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import shared_memory_check as P; "
            f"print(json.dumps(P.shared_memory_table({arch}, {limit}, [{tokens}])))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200,
                         cwd=SCRIPTS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not TOOLS, reason="this Triton has no NVIDIA tools")
def test_every_launch_fits_a_99_kib_card_and_the_h200_tiles_would_not():
    small = _table(86, SMALL_CARD_BYTES, "64, 4096")
    names = {r["kernel"] for r in small}
    # the whole prefill chunk was seen (projections, the gated delta rule, attention, the MoE's plan and expert
    # GEMMs), the decode step (GEMVs, GDN, split-K attention, the MoE, the greedy pick, a sampled draw) and the
    # batched step
    assert {"_gdn_prep_blocked_kernel", "_gdn_scan_kernel", "_flash_attn_kernel", "_moe_gate_up_kernel",
            "_moe_down_kernel", "_plan_blocks_kernel", "_q_gemm_kernel", "_gemm_nt_kernel", "q_gemv_kernel",
            "gdn_decode_kernel", "attn_split_kernel", "moe_gate_up_kernel", "moe_down_kernel", "greedy_finish_kernel",
            "_sample_partials_kernel", "_sample_finish_kernel", "q_gemv_rows_kernel", "gdn_step_rows_kernel",
            "attn_split_rows_kernel"} <= names, names
    over = [(r["kernel"], r["tiles"], r["shared_bytes"]) for r in small if not r["fits"]]
    assert not over, over
    assert all(0 <= r["shared_bytes"] <= SMALL_CARD_BYTES for r in small)
    # the H200's tiles compiled for the same card: the chunk walk's two stages, the prefill attention's 128 x 64
    # tiles and the decode attention's three stages were over 99 KiB (Triton 3.9: 112 / 112 / 138 KiB), which Triton
    # would refuse as they load; at least one of them still is (another Triton may ask a little less), and only
    # those the switch handles
    big = _table(86, H200_BYTES, "4096")
    over = {r["kernel"] for r in big if r["shared_bytes"] > SMALL_CARD_BYTES}
    assert over and over <= {"_gdn_scan_kernel", "_flash_attn_kernel", "attn_split_kernel"}, over


def test_max_shared_bytes_honours_the_override(monkeypatch):
    monkeypatch.delenv("LILY_MAX_SHARED_BYTES", raising=False)
    cpu = max_shared_bytes("cpu")
    assert cpu > H200_BYTES   # the interpreter has no shared memory to run out of
    monkeypatch.setenv("LILY_MAX_SHARED_BYTES", str(SMALL_CARD_BYTES))
    assert max_shared_bytes("cpu") == SMALL_CARD_BYTES
    assert max_shared_bytes(torch.device("meta")) == SMALL_CARD_BYTES
    for bad in ("lots", "0", "-5"):
        monkeypatch.setenv("LILY_MAX_SHARED_BYTES", bad)
        with pytest.raises(ValueError, match="LILY_MAX_SHARED_BYTES"):
            max_shared_bytes("cpu")


@pytest.mark.parametrize("limit, wide, walk, split", [
    (None, flash_attention.TILES_WIDE, (gdn_chunked.SCAN_WARPS, gdn_chunked.SCAN_STAGES), 3),
    (H200_BYTES, flash_attention.TILES_WIDE, (gdn_chunked.SCAN_WARPS, gdn_chunked.SCAN_STAGES), 3),
    (163 * 1024, flash_attention.TILES_WIDE, (gdn_chunked.SCAN_WARPS, gdn_chunked.SCAN_STAGES), 3),   # an A100
    (SMALL_CARD_BYTES, flash_attention.TILES_WIDE_SMALL, (gdn_chunked.SCAN_WARPS, 1), 2)])
def test_the_tiles_follow_the_card(monkeypatch, limit, wide, walk, split):
    if limit is None:
        monkeypatch.delenv("LILY_MAX_SHARED_BYTES", raising=False)
    else:
        monkeypatch.setenv("LILY_MAX_SHARED_BYTES", str(limit))
    assert flash_attention.tiles(256, "cpu") == wide
    assert flash_attention.tiles(64, "cpu") == flash_attention.TILES   # small heads ask little anywhere
    assert gdn_chunked.scan_shape(4096, "cpu") == walk
    assert gdn_chunked.scan_shape(gdn_chunked.SCAN_SHORT_MAX_T, "cpu") == gdn_chunked.SCAN_SHORT
    assert attention_decode.split_stages("cpu") == split
