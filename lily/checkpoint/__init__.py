"""Checkpoints: reading (strictly) and writing the directories lily runs from.

Two kinds are read: MLX affine 4-bit checkpoints, and Qwen's original bf16 and FP8 releases, which are
quantised at load (or converted once by `lily convert`) to exactly the MLX 4-bit weights. One file a
concept: base (the loaded result, the error, the progress callback), layout (lily's weight names and
what a config implies), safetensors_dir (headers, index, streaming), mlx_format (the MLX reader and
writer), original_format (the original releases' layout), fp8 (block-wise FP8 dequantisation),
quantize_at_load (original -> MLX 4-bit, in memory or to disk), loading (which kind, and loading it),
progress (stderr progress)."""

from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, tokenizer_dir_of
from lily.checkpoint.layout import TensorSpec, describe, expected_tensors, mlx_name
from lily.checkpoint.loading import (checkpoint_kind, convert_checkpoint, inspect_checkpoint, load_checkpoint,
                                    read_config)
from lily.checkpoint.mlx_format import write_checkpoint
from lily.checkpoint.progress import stderr_progress
from lily.checkpoint.safetensors_dir import read_safetensors_header

__all__ = ["Checkpoint", "CheckpointError", "Progress", "TensorSpec", "expected_tensors", "mlx_name",
           "load_checkpoint", "inspect_checkpoint", "read_config", "checkpoint_kind", "convert_checkpoint",
           "write_checkpoint", "read_safetensors_header", "stderr_progress", "describe", "tokenizer_dir_of"]
