"""`lily generate`: greedy generation from a prompt given as text or as token ids.

    lily generate --model DIR --prompt-ids 1,2,3 --max-tokens 16 --top-logprobs 5 --json

With --json the last line of stdout is one JSON object:
    {"tokens": [...], "top_logprobs": [[[token_id, logprob], ...K pairs], ...one list per generated token]}
(plus "text" when the checkpoint has a tokenizer). Logprobs are the log-softmax of the full-vocabulary
logits at that step. A generated end-of-sequence token is included and ends the run unless --ignore-eos.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class UsageError(ValueError):
    """Something wrong in the command line or the model directory: reported as one line."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (MLX 4-bit)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the checkpoint's tokenizer.json)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens to generate (default: 32)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available, else cpu (default: auto)")
    p.add_argument("--backend", choices=("auto", "reference", "fast"), default="auto",
                   help="auto: fast on cuda, reference on cpu (default: auto)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="activation dtype of the reference backend (default: fp32)")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                   help="report the K most likely tokens at each step (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def parse_prompt_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids: no token ids given")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def load_tokenizer(model_dir: Path, required: bool):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        if required:
            raise UsageError(f"--prompt needs a tokenizer but {model_dir} has no tokenizer.json; "
                             "pass token ids with --prompt-ids instead")
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type
        if required:
            raise UsageError(f"{path}: cannot read the tokenizer ({e})") from None
        return None


def _progress():
    """A bar for loading (an original release is quantised at load: that takes a while); quiet in pipes."""
    from lily.checkpoint import stderr_progress

    return stderr_progress("loading")


def resolve(model_dir: Path, device: str, backend: str) -> tuple[str, str]:
    """The device and backend to run on; one line for what this machine or the path cannot do."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    if backend == "auto":
        backend = "fast" if device == "cuda" else "reference"
    if backend == "fast" and device != "cuda":
        raise UsageError("--backend fast runs on CUDA only; use --backend reference on the CPU")
    if not model_dir.is_dir():
        from lily.checkpoint.base import repo_id_hint

        raise UsageError(f"--model {model_dir}: not a directory{repo_id_hint(model_dir)}")
    return device, backend


def load(model_dir: Path, device: str, backend: str, dtype: torch.dtype, max_seq: int | None = None):
    """The backend for `model_dir`: lily.engine.load_backend when present, else the reference directly.
    `max_seq` sizes a backend that preallocates each sequence's state (the fast one; the reference grows)."""
    device, backend = resolve(model_dir, device, backend)
    try:
        from lily.engine import load_backend
    except ImportError:
        load_backend = None
    if backend == "reference" and (load_backend is None or dtype != torch.float32):
        from lily.engine.reference_backend import ReferenceBackend

        return ReferenceBackend.from_dir(model_dir, device, dtype=dtype, progress=_progress())
    try:
        if load_backend is None:
            raise ImportError("lily.engine.load_backend is missing")
        # one sequence: one slot, of the tokens this run needs (the fast backend's default is 32768)
        return load_backend(model_dir, device, backend=backend, max_seq=max_seq, progress=_progress(), max_batch=1)
    except ImportError as e:
        raise UsageError(f"the {backend} backend is not available in this build ({e})") from None


def generate(backend, prompt: list[int], max_tokens: int, top_k: int = 0, stop_ids=(), on_token=None):
    """Greedy decoding. Returns (tokens, top_logprobs) as described in the module docstring."""
    state = backend.new_state()
    logits = backend.prefill(prompt, state)
    tokens, tops = [], []
    for step in range(max_tokens):
        logprobs = logits.float().reshape(-1).log_softmax(-1)
        token = int(logprobs.argmax())
        tokens.append(token)
        if top_k:
            vals, idx = logprobs.topk(min(top_k, logprobs.numel()))
            tops.append([[int(i), float(v)] for i, v in zip(idx.tolist(), vals.tolist())])
        else:
            tops.append([])
        if on_token is not None:
            on_token(token)
        if token in stop_ids or step + 1 == max_tokens:
            break
        logits = backend.decode(token, state)
    return tokens, tops


def run(args) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.top_logprobs < 0:
        raise UsageError(f"--top-logprobs must be >= 0, got {args.top_logprobs}")
    model_dir = Path(args.model)
    resolve(model_dir, args.device, args.backend)
    tokenizer = load_tokenizer(model_dir, required=args.prompt is not None)
    from lily.checkpoint import read_config

    config = read_config(model_dir)  # config.json alone: the prompt is checked before minutes of loading
    if args.prompt is not None:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        if not prompt:
            raise UsageError("--prompt: the text encodes to no tokens")
    else:
        prompt = parse_prompt_ids(args.prompt_ids, config.vocab_size)
    # as `lily serve` counts a request: prompt + completion within the model's positions, on either backend
    need, limit = len(prompt) + args.max_tokens, config.max_position_embeddings
    if need > limit:
        raise UsageError(f"the prompt's {len(prompt)} tokens plus --max-tokens {args.max_tokens} make {need}, past "
                         f"the model's max_position_embeddings {limit}; lower --max-tokens or shorten the prompt")
    t0 = time.perf_counter()
    backend = load(model_dir, args.device, args.backend, DTYPES[args.dtype], max_seq=need)
    t1 = time.perf_counter()
    stop = () if args.ignore_eos else tuple(config.eos_token_ids)
    tokens, tops = generate(backend, prompt, args.max_tokens, args.top_logprobs, stop)
    t2 = time.perf_counter()
    print(f"lily generate: {backend.__class__.__name__} on {backend.device}: loaded in {t1 - t0:.1f} s, "
          f"{len(prompt)} prompt + {len(tokens)} generated tokens in {t2 - t1:.2f} s", file=sys.stderr)
    text = tokenizer.decode(tokens, skip_special_tokens=False) if tokenizer is not None else None
    if args.json:
        out = {"tokens": tokens, "top_logprobs": tops}
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        print(text if text is not None else " ".join(str(t) for t in tokens))
        if args.top_logprobs:  # then a line a step: the token, and the K most likely with their log-probabilities
            for step, (token, top) in enumerate(zip(tokens, tops)):
                shown = "  ".join(f"{_label(tokenizer, i)} {lp:.4f}" for i, lp in top)
                print(f"{step}\t{_label(tokenizer, token)}\t{shown}")
    return 0


def _label(tokenizer, token: int) -> str:
    """A token as text (repr-quoted, so spaces and newlines show) where there is a tokenizer, else its id."""
    return repr(tokenizer.decode([token], skip_special_tokens=False)) if tokenizer is not None else str(token)
