"""lily.kernels.quant_gemv_rows (the GEMV over a few input rows) against plain torch, TRITON_INTERPRET=1 on the CPU:
every row against its own reference and against the batch-1 GEMV of that row alone, the fused RMSNorm, the in-place
residual, several blocks a program, strided input rows, and the launcher's refusals. Fresh random inputs each
run (the seed is printed on failure); outputs poisoned first."""

from __future__ import annotations

import random

import pytest
import torch

from lily.kernels import quant_gemv as QG
from lily.kernels import quant_gemv_rows as QR
from lily.quant import quantize

from helpers_tensors import assert_rows_within

EPS = 1e-6
# the bounds of tests/test_kernels_decode.py's batch-1 GEMV: each output element over its row's RMS, the fp32 dot
# and the 4-bit codes' fp16-pair dot; a row dotted with another row's x, or a wrong word, is off by O(1)
GEMV = 1e-5
HALF_GEMV = 6e-3


@pytest.fixture(params=[False, True], ids=["fp32-dot", "half-dot"])
def half_dot(request, monkeypatch):
    monkeypatch.setattr(QG, "HALF_DOT", request.param)
    return request.param


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def rn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def weight(gen, n, k, bits):
    return quantize((rn(gen, n, k) * k ** -0.5).to(torch.bfloat16), bits=bits)


def assert_each_row(out, ref, bound, what):
    for m in range(out.shape[0]):
        assert_rows_within(out[m], ref[m], bound, f"{what}, row {m}", row_dims=0)


@pytest.mark.parametrize("bits,n,k,rows", [(4, 40, 128, 2), (4, 24, 4096, 3), (8, 9, 192, 4), (4, 33, 256, 1)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_plain_and_norm(gen, half_dot, bits, n, k, rows, x_dtype):
    w = weight(gen, n, k, bits)
    lin = QG.PackedLinear(w)
    x = (rn(gen, rows, k) * (1 + 3 * torch.rand(rows, 1, generator=gen))).to(x_dtype)   # rows of different sizes
    gain = rn(gen, k).abs() + 0.5
    bound = HALF_GEMV if half_dot and bits == 4 else GEMV
    wd = w.dequantize(torch.float32)
    seed = gen.initial_seed()
    out = QR.gemv_rows(lin, x, torch.full((rows, n), float("nan")))
    assert_each_row(out, QR.gemv_rows_reference(wd, x), bound, f"seed {seed}: plain")
    out = QR.gemv_rows(lin, x, torch.full((rows, n), float("nan")), norm_gain=gain, eps=EPS)
    assert_each_row(out, QR.gemv_rows_reference(wd, x, gain, EPS), bound, f"seed {seed}: RMSNorm prologue")


@pytest.mark.parametrize("sums", [False, True], ids=["sums-by-groups", "sums-from-codes"])
def test_each_row_is_the_batch1_gemv_of_that_row(gen, half_dot, monkeypatch, sums):
    """The codes decoded once and dotted with every row: each row's result is the batch-1 GEMV's of that row alone,
    bit for bit (the same operations in the same order), with the prologue's sums taken either way
    (quant_gemv.SUMS_FROM_CODES, which both kernels follow)."""
    monkeypatch.setattr(QG, "SUMS_FROM_CODES", sums)
    n, k, rows = 48, 512, 4
    w = weight(gen, n, k, 4)
    lin = QG.PackedLinear(w)
    x, gain = rn(gen, rows, k), rn(gen, k).abs() + 0.5
    out = QR.gemv_rows(lin, x, torch.full((rows, n), float("nan")), norm_gain=gain, eps=EPS, block=(8, 2))
    for m in range(rows):
        alone = QG.gemv(lin, x[m].contiguous(), torch.full((n,), float("nan")), norm_gain=gain, eps=EPS, block=(8, 2))
        assert torch.equal(out[m], alone), m


@pytest.mark.parametrize("block", [None, (8, 2)])
def test_gemv_rows_accumulates_in_place(gen, half_dot, block):
    """out += W x, several blocks a program with (8, 2), a partial last block: every row's residual kept."""
    n, k, rows = 37, 256, 3
    w = weight(gen, n, k, 4)
    lin = QG.PackedLinear(w)
    x, res = rn(gen, rows, k), rn(gen, rows, n) * 4
    out = res.clone()
    QR.gemv_rows(lin, x, out, accumulate=True, block=block)
    ref = QR.gemv_rows_reference(w.dequantize(torch.float32), x)
    assert_each_row(out - res, ref, HALF_GEMV if half_dot else GEMV, f"seed {gen.initial_seed()}: accumulate {block}")


def test_gemv_rows_reads_strided_rows_and_writes_a_slice(gen, half_dot):
    """x rows `x_stride` apart (a view of a wider buffer) and out a slice of a taller one: nothing outside is read
    as input or written."""
    n, k, rows = 40, 128, 2
    w = weight(gen, n, k, 4)
    lin = QG.PackedLinear(w)
    wide = rn(gen, rows, k + 64)
    tall = torch.full((rows + 2, n), float("nan"))
    QR.gemv_rows(lin, wide[:, :k], tall[:rows])
    ref = QR.gemv_rows_reference(w.dequantize(torch.float32), wide[:, :k])
    assert_each_row(tall[:rows], ref, HALF_GEMV if half_dot else GEMV, f"seed {gen.initial_seed()}: strided")
    assert torch.isnan(tall[rows:]).all()


def test_gemv_rows_refuses_what_it_cannot_do(gen):
    lin = QG.PackedLinear(weight(gen, 16, 128, 4))
    with pytest.raises(ValueError, match="input rows"):
        QR.gemv_rows(lin, rn(gen, QR.MAX_ROWS + 1, 128), torch.empty(QR.MAX_ROWS + 1, 16))
    with pytest.raises(ValueError, match="against a"):
        QR.gemv_rows(lin, rn(gen, 2, 64), torch.empty(2, 16))
    with pytest.raises(ValueError, match="fp32"):
        QR.gemv_rows(lin, rn(gen, 2, 128), torch.empty(2, 16, dtype=torch.bfloat16))
