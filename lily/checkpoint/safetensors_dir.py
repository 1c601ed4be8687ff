"""A directory of safetensors files: headers read and checked by hand (so a broken file gives one clear
line), the index resolved, the config.json parsed, and tensors streamed one at a time."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from lily.checkpoint.base import CheckpointError

DTYPES = {  # safetensors dtype string -> (torch dtype, bytes per element)
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1),
    "U16": (torch.uint16, 2), "I16": (torch.int16, 2), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "U32": (torch.uint32, 4), "I32": (torch.int32, 4), "F32": (torch.float32, 4),
    "U64": (torch.uint64, 8), "I64": (torch.int64, 8), "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}
DTYPE_NAME = {t: name for name, (t, _) in DTYPES.items()}


LFS_POINTER = ("this is a Git LFS pointer, not the weights (a git clone without git-lfs): run `git lfs pull` in "
               "the checkpoint's directory, or download it with `hf download REPO --local-dir DIR`")


def is_lfs_pointer(path: Path) -> bool:
    """A Git LFS pointer file (what a clone without git-lfs leaves in place of a large file): a few lines of text
    beginning `version https://git-lfs`."""
    try:
        with open(path, "rb") as f:
            return f.read(32).startswith(b"version https://git-lfs")
    except OSError:
        return False


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
            if size < 1024 and is_lfs_pointer(path):
                raise CheckpointError(f"{path}: {LFS_POINTER}")
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
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unknown dtype {dtype!r}")
        nbytes = math.prod(shape) * DTYPES[dtype][1]
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



def read_config_json(d: Path) -> dict:
    """config.json of a checkpoint directory, as a dict (one-line errors for a missing or broken file)."""
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d}: no config.json (not a model checkpoint directory)")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):  # valid JSON, but a list or a string is no model config
        raise CheckpointError(f"{f}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def weight_files(d: Path) -> dict[str, StoredTensor]:
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


def stream_tensors(tensors: Iterable[StoredTensor], device) -> Iterator[tuple[StoredTensor, torch.Tensor]]:
    """Each stored tensor, grouped file by file, copied to `device` as soon as it is read."""
    from safetensors import safe_open

    by_file: dict[Path, list[StoredTensor]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    dev = torch.device(device)
    for file, group in by_file.items():
        try:
            # safe_open maps the file; get_tensor copies one tensor straight to the device.
            with safe_open(str(file), framework="pt", device=str(dev)) as f:
                for t in group:
                    yield t, f.get_tensor(t.name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read safetensors data ({e})") from None
