"""The two ways lily/kernels/q4_gemm.py multiplies by a 4/8-bit weight: the tile dequantized on the way in
(small M) and the weight dequantized once into bf16 scratch, then a plain bf16 GEMM (prefill-sized M).

Oracle: fp32 x @ dequantize(w)^T (lily.quant, bit-exact with mlx). Fresh random inputs (the seed is in
the failure message), outputs poisoned with NaN first; every row is checked, not one norm over the tensor.
Under TRITON_INTERPRET (no GPU) fp32->bf16 casts truncate, so the bf16 weight is within one bf16 step.
"""

from __future__ import annotations

import pytest
import torch

import lily.kernels.q4_gemm as QG
from lily.quant import quantize

from helpers_tensors import DEV, assert_rows_within, new_generator, randn  # noqa: E402

# The worst row's relative error of either path against the fp32 oracle: ~3x the worst measured over 12
# seeds under the interpreter (bf16 x times the weight dequantized to bf16, truncated there): 3.5e-3 at
# 8 bits, 2.4e-3 at 4 bits (medians 3.4e-3, 2.3e-3; 3.6e-3 and 2.4e-3 worst over 12 more)
DENSE = 1e-2


@pytest.fixture
def gen():
    return new_generator()


def qt(g, n, k, bits=4):
    w = torch.randn(n, k, generator=g) * k ** -0.5
    return quantize(w.to(torch.bfloat16), bits=bits).to(DEV)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_bf16_every_element(gen, bits):
    w = qt(gen, 70, 256, bits)
    out = torch.full((70, 256), float("nan"), device=DEV, dtype=torch.bfloat16)
    QG.dequantize_bf16(w, out)
    ref = w.dequantize(torch.float32)
    step = ref.abs() * 2.0 ** -7 + 1e-30  # one bf16 step at that magnitude
    assert ((out.float() - ref).abs() <= step).all(), f"seed {gen.initial_seed()}"


# the GPU's tiles are the module's own (what a 4K prompt and a short one use there), read at collection
@pytest.mark.parametrize("tiles", [(32, 32, 64, 4, 1), QG.BF16_TILES, QG.BF16_SMALL],
                         ids=["ragged", "gpu-tiles", "gpu-small-tiles"])
@pytest.mark.parametrize("bits,accumulate", [(4, False), (8, False), (4, True)])
def test_predequantized_path_matches_reference(gen, monkeypatch, tiles, bits, accumulate):
    """M over PREDEQUANT_MIN_M: scratch dequantization + bf16 GEMM, with ragged M and N blocks."""
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 8)
    monkeypatch.setattr(QG, "BF16_TILES", tiles)
    M, N, K = 150, 300, 256
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K, bits)
    ref = QG.q_gemm_reference(x, w)
    if accumulate:
        res = randn(gen, M, N)
        out = res.clone()
        QG.q_gemm(x, w, out=out, accumulate=True)
        assert_rows_within(out - res, ref, DENSE, f"seed {gen.initial_seed()}: predequantized, accumulated")
    else:
        out = torch.full((M, N), float("nan"), device=DEV)
        QG.q_gemm(x, w, out=out)
        assert_rows_within(out, ref, DENSE, f"seed {gen.initial_seed()}: predequantized")


def test_fused_path_with_the_large_prompt_tiles(gen, monkeypatch):
    """The fused path's tile for prefill-sized M (DENSE_LARGE, which the GPU takes past SMALL_M rows where
    the weight is not predequantized, e.g. lm_head), on a small M by lowering SMALL_M: every row right.
    (The smaller M's tiles: test_kernels_prefill's q_gemm test, M of 5, 37 and 70.)"""
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 1 << 30)
    monkeypatch.setattr(QG, "SMALL_M", 64)
    M, N, K = 150, 300, 256
    assert QG._config(M, N) == QG.DENSE_LARGE
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K)
    out = torch.full((M, N), float("nan"), device=DEV)
    QG.q_gemm(x, w, out=out)
    assert_rows_within(out, QG.q_gemm_reference(x, w), DENSE, f"seed {gen.initial_seed()}: fused large tiles")


def test_both_paths_agree_and_scratch_is_reused(gen, monkeypatch):
    """The same product by either path; a second, smaller weight reuses the scratch buffer."""
    x = randn(gen, 96, 128, dtype=torch.bfloat16)
    w1, w2 = qt(gen, 200, 128), qt(gen, 64, 128)
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 1 << 30)
    fused = [QG.q_gemm(x, w, out_dtype=torch.float32) for w in (w1, w2)]
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 1)
    monkeypatch.setattr(QG, "BF16_TILES", (32, 64, 64, 4, 1))
    monkeypatch.setattr(QG, "_SCRATCH", {})
    pre = [QG.q_gemm(x, w, out_dtype=torch.float32) for w in (w1, w2)]
    assert len(QG._SCRATCH) == 1 and next(iter(QG._SCRATCH.values())).numel() == 200 * 128
    for a, b, w in zip(fused, pre, (w1, w2)):
        ref = QG.q_gemm_reference(x, w)
        assert_rows_within(a, ref, DENSE, f"seed {gen.initial_seed()}: fused")
        assert_rows_within(b, ref, DENSE, f"seed {gen.initial_seed()}: predequantized")
