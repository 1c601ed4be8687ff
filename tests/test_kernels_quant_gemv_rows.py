"""The decode batch's row GEMVs (lily.kernels.quant_gemv_rows) and the PERM64 outputs of the kernels that feed
them, against plain torch (TRITON_INTERPRET=1 on the CPU, small shapes). Fresh random inputs each run (the
seed is in the failure messages); outputs are poisoned first."""

from __future__ import annotations

import pytest
import torch
from helpers_tensors import assert_rows_within, new_generator

from lily.kernels import attention_decode_batch as AB
from lily.kernels.attention_decode import rope_inv_freq
from lily.kernels.gdn_chunked import gated_rmsnorm
from lily.kernels.q4_gemm import rmsnorm_rows
from lily.kernels.quant_gemv import perm64_index
from lily.kernels.quant_gemv_rows import ROWS_MAX, gemv_rows, perm_x_fits
from lily.quant import quantize

I32 = torch.int32
# fp32 products and sums of exact codes: a row's relative error is a few fp32 roundings (~3e-7 measured);
# a wrong code, group or row is off by far more
ROW = 1e-5


@pytest.fixture
def gen():
    return new_generator()


def rn(gen, *shape):
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("bits,perm_x,rows,n,k", [(4, True, 1, 200, 256), (4, True, 3, 72, 512),
                                                   (4, True, ROWS_MAX, 130, 256), (4, False, 5, 96, 128),
                                                   (8, False, 2, 100, 256)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_rows_matches_the_dequantized_product(gen, bits, perm_x, rows, n, k, accumulate):
    w = quantize((rn(gen, n, k) * k ** -0.5).to(torch.bfloat16), bits=bits)
    x = rn(gen, rows, k).to(torch.bfloat16)          # (bf16 as the step's norms write it: exact in fp32)
    want = x.float() @ w.dequantize(torch.float32).T
    xin = x[:, perm64_index(k)].contiguous() if perm_x else x
    seed = f"seed {gen.initial_seed()}"
    if accumulate:
        res = rn(gen, rows, n)
        out = res.clone()
        gemv_rows(xin, w, out=out, accumulate=True, perm_x=perm_x)
        assert_rows_within(out - res, want, ROW, f"{seed}: added into the residual")
    else:
        out = torch.full((rows, n), float("nan"))
        gemv_rows(xin, w, out=out, perm_x=perm_x)
        assert_rows_within(out, want, ROW, f"{seed}: rows")


def test_gemv_rows_bf16_output_and_fp32_input(gen):
    w = quantize((rn(gen, 64, 128) * 0.1).to(torch.bfloat16), bits=4)
    x = rn(gen, 2, 128)
    out = torch.full((2, 64), float("nan"), dtype=torch.bfloat16)
    gemv_rows(x, w, out=out)
    assert_rows_within(out.float(), x @ w.dequantize(torch.float32).T, 2 ** -8, f"seed {gen.initial_seed()}")


def test_gemv_rows_refuses_what_it_cannot_take(gen):
    w4 = quantize(rn(gen, 64, 128).to(torch.bfloat16), bits=4)
    w8 = quantize(rn(gen, 64, 128).to(torch.bfloat16), bits=8)
    with pytest.raises(ValueError, match="PERM64"):
        gemv_rows(rn(gen, 2, 128), w8, perm_x=True)
    with pytest.raises(ValueError):
        gemv_rows(rn(gen, ROWS_MAX + 1, 128), w4)
    with pytest.raises(ValueError):
        gemv_rows(rn(gen, 2, 128), quantize(rn(gen, 64, 192).to(torch.bfloat16), bits=4))   # K not a power of 2
    assert perm_x_fits(w4) and not perm_x_fits(w8)


def test_rmsnorm_rows_perm64_is_the_natural_rows_permuted(gen):
    h, g = rn(gen, 5, 256) * 3, rn(gen, 256).abs() + 0.5
    assert torch.equal(rmsnorm_rows(h, g, 1e-6, perm64=True), rmsnorm_rows(h, g, 1e-6)[:, perm64_index(256)])
    with pytest.raises(ValueError):
        rmsnorm_rows(h, g, 1e-6, permuted_copy=True, perm64=True)


def test_gated_rmsnorm_perm64_is_the_natural_rows_permuted(gen):
    o, z, g = rn(gen, 3, 4, 32), rn(gen, 3, 128), rn(gen, 32).abs() + 0.5
    assert torch.equal(gated_rmsnorm(o, z, g, perm64=True), gated_rmsnorm(o, z, g)[:, perm64_index(128)])


def test_attention_rows_perm64_is_the_natural_rows_permuted(gen):
    n_slots, max_seq, hq, hkv, D = 3, 24, 4, 2, 32
    slots, nv = torch.tensor([2, 0], dtype=I32), torch.tensor([2], dtype=I32)
    kc = rn(gen, n_slots, max_seq, hkv, D).to(torch.bfloat16)
    vc = rn(gen, n_slots, max_seq, hkv, D).to(torch.bfloat16)
    pos = torch.tensor([5, 0, 17], dtype=I32)
    proj = rn(gen, 2, hq * 2 * D + 2 * hkv * D)
    qn, kn, inv = rn(gen, D).abs() + 0.5, rn(gen, D).abs() + 0.5, rope_inv_freq(16, 1e7)
    natural = AB.attention_decode_rows(proj, kc, vc, pos, slots, nv, qn, kn, inv, 1e-6, hq, block_t=16)
    # (again: the same K/V rows are written at the same positions)
    permuted = AB.attention_decode_rows(proj, kc, vc, pos, slots, nv, qn, kn, inv, 1e-6, hq, block_t=16, perm64=True)
    assert torch.equal(permuted, natural[:, perm64_index(hq * D)])
