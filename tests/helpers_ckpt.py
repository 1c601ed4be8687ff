"""Shared test fixtures: tiny MLX-format checkpoints on disk.

    from helpers_ckpt import write_tiny_checkpoint     # tests/ is on sys.path under pytest
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=1)           # TINY config, no tokenizer
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", tokenizer=True)   # + demo tokenizer/template
    ckpt = lily.checkpoint.load_checkpoint(path)                     # ckpt.weights == as_loaded(weights)

`weights` is the dict that was written (docs/internals.md names; lily.synthetic.random_weights scaling).
Use a fresh seed per test so each check sees new random inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lily.checkpoint import write_checkpoint
from lily.config import TINY, ModelConfig
from lily.quant import QuantTensor
from lily.synthetic import random_weights


def write_tiny_checkpoint(path, config: ModelConfig = TINY, seed: int = 0, tokenizer: bool = False,
                          shard_bytes: int | None = None) -> tuple[Path, dict]:
    """Write a random checkpoint of `config` to `path` in the exact MLX on-disk format."""
    weights = random_weights(config, seed=seed)
    out = write_checkpoint(path, config, weights, shard_bytes=shard_bytes)
    if tokenizer:
        from lily.demo_tokenizer import write_tokenizer_files

        write_tokenizer_files(out)
    return out, weights


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n random token ids in [0, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def same_weight(a, b) -> bool:
    """Bit-identical QuantTensors (codes, scales, biases, bits) or plain tensors (values and dtype)."""
    if isinstance(a, QuantTensor) or isinstance(b, QuantTensor):
        return (isinstance(a, QuantTensor) and isinstance(b, QuantTensor) and a.bits == b.bits
                and all(torch.equal(x.cpu(), y.cpu()) and x.dtype == y.dtype
                        for x, y in ((a.weight, b.weight), (a.scales, b.scales), (a.biases, b.biases))))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def as_loaded(weights: dict) -> dict:
    """What the loader hands out for written `weights` (docs/internals.md): the same tensors, with A_log and
    dt_bias in float32 (exact upcasts of what the file holds)."""
    return {k: w.float() if k.endswith(("A_log", "dt_bias")) else w for k, w in weights.items()}


def edit_config(path, fn) -> None:
    """Rewrite path/config.json through fn(dict) (mutate in place)."""
    f = Path(path) / "config.json"
    cfg = json.loads(f.read_text())
    fn(cfg)
    f.write_text(json.dumps(cfg))


def refused(path, *needles, **load_kwargs) -> str:
    """load_checkpoint(path) must raise CheckpointError with one line holding every needle; returns it."""
    import pytest

    from lily.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, **load_kwargs)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def edit_tensors(path, fn):
    """Rewrite model.safetensors through fn(dict of tensors) and keep the index consistent."""
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    idx["weight_map"] = {k: "model.safetensors" for k in sorted(tensors)}
    index.write_text(json.dumps(idx))
