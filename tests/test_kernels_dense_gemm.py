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

from helpers_tensors import DEV, assert_rows_within, new_generator, qt, randn  # noqa: E402

# The worst row's relative error of either path against the fp32 oracle: ~3x the worst measured over 12
# seeds under the interpreter (bf16 x times the weight dequantized to bf16, truncated there): 3.5e-3 at
# 8 bits, 2.4e-3 at 4 bits (medians 3.4e-3, 2.3e-3; 3.6e-3 and 2.4e-3 worst over 12 more)
DENSE = 1e-2


@pytest.fixture
def gen():
    return new_generator()


@pytest.fixture(autouse=True)
def triton_paths(monkeypatch):
    """These tests pin q_gemm's Triton paths; on a Hopper GPU the rows they use would otherwise go to the
    Gluon dense mode, which tests/test_kernels_moe_wgmma.py checks."""
    monkeypatch.setattr(QG, "WGMMA_DENSE", False)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_bf16_every_element(gen, bits):
    w = qt(gen, 70, 256, bits=bits)
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
    """M over PREDEQUANT_MIN_M: scratch dequantization + bf16 GEMM, with ragged M and N blocks (M past
    SMALL_M, so the pointer kernel runs on `tiles`)."""
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 8)
    monkeypatch.setattr(QG, "SMALL_M", 64)
    monkeypatch.setattr(QG, "BF16_GEMM_TMA", False)
    monkeypatch.setattr(QG, "BF16_TILES", tiles)
    M, N, K = 150, 300, 256
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K, bits=bits)
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


# The TMA kernel's persistent loop under the interpreter: few programs (GPU_SMS lowered), so each walks
# several tiles, on tiles that leave M and N ragged (150 = 4 * 32 + 22 rows, 296 = 4 * 64 + 40 columns).
TMA_SMALL = (32, 64, 64, 4, 1)
TMA_PROGRAMS = 3
# TMA against the pointer kernel (the same bf16 products, summed in fp32 per 64 columns of K by both)
SAME_SUMS = 1e-6


def use_tma(monkeypatch, tiles, split=2):
    """Route q_gemm's bf16 GEMM through the TMA kernel at M = 150 (predequantized, past SMALL_M)."""
    monkeypatch.setattr(QG, "PREDEQUANT_MIN_M", 8)
    monkeypatch.setattr(QG, "SMALL_M", 64)
    monkeypatch.setattr(QG, "GPU_SMS", TMA_PROGRAMS)
    monkeypatch.setattr(QG, "BF16_GEMM_TMA", True)
    monkeypatch.setattr(QG, "BF16_TMA_TILES", tiles)
    monkeypatch.setattr(QG, "BF16_TMA_EPILOGUE_SPLIT", split)
    monkeypatch.setattr(QG, "BF16_TILES", (32, 32, 64, 4, 1))


def launches_of(monkeypatch, name):
    """A list that gets an entry each time the kernel `name` of q4_gemm is launched."""
    calls = []
    kernel = getattr(QG, name)

    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]
    monkeypatch.setattr(QG, name, Counted())
    return calls


@pytest.mark.parametrize("tiles", [TMA_SMALL, QG.BF16_TMA_TILES], ids=["ragged", "gpu-tiles"])
@pytest.mark.parametrize("out_dtype,accumulate,split", [
    (torch.float32, False, 1), (torch.bfloat16, False, 2), (torch.float32, True, 2), (torch.float32, True, 4)],
    ids=["fp32", "bf16-split2", "fp32-accumulate-split2", "fp32-accumulate-split4"])
def test_tma_path_matches_reference_and_pointer_path(gen, monkeypatch, tiles, out_dtype, accumulate, split):
    """The persistent TMA GEMM: stores (fp32, bf16) and the in-place fp32 accumulate, the epilogue in 1, 2
    and 4 column pieces; every row against the oracle and against the pointer kernel."""
    M, N, K = 150, 296, 256
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K)
    res = randn(gen, M, N)
    outs = {}
    for tma in (False, True):
        use_tma(monkeypatch, tiles, split)
        monkeypatch.setattr(QG, "BF16_GEMM_TMA", tma)
        launches = launches_of(monkeypatch, "_gemm_nt_tma_kernel")
        out = res.clone() if accumulate else torch.full((M, N), float("nan"), device=DEV, dtype=out_dtype)
        QG.q_gemm(x, w, out=out, accumulate=accumulate)
        assert len(launches) == tma
        outs[tma] = out - res if accumulate else out.float()
    what = f"seed {gen.initial_seed()}: TMA, {out_dtype}, accumulate={accumulate}, split {split}"
    assert_rows_within(outs[True], QG.q_gemm_reference(x, w), DENSE, what)
    # a bf16 output can differ from the pointer kernel's where the fp32 sums differ in their last bit
    assert_rows_within(outs[True], outs[False], SAME_SUMS if out_dtype == torch.float32 else 1e-3,
                       what + " vs the pointer kernel")


@pytest.mark.parametrize("offset,tma", [(8, True), (1, False)], ids=["aligned", "misaligned"])
def test_tma_path_into_a_column_slice(gen, monkeypatch, offset, tma):
    """out a column slice of a wider buffer (row stride != N): accumulated in place through a descriptor
    where its base is 16-byte aligned, by the pointer kernel where it is not; the columns around it are
    left as they were."""
    use_tma(monkeypatch, TMA_SMALL)
    launches = launches_of(monkeypatch, "_gemm_nt_tma_kernel")
    M, N, K = 150, 296, 256
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K)
    wide = randn(gen, M, N + 40)
    before = wide.clone()
    QG.q_gemm(x, w, out=wide[:, offset:offset + N], accumulate=True)
    assert len(launches) == tma
    outside = torch.ones(N + 40, dtype=torch.bool)
    outside[offset:offset + N] = False
    assert torch.equal(wide[:, outside], before[:, outside]), "a column outside the slice was written"
    assert_rows_within(wide[:, offset:offset + N] - before[:, offset:offset + N], QG.q_gemm_reference(x, w), DENSE,
                       f"seed {gen.initial_seed()}: TMA into a column slice at {offset}")


def test_tma_epilogue_split_fits_shared_memory(monkeypatch):
    """The epilogue's pieces grow until the pipeline and the piece buffers fit in the H200's shared memory
    (the sizes ptxas reported for sm_90 builds, less ~40 bytes of barriers)."""
    monkeypatch.setattr(QG, "BF16_TMA_TILES", (128, 256, 64, 8, 3))
    bf16, fp32 = (torch.empty(1, 1, dtype=d) for d in (torch.bfloat16, torch.float32))
    assert QG._epilogue_split(bf16, False) == 2      # 147,456 + 32,768 bytes
    assert QG._epilogue_split(fp32, False) == 2      # 147,456 + 65,536
    assert QG._epilogue_split(fp32, True) == 4       # 147,456 + 2 x 32,768 (2 pieces: 279,552, over 232,448)
    monkeypatch.setattr(QG, "BF16_TMA_EPILOGUE_SPLIT", 1)
    assert QG._epilogue_split(bf16, False) == 1      # 147,456 + 65,536


def test_hopper_dense_mode_takes_its_row_range(gen, monkeypatch):
    """q_gemm's routing to lily/kernels/moe_wgmma.py's dense mode (the kernel itself is Gluon and runs only
    on a Hopper GPU: tests/test_kernels_moe_wgmma.py): 4-bit weights of WGMMA_DENSE_MIN_M ..
    WGMMA_DENSE_MAX_M rows where the kernel fits, fewer rows only against a weight with a 64-row program for
    every SM (GPU_SMS on the CPU) or, K split (WGMMA_DENSE_SKINNY_SPLIT), a program a part for every SM; never
    with the switch off or under the interpreter."""
    from lily.kernels import moe_wgmma as MW
    fits = []
    fake = type("FakeWgmma", (), {"dense_fits": staticmethod(lambda x, w, out: fits.append(x.shape[0]) or True),
                                  "DENSE_TILES": MW.DENSE_TILES, "dense_splits": staticmethod(MW.dense_splits)})
    monkeypatch.setattr(QG, "moe_wgmma", fake)
    monkeypatch.setattr(QG, "UPCAST_DOT", False)
    monkeypatch.setattr(QG, "WGMMA_DENSE", True)
    w4, w8 = qt(gen, 64, 128), qt(gen, 64, 128, bits=8)
    lo, hi = QG.WGMMA_DENSE_MIN_M, QG.WGMMA_DENSE_MAX_M
    x = lambda m: torch.empty(m, 128, dtype=torch.bfloat16)   # noqa: E731
    out = torch.empty(1, 64)
    assert [QG._takes_wgmma_dense(x(m), w4, out) for m in (lo - 1, lo, hi, hi + 1)] == [False, True, True, False]
    assert not QG._takes_wgmma_dense(x(lo), w8, out)
    monkeypatch.setattr(QG, "WGMMA_DENSE", False)
    assert not QG._takes_wgmma_dense(x(lo), w4, out)
    monkeypatch.setattr(QG, "WGMMA_DENSE", True)
    monkeypatch.setattr(QG, "UPCAST_DOT", True)
    assert not QG._takes_wgmma_dense(x(lo), w4, out)
    assert fits == [lo, hi]   # asked only once everything else allowed it
    monkeypatch.setattr(QG, "UPCAST_DOT", False)
    tall, short = qt(gen, 64 * QG.GPU_SMS, 128), qt(gen, 64 * (QG.GPU_SMS - 1), 128)
    assert [QG._takes_wgmma_dense(x(m), tall, out) for m in (1, 16, lo - 1, hi + 1)] == [True, True, True, False]
    assert [QG._takes_wgmma_dense(x(m), short, out) for m in (1, 16, lo - 1, lo)] == [False, False, False, True]
    # a short, deep weight (an out-projection): there only while its tiles times dense_splits' parts of K
    # fill the wave (up to DENSE_SPLIT_MAX_M rows), and with either switch off never
    deep = qt(gen, 64 * 32, 4096)
    xd = lambda m: torch.empty(m, 4096, dtype=torch.bfloat16)   # noqa: E731
    rows = [1, 8, MW.DENSE_SPLIT_MAX_M, MW.DENSE_SPLIT_MAX_M + 1, lo - 1, lo]
    fill = [32 * MW.dense_splits(m, 64 * 32, 4096, QG.GPU_SMS) >= QG.GPU_SMS for m in rows]
    assert fill[:3] == [True] * 3 and fill[3:5] == [False] * 2
    assert [QG._takes_wgmma_dense(xd(m), deep, out) for m in rows] == fill[:5] + [True]
    for switch in ("WGMMA_DENSE_SKINNY_SPLIT", "WGMMA_DENSE_SPLIT"):
        monkeypatch.setattr(QG, switch, False)
        assert [QG._takes_wgmma_dense(xd(m), deep, out) for m in rows] == [False] * 5 + [True], switch
        monkeypatch.setattr(QG, switch, True)
    monkeypatch.setattr(QG, "moe_wgmma", None)    # Gluon missing: the split-K path, whatever the rows
    assert not any(QG._takes_wgmma_dense(x(m), tall, out) for m in (1, lo))


def test_hopper_dense_block_rows():
    """The dense mode's token block (wgmma's N) a program: the power of two >= 16 that holds a few rows, the
    tile's 128 from there on (no 128-row block of tensor-core work for a decode batch's rows)."""
    from lily.kernels import moe_wgmma as MW
    assert [MW.dense_block_rows(m) for m in (1, 2, 16, 17, 33, 64, 65, 128, 129, 1024)] == \
        [16, 16, 16, 32, 64, 64, 128, 128, 128, 128]
