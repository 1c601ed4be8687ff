"""`lily convert SRC OUT`: Qwen's original bf16 or FP8 release in, an MLX affine 4-bit checkpoint out.

The output holds, tensor for tensor, what `mlx_lm.convert -q --q-bits 4 --q-group-size 64` writes from
the bf16 weights (the FP8 release is dequantised to bf16 first), plus the MTP head (`mtp.*`, 4-bit), in
shards of at most 5 GiB with their index, config.json, the tokenizer files and the chat template.
Tensors stream one at a time: the host never holds the whole model.
"""

from __future__ import annotations

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


def run(args) -> int:
    from lily.checkpoint import convert_checkpoint, stderr_progress
    from lily.checkpoint.loading import inspect_original

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
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
    need = sum(j.nbytes for j in jobs) // 3  # 4.5 bits a weight from 16 (an FP8 source: 8) at most
    parent = out if out.exists() else out.parent
    if parent.exists() and shutil.disk_usage(parent).free < need:
        raise UserError(f"{parent}: {shutil.disk_usage(parent).free / 1e9:.1f} GB free, the converted checkpoint "
                        f"needs about {need / 1e9:.1f} GB")
    t0 = time.perf_counter()
    convert_checkpoint(args.src, out, device=device, progress=stderr_progress("converting"))
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {out}: {len(files)} safetensors file(s), {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s "
          f"(quantised on {device})")
    return 0
