"""The `lily` command line as a user meets it: --version, --help with a description and default for every
flag, and every mistake a user can make ending in one line `lily <command>: error: ...` (exit 2), never
a traceback; `lily check` refuses what `lily serve` would refuse; serve binds its address and checks
the tokenizer before it reads a weight."""

import argparse
import importlib
import json
import random
import shutil
import socket
import tomllib
from pathlib import Path

import httpx
import pytest
from helpers_ckpt import write_tiny_checkpoint
from helpers_serve import serving

from lily.cli import SUBCOMMANDS, main, make_parser

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"lily {version}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_flag_has_a_description_and_shows_its_default(command, capsys):
    module, description = SUBCOMMANDS[command]
    parser = make_parser(f"lily {command}", description)
    importlib.import_module(module).add_arguments(parser)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    printed = "".join(capsys.readouterr().out.split())  # argparse wraps lines (even at hyphens): compare unspaced
    alternatives = {a for g in parser._mutually_exclusive_groups for a in g._group_actions}  # one of them is given
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"lily {command} {name}: no description"
        shown = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "".join(shown.split()) in printed
        if not action.option_strings or action.required or action in alternatives:
            continue
        default = action.default
        if default is False or default == []:   # a switch that is off, a list that is empty
            continue
        if default is None or "default" in action.help:  # the help says in words what happens without it
            assert "default" in action.help, f"lily {command} {name}: says nothing of what happens without it"
        else:
            value = "none" if default == "" else str(default)
            assert shown.endswith(f"(default: {value})"), f"lily {command} {name}: default {default!r} not shown"


def test_unknown_command_and_no_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serv"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert main([]) == 2 and "COMMAND" in capsys.readouterr().out


def one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith(f"lily {command}: error: "), err
    return err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", seed=random.randrange(10_000),
                                    tokenizer=True)
    return path


def variant(ckpt: Path, tmp_path: Path, edit) -> Path:
    """A copy of the good checkpoint with one thing broken by `edit(dir)`."""
    d = Path(shutil.copytree(ckpt, tmp_path / "variant"))
    edit(d)
    return d


def truncate_weights(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def drop_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def write_to(name: str, text: str):
    return lambda d: (d / name).write_text(text)


BROKEN_TEMPLATE = "{{ raise_exception('this template refuses everything') }}"


@pytest.mark.parametrize("edit,says", [
    (drop_tokenizer, "tokenizer.json is missing"),
    (write_to("tokenizer.json", '{"version": "1.0", "model": '), "tokenizer.json: cannot be read"),
    (write_to("chat_template.jinja", BROKEN_TEMPLATE), "this template refuses everything"),
    (write_to("chat_template.jinja", "{% if %}"), "the chat template does not compile"),
    (write_to("tokenizer_config.json", "[1, 2"), "tokenizer_config.json: invalid JSON"),
])
def test_check_and_serve_refuse_the_same_tokenizer_problems(ckpt, tmp_path, capsys, edit, says):
    d = variant(ckpt, tmp_path, edit)
    assert main(["check", str(d)]) == 2
    assert says in one_error_line(capsys, "check")
    # serve says the same, before reading any weight: with the weights truncated too, the tokenizer is named
    truncate_weights(d)
    assert main(["serve", "--model", str(d), "--port", "0"]) == 2
    assert says in one_error_line(capsys, "serve")


def test_check_prints_the_tokenizer_and_template(ckpt, capsys):
    assert main(["check", str(ckpt)]) == 0
    out = capsys.readouterr().out
    vocab = json.loads((ckpt / "tokenizer.json").read_text())
    n = len(vocab["model"]["vocab"]) + len(vocab["added_tokens"])
    assert f"tokenizer: {n} tokens" in out and "chat template: renders" in out


def test_check_and_serve_warn_of_a_missing_chat_template(ckpt, tmp_path, capsys):
    """A download filtered to *.json and *.safetensors leaves chat_template.jinja behind: check and serve say so
    at start, naming where they looked, and a chat request's 400 names the files (the server's paths stay out)."""
    d = variant(ckpt, tmp_path, lambda d: (d / "chat_template.jinja").unlink())
    looked_for = (str(d / "chat_template.jinja"), str(d / "tokenizer_config.json"))
    assert main(["check", str(d)]) == 0  # servable: completions work
    captured = capsys.readouterr()
    warning = captured.err.strip()
    assert warning.startswith("lily check: warning: ") and warning.count("\n") == 0, warning
    assert all(path in warning for path in looked_for), warning
    assert "chat template: none" in captured.out

    with serving(["--model", str(d), "--device", "cpu"]) as (url, lines):
        warned = [line for line in lines if "WARNING" in line and "no chat template" in line]
        assert warned and all(path in warned[0] for path in looked_for), "".join(lines)
        words = " ".join(random.sample(["sea", "town", "paint", "robot", "lamp", "river"], 3))
        chat = {"messages": [{"role": "user", "content": words}], "max_tokens": 2}
        responses = {"input": words, "max_output_tokens": 2}
        for route, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
            r = httpx.post(url + route, json={"model": d.name, **body}, timeout=60)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "chat_template.jinja" in message and "tokenizer_config.json" in message and str(d) not in message
        r = httpx.post(url + "/v1/completions", json={"model": d.name, "prompt": words, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text

    # the template inside tokenizer_config.json is as good: no warning
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (ckpt / "chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main(["check", str(d)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "chat template: renders" in captured.out


def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_serve_checks_the_port_before_loading(ckpt, tmp_path, capsys, monkeypatch):
    d = variant(ckpt, tmp_path, truncate_weights)  # a load would fail: the port must be named first
    with busy_port() as s:
        port = s.getsockname()[1]
        assert main(["serve", "--model", str(d), "--port", str(port)]) == 2
        err = one_error_line(capsys, "serve")
        assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err
        # the demo is not even built
        monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["serve", "--demo", "--port", str(port)]) == 2
        one_error_line(capsys, "serve")
        assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("host,says", [
    ("no-such-host.invalid", "--host no-such-host.invalid: cannot resolve"),
    ("192.0.2.1", "cannot listen on 192.0.2.1:"),   # TEST-NET-1: a valid address this machine does not have
])
def test_serve_refuses_a_host_it_cannot_listen_on(ckpt, capsys, host, says):
    assert main(["serve", "--model", str(ckpt), "--host", host, "--port", "0"]) == 2
    assert says in one_error_line(capsys, "serve")


def a_file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    return f


# (argv built from tmp_path, the command, what the line must say)
MISTAKES = [
    (lambda t: ["make-synthetic", "/proc/lily-test/x"], "make-synthetic", "/proc/lily-test/x"),
    (lambda t: ["make-synthetic", str(a_file(t) / "sub")], "make-synthetic", "Not a directory"),
    (lambda t: ["make-synthetic", str(a_file(t))], "make-synthetic", "is not an empty directory"),
    (lambda t: ["make-synthetic", "--device", "tpu", str(t / "o")], "make-synthetic", "device 'tpu': not a device"),
    (lambda t: ["make-synthetic", "--device", "mps", str(t / "o")], "make-synthetic", "lily runs on cpu or cuda"),
    (lambda t: ["make-synthetic", "--seed", str(2**64 + random.randrange(10**6)), str(t / "o")], "make-synthetic",
     "is out of range"),
    (lambda t: ["make-synthetic", "--seed", "-1", str(t / "o")], "make-synthetic", "--seed -1 is out of range"),
    (lambda t: ["check", str(t / "nothing")], "check", "no such directory"),
    (lambda t: ["check", str(a_file(t))], "check", "not a directory"),
    (lambda t: ["check", str(t)], "check", "config.json"),
    (lambda t: ["serve", "--model", str(a_file(t))], "serve", "no such directory"),
    (lambda t: ["serve", "--model", str(t)], "serve", "config.json is missing"),
    (lambda t: ["serve", "--demo", "--port", "-1"], "serve", "--port -1 is out of range"),
    (lambda t: ["serve", "--demo", "--port", "0", "--device", "foo"], "serve", "device 'foo': not a device"),
    (lambda t: ["serve", "--demo", "--port", "0", "--device", "meta"], "serve", "lily runs on cpu or cuda"),
    (lambda t: ["serve", "--demo", "--port", "0", "--device", "cuda:99"], "serve", "device cuda:99"),
    (lambda t: ["generate", "--model", str(t / "nothing"), "--prompt-ids", "1"], "generate", "not a directory"),
    (lambda t: ["bench", "--synthetic", "tiny", "--contexts", "12x"], "bench", "--contexts"),
    (lambda t: ["bench", "--synthetic", "tiny", "--device", "cpu", "--contexts", "8",
                "--out", str(a_file(t) / "x.json")], "bench", "cannot create the folder"),
]


@pytest.mark.parametrize("argv,command,says", MISTAKES)
def test_user_mistakes_are_one_line(tmp_path, capsys, argv, command, says):
    assert main(argv(tmp_path)) == 2
    assert says in one_error_line(capsys, command)


def test_generate_refuses_bad_prompt_ids(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids" in one_error_line(capsys, "generate")


def test_a_closed_stdout_ends_quietly(ckpt):
    """`lily check DIR | head -1`: the reader goes before lily writes; lily stops with no error line and no
    traceback, with the status a shell gives a command a closed pipe ended (141, as coreutils' `yes | head -1`)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "lily", "check", str(ckpt)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before lily has imported torch, so every write of it meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


def test_served_model_name_defaults_to_the_directory_or_the_cache_repo(tmp_path):
    """A Hugging Face cache snapshot (what `hf download REPO` leaves) serves as OWNER/NAME, not as the revision's
    hash; any other directory by its name, through a symlink by the target's."""
    from lily.server.main import default_model_name

    rev = f"{random.getrandbits(160):040x}"
    owner, name = f"org{random.randrange(100)}", f"Qwen3.6-{random.randrange(100)}B-A3B-4bit"
    snap = tmp_path / "hub" / f"models--{owner}--{name}" / "snapshots" / rev
    snap.mkdir(parents=True)
    assert default_model_name(snap) == f"{owner}/{name}"
    plain = tmp_path / f"my-{name}"
    plain.mkdir()
    assert default_model_name(plain) == plain.name
    link = tmp_path / "current"
    link.symlink_to(snap)
    assert default_model_name(link) == f"{owner}/{name}"
    # a folder that only looks half like the cache keeps its name
    odd = tmp_path / "snapshots-elsewhere" / "snapshots" / rev
    odd.mkdir(parents=True)
    assert default_model_name(odd) == rev


def test_serving_beyond_this_machine_without_a_key_is_warned(ckpt, tmp_path, capsys, caplog, monkeypatch):
    """--host 0.0.0.0 with no API key: one warning that anyone who reaches the address can use the model; on the
    loopback, or with a key, none. (The weights are truncated: serve stops after binding, at the load.)"""
    from lily.server.main import _loopback_only

    d = variant(ckpt, tmp_path, truncate_weights)
    monkeypatch.delenv("LILY_API_KEY", raising=False)
    for host, key, warned in (("0.0.0.0", None, True), ("127.0.0.1", None, False), ("0.0.0.0", "k3y", False)):
        caplog.clear()
        argv = ["serve", "--model", str(d), "--host", host, "--port", "0"] + (["--api-key", key] if key else [])
        assert main(argv) == 2
        capsys.readouterr()
        said = [r.getMessage() for r in caplog.records if "with no API key" in r.getMessage()]
        assert bool(said) is warned, (host, key, said)
    for host, loopback in (("127.0.0.1", True), ("0.0.0.0", False)):
        with socket.socket() as s:
            s.bind((host, 0))
            assert _loopback_only([s]) is loopback
