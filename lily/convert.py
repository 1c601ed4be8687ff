"""`lily convert SRC OUT`: Qwen's original bf16 or FP8 release in, an MLX affine 4-bit checkpoint out.

The output holds, tensor for tensor, what `mlx_lm.convert -q --q-bits 4 --q-group-size 64` writes from
the bf16 weights (the FP8 release is dequantised to bf16 first), plus the MTP head (`mtp.*`, 4-bit), in
shards of at most 5 GiB with their index, config.json, the tokenizer files and the chat template.
Tensors stream one at a time: the host never holds the whole model.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def add_arguments(p) -> None:
    p.add_argument("src", help="the original checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("out", help="the output directory (must not exist, or be empty)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to quantise: auto is cuda when there is a GPU, else cpu (default: auto)")


def run(args) -> int:
    from lily.checkpoint import CheckpointError, convert_checkpoint, stderr_progress

    def fail(msg: str) -> int:
        print(f"lily convert: {msg}", file=sys.stderr)
        return 2

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return fail(f"{out} exists and is not empty")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda but no CUDA device is available")
    t0 = time.perf_counter()
    try:
        convert_checkpoint(args.src, out, device=device, progress=stderr_progress("converting"))
    except CheckpointError as e:
        return fail(str(e))
    except OSError as e:  # the output side: a full disk, no permission
        return fail(f"{out}: cannot write ({e.strerror or e})")
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {out}: {len(files)} safetensors file(s), {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s "
          f"(quantised on {device})")
    return 0
