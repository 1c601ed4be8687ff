"""lily.kernels.half_dot under TRITON_INTERPRET=1 (its fp16 sequence in Triton; the PTX block runs in the GPU
script's full-shape GEMV checks): the centred codes exactly, the power-of-two x scale, and the dot of a pair
of words against a float64 reference within fp16's rounding."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from lily.kernels.half_dot import half_dot_words, x_half_pairs, x_scale


@triton.jit
def _pairs_kernel(wa_ptr, wb_ptr, x_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    """out[i] = half_dot_words of words wa[i], wb[i] with x [16, N] (rows 0-7: wa's code positions, 8-15: wb's)."""
    i = tl.arange(0, N)
    xs = tl.load(scale_ptr)
    a0, a1, a2, a3 = x_half_pairs(tl.load(x_ptr + 0 * N + i), tl.load(x_ptr + 1 * N + i), tl.load(x_ptr + 2 * N + i),
                                  tl.load(x_ptr + 3 * N + i), tl.load(x_ptr + 4 * N + i), tl.load(x_ptr + 5 * N + i),
                                  tl.load(x_ptr + 6 * N + i), tl.load(x_ptr + 7 * N + i), xs)
    b0, b1, b2, b3 = x_half_pairs(tl.load(x_ptr + 8 * N + i), tl.load(x_ptr + 9 * N + i), tl.load(x_ptr + 10 * N + i),
                                  tl.load(x_ptr + 11 * N + i), tl.load(x_ptr + 12 * N + i), tl.load(x_ptr + 13 * N + i),
                                  tl.load(x_ptr + 14 * N + i), tl.load(x_ptr + 15 * N + i), xs)
    q = half_dot_words(tl.load(wa_ptr + i), tl.load(wb_ptr + i), a0, a1, a2, a3, b0, b1, b2, b3, False)
    tl.store(out_ptr + i, q)


@triton.jit
def _scale_kernel(xmax_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, x_scale(tl.load(xmax_ptr + i)))


def codes(words: torch.Tensor) -> torch.Tensor:
    """[n] int32 words -> [n, 8] codes (code j at bits 4j..4j+3)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * j)) & 15 for j in range(8)], 1)


def pair_dots(wa, wb, x, scale):
    """The kernel's result and the float64 reference sum (c - 8) * fp16(x * scale) of each pair of words, and the
    sum of |terms| (fp16 rounds relative to it)."""
    n = wa.numel()
    out = torch.full((n,), float("nan"))
    _pairs_kernel[(1,)](wa, wb, x, torch.tensor([scale]), out, N=n)
    c = torch.cat([codes(wa), codes(wb)], 1).double() - 8                      # [n, 16]
    xh = (x.t() * scale).to(torch.float16).double()                             # [n, 16]
    return out.double(), (c * xh).sum(1), (c * xh).abs().sum(1)


def test_centred_codes_are_exact():
    """One code position set at a time (x one-hot): the dot returns (code - 8) * x exactly, at every position."""
    n = 64
    wa = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64).to(torch.int32)
    wb = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64).to(torch.int32)
    c = torch.cat([codes(wa), codes(wb)], 1) - 8
    for j in range(16):
        x = torch.zeros(16, n)
        x[j] = 2.0 ** torch.randint(-3, 4, (n,)).float()
        out, ref, _ = pair_dots(wa, wb, x, 1.0)
        assert torch.equal(out, ref), j
        assert torch.equal(out, (c[:, j] * x[j]).double()), j


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_pair_dot_within_fp16_rounding(magnitude):
    n = 128
    wa = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64).to(torch.int32)
    wb = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64).to(torch.int32)
    x = torch.randn(16, n) * magnitude
    xs = 2.0 ** (8 - math.floor(math.log2(float(x.abs().max()))))                  # max |x| * xs in [2^8, 2^9)
    out, ref, size = pair_dots(wa, wb, x, xs)
    # 15 rounded operations a half (8 products, 7 sums), each within 2^-11 of what it rounds (<= the sum of |terms|)
    assert bool(((out - ref).abs() <= 16 * 2.0 ** -11 * size + 1e-30).all())
    assert float((out - ref).abs().max()) > 0         # fp16 really rounds: the reference is not the kernel


def test_x_scale_is_the_power_of_two_that_brings_the_largest_x_into_range():
    xmax = torch.cat([torch.rand(40) * 10.0 ** torch.randint(-20, 20, (40,)).float(), torch.tensor([0.0, 1.0])])
    out = torch.full((64,), float("nan"))
    _scale_kernel[(1,)](torch.cat([xmax, torch.tensor([float("inf"), float("nan")]),
                                   torch.ones(64 - xmax.numel() - 2)]), out, N=64)
    for v, p in zip(xmax.tolist(), out.tolist()):
        assert math.log2(p) == int(math.log2(p))                                   # a power of two: exact to undo
        if v > 0:
            assert 2 ** 8 <= v * p < 2 ** 9, (v, p)
    assert out[xmax.numel()] == 1.0 and out[xmax.numel() + 1] == 1.0            # non-finite: left alone
