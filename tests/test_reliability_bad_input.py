"""Bad input against the real app (tiny synthetic checkpoint, reference backend, the checkpoint's own chat
template): huge and non-finite numbers, wrong types, deep nesting, invalid UTF-8 and lone surrogates, a
10 MB body, template-injection attempts in message content. Never a 5xx, never a crash, every error in
OpenAI's shape; injected template syntax reaches the model as plain text, exactly as transformers'
own chat-template rendering (the oracle) shows it."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily.engine import load_backend
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer
from test_reliability_support import assert_openai_error, load_test, make_tiny_checkpoint

MODEL = "tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "top_logprobs"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bad-input"))


@pytest.fixture(scope="module")
def client(ckpt):
    backend = load_backend(ckpt, "cpu", "reference")
    tokenizer = Tokenizer.from_dir(ckpt)
    cache = PrefixCache(4, 1 << 28, backend.clone_state, backend.state_nbytes)
    app = create_app(backend, tokenizer, ServerSettings(model_name=MODEL, max_seq=1024), cache)  # 4 MB body limit
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def chat(**fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    body.update(fields)
    return body


def post_raw(client, path: str, raw: bytes, content_type: str = "application/json"):
    return client.post(path, content=raw, headers={"content-type": content_type})


def check(r, allowed=(200, 400), case: str = "") -> None:
    """No 5xx; the status is one of `allowed`; errors in OpenAI's shape; successes are whole answers.
    `case` names the input in a failure."""
    assert r.status_code < 500, (case, r.text[:500])
    assert r.status_code in allowed, (case, r.text[:500])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert load_test.check_stream(lines) == "", r.text[-500:]
    elif r.status_code == 200:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["total_tokens"] > 0
    else:
        assert_openai_error(r)


def healthy(client) -> None:
    r = client.post(CHAT, json=chat())
    assert r.status_code == 200, r.text


# -- numbers ---------------------------------------------------------------------------------------

EXTREMES = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", str(10**400), str(-10**400),
            "18446744073709551616", "-9223372036854775809", "0.5", "-1", "0", "1e308", "true", "\"7\""]


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_extreme_numbers_are_400_or_served(client, field):
    for literal in EXTREMES:
        raw = json.dumps(chat(logprobs=True)).encode()[:-1] + f', "{field}": {literal}}}'.encode()
        r = post_raw(client, CHAT, raw)
        check(r, case=f"{field}: {literal}")
        if r.status_code == 400 and literal in ("NaN", "Infinity", "-Infinity", "true", "\"7\""):
            assert assert_openai_error(r)["param"] == field, r.text
    healthy(client)


def test_max_tokens_is_bounded_by_the_context(client):
    for value in (1025, 10**6, 2**63, 10**30):
        err = assert_openai_error(client.post(CHAT, json=chat(max_tokens=value)), 400)
        assert err["code"] == "context_length_exceeded" or err["param"] == "max_tokens"
    err = assert_openai_error(client.post(COMPLETIONS, json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 10**9}), 400)
    assert err["code"] == "context_length_exceeded"


# -- types -----------------------------------------------------------------------------------------

WRONG = [[], {}, [1, 2], {"a": 1}, "x", "", True, 1.5, -3, None, [[["deep"]]], {"$ref": "#/x"}]


@pytest.mark.parametrize("field", ["model", "messages", "stop", "stream", "stream_options", "tools", "tool_choice",
                                   "logprobs", "chat_template_kwargs", "prompt_cache_key", *NUMERIC_FIELDS])
def test_wrong_types_are_400_naming_the_field(client, field):
    for value in WRONG:
        r = client.post(CHAT, json=chat(**{field: value}, logprobs=True) if field != "logprobs" else chat(**{field: value}))
        check(r, allowed=(200, 400, 404), case=f"{field}: {value!r}")
        if r.status_code != 200:
            param = assert_openai_error(r)["param"]
            assert param is None or param.startswith(field) or param in ("messages", "max_tokens"), (field, value, r.text)
    healthy(client)


def test_message_shapes(client):
    bad = [{"role": "user", "content": {"text": "x"}}, {"role": "user", "content": [{"type": "text"}]},
           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]},
           {"role": ["user"], "content": "x"}, {"content": "x"}, "just a string", None, 5,
           {"role": "tool", "content": None}]
    for m in bad:
        r = client.post(CHAT, json=chat(messages=[m]))
        check(r, allowed=(400,))
        assert assert_openai_error(r)["param"].startswith("messages"), (m, r.text)
    check(client.post(CHAT, json=chat(messages=[{"role": "user", "content": "x"}] * 2000)), allowed=(400,))


# -- structure and encoding ------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [10, 500, 5_000, 200_000])
def test_deep_nesting(client, depth):
    nested_list = b"[" * depth + b"]" * depth
    nested_obj = b'{"a":' * depth + b"1" + b"}" * depth
    base = json.dumps(chat()).encode()[:-1]
    for raw in (base + b', "extra": ' + nested_list + b"}",
                base + b', "chat_template_kwargs": {"x": ' + nested_obj + b"}}",
                base + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": ' + nested_obj + b"}}]}",
                base + b', "messages": [{"role": "user", "content": ' + nested_list + b"}]}",
                nested_list, nested_obj):
        check(post_raw(client, CHAT, raw))
    healthy(client)


INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82",
                b"\x80", b"abc\xf0\x9f\x98"]
LONE_SURROGATES = [b"\\ud800", b"\\udfff", b"x\\udc00y", b"\\udc00\\ud800", b"\\ud83d"]


def test_invalid_utf8_and_lone_surrogates(client):
    for bad in INVALID_UTF8:
        for raw in (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi' + bad + b'"}], "max_tokens": 2}',
                    b'{"model": "tiny' + bad + b'", "messages": [{"role": "user", "content": "hi"}]}',
                    b'{"model": "tiny", "prompt": "' + bad + b'", "max_tokens": 2}', bad):
            check(post_raw(client, CHAT, raw), allowed=(400, 404))  # 404: a model name that exists nowhere
            check(post_raw(client, COMPLETIONS, raw), allowed=(400, 404))
    for bad in LONE_SURROGATES:  # valid JSON escapes that are not Unicode text
        for path, raw in ((CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a' + bad + b'"}], "max_tokens": 2}'),
                          (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "' + bad + b'"}]}], "max_tokens": 2, "stream": true}'),
                          (COMPLETIONS, b'{"model": "tiny", "prompt": "' + bad + b'", "max_tokens": 2}'),
                          (COMPLETIONS, b'{"model": "tiny", "prompt": "a", "stop": "' + bad + b'", "max_tokens": 2}'),
                          (CHAT, b'{"model": "' + bad + b'", "messages": [{"role": "user", "content": "a"}]}')):
            r = post_raw(client, path, raw)
            check(r, allowed=(400, 404))
    healthy(client)


@pytest.mark.parametrize("chunked", [False, True])
def test_ten_megabyte_body_is_413(client, chunked):
    content = "x" * (10 * 2**20)
    raw = json.dumps(chat(messages=[{"role": "user", "content": content}])).encode()
    body = iter([raw[i:i + 2**20] for i in range(0, len(raw), 2**20)]) if chunked else raw
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 413)
    healthy(client)


def test_odd_http(client):
    check(client.post(CHAT, content=b"{}", headers={"content-type": "text/plain"}), allowed=(400,))
    check(client.post(CHAT, content=b"", headers={}), allowed=(400,))
    check(client.post(CHAT, content=json.dumps(chat()).encode("utf-16"), headers={"content-type": "application/json"}),
          allowed=(200, 400))
    for method in ("put", "patch", "delete"):
        check(getattr(client, method)(CHAT), allowed=(405,))
    check(client.get("/v1/../../etc/passwd"), allowed=(404,))
    check(client.get("/v1/models/" + "a" * 20_000), allowed=(404,))
    check(client.get("/v1/models/%00%ff"), allowed=(404,))
    healthy(client)


# -- template injection ----------------------------------------------------------------------------

INJECTIONS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% raw %}", "{% endraw %}", "{{ 7*7 }}", "{% for x in range(10**9) %}x{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% include '/etc/passwd' %}", "{#", "{{", "}}{%", "{{ messages }}", "{{ raise_exception('boom') }}",
    "${7*7} #{7*7} <%= 7*7 %>",
]


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.mark.parametrize("attack", INJECTIONS)
def test_template_syntax_in_content_is_plain_text(client, hf_tokenizer, attack):
    messages = [{"role": "system", "content": f"sys {attack}"}, {"role": "user", "content": attack},
                {"role": "assistant", "content": f"a {attack}"}, {"role": "user", "content": f"again {attack} end"}]
    r = client.post(CHAT, json=chat(messages=messages, temperature=0))
    check(r, allowed=(200,))
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert f"again {attack} end" in rendered  # the oracle keeps it verbatim ...
    want = len(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert r.json()["usage"]["prompt_tokens"] == want  # ... and lily's prompt is the same text
    # also through tool definitions and template kwargs (values, never template source)
    r = client.post(CHAT, json=chat(tools=[{"type": "function", "function": {"name": "f", "description": attack,
                                                                             "parameters": {"type": "object", "x": attack}}}],
                                    chat_template_kwargs={"anything": attack}))
    check(r, allowed=(200,))


# -- random bodies ---------------------------------------------------------------------------------

surrogates = st.integers(0xD800, 0xDFFF).map(chr)
nasty_text = st.lists(st.one_of(st.characters(), surrogates, st.sampled_from(["{{", "}}", "{%", "%}", "<|im_end|>",
                                                                              "<think>", "\x00", "\u202e"])),
                      max_size=30).map("".join) | st.sampled_from(INJECTIONS)
numbers = st.one_of(st.integers(-2**70, 2**70), st.floats(), st.sampled_from([0, 1, -1, 2**63, 2**64]))
scalars = st.none() | st.booleans() | numbers | nasty_text
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3),
                      max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
                                           "content": nasty_text | values}), min_size=1, max_size=3)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=messages, extra=st.dictionaries(st.sampled_from(NUMERIC_FIELDS + ["stop", "stream", "tools", "tool_choice",
                                                                              "chat_template_kwargs", "logprobs"]),
                                            values, max_size=3),
       prompt=nasty_text | st.lists(st.integers(-3, 600), max_size=4), completions=st.booleans())
def test_random_nasty_bodies_never_5xx(client, msgs, extra, prompt, completions):
    base = {"model": MODEL, "max_tokens": 2, **extra}
    body = {**base, "prompt": prompt} if completions else {**base, "messages": msgs}
    raw = json.dumps(body, allow_nan=True).encode()  # surrogates travel as \\uXXXX escapes
    r = post_raw(client, COMPLETIONS if completions else CHAT, raw)
    assert r.status_code < 500, (body, r.text[:300])
    if r.status_code != 200:
        assert_openai_error(r)
