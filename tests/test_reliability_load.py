"""Load: 64 concurrent clients (one first, held at its first decode step; 63 streaming ones behind it) against
`lily serve` (tiny synthetic checkpoint, CPU, reference backend). Every request ends with a complete answer or a
clean 429/503 in OpenAI's error shape, none hangs, the queue drains to 0, and the server's resident memory returns
near its idle level. The server's decode steps wait on the test (helpers_gate), so the queue really is full when
the load arrives, however fast the machine answers."""

from __future__ import annotations

import threading

import httpx
import pytest

from helpers_gate import HANG_S, GateServer
from test_reliability_support import (LilyServer, gated, load_test, make_tiny_checkpoint, wait_metrics,
                                      wait_until_idle)

MODEL = "tiny"
MAX_QUEUE = 32
MAX_BATCH = 4
RSS_SLACK = 64 * 2**20  # bytes above idle still "near idle" (allocator caches, a few grown buffers)


@pytest.fixture(scope="module")
def gates():
    with GateServer() as served:
        yield served


@pytest.fixture(scope="module")
def server(tmp_path_factory, gates):
    tmp = tmp_path_factory.mktemp("load")
    ckpt = make_tiny_checkpoint(tmp)
    with gated(LilyServer(ckpt, "--max-queue", str(MAX_QUEUE), "--max-batch", str(MAX_BATCH), "--max-seq", "512",
                          "--served-model-name", MODEL,
                          log_path=tmp / "serve.log"), gates) as s:
        yield s


def test_64_streaming_clients_complete_or_get_clean_429(server, gates):
    load_test.run_load(server.url, MODEL, clients=4, max_tokens=4)  # one-time allocations happen here
    idle = load_test.settle_rss(server.proc.pid)
    before = wait_until_idle(server.url)
    chat_ok = 'lily_requests_total{endpoint="/v1/chat/completions",status="200"}'
    chat_429 = 'lily_requests_total{endpoint="/v1/chat/completions",status="429"}'
    out = {}

    def first_request():
        # past end-of-text (ignore_eos): it reaches a decode step whatever its first token
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hold the worker"}], "max_tokens": 8,
                "ignore_eos": True}
        with httpx.Client(timeout=HANG_S) as client:
            out["first"] = client.post(server.url + "/v1/chat/completions", json=body)

    with load_test.RSSSampler(server.proc.pid) as sampler:
        with gates.decode.held():
            # the first request runs and holds the worker at its first decode step, so the 63 after it cannot
            # start, however the two arrive: MAX_BATCH - 1 of them find a free slot (taken whatever the queue),
            # MAX_QUEUE wait for one, the rest get 429
            first = threading.Thread(target=first_request)
            first.start()
            gates.decode.wait_waiting()
            load = threading.Thread(target=lambda: out.update(result=load_test.run_load(
                server.url, MODEL, clients=63, max_tokens=8, timeout=HANG_S)))
            load.start()
            taken = MAX_BATCH - 1 + MAX_QUEUE
            wait_metrics(server.url, lambda m: m["lily_queue_depth"] == taken and m["lily_requests_running"] == 1
                         and m.get(chat_429, 0) - before.get(chat_429, 0) == 63 - taken, "the queue to fill")
        first.join(HANG_S)
        load.join(HANG_S)
    result = out["result"]
    print(f"\n1 + {result.requests} requests: 1 + {result.ok} ok, {result.refused} refused; "
          f"{result.requests_per_s:.2f} req/s, p50 {result.latency_p50_s}s, p99 {result.latency_p99_s}s; "
          f"RSS idle {idle >> 20} MiB, peak {sampler.peak >> 20} MiB")

    assert out["first"].status_code == 200, out["first"].text
    assert out["first"].json()["usage"]["completion_tokens"] == 8
    assert result.failures == [] and result.failed == 0 and result.timeouts == 0
    assert result.ok == taken and result.refused == 63 - taken
    assert result.latency_p99_s is not None and result.requests_per_s > 0

    after_metrics = wait_until_idle(server.url)
    assert after_metrics[chat_ok] - before.get(chat_ok, 0) == 1 + result.ok
    assert after_metrics.get(chat_429, 0) - before.get(chat_429, 0) == result.refused

    after = load_test.settle_rss(server.proc.pid)
    assert after <= idle + RSS_SLACK, f"RSS {after >> 20} MiB after the load vs {idle >> 20} MiB idle"

    # steady state: fewer clients than the queue holds are all answered
    again = load_test.run_load(server.url, MODEL, clients=16, max_tokens=4, timeout=HANG_S)
    assert again.ok == 16 and again.refused == 0, again.failures
    assert load_test.settle_rss(server.proc.pid) <= idle + RSS_SLACK


def test_load_script_prints_rate_and_percentiles(server, capsys):
    assert load_test.main(["--url", server.url, "--model", MODEL, "--clients", "3", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "requests/s" in out and "p50" in out and "p99" in out and "3 ok" in out
    with pytest.raises(SystemExit):  # loopback targets only
        load_test.main(["--url", "http://192.0.2.1:8000", "--clients", "1"])


def test_stream_checker_rejects_broken_streams():
    good = ['data: {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}',
            'data: {"choices": [{"delta": {"content": "hi"}, "finish_reason": null}]}',
            'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}', "data: [DONE]"]
    assert load_test.check_stream(good) == ""
    assert load_test.check_stream(good[:-1])                      # cut before [DONE]
    assert load_test.check_stream(good[:2] + good[3:])            # no finish_reason
    assert load_test.check_stream(good[1:])                       # no role chunk
    assert load_test.check_stream(good[:2] + ['data: {"error": {"message": "x"}}', "data: [DONE]"])
    # n = 2: each choice's chunks in turn (by index), a role first and one finish_reason last, each
    second = [ln.replace('"choices": [{', '"choices": [{"index": 1, ') for ln in good[:-1]]
    assert load_test.check_stream(good[:-1] + second + ["data: [DONE]"]) == ""
    assert load_test.check_stream(good[:-1] + second[:2] + ["data: [DONE]"])   # choice 1 never finishes
    assert load_test.check_stream(good[:-1] + second[1:] + ["data: [DONE]"])   # choice 1 has no role chunk
    assert load_test.percentile([3.0, 1.0, 2.0], 50) == 2.0 and load_test.percentile([], 99) is None
    assert load_test.percentile(list(range(1, 101)), 99) == 99
