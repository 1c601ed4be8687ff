"""Moving tensors between mlx and torch bit for bit (bf16 and packed uint32 words included)."""

import numpy as np
import torch

import mlx.core as mx
from mlx.utils import tree_map


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


def mlx_logprobs_fp32(ckpt_dir, ids) -> torch.Tensor:
    """mlx-lm's log-probabilities [T, V] (float64) for a prompt, the checkpoint's float parameters (bf16
    norms, scales, biases) cast up exactly to float32 so the whole forward runs in float32."""
    from mlx_lm.utils import load_model

    model, _ = load_model(ckpt_dir)
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    logits = model(mx.array([ids]))[0]
    assert logits.dtype == mx.float32
    return torch.log_softmax(to_torch(logits).double(), -1)


def lily_logprobs_fp32(ckpt, ids) -> torch.Tensor:
    """lily's reference model (float32) on a loaded Checkpoint: log-probabilities [T, V] (float64)."""
    from lily.model.reference import ReferenceModel

    model = ReferenceModel(ckpt.config, ckpt.weights, device="cpu", dtype=torch.float32)
    return torch.log_softmax(model.forward(torch.tensor(ids), model.new_state()).double(), -1)
