"""Moving tensors between mlx and torch bit for bit (bf16 and packed uint32 words included)."""

import numpy as np
import torch

import mlx.core as mx


def to_mx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy().view(np.uint32))
    return mx.array(t.numpy())


def to_torch(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32)).view(torch.uint32)
    return torch.from_numpy(np.array(a))
