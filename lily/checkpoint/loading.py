"""Which kind of checkpoint a directory holds, and loading it whatever the kind.

Two kinds: an MLX affine 4-bit checkpoint (config.json with a `quantization` block, `.scales` tensors),
loaded as it is; or one of Qwen's original releases (bf16 or block-wise FP8 in the transformers layout),
quantised at load to exactly what its MLX conversion would hold.
"""

from __future__ import annotations

from pathlib import Path

from lily.checkpoint import mlx_format
from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, no_such_directory
from lily.checkpoint.original_format import Fp8Scheme, Job, fp8_scheme, plan_original
from lily.checkpoint.safetensors_dir import read_config_json
from lily.config import ConfigError, ModelConfig


def _directory(path) -> Path:
    d = Path(path)
    if not d.exists():
        raise CheckpointError(no_such_directory(d))
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory (expected a checkpoint directory with config.json)")
    return d


def is_mlx(cfg: dict) -> bool:
    """An MLX checkpoint's config.json carries `quantization` (mlx-lm also copies it to quantization_config,
    where an original FP8 release has its `quant_method`)."""
    q = cfg.get("quantization_config")  # an empty block (some bf16 uploads carry `{}`) counts as none
    return bool(cfg.get("quantization")) or (isinstance(q, dict) and bool(q) and "quant_method" not in q)


def _original(d: Path, cfg: dict) -> tuple[ModelConfig, Fp8Scheme | None]:
    source = str(d / "config.json")
    fp8 = fp8_scheme(cfg, source)
    try:
        config = ModelConfig.from_config_json(cfg, source=source, mlx_quantized=False)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return config, fp8


def checkpoint_kind(path) -> str:
    """A few words for `lily check`: which kind of checkpoint the directory holds."""
    d = _directory(path)
    cfg = read_config_json(d)
    if is_mlx(cfg):
        return "MLX affine 4-bit"
    fp8 = fp8_scheme(cfg, str(d / "config.json"))
    return ("original FP8 release" if fp8 else "original release") + " (quantised to MLX 4-bit at load)"


def read_config(path) -> ModelConfig:
    """The model config of a checkpoint directory of either kind (config.json only, no tensor headers)."""
    d = _directory(path)
    cfg = read_config_json(d)
    return mlx_format.read_mlx_config(d) if is_mlx(cfg) else _original(d, cfg)[0]


def inspect_original(path) -> tuple[ModelConfig, list[Job], Fp8Scheme | None]:
    """Validate an original release from its headers: config, every source tensor, nothing left over."""
    d = _directory(path)
    cfg = read_config_json(d)
    if is_mlx(cfg):
        raise CheckpointError(f"{d}: already an MLX quantized checkpoint (config.json has a quantization block); "
                              "lily runs it as it is")
    config, fp8 = _original(d, cfg)
    return config, plan_original(d, config, fp8), fp8


def inspect_checkpoint(path) -> tuple[ModelConfig, list]:
    """Validate everything that does not need the tensor data (config, names, shapes, dtypes, bits).
    Returns the config and one entry per lily weight with `.spec` and `.parts` (the stored tensors it is
    read from; for an original release a fused gate_up's tensor is counted with the gate)."""
    d = _directory(path)
    if is_mlx(read_config_json(d)):
        return mlx_format.inspect_mlx_checkpoint(d)
    config, jobs, _ = inspect_original(d)
    return config, [mlx_format.Plan(spec, job.parts if i == 0 else ()) for job in jobs
                    for i, spec in enumerate(job.specs)]


def load_checkpoint(path, device="cpu", progress: Progress | None = None, quantize_device=None) -> Checkpoint:
    """Open, validate and load a checkpoint directory of either kind onto `device`. An original release is
    quantised on `quantize_device` (default: the GPU when there is one, else `device`)."""
    d = _directory(path)
    if is_mlx(read_config_json(d)):
        return mlx_format.load_mlx_checkpoint(d, device, progress)
    from lily.checkpoint.quantize_at_load import load_original

    config, jobs, fp8 = inspect_original(d)
    return load_original(d, config, jobs, fp8, device, progress, quantize_device)


def convert_checkpoint(src, out, device=None, progress: Progress | None = None, shard_bytes: int | None = None) -> Path:
    """`lily convert`: an original bf16 or FP8 release in, an MLX affine 4-bit checkpoint directory out."""
    from lily.checkpoint.quantize_at_load import SHARD_BYTES, convert_original

    d = _directory(src)
    config, jobs, fp8 = inspect_original(d)
    return convert_original(d, Path(out), config, jobs, fp8, device, progress, shard_bytes or SHARD_BYTES)
