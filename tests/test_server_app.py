"""The HTTP layer in-process, over a stand-in backend: error shapes and statuses, limits, auth, the
OpenAPI schema, faults, and random / malformed bodies (hypothesis): never a 5xx, healthy after."""

import json
import random
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_gate import HANG_S, StepGate, poll_until
from helpers_standin import HistoryBackend
from lily.demo_tokenizer import write_tokenizer_files
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer

V = 508


class StandInBackend(HistoryBackend):
    """Deterministic logits from the whole history; each step passes a gate the test can hold
    (helpers_gate); can be told to fail."""

    def __init__(self):
        self.gate = StepGate("step")
        self.fail = False
        self.steps = 0

    def new_state(self):
        return []

    def _logits(self, s):
        if self.fail:
            raise RuntimeError("injected fault")
        self.gate.enter()
        self.steps += 1
        g = torch.Generator().manual_seed(hash(tuple(s)) % 2**31)
        x = torch.randn(V, generator=g) * 3
        x[499:502] = -30  # keep the control tokens rare so outputs have length
        return x


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))


def make_client(tokenizer, **overrides):
    backend = StandInBackend()
    s = ServerSettings(model_name="tiny", max_seq=128, max_body=4096, max_queue=1, **overrides)
    app = create_app(backend, tokenizer, s, PrefixCache(4, 1 << 20, backend.clone_state, backend.state_nbytes))
    return TestClient(app, raise_server_exceptions=False), backend


@pytest.fixture(scope="module")
def served(tokenizer):
    client, backend = make_client(tokenizer)
    with client:
        yield client, backend


def chat(**kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    body.update(kw)
    return body


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("body,param", [
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages[0].content[0].type"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[]), "messages"),
    (chat(temperature="0.5"), "temperature"),
    (chat(temperature=3), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(n=17), "n"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(stop=["a"] * 17), "stop"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(stream=1), "stream"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (chat(model=7), "model"),
    # a tagged union's tag is not a field (pydantic's path reads response_format.json_schema.json_schema.schema)
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
     "response_format.json_schema.schema"),
])
def test_invalid_fields_are_400_naming_the_field(served, body, param):
    client, _ = served
    err = assert_error(client.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"] == param and param in err["message"]


def test_vllm_conveniences_model_optional_version_head_and_the_stop_limit(served):
    """A body without model is served by the one model (as vLLM does); GET /version; HEAD on a model; 17 stop
    strings are a 400 that names the limit (not the union's "a valid string")."""
    client, _ = served
    k = random.randrange(1, 4)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": k})
    assert r.status_code == 200 and r.json()["model"] == "tiny" and r.json()["usage"]["completion_tokens"] <= k
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": k})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    from lily import __version__
    assert client.get("/version").json() == {"version": __version__}
    assert client.head("/v1/models/tiny").status_code == 200 and client.head("/v1/models/other").status_code == 404
    assert client.head("/metrics").status_code == 200 and client.head("/version").status_code == 200
    n = random.randrange(17, 40)
    err = assert_error(client.post("/v1/chat/completions", json=chat(stop=["a"] * n)), 400, param="stop")
    assert f"{n} stop strings" in err["message"] and "at most 16" in err["message"], err


def test_malformed_bodies_are_400(served):
    client, _ = served
    for raw in (b"{", b"[1, 2]", b"", b"null", "{\"model\": \"tiny\", \"messages\": \"hi\"}".encode()):
        assert_error(client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert_error(client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 99999]}), 400, param="prompt")
    assert_error(client.post("/v1/completions", json={"model": "tiny", "prompt": ["a"] * 17}), 400, param="prompt")


def test_statuses_404_405_413_and_context_length(served):
    client, _ = served
    assert_error(client.post("/v1/chat/completions", json=chat(model="other")), 404, param="model", code="model_not_found")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/models/other"), 404)
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_error(client.delete("/v1/chat/completions"), 405)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.post("/v1/chat/completions", content=b"x" * 5000, headers={"content-type": "application/json"}), 413)
    # chunked upload (no Content-Length) over the limit is refused too
    assert_error(client.post("/v1/chat/completions", content=iter([b"x" * 3000, b"y" * 3000]),
                             headers={"content-type": "application/json"}), 413)
    assert_error(client.post("/v1/chat/completions", json=chat(max_tokens=120)), 400, param="max_tokens",
                 code="context_length_exceeded")
    assert_error(client.post("/v1/chat/completions", json=chat(max_tokens=None, messages=[{"role": "user", "content": "word " * 200}])),
                 400, code="context_length_exceeded")


def test_api_key_required_everywhere_but_health(tokenizer):
    client, _ = make_client(tokenizer, api_key="s3cret")
    with client:
        assert client.get("/health").status_code == 200
        for method, path in (("get", "/v1/models"), ("get", "/metrics"), ("get", "/openapi.json"), ("post", "/v1/completions"),
                             ("get", "/nope")):
            assert_error(getattr(client, method)(path), 401, code="invalid_api_key")
            assert_error(getattr(client, method)(path, headers={"Authorization": "Bearer wrong"}), 401)
        ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"


def test_fault_is_generic_500_and_server_keeps_serving(served):
    client, backend = served
    backend.fail = True
    try:
        err = assert_error(client.post("/v1/chat/completions", json=chat()), 500)
        assert "injected" not in err["message"]
        stream = client.post("/v1/chat/completions", json=chat(stream=True))
        assert '"error"' in stream.text and stream.text.rstrip().endswith("data: [DONE]")
    finally:
        backend.fail = False
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_queue_full_is_429(tokenizer):
    """With one request running (held at a step: it cannot finish) and one queued (--max-queue 1), the
    next is refused with 429; once the step is let go, both run to the end."""
    client, backend = make_client(tokenizer, max_batch=1)  # one at a time: the others wait
    worker = client.app.state.lily.worker
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 20}
    results = {}

    def post(name):
        results[name] = client.post("/v1/completions", json=body).status_code

    with client, backend.gate.held():
        first, second = threading.Thread(target=post, args=("first",)), threading.Thread(target=post, args=("second",))
        first.start()
        backend.gate.wait_waiting()  # the first runs
        second.start()
        poll_until(lambda: worker.queue_depth == 1 or not second.is_alive(), "the second request to queue")
        post("third")
        assert results == {"third": 429}
        backend.gate.open()
        for t in (first, second):
            t.join(HANG_S)
        assert results == {"first": 200, "second": 200, "third": 429}
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert 'lily_requests_total{endpoint="/v1/completions",status="429"}' in client.get("/metrics").text


def test_openapi_describes_bodies_and_real_errors(served):
    client, _ = served
    schema = client.get("/openapi.json").json()
    post = schema["paths"]["/v1/chat/completions"]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    props = schema["components"]["schemas"][ref]["properties"]
    assert {"messages", "model", "temperature", "tools", "stream"} <= set(props)
    assert "422" not in post["responses"] and {"400", "401", "404", "413", "429"} <= set(post["responses"])


def test_metrics_text_format(served):
    client, _ = served
    client.post("/v1/chat/completions", json=chat())
    text = client.get("/metrics").text
    for name in ("lily_requests_total", "lily_prompt_tokens_total", "lily_completion_tokens_total",
                 "lily_prefill_tokens_per_second", "lily_decode_tokens_per_second", "lily_queue_depth",
                 "lily_prefix_cache_hits_total", "lily_client_disconnects_total"):
        assert f"# TYPE {name} " in text
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
fields = st.sampled_from(["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                          "logprobs", "top_logprobs", "n", "stream", "stream_options", "tools", "tool_choice",
                          "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt",
                          "chat_template_kwargs", "max_completion_tokens", "prompt_cache_key", "echo"])
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": st.text(max_size=20) | json_values})
bodies = st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(message, max_size=3),
                                "prompt": st.text(max_size=10) | st.lists(st.integers(-5, 600), max_size=5),
                                "max_tokens": st.integers(-2, 6)},
                               optional={"x": st.none()}).flatmap(
    lambda base: st.dictionaries(fields, json_values, max_size=4).map(lambda extra: {**base, **extra}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies | json_values, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       raw=st.booleans())
def test_random_bodies_never_5xx(served, body, path, raw):
    client, _ = served
    content = json.dumps(body).encode()
    if raw:  # also damage the bytes
        content = content[: len(content) // 2] + b"\xff" + content[len(content) // 2:]
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert_error(r, r.status_code)
    assert client.get("/health").status_code == 200


def test_server_thinking_default_and_request_override(tokenizer):
    client, backend = make_client(tokenizer, enable_thinking=False)
    seen = []
    original = backend.prefill
    backend.prefill = lambda ids, s: seen.append(tokenizer.decode(ids)) or original(ids, s)
    with client:
        r = client.post("/v1/chat/completions", json=chat()).json()
        assert seen[-1].endswith("<think>\n\n</think>\n\n") and "reasoning_content" not in r["choices"][0]["message"]
        r = client.post("/v1/chat/completions", json=chat(chat_template_kwargs={"enable_thinking": True})).json()
        assert seen[-1].endswith("<think>\n") and "reasoning_content" in r["choices"][0]["message"]


def test_log_line_per_request_without_secrets(tokenizer, caplog):
    client, _ = make_client(tokenizer, api_key="k3y")
    with client, caplog.at_level("INFO", logger="lily.server"):
        client.post("/v1/completions", json={"model": "tiny", "prompt": "secret words", "max_tokens": 2},
                    headers={"Authorization": "Bearer k3y"})
        client.get("/x%0Aforged 200", headers={"Authorization": "Bearer k3y"})
    lines = [r.getMessage() for r in caplog.records if r.name == "lily.server"]
    done = [x for x in lines if x.startswith("POST /v1/completions 200")]
    assert len(done) == 1 and "prompt_tokens=" in done[0] and "completion_tokens=2" in done[0]
    # where the time went: waiting for a slot, the prompt, the first text (from submission: after both)
    fields = dict(kv.split("=", 1) for kv in done[0].split() if "=" in kv)
    queue, prefill, total = int(fields["queue_ms"]), int(fields["prefill_ms"]), int(done[0].split()[3][:-2])
    assert 0 <= queue and 0 <= prefill and queue + prefill <= total + 1
    if "first_text_ms" in fields:   # (absent when no token decoded to text)
        assert queue + prefill - 1 <= int(fields["first_text_ms"]) <= total + 1
    assert not any("secret" in x or "k3y" in x for x in lines)
    assert any(x.startswith("GET /x\\nforged 200 404") for x in lines)


@pytest.mark.parametrize("log_requests", [False, True])
def test_rejected_requests_log_their_reason_with_log_requests(tokenizer, caplog, log_requests):
    """Each rejection's log line carries what the client was told, but only with --log-requests."""
    client, _ = make_client(tokenizer, api_key="k3y", log_requests=log_requests)
    auth = {"Authorization": "Bearer k3y"}
    with client, caplog.at_level("INFO", logger="lily.server"):
        told = [client.post("/v1/chat/completions", json=chat(temperature=-3), headers=auth),
                client.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth),
                client.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
                client.post("/v1/completions", content=b"x" * 5000, headers=auth)]
    lines = [r.getMessage() for r in caplog.records if r.name == "lily.server"]
    for r in told:
        message = r.json()["error"]["message"]
        line = next(x for x in lines if f" {r.status_code} " in x and x.startswith(r.request.method))
        assert (f"reason={message!r}" in line) == log_requests, line
    assert [r.status_code for r in told] == [400, 404, 401, 413]
    assert not any("k3y" in x or "wrong" in x for x in lines)
