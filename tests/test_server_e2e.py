"""`lily serve` end to end: a real server process on the tiny synthetic checkpoint (reference backend,
CPU), driven by the official openai client. Oracles: the reference backend run directly in this
process (greedy tokens, logprobs) and transformers' tokenizer + chat template (prompt tokens)."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_gate import HANG_S, GateServer
from helpers_http import raw_post, read_all, read_until, sse_lines, status_of
from lily.engine import load_backend
from lily.synthetic import make_synthetic
from test_reliability_support import wait_metrics

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-" + os.urandom(4).hex()
MAX_SEQ = 384
MODEL = "tiny-e2e"
ALIAS = "alias-" + os.urandom(3).hex()  # a second --served-model-name
NO_EOS = {"499": -100, "500": -100}  # the random model would otherwise end at random


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_synthetic("tiny", tmp_path_factory.mktemp("e2e") / "ckpt", seed=random.randrange(1000))


@pytest.fixture(scope="module")
def gates():
    with GateServer() as served:
        yield served


@pytest.fixture(scope="module")
def server(ckpt, gates, tmp_path_factory):
    """`lily serve`, its backend's steps behind the test's gates (open unless a test holds them)."""
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    cmd = [*gates.launcher(), "serve", "--model", str(ckpt), "--port", str(port), "--max-seq", str(MAX_SEQ),
           "--api-key", KEY, "--max-queue", "1", "--max-batch", "1", "--prefix-cache", "4", "--max-body", "65536",
           "--served-model-name", MODEL, ALIAS, "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lily serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"lily serve did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    yield {"base": base, "port": port, "proc": proc, "log": log}
    gates.open()
    proc.terminate()
    try:
        proc.wait(HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def oracle(ckpt, tmp_path_factory):
    from transformers import AutoTokenizer

    backend = load_backend(ckpt, "cpu", "reference")
    # tokenizer files alone: beside a qwen3_5_moe config.json, transformers swaps in its own
    # pre-tokenizer instead of the one tokenizer.json defines
    tok_dir = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(ckpt) / name, tok_dir / name)
    hf = AutoTokenizer.from_pretrained(str(tok_dir))

    class Oracle:
        tok = hf
        eos = {500, 499}

        def greedy(self, ids, n):
            state = backend.new_state()
            logits = backend.prefill(list(ids), state)
            out, lps = [], []
            for _ in range(n):
                t = int(torch.argmax(logits))
                if t in self.eos:
                    break
                out.append(t)
                lps.append(torch.log_softmax(logits.double(), -1))
                if len(out) < n:
                    logits = backend.decode(t, state)
            return out, lps

        def score(self, ids):
            """log-softmax of every position's logits, the reference model in one forward [T, V]."""
            state = backend.new_state()
            return torch.log_softmax(backend.model.forward(torch.tensor(ids), state, logits_for="all").double(), -1)

        def chat_ids(self, messages, **kw):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
            return hf.encode(text, add_special_tokens=False)

        def text(self, ids):
            return hf.decode(ids, skip_special_tokens=True)

    return Oracle()


def split_reasoning(text):
    if "</think>" in text:
        r, c = text.split("</think>", 1)
        return r, c.lstrip("\n")
    return text, ""


def user(text):
    return [{"role": "user", "content": text}]


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert httpx.get(server["base"] + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(server["base"] + "/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_greedy_is_the_models_output_with_usage(client, oracle):
    msgs = user("What is the weather like today?")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    ids = oracle.chat_ids(msgs)
    toks, _ = oracle.greedy(ids, 10)
    reasoning, content = split_reasoning(oracle.text(toks))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(toks)
    assert r.usage.total_tokens == len(ids) + len(toks)
    msg = r.choices[0].message
    assert msg.reasoning_content == reasoning and (msg.content or "") == content
    assert r.choices[0].finish_reason == ("length" if len(toks) == 10 else "stop")


def test_chat_continues_the_final_message_as_vllm_does(client, oracle, server):
    """continue_final_message (an assistant prefill): the prompt is transformers' rendering with
    continue_final_message (the final message left open), the answer its greedy continuation only, streamed the
    same; add_generation_prompt false alone renders no assistant header. Combined with a grammar that holds the
    answer from its start, or with add_generation_prompt true, it is a 400."""
    words = "".join(random.choice("abc xyz") for _ in range(random.randint(4, 12))).strip() or "abc"
    msgs = user("Write something.") + [{"role": "assistant", "content": f"Sure: {words}"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False,
             "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(extra_body=extra, **kw)
    text = oracle.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True, enable_thinking=False)
    ids = oracle.tok.encode(text, add_special_tokens=False)
    toks, _ = oracle.greedy(ids, 8)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(toks)
    assert (r.choices[0].message.content or "") == oracle.text(toks)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, extra_body=extra, **kw) if c.choices)
    assert streamed == (r.choices[0].message.content or "")
    plain = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1,
                                           extra_body={"add_generation_prompt": False})
    bare = oracle.tok.apply_chat_template(user("hi"), tokenize=False, add_generation_prompt=False)
    assert plain.usage.prompt_tokens == len(oracle.tok.encode(bare, add_special_tokens=False))
    auth = {"Authorization": f"Bearer {KEY}"}
    for more, param in (({"response_format": {"type": "json_object"}}, "continue_final_message"),
                        ({"add_generation_prompt": True}, "add_generation_prompt")):
        bad = httpx.post(server["base"] + "/v1/chat/completions", headers=auth,
                         json={"model": MODEL, "messages": msgs, "continue_final_message": True, **more})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_stream_equals_non_stream_and_reports_usage(client):
    kw = dict(model=MODEL, messages=user("Tell me a story."), max_tokens=12, temperature=0.9, seed=11,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_token_ids_and_logprobs(client, oracle):
    prompt = [random.randrange(498) for _ in range(12)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    toks, lps = oracle.greedy(prompt, 8)
    assert r.choices[0].text == oracle.text(toks)
    got = r.choices[0].logprobs
    assert len(got.token_logprobs) == len(toks)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        assert abs(got.token_logprobs[i] - float(lp[t])) < 1e-3
        top = got.top_logprobs[i]  # keyed by text: tokens that decode alike share a key
        assert 1 <= len(top) <= 3 and abs(max(top.values()) - float(lp.max())) < 1e-3
    assert r.usage.prompt_tokens == len(prompt)


def test_echo_with_logprobs_scores_the_prompt(client, oracle):
    """The legacy scoring call (lm-eval's loglikelihood): echo + logprobs returns each prompt token's
    log-probability given the tokens before it (the first has none), then the generated tokens'."""
    prompt = [random.randrange(498) for _ in range(random.randint(6, 14))]
    logp = oracle.score(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    got = r.choices[0].logprobs
    assert r.choices[0].text == oracle.text(prompt) and r.usage.completion_tokens == 0
    assert len(got.token_logprobs) == len(prompt) and got.token_logprobs[0] is None and got.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(got.token_logprobs[i] - float(logp[i - 1, prompt[i]])) < 1e-3, i
        assert abs(max(got.top_logprobs[i].values()) - float(logp[i - 1].max())) < 1e-3, i
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    # then generation continues after the prompt: its tokens follow the prompt's entries
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0)
    toks, lps = oracle.greedy(prompt, 3)  # may end early, at an end-of-text token, as the server does
    got = r.choices[0].logprobs
    assert len(got.token_logprobs) == len(prompt) + len(toks)
    assert r.choices[0].text == oracle.text(prompt) + oracle.text(toks)
    for j, t in enumerate(toks):
        assert abs(got.token_logprobs[len(prompt) + j] - float(lps[j][t])) < 1e-3
    assert abs(got.token_logprobs[len(prompt) - 1] - float(logp[len(prompt) - 2, prompt[-1]])) < 1e-3
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == got.token_logprobs


def test_text_offsets_count_characters_when_tokens_split_them(client, oracle):
    """Legacy logprobs' text_offset is each token's start in the choice's text, in characters: the byte pieces of
    one UTF-8 character sit at its start (transformers' decoding of the tokens before it, the unfinished character
    left out); streamed and not, echoed prompt and generated tokens alike."""
    text = "".join(random.choice(["日", "本", "語", "😀", "é", " ok", "x", "中"]) for _ in range(random.randint(4, 12)))
    ids = oracle.tok.encode(text, add_special_tokens=False)
    toks, _ = oracle.greedy(ids, 5)
    everything = ids + toks
    want = [len(oracle.text(everything[:i]).rstrip("\ufffd")) for i in range(len(everything))]
    assert any(a == b for a, b in zip(want, want[1:])), "no token split a character"  # the case under test
    kw = dict(model=MODEL, prompt=text, max_tokens=5, echo=True, logprobs=0, temperature=0)
    r = client.completions.create(**kw)
    assert r.choices[0].text == text + oracle.text(toks)
    assert r.choices[0].logprobs.text_offset == want
    streamed = [o for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == want


def test_tokenize_and_detokenize_agree_with_the_tokenizer_and_usage(server, client, oracle):
    auth = {"Authorization": f"Bearer {KEY}"}
    base = server["base"]
    text = "".join(random.choice("abc xyz,.!\u00e9\u4e2d") for _ in range(random.randint(5, 40)))
    r = httpx.post(base + "/tokenize", headers=auth, json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == oracle.tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_SEQ
    msgs = user(text)
    r = httpx.post(base + "/tokenize", headers=auth, json={"model": MODEL, "messages": msgs}).json()
    assert r["tokens"] == oracle.chat_ids(msgs)
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert r["count"] == used
    ids = [random.randrange(len(oracle.tok)) for _ in range(8)]  # control tokens too: kept, as vLLM's
    r = httpx.post(base + "/detokenize", headers=auth, json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": oracle.tok.decode(ids, skip_special_tokens=False)}
    ids = oracle.chat_ids(msgs)
    r = httpx.post(base + "/detokenize", headers=auth, json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": oracle.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)}
    r = httpx.post(base + "/detokenize", headers=auth, json={"model": MODEL, "tokens": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401


def test_responses_api_is_the_chat_answer_in_output_items(client, oracle):
    """POST /v1/responses through the official client: greedy output equals the reference's tokens split
    as reasoning and text; the stream's events rebuild the same response; function-call items render the
    prompt a chat request with tool_calls would."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"Why {random.randrange(99)}?"}]
    ids = oracle.chat_ids(msgs)
    toks, _ = oracle.greedy(ids, 9)
    reasoning, content = split_reasoning(oracle.text(toks))
    r = client.responses.create(model=MODEL, instructions="be brief", input=msgs[1]["content"], max_output_tokens=9,
                                temperature=0)
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(toks)
    assert r.status == ("incomplete" if len(toks) == 9 else "completed")
    reasoning_items = [o for o in r.output if o.type == "reasoning"]
    assert "".join(c.text for o in reasoning_items for c in o.content) == reasoning
    assert r.output_text == content
    events = list(client.responses.create(model=MODEL, instructions="be brief", input=msgs[1]["content"],
                                          max_output_tokens=9, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response." + r.status
    streamed = events[-1].response
    assert [o.model_dump(exclude={"id"}) for o in streamed.output] == [o.model_dump(exclude={"id"}) for o in r.output]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == content
    # (no tool list: the template's tool preamble alone outgrows this server's short context)
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    r = client.responses.create(model=MODEL, input=turn, max_output_tokens=1)
    chat_turn = [turn[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=chat_turn)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    rendered = oracle.chat_ids([chat_turn[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        chat_turn[2]])
    assert r.usage.input_tokens == len(rendered)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"


def test_min_tokens_and_ignore_eos_hold_off_the_end_of_text(client):
    eos_first = {k: 100 for k in NO_EOS}  # the end-of-text tokens win every draw unless held off
    kw = dict(model=MODEL, prompt=[random.randrange(498) for _ in range(6)], max_tokens=5, logit_bias=eos_first)
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(extra_body={"min_tokens": 3}, **kw)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    msgs = user("hi")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, logit_bias=eos_first,
                                       extra_body={"min_tokens": 2})
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "stop"


def test_chat_logprobs(client, oracle):
    msgs = user("Count: 1 2 3")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    toks, lps = oracle.greedy(oracle.chat_ids(msgs), 5)
    content = r.choices[0].logprobs.content
    assert len(content) == len(toks)
    for entry, t, lp in zip(content, toks, lps):
        assert abs(entry.logprob - float(lp[t])) < 1e-3 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string_across_tokens(client, oracle):
    for _ in range(20):  # a prompt the random model answers with some text before an end-of-text
        prompt = [random.randrange(498) for _ in range(10)]
        toks, _ = oracle.greedy(prompt, 16)
        text = oracle.text(toks)
        if len(text) >= 6:
            break
    else:
        raise AssertionError("20 prompts all ended too early for a stop string")
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == expected


def test_max_tokens_and_seed_determinism(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, max_tokens=8)
    a = client.completions.create(seed=5, **kw)
    b = client.completions.create(seed=5, **kw)
    c = client.completions.create(seed=6, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text or a.usage.completion_tokens < 3
    assert a.usage.completion_tokens <= 8
    if a.usage.completion_tokens == 8:
        assert a.choices[0].finish_reason == "length"


def test_n_choices_follow_seed_plus_index_and_count_the_prompt_once(server, client):
    seed = random.randrange(1 << 30)
    kw = dict(model=MODEL, messages=user(f"Name {seed} colours."), max_tokens=6, temperature=1.0, logit_bias=NO_EOS,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reused = metric(server, "lily_prefix_cache_tokens_total")
    many = client.chat.completions.create(n=3, seed=seed, logprobs=True, top_logprobs=1, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    # the first choice snapshots the prompt but its last token: the other two prefill one token each
    reused = metric(server, "lily_prefix_cache_tokens_total") - reused
    assert reused == 2 * (many.usage.prompt_tokens - 1)
    for i, choice in enumerate(many.choices):  # choice i is what a single request with seed + i answers
        one = client.chat.completions.create(seed=seed + i, **kw).choices[0]
        assert choice.message.content == one.message.content and choice.finish_reason == one.finish_reason == "length"
        assert len(choice.logprobs.content) == 6
    assert len({c.message.content for c in many.choices}) > 1  # three random 6-token answers: never all alike
    single = client.chat.completions.create(seed=seed, **kw)
    assert many.usage.prompt_tokens == single.usage.prompt_tokens and many.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(n=3, seed=seed, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    for i, choice in enumerate(many.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and [m.finish_reason for m in mine][-1] == "length"
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
    assert chunks[-1].usage.completion_tokens == 18 and len({c.id for c in chunks}) == 1


def test_a_batch_of_prompts_is_each_prompts_greedy_output(client, oracle):
    prompts = [[random.randrange(498) for _ in range(random.randint(3, 9))] for _ in range(3)]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0, echo=True)
    assert [c.index for c in r.choices] == list(range(6))
    for p, prompt in enumerate(prompts):  # choice p * n + j is prompt p's
        toks, _ = oracle.greedy(prompt, 5)
        for j in range(2):
            assert r.choices[2 * p + j].text == oracle.text(prompt) + oracle.text(toks)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    texts = ["The sky is", "Once"]
    streamed = {}
    for c in client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0, stream=True):
        streamed[c.choices[0].index] = streamed.get(c.choices[0].index, "") + c.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0)
    assert streamed == {c.index: c.text for c in whole.choices} and len(streamed) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=6, max_tokens=2)
    assert e.value.body["param"] == "n"


def test_thinking_on_and_off(client, oracle):
    msgs = user("Hello there!")
    visible = {"extra_body": {"logit_bias": {**NO_EOS, "501": -100, "505": -100}}}  # some reasoning text, surely
    on = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, **visible)
    off = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    toks_off, _ = oracle.greedy(oracle.chat_ids(msgs, enable_thinking=False), 6)
    assert off.usage.prompt_tokens == len(oracle.chat_ids(msgs, enable_thinking=False))
    assert off.choices[0].message.content == oracle.text(toks_off)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert on.usage.prompt_tokens == len(oracle.chat_ids(msgs))
    assert on.choices[0].message.reasoning_content  # the prompt opened <think>: the words are reasoning
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 **visible))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == on.choices[0].message.reasoning_content
    # reasoning_effort: none and minimal render the no-thinking prompt; an explicit enable_thinking wins
    for effort, kwargs, thinking in (("minimal", None, False), ("none", None, False), ("high", None, True),
                                     ("low", {"enable_thinking": False}, False)):
        extra = {"reasoning_effort": effort, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == len(oracle.chat_ids(msgs, enable_thinking=thinking)), effort


def test_follow_up_turn_reuses_cached_prefix_with_cold_identical_output(client, oracle):
    first = user("Please write a short story about a robot.")
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0,
                                        extra_body={"prompt_cache_key": "conv-1"})
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    follow = first + [{"role": "assistant", "content": r1.choices[0].message.content or "",
                       "reasoning_content": r1.choices[0].message.reasoning_content},
                      {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0,
                                        extra_body={"prompt_cache_key": "conv-1"})
    cached = r2.usage.prompt_tokens_details.cached_tokens
    ids = oracle.chat_ids(follow)
    assert 0 < cached < len(ids) and r2.usage.prompt_tokens == len(ids)
    assert ids[:cached] == oracle.chat_ids(first)[:cached]
    toks, _ = oracle.greedy(ids, 8)  # the cold run
    reasoning, content = split_reasoning(oracle.text(toks))
    assert r2.choices[0].message.reasoning_content == reasoning and (r2.choices[0].message.content or "") == content


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, oracle):
    """vLLM's return_tokens_as_token_ids: every logprobs token (chosen and alternatives, chat and completions,
    streamed or not) is "token_id:N" for the token drawn, so a client can read the ids back exactly."""
    ids = [random.randrange(498) for _ in range(random.randrange(4, 20))]
    toks, lps = oracle.greedy(ids, 4)
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(toks), temperature=0, logprobs=2,
                                  extra_body=extra)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in toks]
    assert [max(top, key=top.get) for top in lp.top_logprobs] == lp.tokens
    streamed = [t for c in client.completions.create(model=MODEL, prompt=ids, max_tokens=len(toks), temperature=0,
                                                    logprobs=1, stream=True, extra_body=extra)
                if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    msgs = user("Name a colour.")
    toks, _ = oracle.greedy(oracle.chat_ids(msgs), 3)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=len(toks), temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body=extra)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in toks]
    assert all(c.top_logprobs[0].token == c.token for c in content)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_completions_top_logprobs_always_hold_the_chosen_token(client, oracle, k):
    """The legacy API's top_logprobs hold the k best and the token chosen (OpenAI's "up to logprobs + 1" and vLLM's),
    for sampled tokens far from the top and for an echoed prompt's tokens (labels as token ids: distinct keys)."""
    ids = [random.randrange(498) for _ in range(random.randrange(4, 12))]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=2.0, logprobs=k, echo=True,
                                  seed=random.randrange(1 << 30),
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = r.choices[0].logprobs
    logp = oracle.score(ids)
    for i, (tok, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        if i == 0:
            assert top is None
            continue
        assert top[tok] == value and len(top) <= k + 1, (i, tok, top)
        best = sorted(top.values(), reverse=True)[:k]
        if i < len(ids):  # the prompt's: the k best of the model's distribution
            want = sorted(logp[i - 1].tolist(), reverse=True)[:k]
            assert all(abs(a - b) < 1e-3 for a, b in zip(best, want)), (i, best, want)


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(client, oracle):
    """vLLM's truncate_prompt_tokens: the model sees only the prompt's last k tokens (the greedy text of that
    shorter prompt, its usage), in completions and in chat; -1 keeps a prompt that fits; 0 is a 400."""
    ids = [random.randrange(498) for _ in range(random.randrange(12, 30))]
    k = random.randrange(2, len(ids) - 1)
    toks, _ = oracle.greedy(ids[-k:], 4)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": k})
    assert r.choices[0].text == oracle.text(toks) and r.usage.prompt_tokens == k
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == len(ids)
    msgs = user("Please tell me a long story about the sea.")
    full = oracle.chat_ids(msgs)
    k = random.randrange(3, len(full) - 1)
    toks, _ = oracle.greedy(full[-k:], 3)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"truncate_prompt_tokens": k})
    reasoning, content = split_reasoning(oracle.text(toks))
    m = r.choices[0].message
    assert r.usage.prompt_tokens == k and (m.reasoning_content, m.content or "") == (reasoning, content)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_more_served_names_are_listed_and_answered_under_the_first(client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    r = client.completions.create(model=ALIAS, prompt="hi", max_tokens=1)
    assert r.model == MODEL


def test_completions_prompt_sent_again_is_served_from_the_cache(client, oracle):
    """The same completions prompt twice: the second reuses every prompt token (the snapshot keeps the logits
    after the prompt) and its greedy text is still the cold run's."""
    ids = [random.randrange(498) for _ in range(random.randrange(5, 30))]
    toks, _ = oracle.greedy(ids, 6)
    runs = [client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0) for _ in range(2)]
    assert [r.choices[0].text for r in runs] == [oracle.text(toks)] * 2
    assert [r.usage.prompt_tokens_details.cached_tokens for r in runs] == [0, len(ids)]


def metric(server, name):
    text = httpx.get(server["base"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def wait_metric(server, name, predicate, what):
    return wait_metrics(server["base"], lambda m: predicate(m[name]), what, api_key=KEY)[name]


def completion_body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 300, "temperature": 1.0,
                       "logit_bias": NO_EOS, **kw}).encode()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_stops_generation_at_its_next_step_then_serves(server, gates, client, stream):
    """A client that leaves (a stream that has begun, or a request waiting for its whole answer) while
    its generation is held at decode step k + 1: once the server has noticed, the held step is the
    last one; the generation never runs on toward max_tokens."""
    auth = {"Authorization": f"Bearer {KEY}"}
    cancelled = metric(server, "lily_requests_cancelled_total")
    decoded = metric(server, "lily_decode_tokens_total")
    left = metric(server, "lily_client_disconnects_total")
    k = random.randint(1, 6)
    with gates.decode.held() as decode:
        start = decode.passed
        decode.allow(k)
        s = raw_post(server["port"], completion_body(stream=stream, seed=k), "/v1/completions", headers=auth)
        decode.wait_for(lambda g: g.passed == start + k and g.waiting, f"decode step {k + 1}")
        if stream:
            assert status_of(read_until(s, b"\r\n\r\n")) == 200  # the stream has begun
        s.close()
        wait_metric(server, "lily_client_disconnects_total", lambda v: v > left, "the server to see the client leave")
    wait_metric(server, "lily_requests_cancelled_total", lambda v: v > cancelled, "the generation to stop")
    assert decode.passed - start == k + 1, "decode steps ran after the client left"
    assert metric(server, "lily_decode_tokens_total") - decoded == k + 1
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_error_statuses(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=user("x"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=2, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=MAX_SEQ)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], max_tokens=2)
    assert "messages[0].content[0].type" in e.value.body["message"]
    auth = {"Authorization": f"Bearer {KEY}"}
    base = server["base"]
    r = httpx.post(base + "/v1/chat/completions", headers=auth, content=b"{" + b" " * 70000 + b"}")
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert httpx.delete(base + "/v1/completions", headers=auth).status_code == 405
    assert httpx.get(base + "/v1/unknown", headers=auth).json()["error"]["type"] == "not_found_error"
    assert httpx.post(base + "/v1/completions", headers=auth, content=b"{nope").status_code == 400


def test_queue_full_is_429(server, gates):
    auth = {"Authorization": f"Bearer {KEY}"}
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    waiting = []
    t = threading.Thread(target=lambda: waiting.append(
        httpx.post(server["base"] + "/v1/completions", headers=auth, json=short, timeout=HANG_S)))
    with gates.decode.held() as decode:
        running = raw_post(server["port"], completion_body(stream=True), "/v1/completions", headers=auth)
        decode.wait_waiting()  # it runs, and cannot finish
        t.start()
        wait_metric(server, "lily_queue_depth", lambda v: v == 1, "a request queued")  # max-queue 1: now full
        r = httpx.post(server["base"] + "/v1/completions", headers=auth, json=short)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1  # when to try again, as clients (the openai SDK) read it
        running.close()
    t.join(HANG_S)
    assert waiting and waiting[0].status_code == 200
    assert httpx.get(server["base"] + "/health").status_code == 200


random_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=8), x, max_size=3),
                           max_leaves=8)
fields = st.sampled_from(["messages", "prompt", "max_tokens", "temperature", "stop", "logprobs", "top_logprobs", "n",
                          "tools", "tool_choice", "seed", "stream", "top_k", "model"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.dictionaries(fields, random_json, max_size=5).map(lambda d: {"model": MODEL, "max_tokens": 2, **d}))
def test_random_bodies_never_5xx(server, path, body):
    r = httpx.post(server["base"] + path, headers={"Authorization": f"Bearer {KEY}"}, content=json.dumps(body), timeout=HANG_S)
    assert r.status_code < 500, r.text
    assert httpx.get(server["base"] + "/health").status_code == 200


def test_metrics_count_the_traffic(server, client):
    before = {name: metric(server, name) for name in (
        "lily_prefix_cache_hits_total", "lily_prefix_cache_tokens_total", "lily_completion_tokens_total",
        'lily_requests_total{endpoint="/v1/chat/completions",status="200"}')}
    prompt = [random.randrange(498) for _ in range(random.randint(5, 12))]
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logit_bias=NO_EOS)
    b = client.completions.create(model=MODEL, prompt=prompt + [random.randrange(498)], max_tokens=2,
                                  logit_bias=NO_EOS)  # the first one's prompt is cached: a strict prefix
    c = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
    assert metric(server, "lily_prefix_cache_hits_total") - before["lily_prefix_cache_hits_total"] >= 1
    assert metric(server, "lily_prefix_cache_tokens_total") - before["lily_prefix_cache_tokens_total"] >= len(prompt)
    assert (metric(server, "lily_completion_tokens_total") - before["lily_completion_tokens_total"]
            == a.usage.completion_tokens + b.usage.completion_tokens + c.usage.completion_tokens)
    chat_ok = 'lily_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert metric(server, chat_ok) - before[chat_ok] == 1
    assert metric(server, "lily_decode_tokens_per_second") > 0
    log = server["log"].read_text()
    assert "POST /v1/chat/completions 200" in log and KEY not in log


def test_sigterm_during_a_stream_exits_promptly(server, gates):  # last: it stops the module's server
    """A stream that cannot end by itself (held at a decode step) and one queued behind it: on SIGTERM
    both end with a final `cancelled` chunk and [DONE] once the grace is over, and the process exits 0."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with gates.decode.held() as decode:
        running = raw_post(server["port"], completion_body(stream=True), "/v1/completions", headers=auth)
        decode.wait_waiting()
        queued = raw_post(server["port"], completion_body(stream=True), "/v1/completions", headers=auth)
        wait_metric(server, "lily_queue_depth", lambda v: v == 1, "a request queued")
        server["proc"].terminate()
        ends = [sse_lines(read_all(queued))]  # the shutdown cancels the queued one after the grace...
        decode.open()  # ...and the running one (marked cancelled by then) at its next step
        ends.append(sse_lines(read_all(running)))
    for lines in ends:
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "cancelled"
    assert server["proc"].wait(HANG_S) == 0
