"""`lily generate` as a user runs it (a subprocess on a tiny checkpoint on disk), checked against the
reference model run in-process on the same weights."""

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lily import checkpoint, synthetic
from lily.config import TINY
from lily.model.reference import ReferenceModel


REPO = Path(__file__).resolve().parents[1]


def lily(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "lily", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def greedy_reference(model, prompt, n, k):
    """Greedy decoding written directly against ReferenceModel.forward (one full re-run per step, no state
    reuse, so the CLI's prefill/decode path is checked against a different path)."""
    tokens, tops = [], []
    for _ in range(n):
        lp = model.forward(torch.tensor(prompt + tokens), model.new_state())[-1].log_softmax(-1)
        tokens.append(int(lp.argmax()))
        vals, idx = lp.topk(k)
        tops.append(list(zip(idx.tolist(), vals.tolist())))
    return tokens, tops


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny checkpoint whose eos is the third greedy token of a fixed prompt, and what to expect of it."""
    seed = random.randrange(2**31)
    weights = synthetic.random_weights(TINY, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    model = ReferenceModel(TINY, weights)
    for _ in range(20):  # a prompt whose third greedy token is new: an eos stop there is unambiguous
        prompt = torch.randint(0, 400, (11,), generator=gen).tolist()
        tokens, tops = greedy_reference(model, prompt, 6, 4)
        if tokens[2] not in tokens[:2]:
            break
    else:
        raise AssertionError(f"seed {seed}: no prompt of 20 has a new third greedy token")
    config = dataclasses.replace(TINY, eos_token_ids=(tokens[2],))
    path = checkpoint.write_checkpoint(tmp_path_factory.mktemp("tiny"), config, weights)
    return path, prompt, tokens, tops


def _last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def test_json_matches_reference(tiny):
    path, prompt, tokens, tops = tiny
    r = lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", 6,
             "--top-logprobs", 4, "--ignore-eos", "--json", "--device", "cpu")
    out = _last_json(r.stdout)
    assert set(out) == {"tokens", "top_logprobs"}  # no tokenizer in this checkpoint
    assert out["tokens"] == tokens
    assert len(out["top_logprobs"]) == 6
    for got, want in zip(out["top_logprobs"], tops):
        assert len(got) == 4
        assert got[0][0] == want[0][0]
        for (gi, gl), (wi, wl) in zip(got, want):
            assert abs(gl - wl) <= 1e-4, (got, want)
        assert {i for i, _ in got} == {i for i, _ in want} or abs(got[-1][1] - want[-1][1]) < 1e-4
        assert all(a[1] >= b[1] for a, b in zip(got, got[1:]))


def test_top_logprobs_are_printed_without_json(tiny):
    """Without --json, --top-logprobs K adds a line a step after the tokens: step, token, and the K most likely
    tokens with their log-probabilities (this checkpoint has no tokenizer: ids), the reference's."""
    path, prompt, tokens, tops = tiny
    r = lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", 6,
             "--top-logprobs", 4, "--ignore-eos", "--device", "cpu")
    lines = r.stdout.strip().splitlines()
    assert lines[0] == " ".join(map(str, tokens)) and len(lines) == 7, r.stdout
    for step, (line, want) in enumerate(zip(lines[1:], tops)):
        index, token, shown = line.split("\t")
        assert (int(index), int(token)) == (step, tokens[step])
        pairs = shown.split("  ")
        assert len(pairs) == 4 and int(pairs[0].split()[0]) == want[0][0], line
        assert all(abs(float(p.split()[1]) - wl) <= 1e-4 for p, (_, wl) in zip(pairs, want)), (line, want)


def test_stops_at_eos_unless_ignored(tiny):
    path, prompt, tokens, _ = tiny
    ids = ",".join(map(str, prompt))
    out = _last_json(lily("generate", "--model", path, "--prompt-ids", ids, "--max-tokens", 6, "--json",
                          "--backend", "reference", "--device", "cpu").stdout)
    assert out["tokens"] == tokens[:3]  # the eos token is reported, then the run ends
    assert out["top_logprobs"] == [[], [], []]
    plain = lily("generate", "--model", path, "--prompt-ids", ids, "--max-tokens", 2, "--backend", "reference",
                 "--device", "cpu")
    assert plain.stdout.strip().splitlines()[-1] == " ".join(map(str, tokens[:2]))


def test_bf16_is_the_bf16_reference_and_near_fp32(tiny):
    """--dtype bf16 against ReferenceModel in bf16 on the checkpoint's weights, stepped here like any
    generation (prefill, then a token at a time): the same tokens and log-probabilities. Against the
    fp32 reference (teacher-forced on those tokens): visibly different (so bf16 really ran), and the
    same greedy token wherever fp32's top-2 margin exceeds twice the bf16 run's log-prob deviation there
    (the largest of the tokens in contention: the competitor's counts as much as the chosen one's)."""
    path, prompt, _, _ = tiny
    n = 4
    out = _last_json(lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", n, "--dtype", "bf16", "--ignore-eos", "--top-logprobs", 2,
                          "--json", "--device", "cpu", "--backend", "reference").stdout)
    tokens, tops = out["tokens"], out["top_logprobs"]
    weights = checkpoint.load_checkpoint(path).weights
    model = ReferenceModel(TINY, weights, dtype=torch.bfloat16)
    state = model.new_state()
    logits = model.forward(torch.tensor(prompt), state)[-1]
    lps = []
    for i in range(n):
        lp = logits.float().log_softmax(-1)
        lps.append(lp)
        vals, idx = lp.topk(2)
        assert tokens[i] == int(idx[0]), (i, tokens, int(idx[0]))
        assert [j for j, _ in tops[i]] == idx.tolist(), (i, tops[i])
        assert max(abs(v - float(w)) for (_, v), w in zip(tops[i], vals)) < 1e-5, (i, tops[i], vals)  # a few fp32 ulps of a log-prob ~ -10
        logits = model.forward(torch.tensor([tokens[i]]), state)[-1]
    fp32 = ReferenceModel(TINY, weights)
    lp32 = fp32.forward(torch.tensor(prompt + tokens[:-1]), fp32.new_state())[len(prompt) - 1:].double().log_softmax(-1)
    got = torch.tensor([v for (_, v), *_ in tops], dtype=torch.float64)
    dev = (lp32[torch.arange(n), tokens] - got).abs()
    assert float(dev.max()) > 1e-4, "the bf16 run gives the fp32 numbers: bf16 did not run"
    top2 = lp32.topk(2, -1)
    # the deviation of the tokens in contention: fp32's top two and the token bf16 chose
    contenders = torch.cat([top2.indices, torch.tensor(tokens)[:, None]], -1)
    dev_top = (lp32 - torch.stack(lps).double()).abs().gather(-1, contenders).amax(-1)
    decisive = (top2.values[:, 0] - top2.values[:, 1]) > 2 * dev_top
    assert (lp32.argmax(-1) == torch.tensor(tokens))[decisive].all(), (tokens, lp32.argmax(-1).tolist(), dev.tolist())


@pytest.mark.parametrize("args,message", [
    (["--prompt", "hello"], "no tokenizer.json"),
    (["--prompt-ids", "1,x,3"], "comma-separated integers"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt-ids", "1", "--backend", "fast", "--device", "cpu"], "CUDA only"),
])
def test_user_errors_are_one_line(tiny, args, message, capsys):
    from lily.cli import main

    path = tiny[0]
    assert main(["generate", "--model", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_missing_model_dir(tmp_path, capsys):
    from lily.cli import main

    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a directory" in err and len(err.splitlines()) == 1


def test_text_prompt_with_the_demo_tokenizer(tmp_path):
    """With a tokenizer, --prompt is encoded and the reply decoded (the tiny synthetic checkpoint has one)."""
    from tokenizers import Tokenizer

    path = synthetic.make_synthetic("tiny", tmp_path / "demo", seed=random.randrange(2**31))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "hello world, this is lily"
    ids = tok.encode(text, add_special_tokens=False).ids
    common = ("--max-tokens", 3, "--ignore-eos", "--json", "--backend", "reference", "--device", "cpu")
    by_text = _last_json(lily("generate", "--model", path, "--prompt", text, *common).stdout)
    by_ids = _last_json(lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, ids)), *common).stdout)
    assert by_text["tokens"] == by_ids["tokens"]
    assert by_text["text"] == tok.decode(by_text["tokens"], skip_special_tokens=False)


@pytest.fixture
def short(tiny, tmp_path):
    """The tiny checkpoint with a small, random max_position_embeddings."""
    limit = random.randrange(16, 48)
    cfg = json.loads((tiny[0] / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = limit
    d = tmp_path / "short"
    d.mkdir()
    for f in tiny[0].iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    return d, limit


def test_prompt_plus_max_tokens_within_the_models_positions(short, tmp_path, capsys):
    """As `lily serve` counts a request: prompt + --max-tokens up to max_position_embeddings runs (on the CPU
    too, where the reference backend would go on past it), one more is one line before any weight is read."""
    from lily.cli import main

    d, limit = short
    n = random.randrange(1, limit - 1)
    ids = ",".join(str(random.randrange(TINY.vocab_size)) for _ in range(n))
    common = ["--model", str(d), "--prompt-ids", ids, "--device", "cpu", "--ignore-eos", "--json"]
    assert main(["generate", *common, "--max-tokens", str(limit - n)]) == 0
    assert len(_last_json(capsys.readouterr().out)["tokens"]) == limit - n
    # weights cut short too: the refusal must come first, before the load would fail
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in d.iterdir():
        (broken / f.name).symlink_to(f.resolve()) if f.suffix != ".safetensors" else \
            (broken / f.name).write_bytes(f.read_bytes()[:-100])
    for model in (d, broken):
        assert main(["generate", *common, "--model", str(model), "--max-tokens", str(limit - n + 1)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"past the model's max_position_embeddings {limit}" in err, err
        assert "lower --max-tokens" in err


def test_the_fast_backend_is_sized_for_the_prompt_and_max_tokens(tiny, monkeypatch, capsys):
    """On CUDA the fast backend preallocates max_seq tokens a sequence (32768 by default, which a longer run
    overflowed after the work): generate asks for prompt + --max-tokens, one slot. No GPU here: load_backend
    is caught and the reference backend runs in its place."""
    import lily.engine
    from lily.cli import main

    path, prompt, tokens, _ = tiny
    asked = {}
    real = lily.engine.load_backend

    def spy(model_dir, device, backend="auto", max_seq=None, **kw):
        asked.update(device=str(device), backend=backend, max_seq=max_seq, max_batch=kw.get("max_batch"))
        return real(model_dir, "cpu", "reference")

    monkeypatch.setattr(lily.engine, "load_backend", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    n = random.randrange(3, 40)
    assert main(["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--device", "cuda",
                 "--max-tokens", str(n), "--ignore-eos", "--json"]) == 0
    assert asked == {"device": "cuda", "backend": "fast", "max_seq": len(prompt) + n, "max_batch": 1}
    assert _last_json(capsys.readouterr().out)["tokens"][:len(tokens)] == tokens[:n]
