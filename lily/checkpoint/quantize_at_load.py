"""Quantise at load, and `lily convert`: an original bf16 or FP8 release -> lily's MLX affine 4-bit weights,
bit for bit what `mlx_lm.convert -q --q-bits 4 --q-group-size 64 --dtype bfloat16` writes from the bf16 input.

The steps mirror mlx-lm's conversion: per tensor, in its stored dtype, the five zero-centred norms get
+1.0 and conv1d turns [C, 1, K] -> [C, K, 1]; every float tensor but A_log is cast to bfloat16 (FP8
weights are first dequantised to bfloat16 block by block); Linear, embedding and expert weights are
quantised (group 64, 4-bit; the router `mlp.gate` and `mlp.shared_expert_gate` 8-bit) by lily.quant,
which is bit-exact with mlx.core.quantize. The MTP head goes through the same steps (lily keeps it,
named `mtp.*`; mlx-lm drops it).

Memory: one job's source tensors at a time (a layer's experts at most), the next job read ahead by one
thread while this one is quantised; quantisation works on slabs of rows so its float32 temporaries stay
bounded. Runs on the GPU when asked (torch ops: the same bits as on the CPU).
"""

from __future__ import annotations

import math
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, tokenizer_dir_of
from lily.checkpoint.fp8 import dequantize_fp8_rows
from lily.checkpoint.layout import TensorSpec, zero_centred_in_hf
from lily.checkpoint.mlx_format import ShardWriter, from_mlx_tensors
from lily.checkpoint.original_format import Fp8Scheme, Job, SourceMatrix
from lily.checkpoint.safetensors_dir import DTYPES
from lily.config import ModelConfig
from lily.quant import quantize

SHARD_BYTES = 5 << 30  # mlx-lm's shard limit (5 GiB)
# What a converted directory gets besides the weights (mlx-lm saves the tokenizer and generation config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "generation_config.json")


def quantize_rows(w: torch.Tensor, bits: int, group_size: int = 64,
                  max_elements: int = 1 << 25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lily.quant.quantize of a bfloat16 [..., out, n] matrix, a slab of rows at a time (groups never cross
    rows, so the bits are the same): (weight uint32, scales bf16, biases bf16)."""
    *lead, out, n = w.shape
    rows = w.reshape(-1, n)
    # the codes go through an int32 view: copies into uint32 tensors are not implemented on every build
    words = torch.empty(rows.shape[0], n * bits // 32, dtype=torch.int32, device=w.device)
    scales = torch.empty(rows.shape[0], n // group_size, dtype=torch.bfloat16, device=w.device)
    biases = torch.empty_like(scales)
    step = max(1, max_elements // n)
    for r in range(0, rows.shape[0], step):
        q = quantize(rows[r:r + step], bits, group_size)
        words[r:r + step], scales[r:r + step], biases[r:r + step] = q.weight.view(torch.int32), q.scales, q.biases
    weight = words.view(torch.uint32)
    return (weight.reshape(*lead, out, -1), scales.reshape(*lead, out, -1), biases.reshape(*lead, out, -1))


def _matrix_value(m: SourceMatrix, t: list[torch.Tensor], fp8: Fp8Scheme | None) -> torch.Tensor:
    """A source matrix as bfloat16 (FP8 dequantised with its block scales)."""
    if m.scale_inv is None:
        return t[0].to(torch.bfloat16)
    return dequantize_fp8_rows(t[0], t[1], fp8.block)


def _plain_value(spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """A norm, conv1d, A_log or dt_bias as the MLX file holds it (mlx-lm's sanitize, then its dtype cast)."""
    if zero_centred_in_hf(spec.key):
        t = t + 1.0  # in the stored dtype, as mlx-lm does
    if spec.key.endswith("conv1d.weight"):
        t = t.movedim(2, 1)  # [C, 1, K] -> [C, K, 1]
    if not spec.key.endswith("A_log"):  # mlx-lm keeps A_log in its stored dtype
        t = t.to(torch.bfloat16)
    return t.contiguous()


def job_outputs(job: Job, tensors: list[torch.Tensor], fp8: Fp8Scheme | None,
                group_size: int = 64) -> Iterator[tuple[TensorSpec, list[torch.Tensor]]]:
    """Each lily weight of a job from its loaded source tensors (job.parts order), as the MLX files hold
    it: [weight, scales, biases] of a quantized module, or [tensor]."""
    values, i = [], 0
    for m in job.sources:
        n = len(m.parts)
        values.append(tensors[i:i + n])
        i += n
    if not job.specs[0].quantized:
        yield job.specs[0], [_plain_value(job.specs[0], values[0][0])]
        return
    if job.how == "stack":
        mats = [torch.stack([_matrix_value(m, v, fp8) for m, v in zip(job.sources, values)])]
    elif job.how == "split":
        fused = _matrix_value(job.sources[0], values[0], fp8)
        half = fused.shape[-2] // 2
        mats = [fused[..., :half, :], fused[..., half:, :]]
    else:
        mats = [_matrix_value(job.sources[0], values[0], fp8)]
    for spec, w in zip(job.specs, mats):
        yield spec, list(quantize_rows(w, spec.bits, group_size))


def _read_job(job: Job, files: dict) -> list[torch.Tensor]:
    """The job's source tensors, read into host memory (each file opened once)."""
    from safetensors import safe_open

    out = []
    for t in job.parts:
        try:
            f = files.get(t.file)
            if f is None:
                f = files[t.file] = safe_open(str(t.file), framework="pt", device="cpu")
            out.append(f.get_tensor(t.name))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{t.file}: cannot read tensor {t.name} ({e})") from None
    return out


def stream_quantized(jobs: list[Job], fp8: Fp8Scheme | None, device, progress: Progress | None = None,
                     group_size: int = 64) -> Iterator[tuple[TensorSpec, list[torch.Tensor]]]:
    """Every lily weight of the plan, quantised on `device`, in the order of lily's MLX files. The next
    job's tensors are read from disk while this one is quantised."""
    dev = torch.device(device)
    total = sum(len(j.parts) for j in jobs)
    total_bytes = sum(j.nbytes for j in jobs)
    done = nbytes = 0
    files: dict = {}  # used by the reading thread only
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lily-read") as pool:
        ahead = pool.submit(_read_job, jobs[0], files) if jobs else None
        for k, job in enumerate(jobs):
            host = ahead.result()
            ahead = pool.submit(_read_job, jobs[k + 1], files) if k + 1 < len(jobs) else None
            tensors = [t.to(dev) for t in host]
            del host
            yield from job_outputs(job, tensors, fp8, group_size)
            del tensors
            done, nbytes = done + len(job.parts), nbytes + job.nbytes
            if progress is not None:
                progress(done, total, nbytes, total_bytes)


def default_quantize_device(device) -> torch.device:
    """Quantise on the GPU when there is one, whatever device the weights end up on."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device(device)


def load_original(d: Path, config: ModelConfig, jobs: list[Job], fp8: Fp8Scheme | None, device="cpu",
                  progress: Progress | None = None, quantize_device=None) -> Checkpoint:
    """Quantise an original release at load: the weights dict `load_checkpoint` gives for its conversion."""
    qdev = default_quantize_device(device) if quantize_device is None else torch.device(quantize_device)
    weights = {}
    for spec, parts in stream_quantized(jobs, fp8, qdev, progress, config.group_size):
        weights[spec.key] = from_mlx_tensors(spec, [p.to(device) for p in parts], config.group_size)
    return Checkpoint(d, config, weights, tokenizer_dir_of(d))


def converted_bytes(jobs: list[Job], group_size: int = 64) -> int:
    """The bytes of tensor data convert_original writes for these jobs, from the shapes: per quantized weight
    its codes (bits per weight) and a bf16 scale and bias per group; bf16 for the norms, conv1d and dt_bias;
    A_log in the dtype it is stored in. (An FP8 source reads 8 bits a weight and writes 4.5; a bf16 one, 16.)"""
    n = 0
    for job in jobs:
        for spec in job.specs:
            count = math.prod(spec.shape)
            if spec.quantized:
                n += count * spec.bits // 8 + 2 * 2 * (count // group_size)
            elif spec.key.endswith("A_log"):
                n += count * DTYPES[job.sources[0].tensor.dtype][1]
            else:
                n += count * 2
    return n


def convert_original(d: Path, out: Path, config: ModelConfig, jobs: list[Job], fp8: Fp8Scheme | None,
                     device=None, progress: Progress | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the MLX affine 4-bit checkpoint of an original release to `out` (which must not exist or be
    empty): shards of at most `shard_bytes` with their index, config.json with its quantization block,
    the tokenizer files and chat template. Written beside `out` first, then moved into place."""
    out = Path(out)
    qdev = default_quantize_device("cpu") if device is None else torch.device(device)
    tmp = out.parent / f".{out.name}.lily-convert"
    shutil.rmtree(tmp, ignore_errors=True)
    made = [p for p in out.absolute().parents if not p.exists()]  # folders made for OUT, deepest first
    try:
        writer = ShardWriter(tmp, shard_bytes)
        has_mtp = False
        for spec, parts in stream_quantized(jobs, fp8, qdev, progress, config.group_size):
            has_mtp |= spec.key.startswith("mtp.")
            if spec.quantized:
                for suffix, t in zip(("weight", "scales", "biases"), parts):
                    writer.add(f"{spec.mlx_name}.{suffix}", t)
            else:
                writer.add(spec.mlx_name, parts[0])
        writer.close(config.mlx_config_json(with_mtp=has_mtp))
        for name in TOKENIZER_FILES:
            if (d / name).is_file():
                shutil.copyfile(d / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked by the caller)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:  # and the folders made for it, where they stayed empty
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return out
