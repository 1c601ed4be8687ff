"""`lily generate` as a user runs it (a subprocess on a tiny checkpoint on disk), checked against the
reference model run in-process on the same weights."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lily.config import TINY
from lily.model.reference import ReferenceModel

checkpoint = pytest.importorskip("lily.checkpoint")
synthetic = pytest.importorskip("lily.synthetic")

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
    seed = torch.seed() % 2**31
    weights = synthetic.random_weights(TINY, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 400, (11,), generator=gen).tolist()
    tokens, tops = greedy_reference(ReferenceModel(TINY, weights), prompt, 6, 4)
    if tokens[2] in tokens[:2]:
        pytest.skip("the third greedy token repeats an earlier one; eos stop would be ambiguous")  # rare
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


def test_bf16_runs(tiny):
    path, prompt, tokens, _ = tiny
    out = _last_json(lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", 3, "--dtype", "bf16", "--ignore-eos", "--top-logprobs", 2,
                          "--json", "--device", "cpu").stdout)
    assert len(out["tokens"]) == 3 and all(0 <= t < TINY.vocab_size for t in out["tokens"])
    assert all(len(t) == 2 and t[0][1] <= 0 for t in out["top_logprobs"])


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

    path = synthetic.make_synthetic("tiny", tmp_path / "demo", seed=torch.seed() % 2**31)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "hello world, this is lily"
    ids = tok.encode(text, add_special_tokens=False).ids
    common = ("--max-tokens", 3, "--ignore-eos", "--json", "--backend", "reference", "--device", "cpu")
    by_text = _last_json(lily("generate", "--model", path, "--prompt", text, *common).stdout)
    by_ids = _last_json(lily("generate", "--model", path, "--prompt-ids", ",".join(map(str, ids)), *common).stdout)
    assert by_text["tokens"] == by_ids["tokens"]
    assert by_text["text"] == tok.decode(by_text["tokens"], skip_special_tokens=False)
