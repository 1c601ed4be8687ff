"""The bench's outputs: the environment record, the JSON document, the stdout table and the plot (plot.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

SCHEMA = "lily-bench/1"
REPO = Path(__file__).resolve().parents[2]
# lily run from its git checkout (results under its benchmarks/results, its revision recorded), not an installed
# wheel, whose parents are site-packages (and perhaps some other project's repository)
CHECKOUT = (REPO / ".git").exists() and (REPO / "pyproject.toml").is_file() and (REPO / "lily").is_dir()


def results_dir() -> Path:
    """Where a run's JSON goes by default: the checkout's benchmarks/results, else ./lily-bench in the current
    directory."""
    return REPO / "benchmarks" / "results" if CHECKOUT else Path.cwd() / "lily-bench"


def _git(*args: str) -> str | None:
    if not CHECKOUT:
        return None
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device: str) -> dict:
    """What the numbers were measured on: GPU, driver, versions, git revision."""
    import triton

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    props = torch.cuda.get_device_properties(torch.device(device)) if cuda else None
    status = _git("status", "--porcelain", "--untracked-files=no")
    from lily import __version__

    return {
        "lily": __version__,
        "device": device,
        "gpu": props.name if props else None,
        "gpu_memory_bytes": props.total_memory if props else None,
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        # an explicit LILY_GIT_REVISION wins: a copy of the tree without its .git (or a stale one) cannot tell
        "git_revision": os.environ.get("LILY_GIT_REVISION") or _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
    }


def common_prefix(a: list[int] | None, b: list[int] | None) -> int | None:
    """How many leading generated tokens two engines agree on (same weights, greedy): a cheap check that
    a peer runs the same model; bf16 engines drift apart eventually on near-ties."""
    if a is None or b is None:
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ratios(engines: dict[str, dict], ours: str = "lily") -> list[dict]:
    """lily / peer throughput per context, for every peer row that lily also has; None where either
    side is missing. `both_accepted` says whether the two rows behind a ratio were accepted."""
    mine = {r["context"]: r for r in engines.get(ours, {}).get("rows", [])}
    out = []
    for peer, doc in engines.items():
        if peer == ours:
            continue
        for r in doc.get("rows", []):
            m = mine.get(r["context"])
            if m is None:
                continue

            def q(a, b):
                return a / b if a and b else None

            out.append({"peer": peer, "context": r["context"],
                        "prefill_ratio": q(m.get("prefill_tok_s"), r.get("prefill_tok_s")),
                        "decode_ratio": q(m.get("decode_tok_s"), r.get("decode_tok_s")),
                        "both_accepted": not m.get("refused") and not r.get("refused"),
                        "same_tokens": common_prefix(m.get("tokens"), r.get("tokens"))})
    return out


def document(env: dict, model: dict, contract: dict, engines: dict, fidelity: dict | None,
             load: dict | None, arguments: dict) -> dict:
    return {
        "schema": SCHEMA,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "arguments": arguments,
        "environment": env,
        "model": model,
        "contract": contract,
        "engines": engines,
        "ratios": ratios(engines),
        "peak_memory_by_context": [{"context": r["context"], "peak_bytes": r.get("peak_mem_bytes")}
                   for r in engines.get("lily", {}).get("rows", [])],
        "fidelity": fidelity,
        "load": load,
    }


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def table(doc: dict) -> str:
    """The human summary: one line per engine and context, then lily / peer ratios."""
    lines = [f"{'engine':<14}{'context':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'drift p/d %':>14}"
             f"{'peak GiB':>10}  status"]
    for name, eng in doc["engines"].items():
        if not eng.get("ok", True) and not eng.get("rows"):
            lines.append(f"{name:<14}{'':>9}  not run: {eng.get('error', 'failed')}")
            continue
        for r in eng["rows"]:
            d = (f"{_num(100 * r['prefill_drift'], '.1f') if r.get('prefill_drift') is not None else '-'}/"
                 f"{_num(100 * r['decode_drift'], '.1f') if r.get('decode_drift') is not None else '-'}")
            mem = _num(r["peak_mem_bytes"] / 2**30, ".2f") if r.get("peak_mem_bytes") else "-"
            lines.append(f"{name:<14}{r['context']:>9}{_num(r.get('prefill_tok_s'), ',.0f'):>15}"
                         f"{_num(r.get('decode_tok_s'), ',.1f'):>14}{d:>14}{mem:>10}  "
                         f"{'REFUSED: ' + r['refused'] if r.get('refused') else 'ok'}")
    if doc["ratios"]:
        lines.append("")
        lines.append(f"{'lily / peer':<14}{'context':>9}{'prefill x':>15}{'decode x':>14}{'same tokens':>13}")
        for q in doc["ratios"]:
            lines.append(f"{q['peer']:<14}{q['context']:>9}{_num(q['prefill_ratio'], '.2f'):>15}"
                         f"{_num(q['decode_ratio'], '.2f'):>14}{_num(q.get('same_tokens'), 'd'):>13}"
                         f"{'' if q['both_accepted'] else '  (a row was refused)'}")
    fid = doc.get("fidelity")
    if fid and fid.get("backend_vs_fp32"):
        f, b = fid["backend_vs_fp32"], fid.get("bf16_reference_vs_fp32") or {}
        lines.append("")
        lines.append(f"fidelity over {fid['positions']} teacher-forced positions (vs fp32 reference): "
                     f"rel logit err {_num(f['rel_err_mean'], '.2e')} (max {_num(f['rel_err_max'], '.2e')}), "
                     f"KL {_num(f['kl_mean'], '.2e')}, top-1 {_num(100 * f['top1_agree'], '.1f')} %; "
                     f"bf16 reference: rel err {_num(b.get('rel_err_mean'), '.2e')}, top-1 "
                     f"{_num(100 * b['top1_agree'], '.1f') if b.get('top1_agree') is not None else '-'} %")
    elif fid:
        lines.append("")
        lines.append(f"fidelity not measured: {fid.get('error') or fid.get('skipped')}")
    for note in doc.get("notes") or []:
        lines.append(f"note: {note}")
    load = doc.get("load") or {}
    if load.get("load_s") is not None:
        lines.append(f"load time (page cache): {load['load_s']:.2f} s for {load.get('checkpoint_bytes', 0) / 2**30:.2f} GiB")
    elif load:
        lines.append(f"load/memory not measured: {load.get('error')}")
    for m in load.get("memory") or []:
        if m.get("skipped"):
            lines.append(f"memory at max_seq {m['max_seq']}: {m['skipped']}")
        elif m.get("peak_bytes") is not None:
            lines.append(f"memory at max_seq {m['max_seq']}: peak allocated {m['peak_bytes'] / 2**30:.2f} GiB, "
                         f"device in use {m['device_used_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


def plot(doc: dict, png: Path) -> bool:
    """Draw a bench document's plot into `png`; False (with a note on stderr) without matplotlib."""
    try:
        from lily.bench.plot import plot_throughput
    except ImportError:  # matplotlib is the optional lily[bench] extra
        print("lily bench: no plot (matplotlib is missing: pip install matplotlib, or lily's bench extra)",
              file=sys.stderr)
        return False
    env = doc["environment"]
    title = (f"lily bench: {env.get('gpu') or env.get('cpu') or env['device']}, {doc['model']['source']}, "
             f"batch 1, {doc['contract']['decode_steps']} decode steps")
    plot_throughput(png, {k: v.get("rows", []) for k, v in doc["engines"].items()}, title)
    return True


def write(doc: dict, out: Path, plot_too: bool = True) -> list[Path]:
    """The JSON at `out`, and the plot beside it (same name, .png). Returns the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    written = [out]
    if plot_too and plot(doc, out.with_suffix(".png")):
        written.append(out.with_suffix(".png"))
    return written
