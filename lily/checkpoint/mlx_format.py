"""The MLX affine 4-bit checkpoint directory: strict reading and writing.

Layout on disk, as mlx_lm.convert writes it: config.json, model.safetensors or shards
model-0000i-of-0000n.safetensors listed by model.safetensors.index.json, tokenizer files.
Every tensor the config implies must be present with the right shape, dtype and bit width, and every
tensor in the files must be consumed (vision and MTP weights are skipped by name): a checkpoint that
does not match exactly is refused with one line naming the file, field or tensor.

Weights are handed out under docs/internals.md names: `language_model.model.` dropped,
`language_model.lm_head` -> `lm_head`; quantized modules as QuantTensor keyed by module name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, tokenizer_dir_of
from lily.checkpoint.layout import TensorSpec, expected_tensors
from lily.checkpoint.safetensors_dir import (DTYPE_NAME, StoredTensor, read_config_json, stream_tensors,
                                             weight_files)
from lily.config import ConfigError, ModelConfig
from lily.quant import QuantTensor

# MLX writes these; lily does not run them.
_SKIPPED = re.compile(r"^(vision_tower\.|model\.visual\.|(language_model\.)?(model\.)?mtp\.)")


def _read_config(d: Path) -> ModelConfig:
    f = d / "config.json"
    cfg = read_config_json(d)
    try:
        config = ModelConfig.from_config_json(cfg, source=str(f))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    # Per-module overrides other than the 8-bit router gates would change a module's bit width.
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    for key, val in q.items():
        if isinstance(val, dict) and not key.endswith((".mlp.gate", ".mlp.shared_expert_gate")):
            if val.get("bits", config.bits) != config.bits or val.get("group_size", 64) != 64:
                raise CheckpointError(f"{f}: quantization.{key} is {val}; lily expects every module but the "
                                      f"router gates at {config.bits} bits, group 64")
        elif val is False:
            raise CheckpointError(f"{f}: quantization.{key} is false (unquantized module); lily expects it "
                                  "quantized")
    return config


def _check_plain(d: Path, spec: TensorSpec, t: StoredTensor | None) -> None:
    name = spec.mlx_name
    if t is None:
        raise CheckpointError(f"{d}: missing tensor {name} (expected {DTYPE_NAME[spec.dtype]}{list(spec.shape)})")
    on_disk = spec.shape + (1,) if name.endswith("conv1d.weight") else spec.shape  # MLX conv: [C, K, 1]
    if t.shape != on_disk:
        raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, expected {list(on_disk)} "
                              "from config.json")
    if t.dtype != DTYPE_NAME[spec.dtype]:
        raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, expected {DTYPE_NAME[spec.dtype]}")


def _check_quant(d: Path, spec: TensorSpec, w: StoredTensor | None, s: StoredTensor | None, b: StoredTensor | None,
                 group: int) -> None:
    name = spec.mlx_name
    *lead, out, n_in = spec.shape
    for part, t in (("weight", w), ("scales", s), ("biases", b)):
        if t is None:
            raise CheckpointError(f"{d}: missing tensor {name}.{part} (quantized module {name}, logical shape "
                                  f"{list(spec.shape)})")
    for t in (s, b):
        if t.shape != (*lead, out, n_in // group):
            raise CheckpointError(f"{t.file}: tensor {t.name} has shape {list(t.shape)}, expected "
                                  f"{[*lead, out, n_in // group]} (logical {list(spec.shape)} from config.json, "
                                  f"group {group})")
        if t.dtype != "BF16":
            raise CheckpointError(f"{t.file}: tensor {t.name} has dtype {t.dtype}, expected BF16")
    if w.dtype != "U32":
        raise CheckpointError(f"{w.file}: tensor {w.name} has dtype {w.dtype}, expected U32 (packed codes)")
    if len(w.shape) != len(spec.shape) or w.shape[:-1] != (*lead, out):
        raise CheckpointError(f"{w.file}: tensor {w.name} has shape {list(w.shape)}, expected "
                              f"{[*lead, out, n_in * spec.bits // 32]} from config.json")
    packed = w.shape[-1]
    bits = packed * 32 / n_in
    if bits != spec.bits:
        got = f"{int(bits)}-bit" if bits == int(bits) else f"{bits:g} bits per weight"
        raise CheckpointError(f"{w.file}: tensor {w.name} packs input dim {n_in} into {packed} words: "
                              f"{got}, expected {spec.bits}-bit")


@dataclass(frozen=True)
class _Plan:
    spec: TensorSpec
    parts: tuple[StoredTensor, ...]  # (weight, scales, biases) or (tensor,)


def _plan(d: Path, config: ModelConfig) -> list[_Plan]:
    stored = weight_files(d)
    unused = {k for k in stored if not _SKIPPED.match(k)}
    plans = []
    for spec in expected_tensors(config).values():
        name = spec.mlx_name
        if spec.quantized:
            parts = tuple(stored.get(f"{name}.{x}") for x in ("weight", "scales", "biases"))
            _check_quant(d, spec, *parts, group=config.group_size)
        else:
            parts = (stored.get(name),)
            _check_plain(d, spec, parts[0])
        for t in parts:
            unused.discard(t.name)
        plans.append(_Plan(spec, parts))
    if unused:
        first = sorted(unused)[0]
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointError(f"{stored[first].file}: unexpected tensor {first}{more}: not part of "
                              f"this model's config")
    return plans


def inspect_checkpoint(path) -> tuple[ModelConfig, list[_Plan]]:
    """Validate everything that does not need the tensor data (config, names, shapes, dtypes, bits)."""
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{d}: no such directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory (expected a checkpoint directory with config.json)")
    config = _read_config(d)
    return config, _plan(d, config)


def load_checkpoint(path, device="cpu", progress: Progress | None = None) -> Checkpoint:
    """Open, validate and load an MLX affine checkpoint directory (see the module docstring)."""
    d = Path(path)
    config, plans = inspect_checkpoint(d)
    total = sum(len(p.parts) for p in plans)
    total_bytes = sum(t.nbytes for p in plans for t in p.parts)
    owner = {t.name: p for p in plans for t in p.parts}
    loaded: dict[str, torch.Tensor] = {}
    weights: dict[str, QuantTensor | torch.Tensor] = {}
    done = nbytes = 0
    for t, tensor in stream_tensors((t for p in plans for t in p.parts), device):
        loaded[t.name] = tensor
        done, nbytes = done + 1, nbytes + t.nbytes
        plan = owner[t.name]
        if all(x.name in loaded for x in plan.parts):
            parts = [loaded.pop(x.name) for x in plan.parts]
            spec = plan.spec
            if spec.quantized:
                weights[spec.key] = QuantTensor(parts[0], parts[1], parts[2], spec.bits, config.group_size)
            elif spec.key.endswith("conv1d.weight"):
                weights[spec.key] = parts[0].reshape(spec.shape)  # [C, K, 1] -> [C, K]
            else:
                weights[spec.key] = parts[0]
        if progress is not None:
            progress(done, total, nbytes, total_bytes)
    # keep the documented key order (embed first, lm_head last)
    weights = {s.spec.key: weights[s.spec.key] for s in plans}
    return Checkpoint(d, config, weights, tokenizer_dir_of(d))


# -- writing ------------------------------------------------------------------------------------------

def _to_mlx_tensors(config: ModelConfig, weights: dict) -> Iterator[tuple[str, torch.Tensor]]:
    specs = expected_tensors(config)
    missing = [k for k in specs if k not in weights]
    extra = [k for k in weights if k not in specs]
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, spec in specs.items():
        w = weights[key]
        name = spec.mlx_name
        if spec.quantized:
            if not isinstance(w, QuantTensor):
                raise ValueError(f"{key}: expected a QuantTensor")
            yield name + ".weight", w.weight
            yield name + ".scales", w.scales
            yield name + ".biases", w.biases
        elif key.endswith("conv1d.weight"):
            yield name, w.reshape(*w.shape, 1)
        else:
            yield name, w


def write_checkpoint(out_dir, config: ModelConfig, weights: dict, shard_bytes: int | None = None,
                     progress: Progress | None = None) -> Path:
    """Write `weights` (internals.md names) as mlx_lm.convert does: config.json, one model.safetensors or
    shards model-0000i-of-0000n.safetensors when shard_bytes is given, and model.safetensors.index.json
    (mlx-lm writes the index in both cases). Tensors may live on any device; each shard is copied to the
    host only while it is written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in _to_mlx_tensors(config, weights):
        nb = t.numel() * t.element_size()
        if shard_bytes is not None and shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nb
    n = len(shards)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    weight_map, total = {}, 0
    n_tensors, all_bytes = sum(len(sh) for sh in shards), sum(t.numel() * t.element_size() for sh in shards
                                                                   for _, t in sh)
    for i, shard in enumerate(shards):
        fname = fmt.format(i + 1, n)
        host = {name: t.detach().to("cpu").contiguous() for name, t in shard}
        save_file(host, str(out / fname), metadata={"format": "mlx"})
        for name, t in host.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del host
        if progress is not None:
            progress(len(weight_map), n_tensors, total, all_bytes)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (out / "config.json").write_text(json.dumps(config.mlx_config_json(), indent=4, sort_keys=True))
    return out

