"""`lily serve` command line: refusals are one clear line; --demo builds the tiny checkpoint once,
caches it, and serves it on the CPU."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers_gate import HANG_S, poll_until
from helpers_serve import serving
from lily.cli import main
from lily.server.main import DEMO_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,needle", [
    (["serve"], "give --model DIR"),
    (["serve", "--model", "/nonexistent/dir"], "no such directory"),
    (["serve", "--demo", "--port", "70000"], "--port 70000 is out of range"),
    (["serve", "--demo", "--max-seq", "1"], "--max-seq 1 is too small"),
    (["serve", "--demo", "--max-queue", "0"], "--max-queue 0 is out of range"),
    (["serve", "--demo", "--gpu-memory-fraction", "0"], "--gpu-memory-fraction 0.0 is out of range"),
    (["serve", "--demo", "--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction 1.5 is out of range"),
    (["serve", "--demo", "--state-memory-gib", "-1"], "--state-memory-gib -1.0 is out of range"),
    (["serve", "--demo", "--header-timeout", "0"], "--header-timeout 0.0 is out of range"),
    (["serve", "--demo", "--body-timeout", "nan"], "--body-timeout nan is out of range"),
])
def test_refusals_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("key", ["", " \t"])
def test_empty_api_key_is_refused(key, tmp_path, monkeypatch, capsys):
    # an empty key (a failed `$(openssl rand -hex 16)`, an unset variable) would otherwise serve with no auth;
    # refused before the model directory is even looked at (so the old code fails here, not hangs serving)
    monkeypatch.delenv("LILY_API_KEY", raising=False)
    assert main(["serve", "--model", str(tmp_path / "absent"), "--port", "0", "--api-key", key]) == 2
    err = capsys.readouterr().err.strip()
    assert "--api-key is empty" in err and len(err.splitlines()) == 1
    monkeypatch.setenv("LILY_API_KEY", key)
    assert main(["serve", "--model", str(tmp_path / "absent"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "LILY_API_KEY is empty" in err and len(err.splitlines()) == 1


def test_not_a_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported model_type 'llama'" in err[0]


def test_demo_builds_once_and_serves(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LILY_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--demo", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def answers():
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=HANG_S).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False
        poll_until(answers, lambda: "the demo server to answer: " + log.read_text()[-2000:], every=0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=HANG_S, json={
            "model": "lily-demo-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(HANG_S)
    built = list((tmp_path / "cache").iterdir())
    assert [p.name for p in built] == [f"demo-tiny-v{DEMO_VERSION}"] and (built[0] / "tokenizer.json").is_file()
    stamp = (built[0] / "config.json").stat().st_mtime_ns
    os.environ["LILY_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        from lily.server.main import demo_dir
        assert demo_dir() == built[0] and (built[0] / "config.json").stat().st_mtime_ns == stamp  # reused
    finally:
        del os.environ["LILY_CACHE_DIR"]
    text = log.read_text()
    assert "building the demo checkpoint" in text and "serving 'lily-demo-tiny'" in text


def test_ready_is_printed_only_once_the_server_answers(tmp_path):
    """`lily serve --port 0`: the line that says ready names the port the system chose, and the server
    answers at once; nothing says ready or serving before it."""
    with serving(["--demo"], env={"LILY_CACHE_DIR": str(tmp_path / "cache")}) as (url, lines):
        assert not any(": serving" in x or "ready in" in x for x in lines[:-1]), "".join(lines)
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200  # no retry: ready means ready
