"""The legacy functions API end to end (`functions` / `function_call`, as the README advertises): the answer's
function_call and the function's result (a role "function" message) go back in the history, and the next prompt is
transformers' rendering of the same conversation as tool_calls and a tool message."""

import copy
import json
import random

import httpx
import pytest
from helpers_gate import HANG_S
from helpers_scripted import hf_tokenizer, prefilled, scripted_server

WORDS = ["sun", "rain", "Paris", "São", "中文", "42", "?", "cloudy", "I", "will", "look"]
FUNCTIONS = [{"name": "get_weather", "description": "Current weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with scripted_server(tmp_path_factory.mktemp("legacy")) as served:
        yield served


def words(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))


def answer(client, stream: bool, **kw) -> dict:
    """The assistant message a legacy client keeps from an answer (streamed: rebuilt from its deltas)."""
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
    message = {"role": "assistant", "content": None, "reasoning_content": ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        message["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        if d.function_call is not None:
            message["function_call"] = {"name": d.function_call.name, "arguments": d.function_call.arguments}
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_and_its_result_go_back_as_a_tool_call_and_its_result(setup, tmp_path, stream):
    ckpt, tokenizer, backend, client = setup
    hf = hf_tokenizer(ckpt, tmp_path)
    rng = random.Random()
    thought, city, result, reply = words(rng), words(rng), words(rng), words(rng)
    messages = [{"role": "user", "content": words(rng)}]
    kw = dict(model="tiny", functions=FUNCTIONS, max_tokens=100)

    backend.script = tokenizer.encode(f"{thought}</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                      f"{city}\n</parameter>\n</function>\n</tool_call>")
    turn = answer(client, stream, messages=messages, **kw)
    assert turn["function_call"]["name"] == "get_weather" and "tool_calls" not in turn
    assert json.loads(turn["function_call"]["arguments"]) == {"city": city}

    follow = messages + [turn, {"role": "function", "name": "get_weather", "content": result}]
    sent, r = prefilled(backend, lambda: client.chat.completions.create(messages=follow, **kw),
                        tokenizer.encode(f"Done.</think>\n\n{reply}"))
    assert r.choices[0].message.content == reply and r.choices[0].finish_reason == "stop"

    # the oracle: the same conversation in today's terms, through transformers and the checkpoint's template
    oracle = [messages[0], {"role": "assistant", "content": "", "reasoning_content": thought, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result}]
    expected = hf.apply_chat_template(oracle, tools=[{"type": "function", "function": f} for f in FUNCTIONS],
                                      tokenize=False, add_generation_prompt=True)
    assert sent == hf.encode(expected, add_special_tokens=False), (turn, expected)
    assert f"<parameter=city>\n{city}\n</parameter>" in expected
    assert f"<tool_response>\n{result}\n</tool_response>" in expected


def test_function_call_history_that_cannot_be_rendered_is_a_400_naming_it(setup):
    _, _, _, client = setup
    url = str(client.base_url).removesuffix("/v1/") + "/v1/chat/completions"
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    user = {"role": "user", "content": "weather?"}
    both = {"role": "assistant", "content": None, "function_call": call,
            "tool_calls": [{"id": "c1", "type": "function", "function": call}]}
    bad = {"role": "assistant", "content": None, "function_call": {**call, "arguments": random.choice(["[1]", "{"])}}
    for assistant, param in ((both, "messages[1].function_call"), (bad, "messages[1].function_call.arguments")):
        body = {"model": "tiny", "functions": FUNCTIONS, "max_tokens": 1, "messages": [
            user, copy.deepcopy(assistant), {"role": "function", "name": "get_weather", "content": "sunny"}]}
        r = httpx.post(url, json=body, timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
