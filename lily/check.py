"""`lily check DIR`: validate a checkpoint directory and print what it holds.

Exit 0 with a summary when lily can run it; exit 2 with one line naming what is wrong otherwise.
By default only headers are read (fast even for 19.5 GB); --load also reads every tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lily.checkpoint import (CheckpointError, describe, inspect_checkpoint, load_checkpoint,
                             stderr_progress, tokenizer_dir_of)


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--load", action="store_true", help="also read every tensor (checks the data is readable)")


def run(args) -> int:
    try:
        config, plans = inspect_checkpoint(args.model_dir)
        if args.load:
            load_checkpoint(args.model_dir, progress=stderr_progress())
    except CheckpointError as e:
        print(f"lily check: {e}", file=sys.stderr)
        return 2
    tensors = [t for p in plans for t in p.parts]
    files = sorted({t.file.name for t in tensors})
    n_quant = sum(1 for p in plans if p.spec.quantized)
    print(f"{args.model_dir}: OK")
    print(f"  model: {describe(config)}")
    print(f"  weights: {len(plans)} ({n_quant} quantized modules), {len(tensors)} tensors, "
          f"{sum(t.nbytes for t in tensors) / 1e9:.3f} GB in {len(files)} file(s)")
    tok = tokenizer_dir_of(Path(args.model_dir))
    print(f"  tokenizer: {'found' if tok else 'none (token ids only)'}")
    return 0
