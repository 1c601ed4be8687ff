"""The API details third-party clients rely on (issue 13's list), each through raw HTTP or a real client:
CORS preflight of a browser SDK, OpenAI's context-length message, /tokenizer_info and model-less
/tokenize, the Content-Type error, HEAD probes, a stream closed early (logged and counted), distinct
logprob keys for pieces of one UTF-8 character, x-request-id, and the empty prompt of a batch named; and what
OpenAI / vLLM refuse with a 400 naming the field (fields lily cannot honour, rules between fields), an assistant
turn's refusal part sent back, and a full queue's Retry-After."""

import random
import re
import threading

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from helpers_gate import HANG_S, GateServer, StepGate, poll_until
from helpers_standin import FixedLogitsBackend as FixedBackend
from lily.demo_tokenizer import write_tokenizer_files
from lily.server.app import ServerSettings, create_app
from lily.synthetic import make_synthetic
from lily.tokenizer import Tokenizer
from test_reliability_support import gated, load_test, read_metrics, wait_metrics

MODEL = "tiny"
# the openai JS SDK's request headers (a browser preflights them all)
JS_SDK_HEADERS = ("authorization, content-type, x-stainless-arch, x-stainless-lang, x-stainless-os, "
                  "x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
                  "x-stainless-runtime-version, x-stainless-timeout, openai-organization, openai-project")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))


def continuation_byte_ids(tokenizer) -> list[int]:
    """Tokens that are one UTF-8 continuation byte (0x80..0xBF): each alone is a piece of a character."""
    return [i for i in range(tokenizer.vocab_size)
            if len(tokenizer.token_bytes(i)) == 1 and 0x80 <= tokenizer.token_bytes(i)[0] <= 0xBF]


@pytest.fixture(scope="module")
def fragments_first(tokenizer):
    """A client whose backend puts five continuation-byte tokens above every other token."""
    seed = random.randrange(2 ** 31)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokenizer.vocab_size, generator=g)
    ids = continuation_byte_ids(tokenizer)
    top = [ids[i] for i in torch.randperm(len(ids), generator=g)[:5].tolist()]
    logits[top] = 10 + torch.rand(5, generator=g)  # distinct values, all above the rest
    backend = FixedBackend(logits)
    app = create_app(backend, tokenizer, ServerSettings(model_name=MODEL, max_seq=128, cors_origins=("*",)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, logits, top


def assert_error(r, status, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# 1 ------------------------------------------------------------------------------------------------------
def test_browser_sdk_preflight_allows_its_headers_and_exposes_the_request_id(fragments_first):
    client, _, _ = fragments_first
    r = client.options("/v1/chat/completions", headers={
        "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": JS_SDK_HEADERS})
    assert r.status_code == 200, r.text
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in JS_SDK_HEADERS.split(",")} <= allowed
    r = client.get("/v1/models", headers={"Origin": "http://localhost:5173"})
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


# 2 ------------------------------------------------------------------------------------------------------
def test_context_length_message_reads_as_openai_s(fragments_first):
    client, _, _ = fragments_first
    words = "word " * 100
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 100,
                                                  "messages": [{"role": "user", "content": words}]})
    err = assert_error(r, 400, "context_length_exceeded")
    m = re.match(r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                 r"\((\d+) in the messages, (\d+) in the completion\)\.", err["message"])
    assert m, err["message"]
    prompt = client.post("/tokenize", json={"messages": [{"role": "user", "content": words}]}).json()["count"]
    assert [int(x) for x in m.groups()] == [128, prompt + 100, prompt, 100]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": words * 2, "max_tokens": 5})
    err = assert_error(r, 400, "context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 128 tokens. However, you requested ")
    assert "in the prompt, 5 in the completion" in err["message"]


# 3 ------------------------------------------------------------------------------------------------------
def test_tokenizer_info_and_tokenize_without_model(fragments_first, tokenizer):
    client, _, _ = fragments_first
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 128
    assert info["chat_template"] == tokenizer.chat_template_source
    text = "Hello, wörld " + str(random.random())
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode(text)
    r = client.post("/detokenize", json={"tokens": tokenizer.encode(text)})
    assert r.status_code == 200 and r.json()["prompt"] == text
    assert_error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)


def test_detokenize_keeps_special_tokens(fragments_first, tokenizer, tmp_path):
    """/detokenize answers tokenizer.decode with special tokens kept, as vLLM's: /tokenize of chat messages then
    /detokenize gives back the rendered prompt (<|im_start|> and all), plain text comes back as it went in, and
    any ids decode as the tokenizer itself decodes them (its own decode, skip_special_tokens false, the oracle)."""
    from tokenizers import Tokenizer as HFTokenizer

    client, _, _ = fragments_first
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"wörld {random.random()}"}]
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = tokenizer.render_chat(messages)
    assert "<|im_start|>" in prompt and "<|im_end|>" in prompt
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == prompt
    assert client.post("/tokenize", json={"prompt": r.json()["prompt"]}).json()["tokens"] == ids
    text = "plain " + str(random.random()) + " é✓"
    assert client.post("/detokenize", json={"tokens": tokenizer.encode(text)}).json()["prompt"] == text
    hf = HFTokenizer.from_str(tokenizer.tokenizer_json())
    for _ in range(20):  # any ids: stray UTF-8 bytes around control tokens, markup tokens
        ids = [random.randrange(tokenizer.vocab_size) for _ in range(random.randint(1, 12))]
        assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == hf.decode(
            ids, skip_special_tokens=False), ids


# 4 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_json_body_with_the_wrong_content_type_says_so(fragments_first, content_type):
    client, _, _ = fragments_first
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    headers = {"content-type": content_type} if content_type else {}
    err = assert_error(client.post("/v1/chat/completions", content=body, headers=headers), 400)
    assert "Content-Type: application/json" in err["message"]
    assert (content_type or "without one") in err["message"]
    ok = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert ok.status_code == 200


# 5 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_head_probes(fragments_first, path):
    client, _, _ = fragments_first
    r = client.head(path)
    assert r.status_code == 200 and r.content == b""
    assert int(r.headers["content-length"]) == len(client.get(path).content)


# 7 ------------------------------------------------------------------------------------------------------
def test_logprobs_keep_pieces_of_one_character_apart(fragments_first, tokenizer):
    client, logits, top = fragments_first
    want = torch.log_softmax(logits.double(), -1)
    labels = {i: "bytes:" + "".join(f"\\x{b:02x}" for b in tokenizer.token_bytes(i)) for i in top}
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 5,
                                             "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    for step in lp["top_logprobs"]:
        assert len(step) == 5, step
        assert step == pytest.approx({labels[i]: float(want[i]) for i in top}, abs=1e-4)
    best = max(top, key=lambda i: float(logits[i]))
    assert lp["tokens"] == [labels[best]] * 3
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "logprobs": True, "top_logprobs": 5,
                                                  "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["token"] == labels[best] and entry["bytes"] == tokenizer.token_bytes(best)
        assert {e["token"]: e["bytes"] for e in entry["top_logprobs"]} == {labels[i]: tokenizer.token_bytes(i)
                                                                         for i in top}


# 9 ------------------------------------------------------------------------------------------------------
def test_the_empty_prompt_of_a_batch_is_named(fragments_first):
    client, _, _ = fragments_first
    k = random.randrange(1, 4)
    prompts = ["a"] * k + [""] + ["b"]
    err = assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": prompts}), 400)
    assert f"prompt[{k}]" in err["message"] and "prompt[0]" not in err["message"]


# 10: fields lily cannot honour, refused by name ------------------------------------------------------------
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# vLLM's structured-output options lily does not honour (the rules themselves are served:
# tests/test_structured_outputs_vllm.py)
GUIDED = [("guided_whitespace_pattern", {"guided_whitespace_pattern": " *"}, "not supported",
           {"guided_whitespace_pattern": None}),
          ("structured_outputs.disable_any_whitespace",
           {"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}}, "only false",
           {"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": False}})]


def body_for(path: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    body.update(fields)
    return body


def assert_refused(client, path: str, fields: dict, param: str, instead: str) -> dict:
    """A 400 naming `param` whose message says what to use instead; the next request is answered."""
    err = assert_error(client.post(path, json=body_for(path, **fields)), 400)
    assert err["param"] == param and err["message"].startswith(param + ": "), err
    assert instead in err["message"], err
    assert client.post(path, json=body_for(path)).status_code == 200
    return err


@pytest.mark.parametrize("path,fields,param,instead,noop", [
    (COMPLETIONS, {"suffix": "}\n"}, "suffix", "prompt", {"suffix": ""}),
    (COMPLETIONS, {"best_of": 3}, "best_of", "n choices", {"best_of": 1}),
    (COMPLETIONS, {"best_of": 2, "n": 3}, "best_of", "n choices", {"best_of": 3, "n": 3}),
    (CHAT, {"best_of": 2}, "best_of", "n choices", {"best_of": 2, "n": 2}),
    (COMPLETIONS, {"include_stop_str_in_output": True}, "include_stop_str_in_output", "append the stop string",
     {"include_stop_str_in_output": False}),
    (CHAT, {"include_stop_str_in_output": True}, "include_stop_str_in_output", "append the stop string",
     {"include_stop_str_in_output": False}),
    (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs", "echo", {"prompt_logprobs": None}),
    (CHAT, {"prompt_logprobs": 0}, "prompt_logprobs", "echo", {"prompt_logprobs": None}),
    *[(path, fields, name, says, noop) for name, fields, says, noop in GUIDED for path in (CHAT, COMPLETIONS)],
    *[(path, {"skip_special_tokens": False}, "skip_special_tokens", "send true", {"skip_special_tokens": True})
      for path in (CHAT, COMPLETIONS)],
    *[(path, {"bad_words": ["a b"]}, "bad_words", "allowed_token_ids", {"bad_words": []})
      for path in (CHAT, COMPLETIONS)],
    *[(path, {"use_beam_search": True}, "use_beam_search", "n sampled choices", {"use_beam_search": False})
      for path in (CHAT, COMPLETIONS)],
    *[(path, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
       "stream_options.continuous_usage_stats", "include_usage",
       {"stream": True, "stream_options": {"continuous_usage_stats": False}}) for path in (CHAT, COMPLETIONS)],
    (CHAT, {"echo": True}, "echo", "/v1/completions", {"echo": False}),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "text", {"modalities": ["text"]}),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only", {"audio": None}),
    (CHAT, {"chat_template": "{{ messages }}"}, "chat_template", "/v1/completions", {"chat_template": None}),
])
def test_a_field_lily_cannot_honour_is_refused_by_name(fragments_first, path, fields, param, instead, noop):
    """Any value that would change the output is a 400 naming the field; its no-op value is accepted."""
    client, _, _ = fragments_first
    assert_refused(client, path, fields, param, instead)
    r = client.post(path, json=body_for(path, **noop))
    assert r.status_code == 200, r.text
    if noop.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text
    else:
        assert len(r.json()["choices"]) == noop.get("n", 1)


@pytest.mark.parametrize("fields,param,instead", [
    ({"conversation": "conv_" + "a1b2"}, "conversation", "input"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "instructions"),
    ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({"max_tool_calls": 1}, "max_tool_calls", "parallel_tool_calls"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include", "/v1/chat/completions"),
])
def test_a_responses_field_lily_cannot_honour_is_refused_by_name(fragments_first, fields, param, instead):
    """Stored conversations and prompts, logprobs and a cap on tool calls were accepted and ignored; now each is a
    400 naming the field; include's other values (outputs of tools lily does not run) are served."""
    client, _, _ = fragments_first
    body = {"model": MODEL, "input": random.choice(["alpha beta", "gamma"]), "max_output_tokens": 2}
    err = assert_error(client.post("/v1/responses", json={**body, **fields}), 400)
    assert err["param"] == param and instead in err["message"], err
    r = client.post("/v1/responses", json={**body, "include": ["reasoning.encrypted_content"], "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text


def test_a_background_response_is_refused_by_name(fragments_first):
    """The Responses API's background mode keeps a response to fetch later; lily stores none, so true is a 400
    naming the field (it answered at once before, as if the field were not there); false is served."""
    client, _, _ = fragments_first
    words = ["alpha", "beta", "gamma", "delta"]
    body = {"model": MODEL, "input": " ".join(random.sample(words, 3)), "max_output_tokens": 2}
    err = assert_error(client.post("/v1/responses", json={**body, "background": True}), 400)
    assert err["param"] == "background" and err["message"].startswith("background: ") and "stores no" in err["message"]
    r = client.post("/v1/responses", json={**body, "background": False})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text


# 11: rules between fields --------------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs", [None, False])
def test_top_logprobs_needs_logprobs(fragments_first, logprobs):
    client, _, _ = fragments_first
    fields = {"top_logprobs": random.randrange(0, 6)}
    if logprobs is not None:
        fields["logprobs"] = logprobs
    assert_refused(client, CHAT, fields, "top_logprobs", "set logprobs to true")
    r = client.post(CHAT, json=body_for(CHAT, **{**fields, "logprobs": True}))
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"], r.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_needs_stream(fragments_first, path, stream):
    client, _, _ = fragments_first
    fields = {"stream_options": {"include_usage": random.choice([True, False])}}
    if stream is not None:
        fields["stream"] = stream
    assert_refused(client, path, fields, "stream_options", "set stream to true")
    r = client.post(path, json=body_for(path, stream_options={"include_usage": True}, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"usage"' in r.text


@pytest.mark.parametrize("path,limit", [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"),
                                        (COMPLETIONS, "max_tokens")])
def test_min_tokens_above_the_token_limit_is_refused(fragments_first, path, limit):
    client, _, _ = fragments_first
    k = random.randrange(1, 5)
    err = assert_refused(client, path, {limit: k, "min_tokens": k + 1}, "min_tokens", f"raise {limit}")
    assert f"{k + 1} is more than {limit} ({k})" in err["message"]
    r = client.post(path, json=body_for(path, **{limit: k, "min_tokens": k}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == k, r.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_min_tokens_above_the_resolved_limit_is_refused(fragments_first, path):
    """max_tokens left out is resolved by the server (completions: 16; chat: the room the context leaves after the
    messages); a min_tokens above that is the same 400 as above an explicit max_tokens (it was served, the
    min_tokens quietly cut to the limit: QA context2.py); at the limit it is served, that many tokens long."""
    client, _, _ = fragments_first
    if path == CHAT:
        counted = client.post("/tokenize", json={"messages": body_for(CHAT)["messages"]}).json()
        resolved = counted["max_model_len"] - counted["count"]
    else:
        resolved = 16
    err = assert_refused(client, path, {"max_tokens": None, "min_tokens": resolved + 1}, "min_tokens", "max_tokens")
    assert f"{resolved + 1} is more than max_tokens ({resolved}, " in err["message"], err
    r = client.post(path, json=body_for(path, max_tokens=None, min_tokens=resolved))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == resolved, r.text


# 12: an assistant turn's refusal part, as OpenAI returns it --------------------------------------------------
def test_an_assistant_refusal_part_is_the_turn_s_text(fragments_first):
    client, _, _ = fragments_first
    said = f"I can't help with that ({random.randrange(10 ** 6)})."
    parts = [{"type": "refusal", "refusal": said}]
    if random.random() < 0.5:
        parts.append({"type": "text", "text": " But ask me another."})
    as_text = "".join(p.get("refusal") or p.get("text") for p in parts)

    def turn(content):
        return [{"role": "user", "content": "help"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "why?"}]

    r = client.post(CHAT, json=body_for(CHAT, messages=turn(parts)))
    assert r.status_code == 200, r.text
    plain = client.post(CHAT, json=body_for(CHAT, messages=turn(as_text))).json()
    assert r.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    rendered = client.post("/tokenize", json={"messages": turn(parts)}).json()["tokens"]
    assert rendered == client.post("/tokenize", json={"messages": turn(as_text)}).json()["tokens"]
    # a user turn has no refusal part
    err = assert_error(client.post(CHAT, json=body_for(CHAT, messages=[{"role": "user", "content": parts}])), 400)
    assert err["param"] == "messages[0].content[0].type"


# 13: a full queue says when to retry ---------------------------------------------------------------------
class GatedBackend(FixedBackend):
    """The fixed logits, each step behind a gate the test holds."""

    def __init__(self, logits):
        super().__init__(logits)
        self.gate = StepGate("step")

    def _logits(self, history):
        self.gate.enter()
        return super()._logits(history)


def test_queue_full_answers_retry_after(tokenizer):
    """One request running (held at a step), one queued (max_queue 1): the next gets a 429 with Retry-After, through
    the openai client too; once the step is let go, the server answers again."""
    backend = GatedBackend(torch.randn(tokenizer.vocab_size))
    app = create_app(backend, tokenizer, ServerSettings(model_name=MODEL, max_seq=128, max_queue=1, max_batch=1))
    worker = app.state.lily.worker
    body = body_for(COMPLETIONS, max_tokens=3)
    results = {}
    with TestClient(app, raise_server_exceptions=False) as client, backend.gate.held():
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=client)
        threads = [threading.Thread(target=lambda k=k: results.setdefault(k, client.post(COMPLETIONS, json=body)))
                   for k in range(2)]
        threads[0].start()
        backend.gate.wait_waiting()  # the first runs, and cannot finish
        threads[1].start()
        poll_until(lambda: worker.queue_depth == 1 or not threads[1].is_alive(), "the second request to queue")
        for path, kw in ((CHAT, body_for(CHAT)), (COMPLETIONS, body)):
            err = assert_error(client.post(path, json=kw), 429, "queue_full")
            assert err["type"] == "rate_limit_error"
        r = client.post(COMPLETIONS, json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.headers
        with pytest.raises(openai.RateLimitError) as e:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
        backend.gate.open()
        for t in threads:
            t.join(HANG_S)
        assert [results[k].status_code for k in range(2)] == [200, 200]
        assert client.post(COMPLETIONS, json=body).status_code == 200


# 6 and 8, against a real `lily serve` ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def gates():
    with GateServer() as served:
        yield served


@pytest.fixture(scope="module")
def served(tmp_path_factory, gates):
    ckpt = make_synthetic("tiny", tmp_path_factory.mktemp("gaps") / "ckpt", seed=random.randrange(1000))
    with gated(load_test.LilyServer(ckpt, "--served-model-name", MODEL, "--max-seq", "512", "--cors-origin", "*",
                                    log_path=tmp_path_factory.mktemp("log") / "serve.log"), gates) as server:
        yield server


def test_request_id_echoed_made_and_logged(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    mine = f"trace-{random.randrange(10 ** 9)}"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"x-request-id": mine})
    assert raw.headers["x-request-id"] == mine
    made = client.models.with_raw_response.list().headers["x-request-id"]
    assert made and made != mine
    other = client.models.with_raw_response.list().headers["x-request-id"]
    assert other != made
    bad = httpx.get(served.url + "/health", headers={"x-request-id": "has spaces\tand tabs"})
    assert bad.headers["x-request-id"] != "has spaces\tand tabs"
    lines = served.log().splitlines()
    assert any("POST /v1/chat/completions 200" in line and f"rid={mine}" in line for line in lines)
    assert any("GET /v1/models 200" in line and f"rid={made}" in line for line in lines)


def test_stream_closed_early_is_logged_and_counted(served, gates):
    closed = 'lily_requests_total{endpoint="/v1/chat/completions",status="499"}'
    before = read_metrics(served.url).get(closed, 0.0)
    rid = f"leaver-{random.randrange(10 ** 9)}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 400,
            "stream": True, "logit_bias": {"499": -100, "500": -100}}
    with gates.decode.held():  # the answer cannot end before the client leaves
        with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid},
                          timeout=HANG_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # leave after the first chunk; closing the response drops the connection
        wait_metrics(served.url, lambda m: m.get(closed, 0.0) > before, "the stream closed early to be counted")
    assert any("POST /v1/chat/completions 499" in line and f"rid={rid}" in line for line in served.log().splitlines())


def test_a_seed_outside_int64_is_a_400_and_its_ends_are_served(fragments_first):
    """vLLM takes a seed in int64's range; a wider one was read modulo 2**64, so 2**64 gave seed 0's output (two
    seeds the client tells apart, one output). Its ends are served, and n choices past the top wrap inside."""
    client, _, _ = fragments_first
    top, bottom = 2 ** 63 - 1, -2 ** 63
    for path in (CHAT, COMPLETIONS):
        for bad in (top + 1, bottom - 1, 2 ** 64 + random.randrange(1000), -2 ** random.randint(64, 90)):
            err = assert_error(client.post(path, json=body_for(path, seed=bad)), 400)
            assert err["param"] == "seed", err
        for good, n in ((top, 2), (bottom, 1), (random.randrange(bottom, top), 2)):
            r = client.post(path, json=body_for(path, seed=good, n=n, temperature=1.0))
            assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
    body = {"model": MODEL, "input": "alpha", "max_output_tokens": 2}
    assert assert_error(client.post("/v1/responses", json={**body, "seed": top + 1}), 400)["param"] == "seed"
    assert client.post("/v1/responses", json={**body, "seed": bottom}).status_code == 200
