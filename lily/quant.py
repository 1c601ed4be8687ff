"""MLX affine quantization, exactly as MLX does it: LSB-first codes packed in uint32, group 64,
w = scale * q + bias, scales and biases in the weight's dtype (bf16 in checkpoints).

A quantized Linear [out, in] is (weight uint32 [out, in*bits/32], scales [out, in/64], biases [out, in/64]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantTensor:
    """One MLX-quantized weight (any leading dims, e.g. experts stacked [E, out, in])."""

    weight: torch.Tensor  # uint32 [..., out, in*bits/32]
    scales: torch.Tensor  # [..., out, in/group]
    biases: torch.Tensor  # [..., out, in/group]
    bits: int
    group_size: int = 64

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        *lead, out, packed = self.weight.shape
        return (*lead, out, packed * 32 // self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size, dtype)

    def to(self, device) -> "QuantTensor":
        return QuantTensor(self.weight.to(device), self.scales.to(device), self.biases.to(device),
                           self.bits, self.group_size)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 [..., n] -> codes int32 [..., n * 32 // bits], LSB first."""
    per = 32 // bits
    p = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed.to(torch.int32)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift is fine: we mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (ints in [0, 2^bits)) [..., n] -> uint32 [..., n * bits // 32], LSB first."""
    per = 32 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    words = c[..., 0].clone()
    for k in range(1, per):  # int32 bit operations: the top field's bits land where uint32 has them
        words |= c[..., k] << (k * bits)
    return words.view(torch.uint32)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = unpack(weight, bits).to(torch.float32)
    *lead, out, n = q.shape
    q = q.reshape(*lead, out, n // group_size, group_size)
    s, b = scales.to(torch.float32).unsqueeze(-1), biases.to(torch.float32).unsqueeze(-1)
    if dtype in (torch.bfloat16, torch.float16):
        # MLX computes a half-precision dequantize in that precision: round scale*q, then round (+ bias).
        # (q * s is exact in fp32, so rounding the fp32 product and sum matches it bit for bit.)
        w = ((q * s).to(dtype).to(torch.float32) + b).to(dtype)
    else:
        w = (q * s + b).to(dtype)
    return w.reshape(*lead, out, n)


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64,
             scale_dtype: torch.dtype = torch.bfloat16) -> QuantTensor:
    """Affine-quantize as mlx.core.quantize does (its CPU path): per group, the end of larger magnitude
    (`edge`) is represented exactly; scale = +-(max - min) / (2^bits - 1) signed so that edge is code 0 or
    a whole code, bias = edge (or 0); codes = clip(round((w - bias) / scale)) with fp32 scale and bias,
    which are then rounded to `scale_dtype` for storage. Scales may be negative, as in MLX."""
    *lead, out, n = w.shape
    if n % group_size:
        raise ValueError(f"input dim {n} is not a multiple of group_size {group_size}")
    g = w.to(torch.float32).reshape(*lead, out, n // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    wmax = g.amax(-1, keepdim=True)
    wmin = g.amin(-1, keepdim=True)
    mask = wmin.abs() > wmax.abs()
    # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal, which rounds
    # differently from the true division mlx (and the CPU) does, and changes the bits
    scale = torch.clamp((wmax - wmin) / torch.full_like(wmax, n_bins), min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, wmin, wmax)
    q0 = torch.round(edge / scale)
    scale = torch.where(q0 != 0, edge / q0, scale)
    bias = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    codes = torch.clamp(torch.round((g - bias) / scale), 0, n_bins)
    codes = codes.reshape(*lead, out, n).to(torch.int32)
    return QuantTensor(pack(codes, bits), scale.squeeze(-1).to(scale_dtype), bias.squeeze(-1).to(scale_dtype),
                       bits, group_size)
