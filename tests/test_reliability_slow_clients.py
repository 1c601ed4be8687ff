"""Clients that hold the server without a whole request, and big prompts that used to hold its event loop: a
connection that sends no whole header in --header-timeout is closed (idle, one byte at a time, or between two
requests of a keep-alive connection), a body that stalls or trickles past --body-timeout is a 408, a body still
arriving when the shutdown's grace ends is a 503 (no traceback, no 500), no descriptor left is one warning line
(not a traceback an accept), the open-file limit is raised to the hard one, and rendering and tokenizing run off
the event loop (a prompt that cannot fit is refused before any of it). Timeouts here are short because the
timeout is what is tested; everything else waits on events (a tokenizer that blocks until the test lets it, a
step gate), never on a guess of the machine's speed."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest

from helpers_gate import HANG_S, poll_until
from helpers_http import raw_post, read_all, sse_lines, status_of
from lily.engine import load_backend
from lily.server.app import ServerSettings, create_app
from lily.server.connections import http_protocol
from lily.tokenizer import LONG_TEXT, Tokenizer
from test_reliability_support import (InstrumentedBackend, LilyServer, ThreadedServer, make_tiny_checkpoint,
                                      wait_until_idle)

MODEL = "tiny"
TIMEOUT = 2.0  # the header and body deadlines of the in-process server (long enough that a loaded machine sends a request's header in time)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("slow"))


class BlockingTokenizer:
    """The checkpoint's tokenizer, but encoding a text that holds `marker` waits until the test releases it
    (`entered` says it is waiting); every text encoded is recorded."""

    def __init__(self, inner: Tokenizer):
        self._inner = inner
        self.marker: str | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.encoded: list[str] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        if self.marker is not None and self.marker in text:
            self.entered.set()
            assert self.release.wait(HANG_S), "the test never released the tokenizer"
        return self._inner.encode(text)


@pytest.fixture(scope="module")
def served(ckpt):
    backend = InstrumentedBackend(load_backend(ckpt, "cpu", "reference"))
    tokenizer = BlockingTokenizer(Tokenizer.from_dir(ckpt))
    settings = ServerSettings(model_name=MODEL, max_seq=512, body_timeout=TIMEOUT)
    app = create_app(backend, tokenizer, settings)
    with ThreadedServer(app, http=http_protocol(TIMEOUT)) as server:
        yield server, backend, tokenizer


@pytest.fixture
def env(served):
    server, backend, tokenizer = served
    wait_until_idle(server.url)
    backend.reset()
    tokenizer.marker, tokenizer.encoded = None, []
    tokenizer.entered.clear(), tokenizer.release.clear()
    yield served
    tokenizer.release.set()
    backend.reset()


def closed_by_server(s: socket.socket, trickle: bytes = b"", every: float = TIMEOUT / 10) -> bytes:
    """Send `trickle` one byte every `every` seconds (then nothing) until the server closes the connection;
    what it sent before closing. Fails after HANG_S (a connection held for ever). (A slow machine only sends
    fewer bytes, which a deadline that any byte resets would then also close: the test can miss such a bug
    there, never fail a correct server.)"""
    got, i = b"", 0
    s.settimeout(HANG_S)
    poll = select.poll()
    poll.register(s, select.POLLIN)
    for _ in range(int(HANG_S / every)):
        if poll.poll(every * 1000):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk
            continue
        if i < len(trickle):  # (then idle)
            try:
                s.sendall(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return got
            i += 1
    raise AssertionError(f"the server held the connection for {HANG_S:.0f}s (received {got[:200]!r})")


# 1. header deadline ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["idle", "header-trickle", "keep-alive-trickle"])
def test_a_connection_without_a_whole_header_is_closed(env, kind):
    """No byte, a header one byte at a time (each byte well within the deadline: uvicorn's keep-alive timer,
    which any byte resets, never ran before a first response anyway), or a keep-alive connection trickling its
    second request's header after a first was answered: closed at the header deadline, with nothing sent."""
    server, _, _ = env
    s = socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S)
    header = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: y\r\n" * 50
    if kind == "keep-alive-trickle":
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'{"status":"ok"}' not in first:  # (the whole answer: its body may come in a later packet)
            chunk = s.recv(4096)
            assert chunk, first
            first += chunk
        assert status_of(first) == 200
    got = closed_by_server(s, b"" if kind == "idle" else header)
    s.close()
    assert got == b"", got[:300]
    assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200


def test_a_request_that_runs_past_the_header_deadline_is_not_cut(env):
    """The deadline covers the header only: a request whose answer takes longer (its decode held at the gate until
    a connection opened after it was closed by the deadline) is answered whole, and its keep-alive connection
    then serves another request."""
    server, backend, _ = env
    decode = backend.gates.decode
    with decode.held():
        body = json.dumps({"model": MODEL, "prompt": "a story:", "max_tokens": 3, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        decode.wait_waiting()  # the request is in, its header long complete
        later = socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S)
        closed_by_server(later)  # a whole header deadline has passed since
        later.close()
    raw = b""
    while b"0\r\n\r\n" not in raw:  # the chunked stream's end
        chunk = s.recv(65536)
        assert chunk, raw[-300:]
        raw += chunk
    assert status_of(raw) == 200 and sse_lines(raw)[-1] == "data: [DONE]", raw[-300:]
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(read_all(s)) == 200
    s.close()


# 2. body deadline --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["stalled", "trickle"])
def test_a_body_that_stalls_or_trickles_is_a_408(env, kind):
    """A body that stops coming, or comes a byte at a time (each byte well within the timeout between parts,
    below the 500 bytes a second it must then keep up): a 408 in OpenAI's error shape, and the connection closed.
    (Both were held for ever: QA slowloris.py.)"""
    server, backend, _ = env
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 2})
    s = raw_post(server.port, body.encode(), send_bytes=random.randrange(1, 40))
    raw = closed_by_server(s, b" " * 10_000 if kind == "trickle" else b"")
    s.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert status_of(raw) == 408, raw[:300]
    assert b"connection: close" in head.lower(), head
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_timeout", err
    assert backend.prefills == 0
    assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200


# 3. work off the event loop ----------------------------------------------------------------------------------
REQUESTS = {
    "chat": ("/v1/chat/completions", lambda text: {"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": text}]}),
    "completions": ("/v1/completions", lambda text: {"model": MODEL, "prompt": text, "max_tokens": 2}),
    "responses": ("/v1/responses", lambda text: {"model": MODEL, "input": text, "max_output_tokens": 2}),
    "tokenize": ("/tokenize", lambda text: {"prompt": text}),
    "tokenize-chat": ("/tokenize", lambda text: {"messages": [{"role": "user", "content": text}]}),
}


@pytest.mark.parametrize("route", list(REQUESTS))
def test_tokenizing_a_prompt_holds_neither_health_nor_a_stream(env, route):
    """While one request's prompt is being tokenized (the tokenizer waits until the test releases it: as a 4 MB
    prompt took seconds), /health answers and another stream runs to its end; then the request is answered.
    (Rendered and tokenized on the event loop, a 3.9 MB prompt held /health 5-9 s and a stream 6 s: QA
    block_loop.py, stall_stream.py.)"""
    server, _, tokenizer = env
    tokenizer.marker = f"marker{random.randrange(10 ** 9)}"
    path, make = REQUESTS[route]
    result = {}

    def big():
        result["r"] = httpx.post(server.url + path, json=make(f"tell me about {tokenizer.marker}"), timeout=HANG_S)

    thread = threading.Thread(target=big)
    thread.start()
    try:
        assert tokenizer.entered.wait(HANG_S), "the request never reached the tokenizer"
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
        with httpx.stream("POST", server.url + "/v1/completions", timeout=HANG_S,
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        assert thread.is_alive() and "r" not in result  # (still tokenizing all along)
    finally:
        tokenizer.release.set()
        thread.join(HANG_S)
    assert result["r"].status_code == 200, result["r"].text[:500]


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_a_prompt_that_cannot_fit_is_refused_untokenized(env, route):
    """A long text (over LONG_TEXT characters) whose bytes over the longest token's already exceed the context
    (--max-seq 512 here) is the usual context_length_exceeded 400, 'at least' that many tokens, and is never
    tokenized; a short one is (its 400, or its answer, counts it exactly)."""
    server, _, tokenizer = env
    longest = tokenizer._inner._longest_token_bytes
    assert longest > 0  # (a byte-level tokenizer)
    path, make = REQUESTS[route]
    text = "".join(random.choice("abcdefgh ") for _ in range(max(longest * 520, LONG_TEXT + 1)))
    r = httpx.post(server.url + path, json=make(text), timeout=HANG_S)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "maximum context length is 512 tokens" in err["message"], err
    assert "at least" in err["message"], err
    assert not any(text in t for t in tokenizer.encoded), "the text was tokenized"
    r = httpx.post(server.url + path, json=make(text[:100]), timeout=HANG_S)
    assert r.status_code == 200 and any(text[:100] in t for t in tokenizer.encoded), r.text[:500]


def test_fewest_tokens_is_a_lower_bound(ckpt):
    """Tokenizer.fewest_tokens never exceeds the real count: ASCII, long runs, multi-byte and decomposed text
    (which NFC, where the tokenizer normalizes, makes shorter)."""
    tokenizer = Tokenizer.from_dir(ckpt)
    alphabet = ["a", "b", " ", "  ", "\n", "é", "e\u0301", "\u1100\u1161\u11a8", "中", "🙂", "<|im_start|>", "ab" * 20]
    for _ in range(200):
        text = "".join(random.choice(alphabet) for _ in range(random.randrange(1, 400)))
        assert tokenizer.fewest_tokens(text) <= len(tokenizer.encode(text)), text


# 4. lily serve: descriptors and the shutdown -----------------------------------------------------------------
def limited(server: LilyServer, soft: int, hard: int) -> LilyServer:
    """The same command with RLIMIT_NOFILE set to (soft, hard) as it starts (as `ulimit -n` would)."""
    setter = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
              "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    server.cmd = [sys.executable, "-c", setter, *server.cmd[1:]]
    return server


def test_idle_connections_past_the_open_file_limit_do_not_lock_clients_out(ckpt, tmp_path):
    """More idle connections than the process may hold descriptors: the soft limit is first raised to the hard one
    (logged), accepting fails once they are all taken, which is one warning line (asyncio logged a traceback for
    each failed accept: 140 MB in 20 s), and the header deadline frees them, so /health is answered while they
    all stay open. (With `ulimit -n 1024`, 1,100 idle sockets locked every client out: QA fd_exhaust.py.)"""
    hard = 64
    server = limited(LilyServer(ckpt, "--served-model-name", MODEL, "--header-timeout", "2",
                                log_path=tmp_path / "serve.log"), 48, hard)
    socks = []
    try:
        server.start()
        with open(f"/proc/{server.proc.pid}/limits") as f:
            row = next(line for line in f if line.startswith("Max open files")).split()
        assert row[3:5] == [str(hard), str(hard)], row
        assert f"open-file limit raised from 48 to {hard}" in server.log()
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) for _ in range(hard + 40)]
        poll_until(lambda: "cannot accept new connections" in server.log(), "a failed accept to be logged")
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.stop()
    log = server.log()
    assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    warnings = [line for line in log.splitlines() if "cannot accept new connections" in line]
    assert 1 <= len(warnings) <= 2 and "Too many open files" in warnings[0], warnings  # (one a minute)


def test_sigterm_while_a_body_arrives_is_a_503_within_the_grace(ckpt, tmp_path):
    """A client mid-body at SIGTERM: when the shutdown's grace ends its request is answered 503 shutting_down
    (OpenAI's shape, the connection closed), with no traceback, the process exits 0, and uvicorn never had to
    cancel a task past its own timeout. (It got a plain-text 500 after 10 s, a traceback through the guard's
    receive() was logged and the exit took 11 s: QA shutdown_midbody.py.)"""
    server = LilyServer(ckpt, "--served-model-name", MODEL, log_path=tmp_path / "serve.log")
    try:
        server.start()
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        s = raw_post(server.port, body, send_bytes=random.randrange(1, len(body)))
        poll_until(lambda: _read_by_server(server.proc.pid, server.port), "the server to read the request's start")
        server.proc.send_signal(signal.SIGTERM)
        raw = read_all(s)
        s.close()
        code = server.proc.wait(HANG_S)
    finally:
        server.stop()
    log = server.log()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert status_of(raw) == 503, raw[:300]
    assert b"connection: close" in head.lower(), head
    err = json.loads(payload)["error"]
    assert err["code"] == "shutting_down" and set(err) == {"message", "type", "param", "code"}, err
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "POST /v1/chat/completions 503" in log and " 500 " not in log, log[-3000:]


def _read_by_server(pid: int, port: int) -> bool:
    """Whether the process holds an accepted connection on `port` with nothing left unread in it (from /proc, so
    no request of the test's own is a connection too): once read, the header was parsed in the same step and the
    guard waits for the rest of the body."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = [line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]]
    return any(int(r[1].split(":")[1], 16) == port and r[3] == "01" and r[9] in inodes
               and int(r[4].split(":")[1], 16) == 0 for r in rows)
