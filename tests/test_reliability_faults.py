"""Faults: clients that vanish at random points, a request cancelled during its prefill, SIGTERM while
streams are open, and a NaN/Inf in one request's state that must reach neither another request nor the
prefix cache. The model is the tiny synthetic checkpoint on the reference backend (CPU); the HTTP side
is lily's app under uvicorn on a loopback port (real sockets, real disconnects) or `lily serve` itself.
The backend's steps wait on the test (helpers_gate), so each scenario happens at the step it names
whatever the machine's speed."""

from __future__ import annotations

import json
import random
import signal
import threading

import httpx
import pytest
import torch

from helpers_gate import HANG_S, GateServer, poll_until
from helpers_http import raw_post, read_all, read_until, sse_lines
from lily.engine import load_backend
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer
from test_reliability_support import (InstrumentedBackend, LilyServer, ThreadedServer, assert_openai_error, gated,
                                      load_test, make_tiny_checkpoint, read_metrics, state_is_finite, wait_metrics,
                                      wait_until_idle)

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


def chat_body(text: str, max_tokens: int, stream: bool, seed: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0.8, "seed": seed}).encode()


def test_random_disconnects_leave_the_server_serving(env):
    """18 clients in a random order: bodies cut short, clients that leave once their request is queued,
    after a few stream events, or once their (non-streamed) request runs, and clients that stay. The
    engine takes one decode step at a time, and only once the server has noticed every client that
    left so far, so a request whose client left can never run on to its end."""
    server, backend, cache, tokenizer = env
    backend.suppress = list(tokenizer.eos_token_ids)  # every answer runs to max_tokens unless cancelled
    max_tokens = 48
    modes = ["partial-body", "after-queued", "mid-stream", "mid-stream", "wait-then-close", "complete"] * 3
    random.shuffle(modes)
    leaving = {"after-queued", "mid-stream", "wait-then-close"}
    prompts = [f"request {i} " + "word " * random.randint(1, 30) for i in range(len(modes))]
    events_read = [random.randint(2, 6) for _ in modes]
    results: dict[int, bytes] = {}
    left = []  # clients that closed a whole request before its answer ended: the server must notice each
    decode = backend.gates.decode
    decode.hold()
    before = read_metrics(server.url)
    base, cancelled_before = before["lily_client_disconnects_total"], before["lily_requests_cancelled_total"]

    def running(i: int) -> bool:
        return any(prompts[i] in tokenizer.decode(ids) for ids in list(backend.prefilled))

    # 1. every request in (the first to arrive runs, held at its first decode step; the others queue)
    socks = {}
    for i, mode in enumerate(modes):
        body = chat_body(prompts[i], max_tokens, mode != "wait-then-close", random.randrange(2**31))
        if mode == "partial-body":  # never complete: never reaches the engine
            raw_post(server.port, body, send_bytes=random.randrange(1, len(body))).close()
            continue
        socks[i] = raw_post(server.port, body)
        if mode == "after-queued":  # a stream's first event (its role) comes once it is queued
            assert b"data: " in read_until(socks[i], b"data: ")
            left.append(i)
            socks.pop(i).close()

    # 2. the clients read (or leave) in threads; the engine steps only once every leaver was noticed
    def client(i: int, mode: str):
        s = socks[i]
        if mode == "mid-stream":
            results[i] = read_until(s, b"data: ", events_read[i])
            if b"data: [DONE]" not in results[i]:  # (48 tokens make more events than that: it left)
                left.append(i)
        elif mode == "wait-then-close":
            poll_until(lambda: running(i), f"request {i} to run")
            left.append(i)
        else:
            results[i] = read_all(s)
        s.close()

    threads = [threading.Thread(target=client, args=(i, m)) for i, m in enumerate(modes) if i in socks]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            poll_until(lambda: decode.waiting or not any(t.is_alive() for t in threads), "a decode step or the end")
            expected = len(left)
            wait_metrics(server.url, lambda m: m["lily_client_disconnects_total"] >= base + expected,
                         f"the server to notice {expected} clients leaving")
            decode.allow(1)
    finally:
        decode.open()
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), "a client hung"

    m = wait_until_idle(server.url)
    for i, mode in enumerate(modes):
        if mode == "complete":  # the clients that stayed got whole answers
            assert load_test.check_stream(sse_lines(results[i])) == "", results[i][-500:]
    # each client that left was noticed once, and its generation stopped early, queued or running
    n_left = sum(mode in leaving for mode in modes)
    assert sorted(left) == [i for i, mode in enumerate(modes) if mode in leaving]
    assert m["lily_client_disconnects_total"] - base == n_left
    assert m["lily_requests_cancelled_total"] - cancelled_before == n_left
    # and the engine still answers
    r = httpx.post(server.url + "/v1/chat/completions", content=chat_body("still there?", 5, False, 0),
                   headers={"content-type": "application/json"}, timeout=HANG_S)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_during_prefill_runs_no_decode_step(env, stream):
    server, backend, cache, tokenizer = env
    backend.suppress = list(tokenizer.eos_token_ids)
    before = read_metrics(server.url)
    long_prompt = " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
    with backend.gates.prefill.held() as prefill:
        s = raw_post(server.port, chat_body(long_prompt, 100, stream, 1))
        prefill.wait_waiting()  # the prompt's prefill has begun, and cannot end yet
        s.close()
        wait_metrics(server.url, lambda m: m["lily_client_disconnects_total"] > before["lily_client_disconnects_total"],
                     "the server to notice the client leaving")
    m = wait_until_idle(server.url)  # the prefill ends; the loop sees the cancellation before any decode step
    assert backend.decodes == 0, "decode steps ran for a request whose client left during prefill"
    assert m["lily_requests_cancelled_total"] == before["lily_requests_cancelled_total"] + 1
    r = httpx.post(server.url + "/v1/chat/completions", content=chat_body("next", 4, False, 2),
                   headers={"content-type": "application/json"}, timeout=HANG_S)
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
    # the healthy request below caches prompt[:6] and prompt[:6] + its output: that output must not be the
    # prompt's next token (1 in ~500), or its snapshot would be a longer cached prefix of the prompt
    inner = backend.inner
    healthy_first = int(torch.argmax(inner.prefill(prompt[:6], inner.new_state())))
    prompt[6] = random.choice([t for t in vocab if t != healthy_first])
    # the poisoned request must reach a decode step: were its first token an EOS (1 in ~250 on the tiny model), it
    # would end cleanly on finite logits, its NaN state never read (and the decode poison would hit the other)
    while not greedy_oracle(inner, prompt, 1, eos, split=6):
        prompt[-1] = random.choice(vocab)
    # an earlier, healthy request leaves a shorter prefix in the cache: it must survive
    healthy = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt[:6], "max_tokens": 2,
                                                               "temperature": 0}, timeout=HANG_S)
    assert healthy.status_code == 200
    assert tuple(prompt[:6]) in cache
    if poison == "decode-nan":
        backend.poison_next_decode = True
    else:
        backend.poison_next_prefill = poison

    results = {}

    def post(name: str, body: dict):
        results[name] = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S)

    bad_body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": poison == "decode-nan"}
    good_body = {"model": MODEL, "prompt": prompt + more, "max_tokens": 6, "temperature": 0}  # shares its prefix
    threads = [threading.Thread(target=post, args=("bad", bad_body)), threading.Thread(target=post, args=("good", good_body))]
    with backend.gates.prefill.held() as prefill:
        threads[0].start()
        prefill.wait_waiting()  # the poisoned request is in its prefill, and stays there
        threads[1].start()
        wait_metrics(server.url, lambda m: m["lily_queue_depth"] == 1, "the clean request to queue")
    for t in threads:  # the clean request ran right after the poisoned one
        t.join(HANG_S)
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
                                                             "temperature": 0}, timeout=HANG_S)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == tokenizer.decode(greedy_oracle(backend.inner, prompt, 6, eos, split=6))
    for entry in list(cache._entries.values()):
        assert state_is_finite(entry.state)


def test_sigterm_mid_stream_ends_every_stream_cleanly_and_exits_0(ckpt, tmp_path):
    """Four requests that cannot end by themselves (the process's decode steps wait on the test): the stream
    running, k steps in, and two queued streams all end with a final `cancelled` chunk and [DONE] once the
    shutdown grace is over; a queued request that is not streamed gets a 503 saying the server is shutting down
    (its client is still there: not the empty 499 of a client gone); the process exits 0 with no traceback, and
    it stops listening."""
    eos = Tokenizer.from_dir(ckpt).eos_token_ids
    with GateServer() as gates:
        server = gated(LilyServer(ckpt, "--max-seq", "1024", "--served-model-name", MODEL,
                                  log_path=tmp_path / "serve.log"), gates)
        decode = gates.decode
        server.start()
        results: dict[int, tuple] = {}

        def stream(i: int):
            body = {"model": MODEL, "prompt": f"story number {i}:", "max_tokens": 1000, "stream": True,
                    "temperature": 1.0, "seed": i, "logit_bias": {str(t): -100 for t in eos}}
            lines, status = [], None
            try:
                if i == plain:
                    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=HANG_S)
                    status, lines = r.status_code, [r.text]
                else:
                    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
                        status = r.status_code
                        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            except httpx.HTTPError as e:
                lines.append(f"EXC {type(e).__name__}: {e}")
            results[i] = (status, lines)

        plain = random.randint(1, 3)  # the queued request that is not streamed
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        try:
            decode.hold()
            k, warm_up = random.randint(1, 5), decode.passed  # (lily serve's warm-up decoded once)
            decode.allow(k)
            threads[0].start()
            decode.wait_for(lambda g: g.passed == warm_up + k and g.waiting, f"the first stream's decode step {k + 1}")
            for t in threads[1:]:
                t.start()
            wait_metrics(server.url, lambda m: m["lily_queue_depth"] == 3, "three streams queued")
            server.proc.send_signal(signal.SIGTERM)
            for t in threads[1:]:  # the shutdown cancels the queued ones after its grace...
                t.join(HANG_S)
                assert not t.is_alive()
            decode.open()  # ...and the running one (already marked cancelled) stops at its next step
            code = server.proc.wait(HANG_S)
            threads[0].join(HANG_S)
            assert not threads[0].is_alive()
        finally:
            decode.open()
            server.stop()
    log = server.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert decode.passed == warm_up + k + 1, "the running stream went on after the shutdown cancelled it"
    status, (text,) = results.pop(plain)
    assert status == 503, (status, text)
    err = json.loads(text)["error"]
    assert err["code"] == "shutting_down" and "shutting down" in err["message"], err
    for i, (status, lines) in results.items():
        assert status == 200, (status, lines[-3:])
        # never cut: each stream ends with a final chunk, then [DONE]
        assert lines and lines[-1] == "data: [DONE]", (i, lines[-3:])
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "cancelled", (i, lines[-3:])
    assert len(results[0][1]) >= 2 and all(len(results[i][1]) == 2 for i in results if i)
    with pytest.raises(httpx.ConnectError):  # and it no longer listens
        httpx.get(server.url + "/health", timeout=HANG_S)


def listening(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=HANG_S)
        return True
    except httpx.ConnectError:
        return False


def test_a_second_ctrl_c_mid_stream_exits_130_without_an_abort(ckpt, tmp_path):
    """Ctrl-C twice while two streams decode (each has sent text before the first signal): the forced quit exits
    130, with no abort. (A QA script that sent the second signal 0.5 s after the first saw SIGABRT, "terminate
    called without an active exception", in 5 of 8 runs before the server stopped its worker on a forced exit;
    this test's timing, the second signal once the socket is closed, did not reproduce that abort in 3 runs on
    the old code: it holds the exit status, not the race.)"""
    server = LilyServer(ckpt, "--max-seq", "4096", "--served-model-name", MODEL, log_path=tmp_path / "serve.log")
    server.start()
    started = [threading.Event(), threading.Event()]

    def stream(i: int):
        body = {"model": MODEL, "prompt": f"story {i}:", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started[i].set()
        except httpx.HTTPError:
            pass  # a forced quit may cut the stream
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(HANG_S), "a stream's first text"
        server.proc.send_signal(signal.SIGINT)
        poll_until(lambda: not listening(server.url), "the first Ctrl-C to close the listening socket")
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(HANG_S)
    finally:
        server.stop()
        for t in threads:
            t.join(HANG_S)
    log = server.log()
    assert "terminate called" not in log, log[-3000:]
    assert code == 130, (code, log[-3000:])


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
