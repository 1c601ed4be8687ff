"""Checkpoints: reading (strictly) and writing the directories lily runs from.

One file a concept: base (the loaded result, the error, the progress callback), layout (lily's weight
names and what a config implies), safetensors_dir (headers, index, streaming), mlx_format (the MLX
affine 4-bit reader and writer), progress (stderr progress)."""

from lily.checkpoint.base import Checkpoint, CheckpointError, Progress, tokenizer_dir_of
from lily.checkpoint.layout import TensorSpec, describe, expected_tensors, mlx_name
from lily.checkpoint.mlx_format import inspect_checkpoint, load_checkpoint, write_checkpoint
from lily.checkpoint.progress import stderr_progress
from lily.checkpoint.safetensors_dir import read_safetensors_header

__all__ = ["Checkpoint", "CheckpointError", "Progress", "TensorSpec", "expected_tensors", "mlx_name",
           "load_checkpoint", "inspect_checkpoint", "write_checkpoint", "read_safetensors_header",
           "stderr_progress", "describe", "tokenizer_dir_of"]
