"""`lily convert SRC OUT`: Qwen's original bf16 or FP8 release in, an MLX affine 4-bit checkpoint out.

The output holds, tensor for tensor, what `mlx_lm.convert -q --q-bits 4 --q-group-size 64` writes from
the bf16 weights (the FP8 release is dequantised to bf16 first), plus the MTP head (`mtp.*`, 4-bit), in
shards of at most 5 GiB with their index, config.json, the tokenizer files and the chat template.
Tensors stream one at a time: the host never holds the whole model.
"""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path

import torch

from lily.cli import UserError


def add_arguments(p) -> None:
    p.add_argument("src", help="the original checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("out", help="the output directory (must not exist, or be empty)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to quantise: auto is cuda when there is a GPU, else cpu")


def output_bytes(src: Path, jobs) -> int:
    """What `lily convert` writes: the tensors' bytes (from their shapes: lily.checkpoint.quantize_at_load),
    a safetensors header entry for each, the tokenizer and config files."""
    from lily.checkpoint.quantize_at_load import TOKENIZER_FILES, converted_bytes

    files = sum((src / name).stat().st_size for name in TOKENIZER_FILES if (src / name).is_file())
    return converted_bytes(jobs) + 256 * 3 * sum(len(j.specs) for j in jobs) + files + (64 << 10)  # + blocks


def existing_ancestor(path: Path) -> Path:
    """The path itself when it exists, else its nearest existing parent (where its free space is measured)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def size_text(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def run(args) -> int:
    from lily.checkpoint import convert_checkpoint, stderr_progress
    from lily.checkpoint.loading import inspect_original

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is a file, not a directory: give a new or empty directory for the output")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available")
    config, jobs, _ = inspect_original(args.src)  # refuses a broken source before anything is written
    # the tokenizer files are copied as they are: an output lily check / serve would refuse (no tokenizer.json,
    # a template that fails, a bad generation_config.json) is refused here, with check's words, before the work
    from lily.server.generation_config import read_generation_config
    from lily.tokenizer import load_model_tokenizer

    load_model_tokenizer(Path(args.src), config)
    read_generation_config(args.src)
    need = output_bytes(Path(args.src), jobs)
    where = existing_ancestor(out.absolute().parent)  # the output is written beside OUT first, then moved
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"{where}: {size_text(free)} free, the converted checkpoint needs about {size_text(need)}; "
                        "free some space or give an OUT on a larger disk")
    t0 = time.perf_counter()
    try:
        convert_checkpoint(args.src, out, device=device, progress=stderr_progress("converting"))
    except OSError as e:  # the partial output is removed by then
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"{where}: {e.strerror} while writing the converted checkpoint (about {size_text(need)}; "
                        f"{size_text(free)} were free at the start); the partial output was removed: free some "
                        "space or give an OUT on a larger disk") from None
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {out}: {len(files)} safetensors file(s), {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s "
          f"(quantised on {device})")
    return 0
