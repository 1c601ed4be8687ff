"""What every checkpoint format shares: the loaded result, the one error type, the progress callback."""

from __future__ import annotations

import re
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


# owner/name as the Hugging Face Hub spells a repo id (what `hf download` takes)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def repo_id_hint(path) -> str:
    """For a checkpoint path that does not exist but reads as a Hugging Face repo id (lily reads no Hub): the
    command that downloads it, as a clause to append; "" otherwise."""
    p = str(path)
    if not _REPO_ID.match(p) or Path(p).exists():
        return ""
    return (f"; lily needs a local checkpoint directory, not a Hugging Face repo id: "
            f"`hf download {p} --local-dir DIR`, then pass DIR")


def no_such_directory(path) -> str:
    return f"{path}: no such directory{repo_id_hint(path)}"
