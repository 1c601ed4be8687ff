"""lily.quant against mlx.core: quantize / pack / unpack / dequantize bit for bit, 4 and 8 bits,
on fresh random inputs of varied scale (including groups with one large outlier and negative-heavy ones)."""

import mlx.core as mx
import pytest
import torch

from helpers_mlx import to_mx, to_torch
from lily import quant


def random_weight(seed: int, shape, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).mul(4).add(0.01)
    # a few outliers and one-sided groups: the edge/scale sign logic must match MLX's
    idx = torch.randint(0, w.numel(), (max(1, w.numel() // 500),), generator=g)
    w.view(-1)[idx] *= 20
    w[..., :64] = w[..., :64].abs() * (-1 if seed % 2 else 1)
    return w.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(48, 256), (3, 32, 128)])
def test_quantize_matches_mlx(bits, shape):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    w = random_weight(seed, shape)
    ours = quant.quantize(w, bits=bits, group_size=64)
    wq, s, b = mx.quantize(to_mx(w), group_size=64, bits=bits)
    assert ours.weight.dtype == torch.uint32 and ours.scales.dtype == torch.bfloat16
    assert torch.equal(ours.weight.view(torch.int32), to_torch(wq).view(torch.int32)), f"seed {seed}"
    assert torch.equal(ours.scales, to_torch(s)), f"seed {seed}"
    assert torch.equal(ours.biases, to_torch(b)), f"seed {seed}"
    assert ours.shape == tuple(shape) and ours.bits == bits


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_edge_groups_match_mlx(bits):
    """The groups affine quantisation treats specially, against mx.quantize: all zero, constant of either
    sign, a single non-zero value, one-sided ranges, an outlier, subnormal-sized and near-overflow values."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    ramp = torch.linspace(0.5, 1.0, 64)
    one = torch.zeros(64).index_fill(0, torch.tensor([5]), 1.0)
    rows = [torch.zeros(64), torch.full((64,), 0.37), torch.full((64,), -2.5), one, -one, ramp + 5, -ramp - 5,
            torch.randn(64, generator=g).index_fill(0, torch.tensor([3]), 3e38),
            torch.randn(64, generator=g) * 1e-30, torch.randn(64, generator=g) * 1e-8,
            torch.randn(64, generator=g) * 1e4, torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)]
    w = torch.stack(rows).to(torch.bfloat16)
    ours = quant.quantize(w, bits=bits)
    wq, s, b = mx.quantize(to_mx(w), group_size=64, bits=bits)
    assert torch.equal(ours.weight.view(torch.int32), to_torch(wq).view(torch.int32))
    assert torch.equal(ours.scales, to_torch(s)) and torch.equal(ours.biases, to_torch(b))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_fp32_input_matches_mlx(bits):
    w = random_weight(int(torch.randint(0, 2**31 - 1, ()).item()), (32, 192), dtype=torch.float32)
    ours = quant.quantize(w, bits=bits)
    wq, s, b = mx.quantize(to_mx(w), group_size=64, bits=bits)
    assert torch.equal(ours.weight.view(torch.int32), to_torch(wq).view(torch.int32))
    # MLX keeps fp32 scales for fp32 input; ours are stored in bf16 (the checkpoint dtype)
    assert torch.equal(ours.scales, to_torch(s).to(torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_match_mlx_layout(bits):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    codes = torch.randint(0, 1 << bits, (16, 128), generator=g, dtype=torch.int32)
    packed = quant.pack(codes, bits)
    assert packed.dtype == torch.uint32 and packed.shape == (16, 128 * bits // 32)
    assert torch.equal(quant.unpack(packed, bits), codes)
    # MLX reads our packed words back as the same codes: scale 1, bias 0 dequantizes to the codes
    ones = mx.ones((16, 2), dtype=mx.float32)
    deq = mx.dequantize(to_mx(packed), ones, mx.zeros_like(ones), group_size=64, bits=bits)
    assert torch.equal(to_torch(deq), codes.float())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_matches_mlx(bits, dtype):
    w = random_weight(int(torch.randint(0, 2**31 - 1, ()).item()), (2, 40, 256))
    wq, s, b = mx.quantize(to_mx(w), group_size=64, bits=bits)
    qt = quant.QuantTensor(to_torch(wq), to_torch(s), to_torch(b), bits)
    ours = qt.dequantize(dtype)
    mx_dtype = mx.bfloat16 if dtype == torch.bfloat16 else mx.float32
    # MLX dequantizes in the scales' dtype: bf16 scales -> bf16 arithmetic; fp32 scales -> fp32
    theirs = mx.dequantize(wq, s.astype(mx_dtype), b.astype(mx_dtype), group_size=64, bits=bits)
    assert ours.dtype == dtype
    assert torch.equal(ours, to_torch(theirs))


def test_quantized_values_reconstruct_closely():
    """Sanity of the affine scheme itself: 4-bit error within one step of each group's range (half a
    step of rounding, plus MLX's exact-edge scale adjustment and the bf16 rounding of scale and bias)."""
    w = random_weight(int(torch.randint(0, 2**31 - 1, ()).item()), (8, 128), dtype=torch.float32)
    qt = quant.quantize(w, bits=4)
    err = (qt.dequantize() - w).abs().reshape(8, 2, 64)
    step = (w.reshape(8, 2, 64).amax(-1) - w.reshape(8, 2, 64).amin(-1)) / 15
    assert (err.amax(-1) <= step).all()
    assert err.mean() < step.mean() * 0.35


def test_quantize_rejects_ragged_input_dim():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.quantize(torch.randn(4, 100))
