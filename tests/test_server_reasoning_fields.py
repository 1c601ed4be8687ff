"""The assistant's reasoning under both of vLLM's names: `reasoning_content` (older vLLM) and `reasoning` (current
vLLM). A past turn's reasoning sent under either reaches the chat template as transformers renders it; an answer's
reasoning comes back under both, whole and streamed, so a client written for either version reads it."""

import copy
import json
import random

import httpx
import pytest
from helpers_gate import HANG_S
from helpers_scripted import hf_tokenizer, prefilled, scripted_server

WORDS = ["sun", "rain", "Paris", "São", "中文", "42", "?", "so", "I", "should", "call"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with scripted_server(tmp_path_factory.mktemp("reasoning")) as served:
        yield served


def words(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))


def tool_loop(rng, reasoning: dict) -> list[dict]:
    """A user asks, the assistant thinks (`reasoning`: its fields) and calls a tool, the tool answers: the
    template keeps that turn's reasoning, since no user message follows it."""
    city = words(rng)
    return [{"role": "user", "content": words(rng)},
            {"role": "assistant", "content": rng.choice(["", None]), **reasoning, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": words(rng)}]


def test_history_reasoning_under_either_name_renders_as_transformers_does(setup, tmp_path):
    ckpt, tokenizer, backend, client = setup
    hf = hf_tokenizer(ckpt, tmp_path)
    rng = random.Random()
    thought = words(rng)
    for fields in ({"reasoning_content": thought}, {"reasoning": thought},
                   {"reasoning_content": thought, "reasoning": thought}):  # as an answer's message comes back
        messages = tool_loop(rng, fields)
        oracle = copy.deepcopy(messages)  # what the template reads: reasoning_content, arguments as a mapping
        for key in ("reasoning_content", "reasoning"):
            oracle[1].pop(key, None)
        oracle[1]["reasoning_content"] = thought
        oracle[1]["tool_calls"][0]["function"]["arguments"] = json.loads(messages[1]["tool_calls"][0]["function"]["arguments"])
        expected = hf.apply_chat_template(oracle, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert f"<think>\n{thought}\n</think>" in expected  # the template shows this turn's reasoning
        got = prefilled(backend, lambda: client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=1))
        assert got == hf.encode(expected, add_special_tokens=False), fields

    # two different reasonings for one turn: which one was meant is unknown
    base = str(client.base_url).removesuffix("/v1/")
    messages = tool_loop(rng, {"reasoning_content": thought, "reasoning": thought + " no"})
    r = httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1},
                   timeout=HANG_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning", r.text


def test_answer_reasoning_comes_under_both_names(setup):
    _, tokenizer, backend, client = setup
    rng = random.Random()
    thought, answer = words(rng), words(rng)
    kw = dict(model="tiny", messages=[{"role": "user", "content": words(rng)}], max_tokens=100)
    backend.script = tokenizer.encode(f"{thought}</think>\n\n{answer}")
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (thought, thought, answer)

    backend.script = tokenizer.encode(f"{thought}</think>\n\n{answer}")
    old, new, content = "", "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        old += getattr(d, "reasoning_content", None) or ""
        new += getattr(d, "reasoning", None) or ""
        content += d.content or ""
        assert getattr(d, "reasoning_content", None) == getattr(d, "reasoning", None), chunk  # in the same chunks
    assert (old, new, content) == (thought, thought, answer)
