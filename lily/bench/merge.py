"""`lily bench --merge-into RUN.json`: peers measured by a separate invocation, added to an earlier result.

A slow peer (MLX-LM prefills ~280 tok/s on CUDA) may not fit the time one run has left after lily's matrix.
It can then run on its own, on the same GPU and the same model, under the earlier run's contract (decode
steps, rounds, retries, drift limit, peer dtype), and its rows join that run's document: its engine entry
says when and at which revision it was measured, and a note says so in the printed table.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path

from lily.bench import report

# the contract a merged peer must be measured under: bench arguments, named as the document's contract keys
CONTRACT_ARGS = ("decode_steps", "rounds", "retries", "max_drift", "peer_dtype")


def load_target(path: Path) -> dict:
    """The earlier result (a lily-bench document); ValueError with one line if it is not one."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"--merge-into {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError:
        raise ValueError(f"--merge-into {path}: not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != report.SCHEMA or not isinstance(doc.get("engines"), dict):
        raise ValueError(f"--merge-into {path}: not a `lily bench` result (schema {report.SCHEMA})")
    return doc


def adopt_contract(args, target: dict) -> None:
    """The bench arguments that make rows comparable, taken from the earlier run (its peer contexts too,
    unless --peer-contexts names others)."""
    terms = target.get("contract") or {}
    for name in CONTRACT_ARGS:
        if terms.get(name) is not None:
            setattr(args, name, terms[name])
    if args.peer_contexts is None and terms.get("peer_contexts"):
        args.peer_contexts = ",".join(str(c) for c in terms["peer_contexts"])


def check_same_setup(target: dict, source: str, env: dict) -> str | None:
    """Why the earlier run is not comparable with this one (another model or GPU), or None."""
    theirs = (target.get("model") or {}).get("source")
    if theirs != source:
        return f"it measured {theirs!r}, this run {source!r}"
    gpu, their_gpu = env.get("gpu"), (target.get("environment") or {}).get("gpu")
    if gpu != their_gpu:
        return f"it ran on {their_gpu or 'the CPU'}, this run on {gpu or 'the CPU'}"
    return None


def merged(target: dict, peers: dict[str, dict], env: dict, arguments: dict) -> tuple[dict, list[str]]:
    """The earlier document with these peers' engine entries in it (a failed run does not replace rows the
    earlier run has), its ratios recomputed and a note a peer; and the labels actually merged."""
    doc = copy.deepcopy(target)
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rev = env.get("git_revision")
    merged_labels = []
    notes = doc.setdefault("notes", [])
    for label, eng in peers.items():
        had_rows = bool((doc["engines"].get(label) or {}).get("rows")) and doc["engines"][label].get("ok", True)
        if not eng.get("ok") and had_rows:
            notes.append(f"{label}: a separate run at {when} failed ({eng.get('error')}); the rows above are the earlier ones")
            continue
        entry = dict(eng)
        entry["separate_run"] = {"created_utc": when, "git_revision": rev, "host": env.get("host"),
                                 "gpu": env.get("gpu"), "torch": env.get("torch"), "arguments": arguments}
        doc["engines"][label] = entry
        merged_labels.append(label)
        notes.append(f"{label}: measured by a separate `lily bench --merge-into` run on the same GPU at {when} "
                     f"(git {rev}), under this run's contract, and merged into this file")
    terms = doc.setdefault("contract", {})
    contexts = {r["context"] for lbl in merged_labels for r in doc["engines"][lbl].get("rows", [])}
    terms["peer_contexts"] = sorted(set(terms.get("peer_contexts") or []) | contexts)
    doc["ratios"] = report.ratios(doc["engines"])
    return doc, merged_labels
