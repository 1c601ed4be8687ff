"""RoPE's frequencies from the config: plain (theta^(-2j / rotary_dim)), or scaled for long contexts by
config.rope_scaling ("linear", "yarn"), as transformers computes them (modeling_rope_utils) and vLLM does.

Every attention kernel takes its frequencies as a tensor (inv_freq, rotary_dim / 2 of them), so a scaling is
only other numbers there. YaRN also scales cos and sin by an attention factor: on q and on k, so the rotary
dims' part of each score by its square and the other dims' part not at all (partial RoPE). The reference
model multiplies cos and sin as transformers does; the fast backend folds the factor into q_norm's and k_norm's
gains over the rotary dims instead (RoPE is linear, so rotating g * x is g times rotating x), which leaves
every kernel as it is.
"""

from __future__ import annotations

import math

import torch

from lily.config import ModelConfig
from lily.kernels import attention_decode, flash_attention


def inv_freq(config: ModelConfig, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The rotary_dim / 2 inverse frequencies. Plain RoPE: float64 as the reference and the prefill kernels
    take them, float32 as the decode kernels do (Hugging Face's float32 formula), each the values those used
    before scaling existed; a scaled one computed in float64, then cast."""
    c = config
    s = c.rope_scaling
    if s is None:
        if dtype == torch.float64:
            return flash_attention.rope_inv_freq(c.rotary_dim, c.rope_theta, device)
        return attention_decode.rope_inv_freq(c.rotary_dim, c.rope_theta, device).to(dtype)
    dim = c.rotary_dim
    pos_freqs = c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    if s.rope_type == "linear":
        out = interpolation
    else:
        low, high = _yarn_correction_range(s.beta_fast, s.beta_slow, dim, c.rope_theta,
                                           s.original_max_position_embeddings, s.truncate)
        if low == high:
            high += 0.001                # (transformers: no zero-width ramp)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp                  # 1: the original frequency (high ones), 0: interpolated (low ones)
        out = interpolation * (1 - keep) + extrapolation * keep
    return out.to(device=device, dtype=dtype)


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int,
                           truncate: bool) -> tuple[float, float]:
    """The dims between which YaRN's ramp runs: where a frequency turns beta_fast and beta_slow times over the
    pretrained context."""
    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (1.0 but for YaRN)."""
    s = config.rope_scaling
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def qk_norm_gain(config: ModelConfig, gain: torch.Tensor) -> torch.Tensor:
    """q_norm's or k_norm's gain [head_dim] in fp32 with the attention factor folded into its rotary dims (the
    fast backend's kernels apply no factor of their own); the gain itself where the factor is 1."""
    gain = gain.float()
    factor = attention_factor(config)
    if factor == 1.0:
        return gain
    scale = torch.ones_like(gain)
    scale[:config.rotary_dim] = factor
    return gain * scale
