"""lily bench: the contract's pieces against independent computations, the plot as a valid PNG, and the
whole command end to end on the tiny model with both peers, whose greedy tokens must equal lily's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lily.bench import contract, report
from lily.model.reference import ReferenceModel

from helpers_tensors import row_rel

REPO = Path(__file__).resolve().parents[1]


# -- the prompt formula ------------------------------------------------------------------------------

def test_synthetic_prompt_matches_uint32_wraparound():
    rng = random.Random()
    for _ in range(5):
        n, vocab = rng.randint(1, 5000), rng.randint(2, 300_000)
        i = np.arange(n, dtype=np.uint32)
        expect = (i * np.uint32(2654435761)) % np.uint32(vocab)   # uint32 multiply wraps mod 2^32
        assert contract.synthetic_prompt(n, vocab) == expect.astype(np.int64).tolist()
    assert contract.synthetic_prompt(3, 248320) == [0, 2654435761 % 2**32 % 248320, (2 * 2654435761) % 2**32 % 248320]


def test_parse_contexts_and_alternating_orders():
    assert contract.parse_contexts("4K, 256,128k,256") == [256, 4096, 131072]
    for bad in ("", "12x", "-5", "0"):
        with pytest.raises(ValueError, match="--contexts"):
            contract.parse_contexts(bad)
    ctx = random.sample(range(1, 10_000), 5)
    orders = contract.round_orders(ctx, 4)
    assert orders[0] == sorted(ctx) and orders[1] == sorted(ctx, reverse=True) and orders[2] == orders[0]


# -- the refusal logic, with fake timings --------------------------------------------------------------

def _round(pre, dec, tokens):
    return contract.Round(pre, dec, list(tokens))


def test_judge_accepts_steady_rounds_and_reports_medians():
    rng = random.Random()
    pre, dec = rng.uniform(0.01, 5), rng.uniform(0.01, 5)
    toks = [rng.randrange(1000) for _ in range(9)]
    rounds = [_round(pre * (1 + rng.uniform(0, 0.02)), dec * (1 + rng.uniform(0, 0.02)), toks) for _ in range(3)]
    row = contract.judge("e", 512, 8, rounds)
    assert row.refused is None
    assert row.prefill_tok_s == pytest.approx(512 / sorted(r.prefill_s for r in rounds)[1])
    assert row.decode_tok_s == pytest.approx(8 / sorted(r.decode_s for r in rounds)[1])
    assert row.digest == contract.token_digest(toks) and len(row.rounds) == 3


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_judge_refuses_drift_over_3_percent(which):
    rng = random.Random()
    base, toks = rng.uniform(0.1, 2), [rng.randrange(50) for _ in range(5)]
    slow = base * rng.uniform(1.031, 1.5)
    a = _round(base, base, toks)
    b = _round(slow, base, toks) if which == "prefill" else _round(base, slow, toks)
    row = contract.judge("e", 64, 4, [a, b])
    assert row.refused and f"{which} rounds drift" in row.refused
    ok = _round(base * 1.029, base * 1.029, toks)
    assert contract.judge("e", 64, 4, [a, ok]).refused is None


def test_judge_refuses_changed_digest():
    toks = [random.randrange(100) for _ in range(6)]
    other = list(toks)
    other[random.randrange(6)] += 1
    row = contract.judge("e", 64, 5, [_round(1, 1, toks), _round(1, 1, other)])
    assert row.refused and "digest changed" in row.refused
    assert contract.token_digest(toks) != contract.token_digest(other)


class FakeEngine:
    """Deterministic tokens; time advances on a fake clock by amounts the test scripts."""

    name = "fake"

    def __init__(self, clock, prefill_cost, decode_cost):
        self.clock, self.prefill_cost, self.decode_cost = clock, prefill_cost, decode_cost
        self.calls = []          # ("prefill", n) / ("decode", steps)
        self.timed = 0

    def reset(self, max_seq):
        self.max_seq = max_seq

    def prefill(self, ids):
        assert len(ids) < self.max_seq
        self.calls.append(("prefill", len(ids)))
        self.clock.t += self.prefill_cost(len(ids), len([c for c in self.calls if c == ("prefill", len(ids))]))
        self.last = sum(ids) % 97
        return self.last

    def decode_greedy(self, token, steps):
        self.calls.append(("decode", steps))
        self.clock.t += self.decode_cost(steps)
        return [(token * 31 + k) % 97 for k in range(steps)]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_measure_matrix_protocol_with_a_fake_engine():
    clock = FakeClock()
    jitter = {4: [1.0, 1.0, 1.10, 1.0, 1.0, 1.0]}        # ctx 4's second timed prefill is 10 % slow

    def prefill_cost(n, k):
        return 1e-3 * n * (jitter.get(n, [1.0] * 9)[k - 1] if k >= 1 else 1.0)

    eng = FakeEngine(clock, prefill_cost, lambda steps: 1e-2 * steps)
    rows = contract.measure_matrix(eng, [8, 4, 2], steps=3, rounds=2, vocab=50, warmup_steps=2,
                                   retries=1, clock=clock)
    prefills = [n for kind, n in eng.calls if kind == "prefill"]
    # warm-up once per context at its exact shape, then rounds ascending, descending; ctx 4 re-measured
    assert prefills == [2, 2, 4, 4, 8, 8, 8, 4, 2, 4, 4]
    assert [c for c in eng.calls if c[0] == "decode"][:2] == [("decode", 2), ("decode", 3)]
    by = {r.context: r for r in rows}
    assert by[2].refused is None and by[8].refused is None
    assert by[4].refused is None and by[4].extra["attempts"] == 2
    assert by[8].prefill_tok_s == pytest.approx(1000.0) and by[8].decode_tok_s == pytest.approx(100.0)
    assert len(by[8].tokens) == 4


def test_measure_matrix_marks_contexts_over_the_time_budget():
    clock = FakeClock()
    eng = FakeEngine(clock, lambda n, k: 0.01 * n, lambda s: 0.1)
    rows = contract.measure_matrix(eng, [10, 1000], steps=2, rounds=2, vocab=9, clock=clock, time_budget_s=5.0)
    by = {r.context: r for r in rows}
    assert by[10].refused is None
    assert by[1000].refused and "time budget" in by[1000].refused and not by[1000].rounds
    assert 1000 not in [n for kind, n in eng.calls if kind == "prefill"]


def test_measure_matrix_marks_a_failing_context_and_keeps_the_rest():
    clock = FakeClock()
    eng = FakeEngine(clock, lambda n, k: 0.01 * n, lambda s: 0.1)
    real_prefill = eng.prefill

    def prefill(ids):
        if len(ids) == 64:
            raise RuntimeError("CUDA out of memory (fake)")
        return real_prefill(ids)

    eng.prefill = prefill
    rows = contract.measure_matrix(eng, [16, 64, 32], steps=2, rounds=2, vocab=11, clock=clock)
    by = {r.context: r for r in rows}
    assert by[64].refused.startswith("failed: RuntimeError: CUDA out of memory")
    assert by[16].refused is None and by[32].refused is None and len(by[32].rounds) == 2


def test_ratios_and_table_from_made_up_rows():
    rng = random.Random()
    lp, ld, pp, pd = (rng.uniform(1, 1e5) for _ in range(4))
    toks = [rng.randrange(9) for _ in range(6)]
    peer_toks = toks[:3] + [t + 1 for t in toks[3:]]
    engines = {
        "lily": {"ok": True, "rows": [{"context": 256, "prefill_tok_s": lp, "decode_tok_s": ld, "refused": None,
                                       "tokens": toks, "prefill_drift": 0.01, "decode_drift": 0.0}]},
        "mlx-lm": {"ok": True, "rows": [{"context": 256, "prefill_tok_s": pp, "decode_tok_s": pd, "refused": "x",
                                         "tokens": peer_toks}]},
        "transformers": {"ok": False, "error": "skipped: wheels absent", "rows": []},
    }
    (q,) = report.ratios(engines)
    assert q["prefill_ratio"] == pytest.approx(lp / pp) and q["decode_ratio"] == pytest.approx(ld / pd)
    assert q["same_tokens"] == 3 and q["both_accepted"] is False
    doc = report.document(report.environment("cpu"), {"source": "made up"}, {"decode_steps": 5}, engines,
                          None, None, {})
    text = report.table(doc)
    assert "not run: skipped: wheels absent" in text and "REFUSED: x" in text and f"{lp / pp:.2f}" in text


def test_backend_engine_uses_the_backends_own_greedy_loop_when_present():
    from lily.bench.lily_engine import BackendEngine
    from lily.config import TINY
    from lily.engine.reference_backend import ReferenceBackend
    from lily.synthetic import random_weights

    backend = ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(1000)))
    ids = [random.randrange(TINY.vocab_size) for _ in range(random.randint(3, 9))]
    plain = BackendEngine(backend)
    plain.reset(32)
    first = plain.prefill(ids)
    want = plain.decode_greedy(first, 3)

    class WithLoop:                      # the fast backend's shape: decode_greedy(token, state, steps)
        config, device = backend.config, backend.device
        new_state = backend.new_state
        prefill = backend.prefill
        calls = 0

        def decode_greedy(self, token, state, steps):
            WithLoop.calls += 1
            return _loop(token, state, steps)

        def decode(self, token, state):
            raise AssertionError("the engine should use decode_greedy")

        def prepare_state(self, state):  # per-state setup (graph capture) happens at reset, untimed
            WithLoop.prepared.append(state)

    WithLoop.prepared = []

    def _loop(token, state, steps):
        out = []
        for _ in range(steps):
            token = int(backend.decode(token, state).argmax())
            out.append(token)
        return out

    looped = BackendEngine(WithLoop())
    looped.reset(32)
    assert WithLoop.prepared == [looped.state]
    assert looped.prefill(ids) == first
    assert looped.decode_greedy(first, 3) == want and WithLoop.calls == 1


@pytest.mark.parametrize("argv, says", [
    (["--synthetic", "tiny", "--contexts", "12x"], "--contexts: '12x'"),
    (["--synthetic", "tiny", "--peers", "mlx,vllm"], "unknown peer 'vllm'"),
    (["--synthetic", "tiny", "--peer-contexts", "4K,,k"], "--peer-contexts: 'k'"),
    (["--synthetic", "tiny", "--rounds", "1"], "at least 2 rounds"),
    (["--synthetic", "tiny", "--device", "cpu", "--backend", "fast"], "CUDA only"),
    (["--synthetic", "tiny", "--device", "cpu", "--contexts", "300000"], "max_position_embeddings"),
    (["--model", "/nonexistent/ckpt"], "no config.json"),
    # a negative bound refused every row, and the run still ended with status 0 (one short context: the
    # old code runs it)
    (["--synthetic", "tiny", "--device", "cpu", "--contexts", "16", "--max-drift", "-0.5"], "--max-drift -0.5"),
    (["--synthetic", "tiny", "--device", "cpu", "--contexts", "16", "--max-drift", "nan"], "--max-drift nan"),
    (["--synthetic", "tiny", "--device", "cpu", "--contexts", "16", "--seed", str(2**64 + random.randrange(10**9))],
     "is out of range"),
    (["--synthetic", "tiny", "--device", "cpu", "--contexts", "16", "--seed", "-3"], "--seed -3 is out of range"),
])
def test_user_errors_are_one_clear_line(argv, says, capsys, tmp_path):
    from lily.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and err.startswith("lily bench: ")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["--synthetic", "tiny", "--peer-time-budget", "vllm=30"], "unknown peer 'vllm'"),
    (["--synthetic", "tiny", "--peer-time-budget", "mlx=soon"], "'mlx=soon' is not PEER=SECONDS"),
    (["--synthetic", "tiny", "--peers", "mlx", "--merge-into", "/nonexistent/run.json"], "cannot read it"),
    (["--synthetic", "tiny", "--merge-into", "/nonexistent/run.json"], "name the peers to run"),
])
def test_peer_budget_and_merge_errors_are_one_clear_line(argv, says, capsys, tmp_path):
    from lily.cli import main

    assert main(["bench", *argv, "--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and err.startswith("lily bench: ")


def test_a_broken_checkpoint_is_one_line_before_any_work(capsys, tmp_path):
    from helpers_ckpt import write_tiny_checkpoint
    from lily.cli import main

    ckpt, _ = write_tiny_checkpoint(tmp_path / "ckpt", seed=random.randrange(1 << 20))
    f = ckpt / "model.safetensors"
    os.truncate(f, f.stat().st_size - random.randrange(1, 1000))
    out = tmp_path / "x.json"
    assert main(["bench", "--model", str(ckpt), "--device", "cpu", "--contexts", "16", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "truncated" in err and len(err.splitlines()) == 1 and err.startswith("lily bench: error: ")
    assert not out.exists()


@pytest.mark.parametrize("user", [True, False])
def test_lily_failing_mid_run_is_a_non_zero_exit(user, capsys, tmp_path, monkeypatch):
    """What cannot be checked up front still ends non-zero once the report (the rest of it) is written: a user
    error (here a checkpoint whose data turns out unreadable) as one line and 2, a bug with its traceback and 1."""
    from lily.bench import main as bench_main
    from lily.checkpoint import CheckpointError
    from lily.cli import main

    why = f"damaged-{random.randrange(1 << 20)}"

    def failing(*a, **k):
        raise CheckpointError(why) if user else RuntimeError(why)

    monkeypatch.setattr(bench_main, "backend_from_weights", failing)
    out = tmp_path / "x.json"
    rc = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--contexts", "16", "--no-plot", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == (2 if user else 1)
    assert why in err[-1] and "did not run" in err[-1]
    assert err[-1].startswith("lily bench: error: ") == user and ("Traceback" in "\n".join(err)) != user
    lily_doc = json.loads(out.read_text())["engines"]["lily"]
    assert not lily_doc["ok"] and why in lily_doc["error"]


def test_peer_shares_of_the_time_left():
    """Own budgets (PEER=S) come first, capped by what is left; peers without one share the rest equally
    under a deadline; a single number bounds every peer."""
    from lily.bench.main import peer_budgets, peer_share

    total = random.uniform(600, 900)
    own = peer_budgets("mlx=480")
    assert own == {"mlx": 480.0}
    assert peer_share("hf", ["mlx"], own, total) == pytest.approx(total - 480)
    assert peer_share("mlx", [], own, 300.0) == 300.0 and peer_share("mlx", [], own, None) == 480.0
    assert peer_share("hf", ["mlx"], own, None) is None
    bound = peer_budgets("100")
    assert peer_share("hf", ["mlx"], bound, total) == 100.0 and peer_share("mlx", [], bound, 60.0) == 60.0
    assert peer_share("hf", ["mlx"], {}, total) == pytest.approx(total / 2)


def _bench_doc(engines: dict, peer_contexts: list[int]) -> dict:
    return {"schema": report.SCHEMA, "engines": engines, "model": {"source": "synthetic tiny (seed 0)"},
            "environment": {"gpu": "G"}, "contract": {"decode_steps": 8, "rounds": 2, "peer_contexts": peer_contexts},
            "notes": []}


def test_merge_keeps_earlier_rows_over_a_failed_rerun():
    from lily.bench import merge

    row = lambda c, p: {"context": c, "prefill_tok_s": p, "decode_tok_s": 10.0, "tokens": [1, 2]}  # noqa: E731
    target = _bench_doc({"lily": {"ok": True, "rows": [row(16, 900.0), row(32, 800.0)]},
                         "transformers": {"ok": True, "rows": [row(16, 300.0)]}}, [16])
    failed = {"ok": False, "error": "RuntimeError: boom", "rows": []}
    good = {"ok": True, "rows": [row(16, 100.0), row(32, 50.0)]}
    doc, labels = merge.merged(target, {"transformers": failed, "mlx-lm": good}, {"git_revision": "abc", "gpu": "G"},
                               {"peers": "hf,mlx"})
    assert labels == ["mlx-lm"] and doc["engines"]["transformers"] == target["engines"]["transformers"]
    assert doc["engines"]["mlx-lm"]["separate_run"]["git_revision"] == "abc"
    assert doc["contract"]["peer_contexts"] == [16, 32]
    assert {(q["peer"], q["context"]): q["prefill_ratio"] for q in doc["ratios"]} == pytest.approx(
        {("transformers", 16): 3.0, ("mlx-lm", 16): 9.0, ("mlx-lm", 32): 16.0})
    assert any("failed" in n and "transformers" in n for n in doc["notes"])
    assert any("mlx-lm" in n and "separate" in n for n in doc["notes"])
    assert "mlx-lm" not in target["engines"] and target["notes"] == []   # the earlier document is not touched
    assert merge.check_same_setup(target, "synthetic tiny (seed 1)", {"gpu": "G"}) is not None
    assert merge.check_same_setup(target, "synthetic tiny (seed 0)", {"gpu": "H"}) is not None
    assert merge.check_same_setup(target, "synthetic tiny (seed 0)", {"gpu": "G"}) is None


def test_bench_merge_into_adds_a_separately_run_peer(tmp_path):
    """lily alone first, then the MLX-LM peer as a separate `--merge-into` invocation: its rows join the
    first run's JSON under that run's contract (decode steps, rounds), lily's rows untouched, and its
    greedy tokens agree with lily's; a run of another model is refused and leaves the file as it was."""
    seed = random.randrange(1 << 20)
    out = tmp_path / "bench-first.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    base = [sys.executable, "-m", "lily", "bench", "--synthetic", "tiny", "--seed", str(seed), "--device", "cpu"]
    first = subprocess.run(base + ["--backend", "reference", "--contexts", "16,32", "--decode-steps", "3",
                                   "--retries", "0", "--peer-dtype", "float32", "--out", str(out)],
                           capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = json.loads(out.read_text())
    assert set(before["engines"]) == {"lily"}
    other = subprocess.run([sys.executable, "-m", "lily", "bench", "--synthetic", "tiny", "--seed", str(seed + 1),
                            "--device", "cpu", "--peers", "mlx", "--merge-into", str(out)],
                           capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert other.returncode == 2 and "not the same setup" in other.stderr and json.loads(out.read_text()) == before
    merged = subprocess.run(base + ["--peers", "mlx", "--peer-contexts", "16", "--merge-into", str(out)],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["engines"]["lily"] == before["engines"]["lily"]
    mlx = doc["engines"]["mlx-lm"]
    assert mlx["ok"] and [r["context"] for r in mlx["rows"]] == [16] and mlx["separate_run"]["created_utc"]
    assert all(len(r["rounds"]) == 2 and len(r["tokens"]) == 3 + 1 for r in mlx["rows"])   # the first run's contract
    q = {(q["peer"], q["context"]): q for q in doc["ratios"]}
    assert set(q) == {("mlx-lm", 16)} and q[("mlx-lm", 16)]["same_tokens"] >= 1
    assert any("mlx-lm" in n and "separate" in n for n in doc["notes"]) and "merged mlx-lm" in merged.stdout
    assert out.with_suffix(".png").exists()


# -- the plot ------------------------------------------------------------------------------------------

def test_plot_draws_every_engine_in_both_panels(tmp_path):
    import matplotlib.image

    from lily.bench.plot import PANELS, draw_throughput, plot_throughput

    ctx = sorted(random.sample([256, 512, 1024, 4096, 32768, 131072], 4))
    engines = {name: [{"context": c, "prefill_tok_s": random.uniform(10, 1e5), "decode_tok_s": random.uniform(1, 1e3),
                       "refused": random.choice([None, "drift"])} for c in ctx]
               for name in ("lily", "mlx-lm", "transformers")}
    engines["transformers"][-1]["decode_tok_s"] = None  # a row it could not measure: no point
    fig = draw_throughput(engines, "test plot")
    axes = fig.get_axes()
    assert [a.get_title() for a in axes] == [label for _, label in PANELS]
    for ax, (key, label) in zip(axes, PANELS):
        assert ax.get_xlabel() == "context (tokens)" and ax.get_ylabel() == label
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctx]
        assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(engines)
        lines = {line.get_gid(): line for line in ax.get_lines()}
        for name, rows in engines.items():
            want = [(r["context"], r[key]) for r in rows if r[key]]
            assert list(zip(*lines[f"{name}/line"].get_data())) == want
            for kind, refused in (("accepted", False), ("refused", True)):
                pts = [(r["context"], r[key]) for r in rows if r[key] and bool(r["refused"]) == refused]
                marker = lines.get(f"{name}/{kind}")
                assert (list(zip(*marker.get_data())) if marker else []) == pts
                if marker:  # hollow = refused
                    assert (marker.get_markerfacecolor() == "white") == refused
    path = tmp_path / "p.png"
    plot_throughput(path, engines, "test plot")
    h, w, _ = matplotlib.image.imread(path).shape
    assert (w, h) == (1280, 560)


# -- end to end: lily bench on the tiny model, both peers, fidelity, load/memory --------------------------

def reference_greedy(weights, config, ids, steps):
    m = ReferenceModel(config, weights, device="cpu", dtype=torch.float32)
    s = m.new_state()
    logits = [m.forward(ids, s, logits_for="last")[-1]]
    toks = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(m.forward([toks[-1]], s)[-1])
        toks.append(int(logits[-1].argmax()))
    margins = [float(l.topk(2).values[0] - l.topk(2).values[1]) for l in logits]
    return toks, margins


def trusted_prefix(margins, eps=1e-3) -> int:
    """Positions up to (and including) the first near-tie, where fp32 engines may legitimately differ."""
    for i, m in enumerate(margins):
        if m < eps:
            return i + 1
    return len(margins)


def test_bench_end_to_end_tiny_with_peers(tmp_path):
    from lily.checkpoint import load_checkpoint

    seed = random.randrange(1 << 20)
    out = tmp_path / "res" / "bench-test.json"
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "lily", "bench", "--synthetic", "tiny", "--seed", str(seed), "--device", "cpu",
           "--backend", "reference", "--contexts", "16,32", "--decode-steps", "4", "--retries", "0",
           "--peers", "mlx,hf", "--peer-dtype", "float32", "--fidelity", "--fidelity-positions", "16",
           "--memory", "--memory-max-seq", "24,40", "--checkpoint-dir", str(ckpt), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())

    assert doc["schema"] == report.SCHEMA
    for k in ("gpu", "driver", "torch", "triton", "git_revision", "python"):
        assert k in doc["environment"]
    assert doc["environment"]["torch"] == torch.__version__
    assert doc["contract"]["decode_steps"] == 4 and doc["contract"]["contexts"] == [16, 32]
    assert set(doc["engines"]) == {"lily", "mlx-lm", "transformers"}
    import matplotlib.image
    assert matplotlib.image.imread(out.with_suffix(".png")).shape[:2] == (560, 1280)
    assert "prefill tok/s" in p.stdout and "lily / peer" in p.stdout

    # lily's greedy tokens against an independent run of the fp32 reference on the checkpoint's weights
    ck = load_checkpoint(ckpt)
    for name, eng in doc["engines"].items():
        assert eng["ok"], (name, eng.get("error"))
        assert [r["context"] for r in eng["rows"]] == [16, 32]
        for r in eng["rows"]:
            assert len(r["rounds"]) >= 2 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
            assert r["refused"] is None or isinstance(r["refused"], str)
            want, margins = reference_greedy(ck.weights, ck.config, contract.synthetic_prompt(r["context"],
                                                                                          ck.config.vocab_size), 4)
            n = trusted_prefix(margins)
            assert r["tokens"][:n] == want[:n], (name, r["context"], r["tokens"], want)
            assert r["digest"] == contract.token_digest(r["tokens"])
    ratios = {(q["peer"], q["context"]): q for q in doc["ratios"]}
    assert len(ratios) == 4 and all(q["same_tokens"] is not None for q in ratios.values())

    # fidelity: the report's measures are those of the test's own runs of the reference in fp32 and bf16
    # over the same 16 teacher-forced positions (the backend here is the reference: its token-by-token
    # decode path against the fp32 prefill is within fp32 rounding)
    fid = doc["fidelity"]
    assert fid["positions"] == 16
    ids = contract.synthetic_prompt(16, ck.config.vocab_size)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = ReferenceModel(ck.config, ck.weights, device="cpu", dtype=dtype)
        logits[dtype] = m.forward(ids, m.new_state()).float()
    rel = row_rel(logits[torch.bfloat16], logits[torch.float32])
    bf16 = fid["bf16_reference_vs_fp32"]
    assert bf16["rel_err_mean"] == pytest.approx(float(rel.mean()), rel=1e-3)
    assert bf16["rel_err_max"] == pytest.approx(float(rel.max()), rel=1e-3)
    agree = logits[torch.bfloat16].argmax(-1) == logits[torch.float32].argmax(-1)
    assert bf16["top1_agree"] == pytest.approx(float(agree.float().mean()))
    assert 1e-4 < bf16["rel_err_mean"] < 0.1   # bf16 is visibly, but slightly, off
    assert fid["backend_vs_fp32"]["rel_err_max"] < 1e-4 and fid["backend_vs_fp32"]["top1_agree"] == 1.0

    assert doc["load"]["ok"], doc["load"]
    assert doc["load"]["load_s"] > 0 and [m["max_seq"] for m in doc["load"]["memory"]] == [24, 40]


def test_results_and_revision_from_a_checkout_only(tmp_path, monkeypatch):
    """From lily's git checkout a run's JSON goes to its benchmarks/results with its revision; from an installed
    wheel (site-packages, perhaps inside another project's repository) to ./lily-bench, with no revision of
    someone else's repository; lily's version recorded either way."""
    import lily
    from lily.bench import report

    monkeypatch.setattr(report, "CHECKOUT", True)
    assert report.results_dir() == report.REPO / "benchmarks" / "results"
    monkeypatch.setattr(report, "CHECKOUT", False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LILY_GIT_REVISION", raising=False)
    assert report.results_dir() == tmp_path / "lily-bench"
    env = report.environment("cpu")
    assert env["git_revision"] is None and env["git_dirty"] is None and env["lily"] == lily.__version__
