"""The MLX affine 4-bit checkpoint directory: strict reading and writing.

Layout on disk, as mlx_lm.convert writes it: config.json, model.safetensors or shards
model-0000i-of-0000n.safetensors listed by model.safetensors.index.json, tokenizer files.
Every tensor the config implies must be present with the right shape, dtype and bit width, and every
tensor in the files must be consumed (vision weights, and MTP weights under another prefix than lily's
`mtp.`, are skipped by name): a checkpoint that does not match exactly is refused with one line naming
the file, field or tensor. The MTP head (`mtp.*`, as `lily convert` writes it from the original
release) is loaded whole when it is complete; lily never runs it, so any other mtp.* tensors (a partial
head, or one another converter wrote) are skipped with one warning.

Weights are handed out under docs/internals.md names: `language_model.model.` dropped,
`language_model.lm_head` -> `lm_head`; quantized modules as QuantTensor keyed by module name.
Unquantized float tensors may be stored in float32, bfloat16 or float16; in memory A_log and dt_bias
are float32 and the norms and conv1d bfloat16 (layout.memory_dtype).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, tokenizer_dir_of
from lily.checkpoint.layout import TensorSpec, expected_tensors, memory_dtype
from lily.checkpoint.safetensors_dir import (DTYPE_NAME, StoredTensor, read_config_json, stream_tensors,
                                             weight_files)
from lily.config import MLX_REMEDY, ConfigError, ModelConfig
from lily.quant import QuantTensor

# Vision weights, and MTP heads in other layouts than lily's `mtp.*`: lily does not run them.
_SKIPPED = re.compile(r"^(vision_tower\.|model\.visual\.|language_model\.(model\.)?mtp\.)")
_FLOATS = ("F32", "BF16", "F16")
_ROUTER_GATES = (".mlp.gate", ".mlp.shared_expert_gate")
log = logging.getLogger("lily.checkpoint")


def read_mlx_config(d: Path) -> ModelConfig:
    f = d / "config.json"
    cfg = read_config_json(d)
    try:
        config = ModelConfig.from_config_json(cfg, source=str(f))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    # Per-module overrides other than the 8-bit router gates would change a module's bit width.
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    for key, val in q.items():
        if isinstance(val, dict) and not key.endswith(_ROUTER_GATES):
            if val.get("bits", config.bits) != config.bits or val.get("group_size", 64) != 64:
                raise CheckpointError(f"{f}: quantization.{key} is {val}: a mixed-precision recipe (mlx_lm.convert "
                                      f"--quant-predicate mixed_4_6 or the like; lily expects every module but the "
                                      f"router gates at {config.bits} bits, group 64); {MLX_REMEDY}")
        elif val is False:
            raise CheckpointError(f"{f}: quantization.{key} is false (unquantized module); lily expects it "
                                  f"quantized; {MLX_REMEDY}")
    return config


def _check_plain(d: Path, spec: TensorSpec, t: StoredTensor | None) -> None:
    name = spec.mlx_name
    if t is None:
        raise CheckpointError(f"{d}: missing tensor {name} (expected {DTYPE_NAME[spec.dtype]}{list(spec.shape)})")
    if t.dtype not in _FLOATS:
        raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, expected a float "
                              f"({', '.join(_FLOATS)})")
    on_disk = spec.shape + (1,) if name.endswith("conv1d.weight") else spec.shape  # MLX conv: [C, K, 1]
    if t.shape != on_disk:
        raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, expected {list(on_disk)} "
                              "from config.json")


def _check_quant(d: Path, spec: TensorSpec, w: StoredTensor | None, s: StoredTensor | None, b: StoredTensor | None,
                 group: int, quant: dict | None = None) -> None:
    """One quantized module's three tensors against its spec; `quant` (config.json's quantization block) lets
    a router gate of the wrong width be told against what the config says of it."""
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
        if t.dtype == "F16":
            raise CheckpointError(f"{t.file}: tensor {t.name} has dtype F16, expected BF16: float16 scales and biases "
                                  "(mlx_lm.convert --dtype float16); lily runs bf16 ones: mlx_lm.convert -q --q-bits 4 "
                                  "--q-group-size 64 --dtype bfloat16, or `lily convert` the original release")
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
        if quant is not None and name.endswith(_ROUTER_GATES):
            raise CheckpointError(f"{w.file}: tensor {w.name} is {got}, expected {spec.bits}-bit: "
                                  f"{_router_entry(name, quant, spec.bits)}; "
                                  f"re-convert with mlx_lm.convert -q --q-bits 4 --q-group-size 64 (it writes the "
                                  f"router gates at 8 bits, each with its entry), or `lily convert` the original "
                                  f"release")
        raise CheckpointError(f"{w.file}: tensor {w.name} packs input dim {n_in} into {packed} words: "
                              f"{got}, expected {spec.bits}-bit")


def _router_entry(name: str, quant: dict, bits: int) -> str:
    """What config.json's quantization block says of a router gate's width (lily reads one width for all)."""
    entry = quant.get(name)
    if isinstance(entry, dict):
        return f"config.json's quantization.{name} says {entry.get('bits')}-bit"
    if any(isinstance(v, dict) and k.endswith(_ROUTER_GATES) for k, v in quant.items()):
        return f"config.json's quantization block has no entry for {name} (its other router gates': {bits}-bit)"
    return (f"config.json's quantization block has no entry for {name} (nor for any router gate), which lily reads "
            f"as mlx-lm's {bits}-bit router gates")


@dataclass(frozen=True)
class Plan:
    spec: TensorSpec
    parts: tuple[StoredTensor, ...]  # (weight, scales, biases) or (tensor,)


def _plan_one(d: Path, spec: TensorSpec, stored: dict[str, StoredTensor], group: int, quant: dict) -> Plan:
    name = spec.mlx_name
    if spec.quantized:
        parts = tuple(stored.get(f"{name}.{x}") for x in ("weight", "scales", "biases"))
        _check_quant(d, spec, *parts, group=group, quant=quant)
    else:
        parts = (stored.get(name),)
        _check_plain(d, spec, parts[0])
    return Plan(spec, parts)


def _plan(d: Path, config: ModelConfig, quant: dict | None = None) -> list[Plan]:
    stored = weight_files(d)
    quant = quant or {}
    unused = {k for k in stored if not _SKIPPED.match(k)}
    plans = [_plan_one(d, spec, stored, config.group_size, quant) for spec in expected_tensors(config).values()]
    for p in plans:
        unused.difference_update(t.name for t in p.parts)
    mtp = sorted(k for k in unused if k.startswith("mtp."))
    if mtp:  # lily never runs the MTP head: loaded whole when it is lily's, else skipped with one warning
        try:
            if config.mtp_num_hidden_layers == 0:
                raise CheckpointError("config.json has no text_config.mtp_num_hidden_layers")
            head = [_plan_one(d, spec, stored, config.group_size, quant)
                    for key, spec in expected_tensors(config, mtp=True).items() if key.startswith("mtp.")]
            extra = set(mtp).difference(t.name for p in head for t in p.parts)
            if extra:
                raise CheckpointError(f"unexpected tensor {min(extra)}")
            plans += head
        except CheckpointError as e:
            _warn_once(f"{d}: skipping the MTP head's {len(mtp)} tensor(s) (mtp.*; lily does not run it): "
                       f"not lily's complete head ({str(e).removeprefix(f'{d}: ')})")
        unused.difference_update(mtp)
    if unused:
        first = sorted(unused)[0]
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointError(f"{stored[first].file}: unexpected tensor {first}{more}: not part of "
                              f"this model's config")
    return plans


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning about a checkpoint, logged once a process (check, serve and load read a directory again)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def inspect_mlx_checkpoint(d: Path) -> tuple[ModelConfig, list[Plan]]:
    """Validate everything that does not need the tensor data (config, names, shapes, dtypes, bits)."""
    config = read_mlx_config(d)
    cfg = read_config_json(d)
    quant = cfg.get("quantization") or cfg.get("quantization_config") or {}
    return config, _plan(d, config, quant)


def load_mlx_checkpoint(d: Path, device="cpu", progress: Progress | None = None) -> Checkpoint:
    """Validate and load an MLX affine checkpoint directory (see the module docstring)."""
    config, plans = inspect_mlx_checkpoint(d)
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
            weights[plan.spec.key] = from_mlx_tensors(plan.spec, [loaded.pop(x.name) for x in plan.parts],
                                                      config.group_size)
        if progress is not None:
            progress(done, total, nbytes, total_bytes)
    # keep the documented key order (embed first, lm_head, then the MTP head)
    weights = {s.spec.key: weights[s.spec.key] for s in plans}
    return Checkpoint(d, config, weights, tokenizer_dir_of(d))


def from_mlx_tensors(spec: TensorSpec, parts: list[torch.Tensor], group_size: int) -> QuantTensor | torch.Tensor:
    """One weight in memory from its tensors as the MLX files hold them: (weight, scales, biases) of a
    quantized module, or one plain tensor (conv1d [C, K, 1] -> [C, K]; float dtype -> memory_dtype)."""
    if spec.quantized:
        return QuantTensor(parts[0], parts[1], parts[2], spec.bits, group_size)
    t = parts[0].reshape(spec.shape) if spec.key.endswith("conv1d.weight") else parts[0]
    return t.to(memory_dtype(spec))


# -- writing ------------------------------------------------------------------------------------------

def _to_mlx_tensors(config: ModelConfig, weights: dict) -> Iterator[tuple[str, torch.Tensor]]:
    specs = expected_tensors(config, mtp=has_mtp(weights))
    missing = [k for k in specs if k not in weights]
    extra = [k for k in weights if k not in specs]
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, spec in specs.items():
        yield from mlx_tensors(spec, weights[key])


def mlx_tensors(spec: TensorSpec, w: QuantTensor | torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One weight as the MLX files hold it: (name, tensor) of its weight, scales and biases, or of itself."""
    name = spec.mlx_name
    if spec.quantized:
        if not isinstance(w, QuantTensor):
            raise ValueError(f"{spec.key}: expected a QuantTensor")
        yield name + ".weight", w.weight
        yield name + ".scales", w.scales
        yield name + ".biases", w.biases
    elif spec.key.endswith("conv1d.weight"):
        yield name, w.reshape(*w.shape, 1)
    else:
        yield name, w


def _new_file_mode() -> int:
    """The mode open() gives a new file (0o666 less the umask), as the config and tokenizer files get."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class ShardWriter:
    """Safetensors shards written as tensors stream in (each copied to the host when added, a shard
    saved once the next tensor would pass `shard_bytes`), then named as mlx-lm names them: one
    model.safetensors, or model-0000i-of-0000n.safetensors, with model.safetensors.index.json."""

    def __init__(self, out_dir: Path, shard_bytes: int | None = None):
        self.out, self.shard_bytes = Path(out_dir), shard_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[tuple[Path, list[str]]] = []  # (temporary file, its tensor names)
        self.bytes_written = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nb = t.numel() * t.element_size()
        if self.shard_bytes is not None and self._shard and self._size + nb > self.shard_bytes:
            self._flush()
        self._shard[name] = t.detach().to("cpu").contiguous()
        self._size += nb

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = self.out / f"model-{len(self._files) + 1:05d}.safetensors.partial"
        try:
            save_file(self._shard, str(tmp), metadata={"format": "mlx"})
        except OSError:
            raise
        except Exception as e:  # safetensors' own SafetensorError, even for a full disk: an OSError when it says so
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code:
                raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(tmp)) from None
            raise CheckpointError(f"{tmp}: cannot be written ({e})") from None
        os.chmod(tmp, _new_file_mode())  # save_file makes it 0600: another user or a container uid could not read it
        self._files.append((tmp, list(self._shard)))
        self.bytes_written += self._size
        self._shard, self._size = {}, 0

    def close(self, config_json: dict) -> Path:
        """Save the last shard, give the shards their final names, write the index and config.json."""
        if self._shard or not self._files:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._files):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            tmp.rename(self.out / fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": self.bytes_written}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
        (self.out / "config.json").write_text(json.dumps(config_json, indent=4, sort_keys=True))
        return self.out


def write_checkpoint(out_dir, config: ModelConfig, weights: dict, shard_bytes: int | None = None,
                     progress: Progress | None = None) -> Path:
    """Write `weights` (internals.md names) as mlx_lm.convert does: config.json, one model.safetensors or
    shards model-0000i-of-0000n.safetensors when shard_bytes is given, and model.safetensors.index.json
    (mlx-lm writes the index in both cases). Tensors may live on any device; each shard is copied to the
    host only while it is written."""
    tensors = list(_to_mlx_tensors(config, weights))
    n_tensors, all_bytes = len(tensors), sum(t.numel() * t.element_size() for _, t in tensors)
    writer = ShardWriter(out_dir, shard_bytes)
    for i, (name, t) in enumerate(tensors):
        writer.add(name, t)
        if progress is not None:
            progress(i + 1, n_tensors, writer.bytes_written + writer._size, all_bytes)
    return writer.close(config.mlx_config_json(with_mtp=has_mtp(weights)))


def has_mtp(weights: dict) -> bool:
    return any(k.startswith("mtp.") for k in weights)
