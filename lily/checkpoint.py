"""Strict loading (and writing) of an MLX affine 4-bit checkpoint directory.

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
import math
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from lily.config import ConfigError, ModelConfig
from lily.quant import QuantTensor


class CheckpointError(ValueError):
    """A checkpoint lily cannot run: the one-line message names the file, field or tensor."""


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, QuantTensor | torch.Tensor]
    tokenizer_dir: Path | None


# -- what the config implies ------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One entry of the weights dict: a quantized module (bits set) or a plain tensor (dtype set)."""

    key: str                 # lily name (internals.md)
    shape: tuple[int, ...]   # logical shape (conv1d: [C, K], as lily hands it out)
    bits: int | None = None  # quantized module: expected bit width
    dtype: torch.dtype | None = None  # plain tensor: expected dtype

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def mlx_name(self) -> str:
        return mlx_name(self.key)


def mlx_name(key: str) -> str:
    """lily key -> tensor/module name in the MLX files."""
    return "language_model.lm_head" if key == "lm_head" else "language_model.model." + key


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every weight the config implies, in a stable order (the order files are written in)."""
    c, bf16 = config, torch.bfloat16
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    specs: list[TensorSpec] = [TensorSpec("embed_tokens", (c.vocab_size, H), bits=c.bits)]

    def q(key, *shape, bits=c.bits):
        specs.append(TensorSpec(key, tuple(shape), bits=bits))

    def p(key, *shape, dtype=bf16):
        specs.append(TensorSpec(key, tuple(shape), dtype=dtype))

    for i, kind in enumerate(c.layer_types):
        L = f"layers.{i}"
        p(f"{L}.input_layernorm.weight", H)
        p(f"{L}.post_attention_layernorm.weight", H)
        if kind == "full_attention":
            a = f"{L}.self_attn"
            q(f"{a}.q_proj", c.attn_q_dim, H)
            q(f"{a}.k_proj", c.attn_kv_dim, H)
            q(f"{a}.v_proj", c.attn_kv_dim, H)
            q(f"{a}.o_proj", H, c.num_attention_heads * c.head_dim)
            p(f"{a}.q_norm.weight", c.head_dim)
            p(f"{a}.k_norm.weight", c.head_dim)
        else:
            g = f"{L}.linear_attn"
            q(f"{g}.in_proj_qkv", c.linear_conv_dim, H)
            q(f"{g}.in_proj_z", c.linear_value_dim, H)
            q(f"{g}.in_proj_b", c.linear_num_value_heads, H)
            q(f"{g}.in_proj_a", c.linear_num_value_heads, H)
            p(f"{g}.conv1d.weight", c.linear_conv_dim, c.linear_conv_kernel_dim)
            p(f"{g}.A_log", c.linear_num_value_heads, dtype=torch.float32)
            p(f"{g}.dt_bias", c.linear_num_value_heads)
            p(f"{g}.norm.weight", c.linear_value_head_dim)
            q(f"{g}.out_proj", H, c.linear_value_dim)
        m = f"{L}.mlp"
        q(f"{m}.gate", E, H, bits=c.router_bits)
        q(f"{m}.switch_mlp.gate_proj", E, I, H)
        q(f"{m}.switch_mlp.up_proj", E, I, H)
        q(f"{m}.switch_mlp.down_proj", E, H, I)
        q(f"{m}.shared_expert.gate_proj", Is, H)
        q(f"{m}.shared_expert.up_proj", Is, H)
        q(f"{m}.shared_expert.down_proj", H, Is)
        q(f"{m}.shared_expert_gate", 1, H, bits=c.router_bits)
    p("norm.weight", H)
    q("lm_head", c.vocab_size, H)
    return {s.key: s for s in specs}


# MLX writes these; lily does not run them.
_SKIPPED = re.compile(r"^(vision_tower\.|model\.visual\.|(language_model\.)?(model\.)?mtp\.)")

_DTYPES = {  # safetensors dtype string -> (torch dtype, bytes per element)
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1),
    "U16": (torch.uint16, 2), "I16": (torch.int16, 2), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "U32": (torch.uint32, 4), "I32": (torch.int32, 4), "F32": (torch.float32, 4),
    "U64": (torch.uint64, 8), "I64": (torch.int64, 8), "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}
_DTYPE_NAME = {t: name for name, (t, _) in _DTYPES.items()}


# -- reading safetensors headers ourselves (so a broken file gives a clear message) -----------------

@dataclass(frozen=True)
class StoredTensor:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """Parse and check a .safetensors header: 8-byte little-endian length, JSON, data offsets that
    tile the data section and stay inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file (header length {n} "
                                      f"but the file has {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (invalid JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, StoredTensor] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape) or not (
                    isinstance(start, int) and isinstance(end, int)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unknown dtype {dtype!r}")
        nbytes = math.prod(shape) * _DTYPES[dtype][1]
        if end - start != nbytes or start < 0:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name} {dtype}{list(shape)} "
                                  f"needs {nbytes} bytes but its data_offsets span {end - start}")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated safetensors file: tensor {name} ends at byte "
                                  f"{8 + n + end} but the file has {size} bytes")
        spans.append((start, end, name))
        out[name] = StoredTensor(path, name, dtype, shape, nbytes)
    spans.sort()
    pos = 0
    for start, end, name in spans:
        if start < pos:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name} overlaps another")
        pos = end
    return out


# -- the directory ----------------------------------------------------------------------------------

def _read_config(d: Path) -> ModelConfig:
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d}: no config.json (not a model checkpoint directory)")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
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


def _weight_files(d: Path) -> dict[str, StoredTensor]:
    """All tensors in the directory's safetensors files (via the index when there is one)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: invalid index (expected JSON with a 'weight_map' object: {e})") \
                from None
        for name in weight_map.values():
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise CheckpointError(f"{index}: weight_map names file {name!r}; expected a file in the directory")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (d / name).is_file():
                raise CheckpointError(f"{index}: weight_map names {name}, which does not exist in {d}")
    else:
        weight_map = None
        files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors files and no model.safetensors.index.json")
    stored: dict[str, StoredTensor] = {}
    for name in files:
        for t in read_safetensors_header(d / name).values():
            if t.name in stored:
                raise CheckpointError(f"{d / name}: tensor {t.name} is also in {stored[t.name].file.name}")
            stored[t.name] = t
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if tname not in stored or stored[tname].file.name != fname:
                raise CheckpointError(f"{index}: weight_map puts {tname} in {fname}, but that file does not hold it")
        for tname, t in stored.items():
            if tname not in weight_map:
                raise CheckpointError(f"{t.file}: tensor {tname} is not listed in {index.name}")
    return stored


def _check_plain(d: Path, spec: TensorSpec, t: StoredTensor | None) -> None:
    name = spec.mlx_name
    if t is None:
        raise CheckpointError(f"{d}: missing tensor {name} (expected {_DTYPE_NAME[spec.dtype]}{list(spec.shape)})")
    on_disk = spec.shape + (1,) if name.endswith("conv1d.weight") else spec.shape  # MLX conv: [C, K, 1]
    if t.shape != on_disk:
        raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, expected {list(on_disk)} "
                              "from config.json")
    if t.dtype != _DTYPE_NAME[spec.dtype]:
        raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, expected {_DTYPE_NAME[spec.dtype]}")


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
    stored = _weight_files(d)
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


def tokenizer_dir_of(d: Path) -> Path | None:
    return d if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() else None


# -- progress -----------------------------------------------------------------------------------------

Progress = Callable[[int, int, int, int], None]  # (tensors done, tensors total, bytes done, bytes total)


def stderr_progress(what: str = "loading") -> Progress:
    """A progress callback that rewrites one stderr line, at most ~5 times a second."""
    last = [0.0]

    def show(done, total, nbytes, total_bytes):
        now = time.monotonic()
        if done != total and now - last[0] < 0.2:
            return
        last[0] = now
        end = "\n" if done == total else ""
        sys.stderr.write(f"\r{what} weights: {done}/{total} tensors, "
                         f"{nbytes / 1e9:.2f}/{total_bytes / 1e9:.2f} GB{end}")
        sys.stderr.flush()

    return show


# -- loading ------------------------------------------------------------------------------------------

def inspect_checkpoint(path) -> tuple[ModelConfig, list[_Plan]]:
    """Validate everything that does not need the tensor data (config, names, shapes, dtypes, bits)."""
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{d}: no such directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory (expected a checkpoint directory with config.json)")
    config = _read_config(d)
    return config, _plan(d, config)


def _stream(plans: list[_Plan], device) -> Iterator[tuple[StoredTensor, torch.Tensor]]:
    """Each stored tensor once, file by file, moved to `device` as soon as it is read."""
    from safetensors import safe_open

    by_file: dict[Path, list[StoredTensor]] = {}
    for plan in plans:
        for t in plan.parts:
            by_file.setdefault(t.file, []).append(t)
    dev = torch.device(device)
    for file, tensors in by_file.items():
        try:
            # safe_open maps the file; get_tensor copies one tensor straight to the device.
            with safe_open(str(file), framework="pt", device=str(dev)) as f:
                for t in tensors:
                    yield t, f.get_tensor(t.name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read safetensors data ({e})") from None


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
    for t, tensor in _stream(plans, device):
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


def describe(config: ModelConfig) -> str:
    """A short human summary of a config (used by `lily check`)."""
    c = config
    return (f"{c.num_hidden_layers} layers ({len(c.linear_attention_layers)} gated DeltaNet, "
            f"{len(c.full_attention_layers)} full attention), hidden {c.hidden_size}, vocab {c.vocab_size}, "
            f"{c.num_experts} experts top-{c.num_experts_per_tok} (intermediate {c.moe_intermediate_size}, "
            f"shared {c.shared_expert_intermediate_size}), attention {c.num_attention_heads}q/"
            f"{c.num_key_value_heads}kv x {c.head_dim}, GDN {c.linear_num_key_heads}k/{c.linear_num_value_heads}v "
            f"x {c.linear_key_head_dim}, {c.bits}-bit group {c.group_size} (router {c.router_bits}-bit)")


__all__ = ["Checkpoint", "CheckpointError", "TensorSpec", "expected_tensors", "mlx_name", "load_checkpoint",
           "inspect_checkpoint", "write_checkpoint", "read_safetensors_header", "stderr_progress", "describe",
           "tokenizer_dir_of"]
