"""Bad checkpoints at the door of `lily serve`: tests/test_checkpoint_errors.py covers every refusal of
the loader itself; here each damaged directory is handed to `lily serve` (its run(), in-process) and
must be refused with exit status 2 and one line on stderr, before anything listens. Covered here and
not there: the tokenizer side (missing or garbage tokenizer files, a chat template that does not
compile, a tokenizer with more tokens than the model's vocabulary) and config lies seen through serve."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import uvicorn

import lily.server.main as serve_main
from helpers_ckpt import edit_config, write_tiny_checkpoint
from lily.cli import main as lily_main
from lily.config import TINY


class WouldServe(Exception):
    """Raised instead of listening: the checkpoint was accepted."""


@pytest.fixture(autouse=True)
def no_listening(monkeypatch):
    def refuse_to_listen(self, *a, **k):
        raise WouldServe()

    monkeypatch.setattr(uvicorn.Server, "run", refuse_to_listen)
    monkeypatch.setattr(serve_main.signal, "signal", lambda *a: None)  # leave pytest's handlers alone


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt", seed=random.randrange(1000),
                                    tokenizer=True)
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def serve(path, capsys, *extra: str):
    try:
        code = lily_main(["serve", "--model", str(path), "--device", "cpu", "--backend", "reference", "--port", "0",
                          *extra])
    except WouldServe:
        code = "served"
    return code, capsys.readouterr().err


def refused(path, capsys, *needles: str) -> str:
    code, err = serve(path, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"accepted a bad checkpoint ({code}); stderr: {err[-500:]}"
    assert len(lines) == 1 and lines[0].startswith("lily serve: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    print(lines[0])
    return lines[0]


def test_the_pristine_copy_is_served(ckpt, capsys):
    assert serve(ckpt, capsys)[0] == "served"


@pytest.mark.parametrize("field,value", [("hidden_size", 256), ("moe_intermediate_size", 128), ("num_experts", 16),
                                         ("vocab_size", 1024), ("head_dim", 32), ("linear_num_value_heads", 8),
                                         ("num_hidden_layers", 2)])
def test_config_that_lies_about_a_dimension(ckpt, capsys, field, value):
    def lie(cfg):
        target = cfg.get("text_config", cfg)
        target[field] = value
        if field == "num_hidden_layers" and "layer_types" in target:
            target["layer_types"] = target["layer_types"][:value]
    edit_config(ckpt, lie)
    refused(ckpt, capsys)


@pytest.mark.parametrize("change", [{"bits": 8}, {"bits": 3}, {"group_size": 32}, {"mode": "mxfp4"}])
def test_wrong_quantization_in_config(ckpt, capsys, change):
    def requant(cfg):
        for key in ("quantization", "quantization_config"):
            if isinstance(cfg.get(key), dict):
                cfg[key].update(change)
    edit_config(ckpt, requant)
    refused(ckpt, capsys)


def test_tokenizer_json_missing(ckpt, capsys):
    (ckpt / "tokenizer.json").unlink()
    refused(ckpt, capsys, "tokenizer")


def test_tokenizer_json_garbage(ckpt, capsys):
    (ckpt / "tokenizer.json").write_bytes(bytes(random.randrange(256) for _ in range(300)))
    refused(ckpt, capsys, "tokenizer.json")


def test_tokenizer_config_invalid_json(ckpt, capsys):
    (ckpt / "tokenizer_config.json").write_text('{"eos_token": ')
    refused(ckpt, capsys, "tokenizer_config.json")


def test_chat_template_that_does_not_compile(ckpt, capsys):
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    refused(ckpt, capsys, "chat template")


def test_tokenizer_bigger_than_the_models_vocabulary(tmp_path, capsys):
    small = dataclasses.replace(TINY, vocab_size=256, eos_token_ids=(200,))
    path, _ = write_tiny_checkpoint(tmp_path / "ckpt", config=small, seed=random.randrange(1000), tokenizer=True)
    tokens = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    assert tokens > 256
    refused(path, capsys, "256")
