"""`lily check DIR`: validate a checkpoint directory and print what it holds.

Exit 0 with a summary when `lily serve` can run it; exit 2 with one line naming what is wrong otherwise.
The tokenizer, chat template and generation_config.json get the same checks `lily serve` makes before
loading. By default only headers are read (fast even for 19.5 GB); --load also reads every tensor.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from lily.checkpoint import checkpoint_kind, describe, inspect_checkpoint, load_checkpoint
from lily.progress import bytes_progress
from lily.server.generation_config import read_generation_config
from lily.tokenizer import load_model_tokenizer


def add_arguments(p) -> None:
    p.add_argument("model_dir", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("--load", action="store_true", help="also read every tensor (checks the data is readable)")


class _WarningLine(logging.Handler):
    """The checkpoint reader's warnings (a skipped MTP head), as check's own warning lines."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"lily check: warning: {record.getMessage()}", file=sys.stderr)


def run(args) -> int:
    logger = logging.getLogger("lily.checkpoint")
    handler, propagate = _WarningLine(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        return _check(args)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _check(args) -> int:
    config, plans = inspect_checkpoint(args.model_dir)
    tokenizer = load_model_tokenizer(Path(args.model_dir), config)
    missing = tokenizer.missing_template_warning()
    if missing:  # servable, so not an error; but every chat request would fail, so said first
        print(f"lily check: warning: {missing}", file=sys.stderr)
    defaults, _ = read_generation_config(args.model_dir)  # a file lily serve would refuse fails here too
    if args.load:
        load_checkpoint(args.model_dir, progress=bytes_progress("reading"))
    tensors = [t for p in plans for t in p.parts]
    files = sorted({t.file.name for t in tensors})
    n_quant = sum(1 for p in plans if p.spec.quantized)
    print(f"{args.model_dir}: OK")
    print(f"  model: {describe(config)}")
    mtp = any(p.spec.key.startswith("mtp.") for p in plans)
    print(f"  format: {checkpoint_kind(args.model_dir)}{', with the MTP head' if mtp else ''}")
    print(f"  weights: {len(plans)} ({n_quant} quantized modules), {len(tensors)} tensors, "
          f"{sum(t.nbytes for t in tensors) / 1e9:.3f} GB in {len(files)} file(s)")
    print(f"  tokenizer: {tokenizer.vocab_size} tokens, end of sequence {tokenizer.eos_token_ids}")
    template = "renders" if tokenizer.has_chat_template else "none (chat requests are refused; see the warning)"
    print(f"  chat template: {template}")
    print(f"  sampling defaults: {defaults.describe()}")
    return 0
