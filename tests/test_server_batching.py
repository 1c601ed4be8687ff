"""Many clients at once through the HTTP server: the official openai client streams several completions
concurrently from lily's app (reference backend, tiny checkpoint, --max-batch 4); they decode in the same
steps and each stream carries exactly the text the same request gets when it runs alone.
Concurrency is arranged by events: the worker is held inside the first request's prefill until every
client's request has reached the engine."""

from __future__ import annotations

import random
import threading

import openai
import pytest
from helpers_batching import WAIT_S, Recorder
from test_reliability_support import ThreadedServer, make_tiny_checkpoint

from lily.engine import load_backend
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("batching"))
    rec = Recorder(load_backend(ckpt, "cpu", "reference"))
    app = create_app(rec, Tokenizer.from_dir(ckpt), ServerSettings(model_name=MODEL, max_seq=256, max_batch=4))
    with ThreadedServer(app) as server:
        yield server, rec, app.state.worker


def stream_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def test_concurrent_streams_get_their_solo_text(served):
    server, rec, worker = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven"]
    jobs = [(" ".join(random.choice(words) for _ in range(random.randrange(2, 9))), random.randrange(8, 14))
            for _ in range(4)]

    arrived = threading.Semaphore(0)
    submit_all = worker.submit_all

    def counting_submit(items):
        submit_all(items)
        arrived.release()
    worker.submit_all = counting_submit
    results: dict[int, tuple[str, str]] = {}

    def client_thread(i):
        results[i] = stream_text(client, *jobs[i])
    rec.hold()
    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(len(jobs))]
    threads[0].start()
    rec.wait_held()                        # the first is in its prefill, holding the worker
    for t in threads[1:]:
        t.start()
    for _ in jobs:                         # every request has reached the engine
        assert arrived.acquire(timeout=WAIT_S)
    rec.release()
    for t in threads:
        t.join(WAIT_S)
    worker.submit_all = submit_all
    assert max(rec.decode_sizes()) == len(jobs), rec.decode_sizes()
    for i, (prompt, n) in enumerate(jobs):
        alone = stream_text(client, prompt, n)
        assert results[i] == alone and alone[1] == "length", (i, results[i], alone)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_streamed_request_s_choices_interleave_as_they_decode_together(served, api):
    """n choices decode in the same steps, so the stream sends each choice's chunks as they come, not choice 0
    to its end first; each choice's text (and its log-probabilities' offsets) is the unstreamed answer's."""
    server, rec, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    n, max_tokens, seed = 3, random.randrange(8, 13), random.randrange(1 << 30)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone"]
    prompt = " ".join(random.choice(words) for _ in range(random.randrange(3, 8)))
    if api == "chat":
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], n=n, max_tokens=max_tokens,
                  temperature=1.0, seed=seed,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
        create = client.chat.completions.create
    else:
        kw = dict(model=MODEL, prompt=prompt, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=1,
                  extra_body={"ignore_eos": True})
        create = client.completions.create
    whole = create(**kw)
    before = len(rec.decode_sizes())
    order, texts, offsets_ok = [], {}, True
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        order.append((c.index, c.finish_reason))
        piece = (c.delta.content or "") if api == "chat" else c.text
        if api == "completions" and c.logprobs and c.logprobs.text_offset:
            offsets_ok &= c.logprobs.text_offset[0] == len(texts.get(c.index, ""))
        texts[c.index] = texts.get(c.index, "") + piece
    assert max(rec.decode_sizes()[before:]) == n            # the choices stepped together
    firsts = {i: next(k for k, (j, _) in enumerate(order) if j == i) for i in range(n)}
    ends = {i: next(k for k, (j, f) in enumerate(order) if j == i and f) for i in range(n)}
    assert firsts[n - 1] < ends[0], order                 # the last choice began before the first one ended
    answers = [(c.message.content if api == "chat" else c.text) for c in whole.choices]
    assert [texts[i] for i in range(n)] == answers and len(set(answers)) > 1
    assert offsets_ok
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == n * max_tokens
