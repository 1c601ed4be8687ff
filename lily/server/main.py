"""`lily serve`: load a checkpoint and serve it over the OpenAI-compatible API.

`lily serve --demo` builds the tiny synthetic checkpoint once (cached under ~/.cache/lily, keyed by a
version) and serves it on the CPU, so the whole path can be tried without a GPU or a download.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from lily.cli import UserError
from lily.config import KV_CACHE_DTYPES, RECURRENT_STATE_DTYPES
from lily.progress import bytes_progress, quiet
from lily.server.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

DEMO_VERSION = "2"  # bump when the demo checkpoint changes (2: tokenizer learned by the tokenizers trainer)
GIB = 2 ** 30
DEMO_NAME = "lily-demo-tiny"

log = logging.getLogger("lily.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="checkpoint directory (MLX affine 4-bit); give this or --demo")
    src.add_argument("--demo", action="store_true",
                     help="serve a tiny random-weight demo model on the CPU (built once, cached; its replies are gibberish)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--max-seq", type=int, default=None, metavar="N",
                   help="longest sequence (prompt + completion) a request may use (default 8192, or the "
                        "model's limit if smaller)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                        "LILY_API_KEY environment variable; none: open)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu; auto picks cuda when present")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "fast"),
                   help="fast (Triton, CUDA) or reference (plain torch); auto picks fast on CUDA")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a free slot (--max-batch) (default 256: a burst of a hundred "
                        "agents or an eval batch waits rather than fails); more get 429")
    p.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="requests decoded together in one step; more wait in the queue")
    p.add_argument("--step-tokens", type=int, default=8192, metavar="N",
                   help="token budget of a step while others decode: the decodes plus one prefill piece, so a "
                        "long prompt holds running streams back by at most one piece")
    p.add_argument("--no-run-ahead", action="store_true",
                   help="decode a lone greedy stream step by step (default: its next step is queued on the GPU "
                        "before the current one is read back, so the GPU never waits for the host's work)")
    p.add_argument("--no-overlap-prefill", action="store_true",
                   help="run a new prompt between the running streams' decode steps (default: on the GPU it runs "
                        "beside them, on a stream of its own, so they keep stepping while it prefills)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9, metavar="F",
                   help="share of the GPU's memory lily may use (weights, prefill scratch, prefix cache and the "
                        "sequence slots, whose number it bounds)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16",
                   help="the fast backend's KV cache: bf16, or int8 (one scale a token and head): about half the "
                        "memory a sequence's context takes, at a small cost in accuracy and, today, a slower decode "
                        "(the reference backend computes with the same rounding)")
    p.add_argument("--recurrent-state-dtype", choices=RECURRENT_STATE_DTYPES, default="fp32",
                   help="the fast backend's GDN recurrent state between steps: fp32, or bf16 (half its memory and "
                        "bytes a step, each step's update still in fp32, at a small cost in accuracy; the reference "
                        "backend stores it with the same rounding)")
    p.add_argument("--state-memory-gib", type=float, default=None, metavar="GIB",
                   help="memory for the sequence slots instead of what --gpu-memory-fraction leaves (default: none)")
    p.add_argument("--prefix-cache", type=int, default=16, metavar="N",
                   help="decode states kept for prefix reuse (0 disables)")
    p.add_argument("--prefix-cache-gib", type=float, default=4.0, metavar="GIB",
                   help="memory budget of the prefix cache, in GiB")
    p.add_argument("--max-body", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                   help="largest request body accepted (413 above)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="a connection that has not sent a request's whole header this many seconds after it opened "
                        "(or after its previous response) is closed, however slowly it trickles in (default 60, "
                        "nginx's client_header_timeout)")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="a request body that pauses this long, or arrives slower than 500 bytes a second once this "
                        "long has passed, is answered 408 and its connection closed (default 60, nginx's "
                        "client_body_timeout)")
    p.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                   help="auto (the default): the sampling fields a request leaves out (temperature, top_p, top_k, "
                        "min_p, repetition_penalty; chat's and responses' max_tokens from max_new_tokens) take the "
                        "values of the checkpoint's generation_config.json, as vLLM does; none: lily's built-in "
                        "ones (temperature 1, top_p 1, top_k and min_p off, no repetition penalty)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="default of chat_template_kwargs.enable_thinking (default: the template's, which thinks)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id clients use (default: the directory name, or OWNER/NAME for a Hugging Face "
                        "cache snapshot); more names are aliases a request may use too (answers carry the first)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let a browser page from ORIGIN (e.g. http://localhost:3000, or *) call the API; repeatable")
    p.add_argument("--log-requests", action="store_true",
                   help="also log prompt text, and the reason of each rejected request (never keys)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="how much the server logs")


def demo_dir() -> Path:
    """The cached tiny demo checkpoint, built on first use (atomically, so a crash leaves no half copy)."""
    base = Path(os.environ.get("LILY_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lily")
    target = base / f"demo-tiny-v{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    from lily.synthetic import make_synthetic

    base.mkdir(parents=True, exist_ok=True)
    log.info("building the demo checkpoint in %s (once)", target)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=base))
    try:
        make_synthetic("tiny", tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_name(model_dir: Path) -> str:
    """The model id a server of this directory answers to: its name, or for a Hugging Face cache snapshot
    (.../models--OWNER--NAME/snapshots/REVISION, as `hf download` without --local-dir leaves it) the repo id
    OWNER/NAME rather than the revision's hash."""
    d = model_dir.resolve()
    repo = d.parent.parent.name
    if d.parent.name == "snapshots" and repo.startswith("models--") and "--" in repo[len("models--"):]:
        return repo[len("models--"):].replace("--", "/", 1)
    return d.name


def _loopback_only(sockets) -> bool:
    """Whether every listening socket is on a loopback address (only this machine can connect)."""
    import ipaddress

    for sock in sockets:
        try:
            if not ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback:
                return False
        except ValueError:
            return False
    return True


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.demo and not args.model:
        raise UserError("give --model DIR (a checkpoint directory) or --demo")
    for name in ("port", "max_queue", "prefix_cache", "max_body", "max_batch", "step_tokens"):
        v = getattr(args, name)
        if v < (1 if name in ("max_queue", "max_body", "max_batch", "step_tokens") else 0) \
                or (name == "port" and v > 65535):
            raise UserError(f"--{name.replace('_', '-')} {v} is out of range")
    if args.max_seq is not None and args.max_seq < 2:
        raise UserError(f"--max-seq {args.max_seq} is too small (at least 2)")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:  # (nan too)
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range (seconds, above 0)")
    if args.prefix_cache_gib < 0:
        raise UserError(f"--prefix-cache-gib {args.prefix_cache_gib} is out of range")
    if not 0 < args.gpu_memory_fraction <= 1:
        raise UserError(f"--gpu-memory-fraction {args.gpu_memory_fraction} is out of range (0, 1]")
    if args.state_memory_gib is not None and args.state_memory_gib <= 0:
        raise UserError(f"--state-memory-gib {args.state_memory_gib} is out of range")
    api_key = args.api_key if args.api_key is not None else os.environ.get("LILY_API_KEY")
    # an empty key is what a failed `--api-key "$(openssl ...)"` or an unset variable gives: serving with no
    # authentication is then not what was asked for
    if api_key is not None and not api_key.strip():
        if args.api_key is not None:
            raise UserError("--api-key is empty; give a non-empty key (or leave --api-key out to serve with no key)")
        raise UserError("LILY_API_KEY is empty; set it to a non-empty key (or unset it to serve with no key)")
    if not args.demo and not Path(args.model).is_dir():
        from lily.checkpoint.base import repo_id_hint

        raise UserError(f"--model {args.model}: no such directory{repo_id_hint(args.model)}")
    from lily.engine import resolve

    resolve("cpu" if args.demo and args.device == "auto" else args.device, args.backend)  # this machine can run it

    # the address first: a busy port or an unknown host is known in a second, before minutes of loading
    from lily.server.listen import bind_sockets

    sockets = bind_sockets(args.host, args.port)
    if api_key is None and not _loopback_only(sockets):
        log.warning("serving on %s with no API key: anyone who can reach this address can use the model "
                    "(set --api-key or LILY_API_KEY)", args.host)
    _raise_open_file_limit()
    try:
        _load_and_serve(args, sockets, api_key)
    finally:
        for s in sockets:
            s.close()
    return 0


def _load_and_serve(args, sockets, api_key) -> None:
    from lily.engine import load_backend
    from lily.engine.prefix_cache import PrefixCache
    from lily.server.app import ServerSettings, create_app
    from lily.server.generation_config import read_generation_config
    from lily.server.listen import url_of
    from lily.tokenizer import load_model_tokenizer

    if args.demo:
        model_dir = demo_dir()
        device = "cpu" if args.device == "auto" else args.device
        name = args.served_model_name[0] if args.served_model_name else DEMO_NAME
    else:
        model_dir = Path(args.model)
        device = args.device
        name = args.served_model_name[0] if args.served_model_name else default_model_name(model_dir)

    t0 = time.perf_counter()
    config = _read_config(model_dir)
    limit = config.max_position_embeddings
    max_seq = args.max_seq if args.max_seq is not None else min(8192, limit)
    if max_seq > limit:
        raise UserError(f"--max-seq {max_seq} exceeds the model's max_position_embeddings {limit}")
    tokenizer = load_model_tokenizer(model_dir, config)  # before the weights: a bad tokenizer fails fast
    if tokenizer.missing_template_warning():
        log.warning("%s", tokenizer.missing_template_warning())
    defaults, notes = read_generation_config(model_dir, args.generation_config)  # so does a bad generation config
    for note in notes:
        log.warning("%s", note)
    log.info("sampling defaults of requests that leave them out: %s", defaults.describe())
    log.info("loading %s (device %s, backend %s)", model_dir, device, args.backend)
    with _loading_heartbeat() if quiet() else contextlib.nullcontext():  # a terminal shows the bar instead
        backend = load_backend(model_dir, device, args.backend, max_seq=max_seq,
                               progress=bytes_progress("loading", plain=False), max_batch=args.max_batch,
                               memory_fraction=args.gpu_memory_fraction,
                               state_bytes=None if args.state_memory_gib is None else int(args.state_memory_gib * GIB),
                               reserve_bytes=int(args.prefix_cache_gib * GIB) if args.prefix_cache else 0,
                               kv_dtype=args.kv_cache_dtype, rec_dtype=args.recurrent_state_dtype)
    log.info("loaded in %.1fs; warming up", time.perf_counter() - t0)
    _warm_up(backend)
    # (the fast backend may have shrunk the cache's budget so that one sequence fits the GPU memory budget)
    cache_bytes = min(int(args.prefix_cache_gib * GIB), getattr(backend, "prefix_cache_bytes", 1 << 62))
    cache = PrefixCache(args.prefix_cache, cache_bytes, backend.clone_state, backend.state_nbytes)
    settings = ServerSettings(model_name=name, max_seq=max_seq, api_key=api_key,
                              max_body=args.max_body, body_timeout=args.body_timeout, max_queue=args.max_queue,
                              enable_thinking=args.enable_thinking, log_requests=args.log_requests,
                              model_aliases=(str(model_dir),), served_aliases=tuple((args.served_model_name or ())[1:]),
                              cors_origins=tuple(args.cors_origin),
                              max_batch=args.max_batch, step_tokens=args.step_tokens,
                              run_ahead=not args.no_run_ahead, overlap_prefill=not args.no_overlap_prefill,
                              sampling_defaults=defaults)
    app = create_app(backend, tokenizer, settings, cache)

    import uvicorn

    from lily.server.connections import http_protocol

    port = sockets[0].getsockname()[1]  # the real one when --port 0 let the system choose

    def ready():
        log.info("serving %r at %s (max-seq %d, %s): ready in %.1fs", name, url_of(args.host, port), max_seq,
                 backend.device, time.perf_counter() - t0)

    # uvicorn drains open streams on SIGTERM / Ctrl-C, then re-raises the signal; end with status 0
    # (SIGTERM: a supervisor sees a clean stop) or 130 (Ctrl-C) instead of dying by it with a traceback
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    # on SIGTERM, open streams get a few seconds, then the worker cancels what still runs; log_config None:
    # uvicorn's few lines go through the format above. No limit_concurrency: uvicorn counts idle connections
    # in it and answers the requests over it a plain-text 503, so a few hundred idle sockets would refuse real
    # clients; the engine's queue (--max-queue, 429) bounds the work, the header and body deadlines the sockets.
    config = uvicorn.Config(app, log_level="warning", log_config=None, access_log=False,
                            http=http_protocol(args.header_timeout), timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5)
    _serve(config, app.state.worker, sockets, ready, app.state.draining)


SHUTDOWN_GRACE_S = 5.0


def _exit_cleanly(signum, frame):
    raise SystemExit(0 if signum == signal.SIGTERM else 128 + signum)


def _serve(config, worker, sockets, ready, draining=None) -> None:
    """uvicorn's Server on the bound `sockets`, plus: `ready()` once it really listens; once asked to
    exit, open streams get SHUTDOWN_GRACE_S seconds, then the running and queued generations are
    cancelled so every stream still ends with its final chunk and [DONE], and a request body still arriving
    is answered 503 (`draining`, guard.py). (uvicorn's own timeout would cut them mid-body, and the app's
    lifespan shutdown, which stops the worker, runs only after the connections are gone.) A failed accept (no
    descriptor left) is logged as one line a minute, not a traceback each time."""
    import asyncio

    import uvicorn

    from lily.server.connections import install_accept_errors

    def grace_over():
        if draining is not None:
            draining.set()
        worker.shutdown()

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None):
            install_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)
            if self.started and not self.should_exit:
                ready()

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                timer = threading.Timer(SHUTDOWN_GRACE_S, grace_over)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    try:
        DrainingServer(config).run(sockets=sockets)
    finally:
        # a second Ctrl-C forces uvicorn out before the app's lifespan stops the worker: stop it here, so its
        # thread is not inside torch while the interpreter tears down (that aborted the process, SIGABRT)
        worker.shutdown(timeout=SHUTDOWN_GRACE_S)


def _raise_open_file_limit() -> None:
    """Each connection holds a descriptor: the soft limit (often 1024) up to the hard one, said in the log."""
    from lily.server.connections import raise_open_file_limit

    raised = raise_open_file_limit()
    if raised is not None:
        log.info("open-file limit raised from %d to %d (each connection holds one)", *raised)


@contextlib.contextmanager
def _loading_heartbeat(every: float = 5.0):
    """A 'still loading' line every few seconds, where no progress bar is drawn (stderr is not a terminal)."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat():
        while not done.wait(every):
            log.info("still loading (%.0fs)", time.perf_counter() - t0)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _read_config(model_dir: Path):
    import json

    from lily.checkpoint import read_config

    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: config.json is missing (not a checkpoint directory)")
    try:
        json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON ({e})") from None
    return read_config(model_dir)  # either kind: MLX 4-bit, or an original release quantised at load


def _warm_up(backend) -> None:
    """One prefill and one decode step: compiles kernels and fails here, not on the first request. Then the
    batched decode step for each batch size the slots allow (the fast backend's CUDA graphs)."""
    state = backend.new_state()
    logits = backend.prefill([0, 1], state)
    backend.decode(int(logits.argmax()), state)
    backend.release_state(state)  # the fast backend pools it with its decode graph: the first request reuses both
    prepare = getattr(backend, "prepare_batches", None)
    if prepare is not None:
        t0 = time.perf_counter()
        buckets = prepare()
        if buckets:
            log.info("batched decode ready for up to %d sequences (graphs for %s rows, %.1fs)",
                     backend.max_batch, ", ".join(map(str, buckets)), time.perf_counter() - t0)
