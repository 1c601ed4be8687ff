"""Faults: clients that vanish at random points, a request cancelled during its prefill, SIGTERM while
streams are open, and a NaN/Inf in one request's state that must reach neither another request nor the
prefix cache. The model is the tiny synthetic checkpoint on the reference backend (CPU); the HTTP side
is lily's app under uvicorn on a loopback port (real sockets, real disconnects) or `lily serve` itself."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time

import httpx
import pytest
import torch

from lily.engine import load_backend
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer
from test_reliability_support import (InstrumentedBackend, LilyServer, ThreadedServer, assert_openai_error,
                                      load_test, make_tiny_checkpoint, state_is_finite, wait_until_idle)

MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def served(ckpt):
    backend = InstrumentedBackend(load_backend(ckpt, "cpu", "reference"))
    tokenizer = Tokenizer.from_dir(ckpt)
    tokenizer.eos_token_ids = list(dict.fromkeys([*backend.config.eos_token_ids, *tokenizer.eos_token_ids]))
    cache = PrefixCache(8, 1 << 30, backend.clone_state, backend.state_nbytes)
    app = create_app(backend, tokenizer, ServerSettings(model_name=MODEL, max_seq=512), cache)
    with ThreadedServer(app) as server:
        yield server, backend, cache, tokenizer


@pytest.fixture
def env(served):
    server, backend, cache, tokenizer = served
    wait_until_idle(server.url)
    backend.reset()
    cache.clear()
    yield server, backend, cache, tokenizer
    backend.reset()


def chat_body(text: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0.8, "seed": random.randrange(2**31)}).encode()


def raw_post(port: int, body: bytes, path: str = "/v1/chat/completions", send_bytes: int | None = None) -> socket.socket:
    """An HTTP/1.1 POST on a raw socket (so it can be cut anywhere); `send_bytes` of the body only."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    s.sendall(head + body[:len(body) if send_bytes is None else send_bytes])
    return s


def read_until(s: socket.socket, n_events: int) -> bytes:
    """Read until `n_events` SSE events arrived (or the server closed)."""
    data = b""
    while data.count(b"data: ") < n_events:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def sse_lines(raw: bytes) -> list[str]:
    """The data lines of a chunked SSE response read off a raw socket."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    return [ln for ln in body.decode("utf-8", "replace").split("\n") if ln.startswith("data: ")]


def test_random_disconnects_leave_the_server_serving(env):
    server, backend, cache, tokenizer = env
    backend.suppress = list(tokenizer.eos_token_ids)  # every answer runs to max_tokens unless cancelled
    backend.decode_delay = 0.005
    max_tokens, rng = 48, random.Random()
    modes = ["partial-body", "after-send", "mid-stream", "mid-stream", "wait-then-close", "complete"] * 3
    rng.shuffle(modes)
    results: dict[int, object] = {}

    def client(i: int, mode: str):
        body = chat_body(f"request {i} " + "word " * rng.randint(1, 30), max_tokens, mode != "wait-then-close")
        if mode == "partial-body":
            s = raw_post(server.port, body, send_bytes=rng.randrange(1, len(body)))
            time.sleep(rng.random() * 0.2)
        elif mode == "after-send":
            s = raw_post(server.port, body)
        elif mode == "mid-stream":
            s = raw_post(server.port, body)
            results[i] = read_until(s, rng.randint(2, 6))
        elif mode == "wait-then-close":
            s = raw_post(server.port, body)
            time.sleep(rng.random() * 0.5)
        else:
            s = raw_post(server.port, body)
            results[i] = read_all(s)
        s.close()

    threads = [threading.Thread(target=client, args=(i, m)) for i, m in enumerate(modes)]
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.03)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a client hung"

    m = wait_until_idle(server.url)
    for i, mode in enumerate(modes):
        if mode == "complete":  # the clients that stayed got whole answers
            assert load_test.check_stream(sse_lines(results[i])) == "", results[i][-500:]
    # those that left mid-stream were cancelled, not run to the end
    assert m["lily_requests_cancelled_total"] >= modes.count("mid-stream")
    # without cancellation all but the partial bodies would run to max_tokens
    assert backend.decodes < (modes.count("complete") + modes.count("wait-then-close") + 4) * max_tokens
    # and the engine still answers
    r = httpx.post(server.url + "/v1/chat/completions", content=chat_body("still there?", 5, False),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_during_prefill_runs_no_decode_step(env, stream):
    server, backend, cache, tokenizer = env
    backend.suppress = list(tokenizer.eos_token_ids)
    backend.prefill_delay = 1.0
    before = load_test.metrics(server.url)["lily_requests_cancelled_total"]
    long_prompt = " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
    s = raw_post(server.port, chat_body(long_prompt, 100, stream))
    deadline = time.time() + 10
    while backend.prefills_started == 0 and time.time() < deadline:  # the prefill has started (it sleeps)
        time.sleep(0.01)
    assert backend.prefills_started, "the request never reached the engine"
    time.sleep(0.2)
    assert backend.decodes == 0
    s.close()
    m = wait_until_idle(server.url)
    assert backend.decodes == 0, "decode steps ran for a request whose client left during prefill"
    assert m["lily_requests_cancelled_total"] == before + 1
    backend.prefill_delay = 0.0
    r = httpx.post(server.url + "/v1/chat/completions", content=chat_body("next", 4, False),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def greedy_oracle(backend, prompt: list[int], n: int, eos: set[int], split: int) -> list[int]:
    """Greedy tokens straight from the backend, from a fresh state, the prompt run in the same two
    pieces as the engine (which reuses the cached first `split` tokens): what a clean request must produce."""
    state = backend.new_state()
    backend.prefill(prompt[:split], state)
    logits = backend.prefill(prompt[split:], state)
    out = []
    while len(out) < n:
        t = int(torch.argmax(logits))
        if t in eos:
            break
        out.append(t)
        logits = backend.decode(t, state)
    return out


def cache_is_clean(cache: PrefixCache, poisoned_prompt: list[int]) -> None:
    for tokens, entry in list(cache._entries.items()):
        assert state_is_finite(entry.state), f"a non-finite state of {len(tokens)} tokens is cached"
    assert tuple(poisoned_prompt) not in cache, "the failed request's prompt snapshot is cached"


@pytest.mark.parametrize("poison", ["state-nan", "logits-inf", "decode-nan"])
def test_non_finite_state_reaches_no_other_request(env, poison):
    server, backend, cache, tokenizer = env
    vocab = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.hidden_ids]
    prompt = [random.choice(vocab) for _ in range(random.randint(12, 40))]
    more = [random.choice(vocab) for _ in range(5)]
    eos = set(tokenizer.eos_token_ids)
    # an earlier, healthy request leaves a shorter prefix in the cache: it must survive
    healthy = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt[:6], "max_tokens": 2,
                                                               "temperature": 0}, timeout=60)
    assert healthy.status_code == 200
    assert tuple(prompt[:6]) in cache
    backend.prefills_started = 0
    if poison == "decode-nan":
        backend.poison_next_decode = True
    else:
        backend.poison_next_prefill = poison

    results = {}

    def poisoned():
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": poison == "decode-nan"}
        results["bad"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    def clean():  # queued right behind it, sharing its prefix
        deadline = time.time() + 30
        while backend.prefills_started == 0 and time.time() < deadline:
            time.sleep(0.005)
        body = {"model": MODEL, "prompt": prompt + more, "max_tokens": 6, "temperature": 0}
        results["good"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=poisoned), threading.Thread(target=clean)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bad = results["bad"]
    if poison == "decode-nan":  # the stream had started: it ends with an error event, then [DONE]
        lines = [ln for ln in bad.text.split("\n") if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert not any('"finish_reason": "length"' in ln or '"finish_reason": "stop"' in ln for ln in lines)
    else:
        assert_openai_error(bad, 500)
    cache_is_clean(cache, prompt)
    assert tuple(prompt[:6]) in cache, "a healthy snapshot was dropped"

    good = results["good"]
    assert good.status_code == 200, good.text
    want = greedy_oracle(backend.inner, prompt + more, 6, eos, split=6)
    assert good.json()["usage"]["completion_tokens"] == len(want)
    assert good.json()["choices"][0]["text"] == tokenizer.decode(want)
    # and a repeat of the poisoned prompt, now healthy, answers like the oracle
    assert not any(len(t) < len(prompt) and t != tuple(prompt[:6]) and t == tuple(prompt[:len(t)])
                   for t in list(cache._entries)), "a longer cached prefix would change the split"
    again = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                             "temperature": 0}, timeout=60)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == tokenizer.decode(greedy_oracle(backend.inner, prompt, 6, eos, split=6))
    for entry in list(cache._entries.values()):
        assert state_is_finite(entry.state)


def test_sigterm_mid_stream_ends_every_stream_cleanly_and_exits_0(ckpt, tmp_path):
    """Four long streams (EOS biased away, so they outlast the shutdown grace): the one running and the
    ones queued all end with a final chunk and [DONE] (finished, or cancelled after the grace), the
    process exits 0 with no traceback, and it stops listening."""
    server = LilyServer(ckpt, "--max-seq", "1024", "--served-model-name", MODEL, log_path=tmp_path / "serve.log")
    eos = Tokenizer.from_dir(ckpt).eos_token_ids
    server.start()
    try:
        results: dict[int, object] = {}
        first_chunk = threading.Event()

        def stream(i: int):
            body = {"model": MODEL, "prompt": f"story number {i}:", "max_tokens": 1000, "stream": True,
                    "temperature": 1.0, "seed": i, "logit_bias": {str(t): -100 for t in eos}}
            lines, status = [], None
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            first_chunk.set()
            except httpx.HTTPError as e:
                lines.append(f"EXC {type(e).__name__}: {e}")
            results[i] = (status, lines)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        assert first_chunk.wait(60)
        m = load_test.metrics(server.url)
        assert m["lily_queue_depth"] + m["lily_requests_running"] >= 2, m  # streams really are open
        t0 = time.time()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.time() - t0
        for t in threads:
            t.join(30)
            assert not t.is_alive()
    finally:
        server.stop()
    log = server.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert took < 15, f"shutdown took {took:.1f}s"
    reasons = []
    for i, (status, lines) in results.items():
        assert status == 200, (status, lines[-3:])
        # never cut: each stream ends with a final chunk (finished or cancelled) or an error event, then [DONE]
        assert lines and lines[-1] == "data: [DONE]", (i, lines[-3:])
        last = json.loads(lines[-2][6:])
        assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length", "cancelled"), last
        reasons.append("error" if "error" in last else last["choices"][0]["finish_reason"])
    assert "cancelled" in reasons, f"no stream outlasted the grace: the test proved little ({reasons})"
    with pytest.raises(httpx.HTTPError):  # and it no longer listens
        httpx.get(server.url + "/health", timeout=2)


def test_request_taken_off_the_queue_as_shutdown_begins_still_gets_its_final_event():
    """The race behind a SIGTERM flake: the worker takes the next request off the queue just after
    shutdown() set `stopping` and drained the queue. It must still end that request's stream (cancelled),
    not drop it (its client would hang until uvicorn's own timeout cut it, with a traceback)."""
    from lily.engine.generation import Finished, GenerationRequest
    from lily.engine.sequence import Sequence
    from lily.engine.worker import EngineWorker, _Submission

    worker = EngineWorker(backend=None, tokenizer=None)  # never generates: the request ends cancelled
    got = []
    late = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=5)
    with worker._cv:  # shutdown has begun and its drain ran; then the request reaches the worker's hands
        worker._stopping = True
        worker._inbox.append(_Submission([Sequence(late, got.append, None)]))
        worker._cv.notify()
    worker._thread.join(10)
    assert not worker._thread.is_alive()
    assert len(got) == 1 and isinstance(got[0], Finished) and got[0].finish_reason == "cancelled"
