"""vLLM's stop_token_ids, min_tokens holding back stop strings and stop tokens, allowed_token_ids, and the 400s for
token ids outside the vocabulary: lily's app on the tiny synthetic checkpoint (reference backend, --max-batch 4, so
n choices decode together and greedy rows run ahead on the device), driven by the official openai client. Oracle:
the reference backend's own greedy tokens, run here step by step, and the checkpoint's tokenizer. Stop tokens and
strings are taken from a random prompt's unconstrained output at a random position."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch
from test_reliability_support import ThreadedServer, make_tiny_checkpoint

from lily.engine import load_backend
from lily.engine.generation import StopMatcher
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer

MODEL = "tiny"
N = 14  # tokens of each oracle continuation


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("stop_tokens"))
    backend = load_backend(ckpt, "cpu", "reference")
    tokenizer = Tokenizer.from_dir(ckpt)
    app = create_app(load_backend(ckpt, "cpu", "reference"), tokenizer,
                     ServerSettings(model_name=MODEL, max_seq=256, max_batch=4))
    with ThreadedServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield server, client, backend, tokenizer


def greedy(backend, prompt: list[int], n: int, stop_ids=(), min_tokens: int = 0, allowed=None) -> tuple[list, bool]:
    """The reference model's greedy tokens (end-of-text ignored): at most n, ending before a stop id drawn once
    min_tokens tokens exist (before that, stop ids cannot be drawn, as in vLLM); (tokens, stopped)."""
    state = backend.new_state()
    logits = backend.prefill(list(prompt), state)
    out = []
    while len(out) < n:
        row = logits.clone()
        if allowed is not None:
            keep = torch.full_like(row, float("-inf"))
            keep[list(allowed)] = 0
            row = row + keep
        if len(out) < min_tokens and stop_ids:
            row[list(stop_ids)] = float("-inf")
        t = int(torch.argmax(row))
        if t in stop_ids:
            return out, True
        out.append(t)
        logits = backend.decode(t, state)
    return out, False


def random_prompt() -> list[int]:
    return [random.randrange(498) for _ in range(random.randrange(3, 12))]


def run(client, stream: bool, n: int = 1, chat_messages=None, **kw) -> list[tuple[str, str, int | None]]:
    """Each choice's (text, finish_reason) and the usage's completion tokens (all choices') in [-1]."""
    if chat_messages is not None:
        kw = dict(model=MODEL, messages=chat_messages, temperature=0, n=n, **kw)
        extra = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True, **kw.pop("extra_body", {})}
        call = client.chat.completions.create
    else:
        kw = dict(model=MODEL, temperature=0, n=n, **kw)
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        call = client.completions.create
    texts, finishes = [""] * n, [None] * n
    if not stream:
        r = call(extra_body=extra, **kw)
        for c in r.choices:
            texts[c.index] = c.message.content if chat_messages is not None else c.text
            finishes[c.index] = c.finish_reason
        return list(zip(texts, finishes)), r.usage.completion_tokens
    usage = None
    for chunk in call(extra_body=extra, stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if chat_messages is not None else c.text
            texts[c.index] += piece or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    return list(zip(texts, finishes)), usage.completion_tokens


def prompt_and_tokens(backend, tokenizer):
    """A random prompt whose greedy continuation's text grows with every token (no token without text)."""
    for _ in range(30):
        prompt = random_prompt()
        toks, _ = greedy(backend, prompt, N)
        if all(tokenizer.decode(toks[:i]) != tokenizer.decode(toks[:i + 1]) for i in range(N)):
            return prompt, toks
    raise AssertionError("30 prompts each had a token without text")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_stop_token_ids_end_the_generation_before_the_token(setup, stream, n):
    server, client, backend, tokenizer = setup
    prompt, toks = prompt_and_tokens(backend, tokenizer)
    k = random.randrange(N)
    never = random.choice([t for t in range(tokenizer.vocab_size) if t not in toks])
    stop_ids = [toks[k], never]
    cut = toks.index(toks[k])  # its first occurrence ends it
    print("prompt", prompt, "tokens", toks, "stop ids", stop_ids)
    got, used = run(client, stream, n, prompt=prompt, max_tokens=N, extra_body={"stop_token_ids": stop_ids})
    assert got == [(tokenizer.decode(toks[:cut]), "stop")] * n
    assert used == cut * n
    # min_tokens: no stop id before that many tokens (the model's next choice instead), then the first one ends it
    m = random.randrange(cut + 1, N + 1)
    expected, stopped = greedy(backend, prompt, N, set(stop_ids), min_tokens=m)
    got, used = run(client, stream, n, prompt=prompt, max_tokens=N,
                    extra_body={"stop_token_ids": stop_ids, "min_tokens": m})
    assert got == [(tokenizer.decode(expected), "stop" if stopped else "length")] * n
    assert used == len(expected) * n and len(expected) >= m


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_in_chat(setup, stream):
    server, client, backend, tokenizer = setup
    # an answer the chat parser passes through as content as it is: no token with a "<" (tags) or whitespace at an
    # end may be drawn, in the oracle and in the request alike (a random model may begin every answer with a tag
    # or a space, which the parser reads or trims: 1 checkpoint seed in 4)
    no_tags = [t for t in range(tokenizer.vocab_size)
               if "<" not in tokenizer.decode([t]) and tokenizer.decode([t]).strip() == tokenizer.decode([t])]
    for _ in range(30):
        messages = [{"role": "user", "content": " ".join(random.choice(["red", "sea", "owl", "nine", "up"])
                                                         for _ in range(random.randrange(1, 6)))}]
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "chat_template_kwargs": {
            "enable_thinking": False}}).json()["tokens"]
        toks, _ = greedy(backend, ids, N, allowed=no_tags)
        plain = [k for k in range(N) if 0 < toks.index(toks[k]) and "<" not in tokenizer.decode(toks[:k])
                 and tokenizer.decode(toks[:toks.index(toks[k])]).strip() == tokenizer.decode(toks[:toks.index(toks[k])])]
        if plain:
            break
    else:
        raise AssertionError("30 chats all began with markup")
    k = random.choice(plain)
    cut = toks.index(toks[k])
    got, used = run(client, stream, 2, chat_messages=messages, max_tokens=N,
                    extra_body={"stop_token_ids": [toks[k]], "allowed_token_ids": no_tags})
    assert got == [(tokenizer.decode(toks[:cut]), "stop")] * 2 and used == 2 * cut


def stop_string_case(backend, tokenizer):
    """(prompt, tokens, text, stop, i): a stop string that occurs once in the greedy text, and the number of tokens
    whose text completes it."""
    for _ in range(40):
        prompt, toks = prompt_and_tokens(backend, tokenizer)
        text = tokenizer.decode(toks)
        prefixes = [tokenizer.decode(toks[:i]) for i in range(N + 1)]
        if not all(text.startswith(p) for p in prefixes):  # (a character split across tokens)
            continue
        for _ in range(20):
            a = random.randrange(len(text) - 1)
            stop = text[a:a + random.randrange(2, 4)]
            if len(stop) >= 2 and text.count(stop) == 1 and stop.isprintable() and "\ufffd" not in stop:
                end = a + len(stop)
                i = next(i for i in range(N + 1) if len(prefixes[i]) >= end)
                # (text ending in U+FFFD, an invalid byte's, is held back to the next token by the server's
                # detokenizer: the stop string would then come with token i + 1)
                if not prefixes[i].endswith("\ufffd"):
                    return prompt, toks, text, stop, i
    raise AssertionError("no prompt gave a text with a stop string that occurs once")


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings(setup, stream):
    server, client, backend, tokenizer = setup
    prompt, toks, text, stop, i = stop_string_case(backend, tokenizer)
    print("prompt", prompt, "text", repr(text), "stop", repr(stop), "completed by token", i)
    before = (text[:text.find(stop)], "stop")
    kw = dict(prompt=prompt, max_tokens=N, stop=[stop, "\x00never"])
    assert run(client, stream, 2, **kw)[0] == [before] * 2
    # the token that completes the stop string is the min_tokens-th: it ends the generation
    assert run(client, stream, 2, extra_body={"min_tokens": random.randrange(i) + 1}, **kw)[0] == [before] * 2
    # one token later: the stop string came too early to count, and the text held back for it comes out whole
    if i < N:
        got, used = run(client, stream, 2, extra_body={"min_tokens": random.randrange(i + 1, N + 1)}, **kw)
        assert got == [(text, "length")] * 2 and used == 2 * N


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_token_ids_limit_the_draw(setup, stream):
    server, client, backend, tokenizer = setup
    prompt = random_prompt()
    allowed = random.sample(range(tokenizer.vocab_size), random.randrange(2, 8))
    expected, _ = greedy(backend, prompt, 8, allowed=allowed)
    assert set(expected) <= set(allowed)
    got, used = run(client, stream, 2, prompt=prompt, max_tokens=8, extra_body={"allowed_token_ids": allowed})
    assert got == [(tokenizer.decode(expected), "length")] * 2 and used == 16


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def body(path: str, **fields) -> dict:
    out = {"model": MODEL, "max_tokens": 2}
    out.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    return {**out, **fields}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_them(setup, path, field):
    server, client, backend, tokenizer = setup
    v = tokenizer.vocab_size
    bad = sorted(random.sample(range(v, v + 10_000), 2))
    good = random.randrange(v)
    ids = [good, *bad]
    value = {str(i): random.uniform(-5, 5) for i in ids} if field == "logit_bias" else ids
    r = httpx.post(server.url + path, json=body(path, **{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field + ": ")
    assert f"{bad[0]}, {bad[1]}" in err["message"] and str(good) not in err["message"].split("(")[0]
    assert f"size is {v}" in err["message"]
    ok = {str(good): 1.0} if field == "logit_bias" else [good]
    assert httpx.post(server.url + path, json=body(path, **{field: ok})).status_code == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_empty_allowed_token_ids_is_a_400(setup, path):
    server = setup[0]
    r = httpx.post(server.url + path, json=body(path, allowed_token_ids=[]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_a_stop_string_counts_only_where_it_ends_in_checked_text():
    """Text pushed before min_tokens (check=False) is released even when it holds a stop string; a later checked
    push matches only a stop string ending in its own text, as vLLM searches each token's new text."""
    stop = "".join(random.choice("abcdef") for _ in range(3))
    m = StopMatcher([stop, stop[1]])
    out, hit = m.push("q" + stop[:2], check=False)   # stop[1] whole, and a start of `stop`, held back
    assert (out, hit) == ("q", False)
    out2, hit = m.push("z", check=True)  # stop[1] ended in unchecked text: no stop
    assert (out2, hit) == (stop[:2] + "z", False)
    m = StopMatcher([stop])
    out, hit = m.push("q" + stop[:2], check=False)
    assert (out, hit) == ("q", False) and m.push(stop[2:] + "r", check=True) == ("", True)  # ends in checked text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_min_tokens_with_only_stop_tokens_allowed_is_a_400(setup, path):
    server, client, backend, tokenizer = setup
    stop = random.sample(range(tokenizer.vocab_size), 2)
    fields = {"allowed_token_ids": stop[:1], "stop_token_ids": stop, "max_tokens": 3}
    r = httpx.post(server.url + path, json=body(path, min_tokens=1, **fields))
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    r = httpx.post(server.url + path, json=body(path, **fields))  # without min_tokens: ends at once
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
