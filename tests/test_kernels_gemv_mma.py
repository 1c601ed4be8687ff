"""The batch-1 4-bit GEMV on the tensor cores (lily/kernels/gemv_mma.py).

Gluon does not run under TRITON_INTERPRET, so on the CPU these check the kernel's pieces against independent
oracles: its dequantization PTX (emulated) against MLX's nibble order, its load layout against the A-fragment
layout it is converted to, and its arithmetic (`gemv_mma_emulated`: exact codes, x rounded once to fp16 in the
fragment's column order, each group's dot in its own accumulator column) against the fp32 product with the
dequantized weight. On a Hopper GPU (marked gpu) the kernel itself runs at the decode step's shapes against
that product and the emulation.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers_tensors import DEV, new_generator, qt
from lily.kernels import gemv_mma, moe_wgmma
from lily.kernels.quant_gemv import gemv_reference, perm64_index, rmsnorm_reference


@pytest.fixture
def gen():
    return new_generator()


def _coord(bases, index: int) -> tuple[int, ...]:
    c = [0] * len(bases[0]) if bases else []
    for bit, b in enumerate(bases):
        if index >> bit & 1:
            c = [x ^ y for x, y in zip(c, b)]
    return tuple(c)


def _held(lay, warp: int, lane: int) -> set:
    base = [a ^ b for a, b in zip(_coord(lay.lane_bases, lane), _coord(lay.warp_bases, warp))]
    return {tuple(a ^ b for a, b in zip(_coord(lay.reg_bases, r), base)) for r in range(1 << len(lay.reg_bases))}


@pytest.mark.parametrize("bw,warps", [(64, 4), (128, 4), (64, 2), (128, 8)])
def test_load_layout_holds_the_fragment_words(bw, warps):
    """Each thread loads exactly the (row, word) elements the A fragment's layout gives it (so the conversion
    between them moves no data), its two words of a row first in its registers (one 8-byte load)."""
    load = gemv_mma._words_load_layout(bw, warps)
    frag = moe_wgmma._words_layout_3d(bw, warps, True)
    for w, lane in itertools.product(range(warps), range(32)):
        want = {(r, j) for r, j, s in _held(frag, w, lane)}
        assert _held(load, w, lane) == want, (w, lane)
    assert load.reg_bases[0] == [0, 1]


def _emulate_codes_asm(words: torch.Tensor, shift: int, mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PTX of gemv_mma._CODES_ASM on 32-bit words: shr, lop3 0xEA ((a & b) | c), the halves unpacked."""
    text = gemv_mma._CODES_ASM.value
    assert [ln.split()[0] for ln in text.strip().strip("{}").strip().splitlines()] == [
        ".reg", "shr.u32", "lop3.b32", "mov.b32"], text
    assert "0x64006400, 0xEA" in text
    x = (((words.to(torch.int64) & 0xFFFFFFFF) >> shift) & mask) | 0x64006400
    half = lambda b: (b & 0xFFFF).to(torch.int16).view(torch.float16)  # noqa: E731
    return half(x), half(x >> 16)


def test_codes_asm_gives_exact_codes_in_fragment_order(gen):
    """Emulated on random MLX words, the PTX at the kernel's (shift, mask) of each s puts nibbles s and s + 4
    of the word into the halves as 1024 + code (s even) or 1024 + 16 code (s odd), exactly; those are the
    values codes_fragment_reference places at columns k' = 16 s + 8 h + 2 q + e."""
    words = torch.randint(-2 ** 31, 2 ** 31, (40, 8), generator=gen, dtype=torch.int64).to(torch.int32)
    ref = gemv_mma.codes_fragment_reference(words)
    nib = ((words.to(torch.int64) & 0xFFFFFFFF)[:, :, None] >> (4 * torch.arange(8))) & 0xF
    for s in range(4):
        lo, hi = _emulate_codes_asm(words, (s // 2) * 8, 0x000F000F if s % 2 == 0 else 0x00F000F0)
        f = 16 if s % 2 else 1
        assert torch.equal(lo.double(), 1024 + f * nib[:, :, s].double())
        assert torch.equal(hi.double(), 1024 + f * nib[:, :, s + 4].double())
        for j in range(8):
            assert torch.equal(ref[:, 16 * s + 8 * (j % 2) + 2 * (j // 2)], lo[:, j])
            assert torch.equal(ref[:, 16 * s + 8 * (j % 2) + 2 * (j // 2) + 1], hi[:, j])


@pytest.mark.parametrize("k,x_scale", [(512, 1.0), (1024, 300.0), (1024, 1e-3)])
def test_emulated_arithmetic_is_the_dequantized_product(gen, k, x_scale):
    """The kernel's arithmetic (exact codes against x' = fp16(x xs / f) in the fragment's order, a group a
    column of the accumulator, scale and bias per group in fp32) matches the fp32 product with the dequantized
    weight, for inputs far above and below fp16's comfortable range (xs keeps them there)."""
    w = qt(gen, 48, k)
    x = torch.randn(k, generator=gen) * x_scale
    ref = gemv_reference(w, x)
    got = gemv_mma.gemv_mma_emulated(w.weight.view(torch.int32), w.scales, w.biases, x)
    err = float((got - ref).norm() / ref.norm())
    assert err < 2e-3, err
    # and it is not the product with another order of x or without the 1024 offset removed
    idx = torch.randperm(k, generator=gen)
    wrong = gemv_mma.gemv_mma_emulated(w.weight.view(torch.int32), w.scales, w.biases, x[idx])
    assert float((wrong - ref).norm() / ref.norm()) > 0.1


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("n,k", [(12352, 2048), (9216, 2048), (2048, 4096), (1000, 2048), (248320, 2048)])
def test_gemv_mma_full_shapes(gen, n, k):
    """At the decode step's shapes (and a ragged N): plain x and the RMSNorm prologue, natural and PERM64 x,
    against the fp32 product with the dequantized weight; the output poisoned first."""
    w = qt(gen, n, k)
    w = type(w)(w.weight.to(DEV), w.scales.to(DEV), w.biases.to(DEV), w.bits, w.group_size)
    x = torch.randn(k, generator=gen).to(DEV) * 3
    gain = (torch.rand(k, generator=gen) + 0.5).to(DEV, torch.bfloat16)
    p = perm64_index(k, DEV)
    words = w.weight.view(torch.int32)
    for norm, perm in itertools.product((False, True), (False, True)):
        xin = rmsnorm_reference(x, gain, 1e-6) if norm else x
        ref = gemv_reference(w, xin)
        out = torch.full((n,), float("nan"), device=DEV)
        gemv_mma.gemv_mma(words, w.scales, w.biases, x[p] if perm else x, out,
                          norm_gain=(gain[p] if perm else gain) if norm else None, perm_x=perm)
        assert torch.isfinite(out).all()
        err = float((out - ref).norm() / ref.norm())
        assert err < 2e-3, (n, k, norm, perm, err)
