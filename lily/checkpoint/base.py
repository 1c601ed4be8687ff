"""What every checkpoint format shares: the loaded result, the one error type, the progress callback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lily.config import ModelConfig
from lily.quant import QuantTensor


class CheckpointError(ValueError):
    """A checkpoint lily cannot run: the one-line message names the file, field or tensor."""


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, QuantTensor | torch.Tensor]
    tokenizer_dir: Path | None


Progress = Callable[[int, int, int, int], None]  # (tensors done, tensors total, bytes done, bytes total)


def tokenizer_dir_of(d: Path) -> Path | None:
    return d if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() else None
