"""`lily bench`: the benchmark matrix (docs/design.md "Benchmark contract").

lily is measured in this process; each peer (MLX-LM, transformers) in its own subprocess on the same
checkpoint bytes, after lily has released the GPU. Optional: fidelity against the fp32 reference, and
load time plus peak memory in a fresh process (last). With --deadline the later phases get what is left. Writes JSON (and a PNG beside it) and prints a table.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from lily.bench import contract, report
from lily.bench.lily_engine import accepts
from lily.config import KV_CACHE_DTYPES, RECURRENT_STATE_DTYPES

PEERS = {"mlx": ("lily.bench.peers.mlx_peer", "mlx-lm"), "hf": ("lily.bench.peers.hf_peer", "transformers")}
WARMUP_STEPS = 4
MEMORY_RESERVE_S = 75      # kept for the load + memory process when a --deadline is set


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="an MLX 4-bit checkpoint directory")
    src.add_argument("--synthetic", choices=["full", "tiny"],
                     help="random weights with the exact shapes, built on --device (written to disk only "
                          "when peers or --memory need a checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="where to run (default: cuda when present)")
    p.add_argument("--backend", choices=["auto", "fast", "reference"], default="auto",
                   help="lily backend (auto: fast on cuda, reference on cpu)")
    p.add_argument("--contexts", default=",".join(map(str, contract.DEFAULT_CONTEXTS)),
                   help="prompt lengths, e.g. 256,4K,128K (default: 256 ... 128K)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per context, alternating order (at least 2)")
    p.add_argument("--retries", type=int, default=1, help="re-measure a row refused for drift this often")
    p.add_argument("--max-drift", type=float, default=contract.MAX_DRIFT,
                   help="a row whose rounds differ by more than this fraction is refused")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds for lily's matrix; contexts predicted to overrun are skipped and marked (default: no limit)")
    p.add_argument("--peers", default="", help="comma list of mlx,hf (each in its own subprocess)")
    p.add_argument("--peer-contexts", default=None, help="contexts for the peers (default: --contexts)")
    p.add_argument("--peer-time-budget", default=None, metavar="S|PEER=S,...",
                   help="seconds per peer process, load included: one number for every peer, or per peer "
                        "(e.g. mlx=480,hf=120; a peer not named shares what is left) (default: no limit)")
    p.add_argument("--peer-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the transformers peer runs in")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16",
                   help="lily's KV cache: bf16, or int8 (a scale a token and head; about half the memory); the "
                        "fidelity section compares either against the fp32 reference")
    p.add_argument("--recurrent-state-dtype", choices=RECURRENT_STATE_DTYPES, default="fp32",
                   help="lily's GDN recurrent state between steps: fp32, or bf16 (half its bytes); the fidelity "
                        "section compares either against the fp32 reference")
    p.add_argument("--fidelity", action="store_true", help="teacher-forced comparison with the fp32 reference")
    p.add_argument("--fidelity-positions", type=int, default=192, help="teacher-forced positions of --fidelity")
    p.add_argument("--memory", action="store_true", help="load time and peak memory, in a fresh process")
    p.add_argument("--memory-max-seq", default="4096,32768,131072",
                   help="--max-seq values whose peak memory --memory measures")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where a synthetic checkpoint is written for peers / --memory (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench-DATE.json in lily's "
                                                "checkout, else lily-bench/bench-DATE.json here); PNG beside it")
    p.add_argument("--no-plot", action="store_true", help="write no PNG beside the JSON")
    p.add_argument("--note", action="append", help="a line to keep in the JSON and print (repeatable; default: none)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="finish within S seconds: later phases (fidelity, memory, peers) shrink or are skipped "
                        "(default: no deadline)")
    p.add_argument("--merge-into", default=None, metavar="JSON",
                   help="run only the --peers (not lily, fidelity or memory) and add their rows to this earlier "
                        "`lily bench` result of the same model on the same GPU, noted as a separate run; the "
                        "contract (decode steps, rounds, retries, drift, peer dtype) is the file's (default: "
                        "a new result with lily in it)")


def backend_class(kind: str):
    if kind == "fast":
        from lily.engine.fast_backend import FastBackend
        return FastBackend
    from lily.engine.reference_backend import ReferenceBackend
    return ReferenceBackend


def backend_from_weights(kind: str, config, weights: dict, device: str, max_seq: int, kv_dtype: str = "bf16",
                         rec_dtype: str = "fp32"):
    """A backend over an in-memory weights dict (synthetic runs never touch the disk)."""
    cls = backend_class(kind)
    make = getattr(cls, "from_weights", None) or cls
    kwargs = {"max_seq": max_seq} if accepts(make, "max_seq") else {}
    for name, value in (("kv_dtype", kv_dtype), ("rec_dtype", rec_dtype)):
        if accepts(make, name):
            kwargs[name] = value
    if accepts(make, "max_batch"):   # the bench runs one sequence: one slot (more would count in its peak memory)
        kwargs["max_batch"] = 1
    return make(config, weights, device, **kwargs)


def _fail(msg: str) -> int:
    from lily.cli import UserError

    raise UserError(msg)


def peer_budgets(text: str | None) -> dict[str, float]:
    """--peer-time-budget: S (key "*": a bound on every peer's time) or PEER=S pairs (that peer's own time)."""
    if not text:
        return {}
    try:
        return {"*": float(text)}
    except ValueError:
        pass
    budgets = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in PEERS:
            raise ValueError(f"--peer-time-budget: unknown peer {name!r} in {item!r}; expected "
                             f"S or PEER=S with PEER one of {', '.join(PEERS)}")
        try:
            budgets[name] = float(value)
        except ValueError:
            raise ValueError(f"--peer-time-budget: {item!r} is not PEER=SECONDS") from None
        if budgets[name] <= 0:
            raise ValueError(f"--peer-time-budget: {item!r} must be a positive number of seconds")
    return budgets


def peer_share(name: str, later: list[str], budgets: dict[str, float], left: float | None) -> float | None:
    """Seconds for this peer, load included: its own budget (PEER=S), else, with a deadline (`left` seconds
    to go), an equal share of what the later peers' own budgets leave; never more than is left, nor than a
    budget for every peer ("*"). None: no limit."""
    own, bound = budgets.get(name), budgets.get("*", float("inf"))
    if left is None:
        share = own if own is not None else bound
        return None if share == float("inf") else share
    if own is None:
        shared = [p for p in later if p not in budgets]
        own = (left - sum(budgets[p] for p in later if p in budgets)) / (len(shared) + 1)
    return min(own, left, bound)


def _synthetic_checkpoint(args, config, ckpt: Path, weights: dict | None = None) -> None:
    """Write the synthetic weights as a checkpoint for the other processes (once: a directory that has one
    keeps it)."""
    if (ckpt / "config.json").exists():
        return
    from lily.checkpoint import write_checkpoint
    from lily.progress import bytes_progress

    if weights is None:
        from lily.synthetic import random_weights

        weights = random_weights(config, seed=args.seed, device=args.device)
    t1 = time.perf_counter()
    write_checkpoint(ckpt, config, weights, shard_bytes=(3 << 30) if args.synthetic == "full" else None,
                     progress=bytes_progress("writing"))
    contract.log(f"[bench] wrote the checkpoint for the other processes to {ckpt} in {time.perf_counter() - t1:.1f} s")


def _run_subprocess(module: str, args: list[str], log_path: Path, timeout: float | None) -> None:
    env = dict(os.environ)
    root = str(report.REPO)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "w") as log:
        try:
            subprocess.run([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                           env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            log.write(f"\nlily bench: {module} killed after {timeout:.0f} s\n")


def run_peer(name: str, ckpt: Path, args, out_dir: Path, stem: str, timeout: float | None,
             budget: float | None) -> dict:
    """One peer in its own process; `budget` bounds its matrix, `timeout` (load included) kills it."""
    res_path = out_dir / f"{stem}-{name}.peer.json"
    log_path = out_dir / f"{stem}-{name}.log"
    res_path.unlink(missing_ok=True)
    cli = ["--checkpoint", str(ckpt), "--contexts", args.peer_contexts or args.contexts,
           "--decode-steps", str(args.decode_steps), "--rounds", str(args.rounds), "--retries", str(args.retries),
           "--max-drift", str(args.max_drift), "--device", args.device, "--dtype", args.peer_dtype,
           "--out", str(res_path)]
    if budget:
        cli += ["--time-budget", f"{budget:.0f}"]
    contract.log(f"[bench] peer {name}: log in {log_path}")
    _run_subprocess(PEERS[name][0], cli, log_path, timeout)
    if not res_path.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] if log_path.exists() else []
        return {"ok": False, "error": f"peer process left no result ({tail[0] if tail else 'no output'})", "rows": []}
    doc = json.loads(res_path.read_text())
    res_path.unlink()
    doc["log"] = log_path.name
    return doc


def run_memory(ckpt: Path, args, kind: str, out_dir: Path, stem: str, timeout: float) -> dict:
    """Load time and peak memory in a fresh process (lily.bench.memory)."""
    res_path = out_dir / f"{stem}-memory.tmp.json"
    log_path = out_dir / f"{stem}-memory.log"
    cli = ["--model", str(ckpt), "--device", args.device, "--backend", kind,
           "--max-seq", args.memory_max_seq, "--time-budget", f"{max(timeout - 20, 10):.0f}", "--out", str(res_path)]
    _run_subprocess("lily.bench.memory", cli, log_path, timeout=timeout)
    if not res_path.exists():
        return {"ok": False, "error": "memory process left no result", "log": log_path.name}
    doc = json.loads(res_path.read_text())
    res_path.unlink()
    doc["log"] = log_path.name
    return doc


def run_lily(args, kind: str, config, ckpt: Path | None, contexts: list[int], max_seq: int, remaining):
    """lily's part, in this process. Returns (engine document, fidelity or None)."""
    from lily.bench.lily_engine import BackendEngine

    t0 = time.perf_counter()
    if args.synthetic:
        from lily.synthetic import random_weights

        weights = random_weights(config, seed=args.seed, device=args.device)
        contract.log(f"[bench] synthetic {args.synthetic} weights on {args.device} in {time.perf_counter() - t0:.1f} s")
        if ckpt is not None:
            _synthetic_checkpoint(args, config, ckpt, weights)
        backend = backend_from_weights(kind, config, weights, args.device, max_seq, args.kv_cache_dtype,
                                       args.recurrent_state_dtype)
    else:
        from lily.checkpoint import load_checkpoint
        from lily.engine import load_backend
        from lily.progress import bytes_progress

        backend = load_backend(ckpt, args.device, kind, max_seq=max_seq, progress=bytes_progress("loading"), max_batch=1,
                               kv_dtype=args.kv_cache_dtype, rec_dtype=args.recurrent_state_dtype)
        weights = load_checkpoint(ckpt, args.device).weights if args.fidelity else None
    info = {"backend": kind, "device": args.device, "setup_s": time.perf_counter() - t0, "max_seq": max_seq,
            "kv_cache_dtype": args.kv_cache_dtype, "recurrent_state_dtype": args.recurrent_state_dtype}

    fidelity = None
    if args.fidelity and remaining(1e9) < 120:
        fidelity = {"skipped": "not enough time left before --deadline"}
    elif args.fidelity:
        from lily.bench import fidelity as fid

        t0 = time.perf_counter()
        try:
            fidelity = fid.run(backend, config, weights, positions=args.fidelity_positions, device=args.device)
        except Exception as e:
            traceback.print_exc()
            fidelity = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        fidelity["seconds"] = time.perf_counter() - t0
    # the backend holds what it needs; dropping our dict lets memory per row show the backend alone
    del weights
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    engine = BackendEngine(backend, "lily")
    rows = contract.measure_matrix(engine, contexts, args.decode_steps, args.rounds, config.vocab_size,
                                   warmup_steps=WARMUP_STEPS, retries=args.retries,
                                   time_budget_s=args.time_budget)
    return {"ok": True, "info": info, "rows": [r.to_json() for r in rows]}, fidelity


def run(args) -> int:
    started = time.perf_counter()

    def remaining(default: float) -> float:
        """Seconds left before --deadline (keeping 15 s for the report), or `default` without one."""
        if args.deadline is None:
            return default
        return args.deadline - (time.perf_counter() - started) - 15

    # -- arguments a user can get wrong: one line each --------------------------------------------------
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        return _fail(f"--peers: unknown peer {unknown[0]!r}; expected a comma list of {', '.join(PEERS)}")
    target = None
    if args.merge_into:   # (before the contract's arguments are read: it takes the earlier run's)
        from lily.bench import merge

        if not peers:
            return _fail("--merge-into: name the peers to run (--peers)")
        try:
            target = merge.load_target(Path(args.merge_into))
        except ValueError as e:
            return _fail(str(e))
        merge.adopt_contract(args, target)
    try:
        contexts = contract.parse_contexts(args.contexts)
        peer_contexts = contract.parse_contexts(args.peer_contexts, "--peer-contexts") if args.peer_contexts else contexts
        contract.parse_contexts(args.memory_max_seq, "--memory-max-seq")
        budgets = peer_budgets(args.peer_time_budget)
    except ValueError as e:
        return _fail(str(e))
    if args.rounds < 2:
        return _fail(f"--rounds {args.rounds}: the contract needs at least 2 rounds")
    if args.decode_steps < 1:
        return _fail(f"--decode-steps {args.decode_steps}: must be at least 1")
    if not args.max_drift >= 0:  # (NaN too) a negative bound refuses every row
        return _fail(f"--max-drift {args.max_drift}: must be a fraction >= 0 (e.g. {contract.MAX_DRIFT})")
    if args.synthetic:
        from lily.synthetic import check_seed

        check_seed(args.seed)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is visible (use --device cpu --backend reference)")
    kind = args.backend if args.backend != "auto" else ("fast" if args.device == "cuda" else "reference")
    if kind == "fast" and args.device != "cuda":
        return _fail("--backend fast runs on CUDA only; use --backend reference on the CPU")
    if args.fidelity and args.fidelity_positions < 2:
        return _fail(f"--fidelity-positions {args.fidelity_positions}: must be at least 2")
    if args.model and not (Path(args.model) / "config.json").is_file():
        from lily.checkpoint.base import repo_id_hint

        return _fail(f"--model {args.model}: no config.json there (expected a checkpoint directory)"
                     f"{repo_id_hint(args.model)}")
    out = Path(args.out) if args.out else Path(args.merge_into) if args.merge_into else \
        report.results_dir() / f"bench-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _fail(f"--out {out}: cannot create the folder {out.parent} ({e.strerror})")
    stem = out.stem

    env = report.environment(args.device)
    max_seq = max(contexts) + args.decode_steps + WARMUP_STEPS + 2
    tmp_ckpt = None

    # -- lily: weights (and the checkpoint the other processes read), backend, fidelity, the matrix ------
    from lily.checkpoint import checkpoint_kind, inspect_checkpoint
    from lily.config import PRESETS

    if args.synthetic:
        config, source = PRESETS[args.synthetic], f"synthetic {args.synthetic} (seed {args.seed})"
        ckpt = None
        if peers or args.memory:
            ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else Path(tempfile.mkdtemp(prefix="lily-bench-"))
            tmp_ckpt = None if args.checkpoint_dir else ckpt
    else:
        ckpt, source = Path(args.model), str(Path(args.model))
        try:
            # an MLX 4-bit checkpoint or an original release (quantised at load); every header and file size is
            # checked here, so a broken checkpoint is one line before any work, as in lily check
            config, _ = inspect_checkpoint(ckpt)
            kind_of = checkpoint_kind(ckpt)
        except (ValueError, OSError) as e:
            return _fail(str(e).splitlines()[0])
        if peers and not kind_of.startswith("MLX"):
            return _fail(f"--model {ckpt}: the peers read MLX 4-bit checkpoints; this is an {kind_of.split(' (')[0]} "
                         "(convert it first: lily convert SRC OUT)")
    if max_seq > config.max_position_embeddings:
        return _fail(f"--contexts: {max(contexts)} tokens plus {args.decode_steps} decode steps pass the model's "
                     f"max_position_embeddings={config.max_position_embeddings}")
    engines: dict = {}
    fidelity = None
    lily_failure = None   # why lily's own rows did not run: the exit status says so after the report
    if target is not None:   # --merge-into: the peers only, on the earlier run's model and GPU
        why = merge.check_same_setup(target, source, env)
        if why:
            return _fail(f"--merge-into {args.merge_into}: not the same setup ({why})")
        if args.synthetic:
            _synthetic_checkpoint(args, config, ckpt)
    else:
        try:
            lily_doc, fidelity = run_lily(args, kind, config, ckpt, contexts, max_seq, remaining)
        except Exception as e:   # keep going: the peers and the report still run, with lily's failure recorded
            from lily.cli import _user_error_types, error_line

            lily_failure = e
            if isinstance(e, _user_error_types()):   # the user's to fix: its line ends the run, no traceback
                contract.log(f"[bench] lily did not run: {error_line(e)}")
            else:
                traceback.print_exc()
            lily_doc = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0], "rows": []}
        engines["lily"] = lily_doc
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    # -- fresh processes: the peers, then load + memory ------------------------------------------------
    memory_reserve = MEMORY_RESERVE_S if args.memory and args.deadline and target is None else 0.0
    for i, name in enumerate(peers):
        label = PEERS[name][1]
        share = peer_share(name, peers[i + 1:], budgets, remaining(1e9) - memory_reserve if args.deadline else None)
        if args.deadline and share < 60:
            engines[label] = {"ok": False, "error": "skipped: not enough time left before --deadline", "rows": []}
            contract.log(f"[bench] peer {label}: {engines[label]['error']}")
            continue
        # the peer's own budget (load + matrix) makes it stop in time; the timeout is only the backstop
        budget = None if share is None else max(share - 30 if args.deadline else share, 10.0)
        timeout = share if args.deadline else (budget + 300 if budget else None)
        engines[label] = run_peer(name, ckpt, args, out.parent, stem, timeout, budget)
        if not engines[label].get("ok"):
            contract.log(f"[bench] peer {label} did not run: {engines[label].get('error')}")
    if target is not None:
        if tmp_ckpt is not None:
            shutil.rmtree(tmp_ckpt, ignore_errors=True)
        doc, labels = merge.merged(target, engines, env, dict(vars(args)))
        if not labels:
            return _fail(f"--merge-into {args.merge_into}: no peer ran ({'; '.join(str(e.get('error')) for e in engines.values())})")
        written = report.write(doc, out, plot_too=not args.no_plot)
        print(report.table(doc))
        print("merged " + ", ".join(labels) + " into " + ", ".join(str(p) for p in written))
        return 0
    load = None
    if args.memory:
        left = remaining(900)
        load = run_memory(ckpt, args, kind, out.parent, stem, left) if left > 45 \
            else {"ok": False, "error": "skipped: not enough time left before --deadline"}
    if tmp_ckpt is not None:
        shutil.rmtree(tmp_ckpt, ignore_errors=True)

    model = {"source": source, "backend": kind, "vocab_size": config.vocab_size,
             "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
             "num_experts": config.num_experts}
    terms = {"batch": 1, "prompt": "token i = (i * 2654435761 mod 2^32) mod vocab",
             "contexts": contexts, "peer_contexts": peer_contexts if peers else [],
             "decode_steps": args.decode_steps, "rounds": args.rounds, "order": "ascending, descending, ...",
             "warmup": f"once per context: the exact prompt + {WARMUP_STEPS} decode steps",
             "prefill_timing": "through the first generated token on the host",
             "max_drift": args.max_drift, "retries": args.retries, "time_budget_s": args.time_budget,
             "peer_dtype": args.peer_dtype}
    doc = report.document(env, model, terms, engines, fidelity, load, dict(vars(args)))
    doc["notes"] = list(args.note or [])
    written = report.write(doc, out, plot_too=not args.no_plot)
    print(report.table(doc))
    print("wrote " + ", ".join(str(p) for p in written))
    if lily_failure is not None:   # the report holds the rest, but the run did not do its main job
        from lily.cli import UserError, _user_error_types, error_line

        if isinstance(lily_failure, _user_error_types()):
            raise UserError(f"lily's rows did not run: {error_line(lily_failure)}")
        contract.log(f"lily bench: lily's rows did not run ({lily_doc['error']}; traceback above)")
        return 1
    return 0
