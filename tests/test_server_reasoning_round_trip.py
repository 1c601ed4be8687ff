"""The assistant's reasoning in and out, in every form clients use. Chat: under both of vLLM's names,
`reasoning_content` (older vLLM) and `reasoning` (current vLLM), a past turn's reasoning sent under either reaches
the chat template as transformers renders it, and an answer's reasoning comes back under both, whole and streamed,
so a client written for either version reads it. The Responses API: input reasoning items render as the chat
route renders the same turns' reasoning_content."""

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
        got, _ = prefilled(backend, lambda: client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=1))
        assert got == hf.encode(expected, add_special_tokens=False), fields

    # two different reasonings for one turn: which one was meant is unknown
    base = str(client.base_url).removesuffix("/v1/")
    messages = tool_loop(rng, {"reasoning_content": thought, "reasoning": thought + " no"})
    r = httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1},
                   timeout=HANG_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning", r.text


def test_answer_reasoning_comes_under_both_names(setup):
    """The answer's message carries its reasoning under both names (clients of older and current vLLM read one or
    the other); a streamed delta under reasoning_content alone, the widest read, since clients that read both names
    in a delta (the OpenAI Agents SDK) would get the reasoning twice."""
    _, tokenizer, backend, client = setup
    rng = random.Random()
    thought, answer = words(rng), words(rng)
    kw = dict(model="tiny", messages=[{"role": "user", "content": words(rng)}], max_tokens=100)
    backend.script = tokenizer.encode(f"{thought}</think>\n\n{answer}")
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (thought, thought, answer)

    backend.script = tokenizer.encode(f"{thought}</think>\n\n{answer}")
    old, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        old += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        assert getattr(d, "reasoning", None) is None, chunk
    assert (old, content) == (thought, answer)


def test_responses_reasoning_items_render_as_the_chat_turns_reasoning(setup, tmp_path):
    """A tool loop sent to the Responses API with its reasoning items (their text in content parts or a summary)
    prefills the very tokens of the same conversation sent to the chat route with reasoning_content, which are
    transformers' rendering: each reasoning after the last user message inside its turn's <think> block, an
    earlier exchange's left out by the template."""
    ckpt, tokenizer, backend, client = setup
    hf = hf_tokenizer(ckpt, tmp_path)
    rng = random.Random()

    def reasoning_item(text: str) -> dict:  # its text as a summary, or in content parts cut anywhere
        if rng.random() < 0.5:
            return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 3))))
        return {"type": "reasoning", "id": f"rs_{rng.randrange(10 ** 6)}", "summary": [], "content": [
            {"type": "reasoning_text", "text": text[a:b]} for a, b in zip([0] + cuts, cuts + [len(text)])]}

    items, chat, thoughts = [], [], []
    if rng.random() < 0.5:  # an earlier exchange: the template drops its reasoning
        question, thought, answer = words(rng), words(rng), words(rng)
        items += [{"role": "user", "content": question}, reasoning_item(thought),
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}]
        chat += [{"role": "user", "content": question},
                 {"role": "assistant", "content": answer, "reasoning_content": thought}]
    question = words(rng)
    items.append({"role": "user", "content": question})
    chat.append({"role": "user", "content": question})
    for k in range(rng.randint(1, 2)):  # rounds of the tool loop: think, maybe say something, call, get results
        thought, text = words(rng), rng.choice(["", words(rng)])
        thoughts.append(thought)
        calls = [(f"call_{k}_{j}", words(rng)) for j in range(rng.randint(1, 2))]
        items.append(reasoning_item(thought))
        if text:
            items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
        items += [{"type": "function_call", "call_id": cid, "name": "get_weather",
                   "arguments": json.dumps({"city": city})} for cid, city in calls]
        results = [(cid, words(rng)) for cid, _ in calls]
        items += [{"type": "function_call_output", "call_id": cid, "output": out} for cid, out in results]
        chat.append({"role": "assistant", "content": text, "reasoning_content": thought, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
            for cid, city in calls]})
        chat += [{"role": "tool", "tool_call_id": cid, "content": out} for cid, out in results]

    oracle = copy.deepcopy(chat)
    for m in oracle:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    expected = hf.apply_chat_template(oracle, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert expected.count("</think>") == len(thoughts), expected  # the earlier exchange's reasoning is not shown
    for thought in thoughts:
        assert f"<think>\n{thought}\n</think>" in expected

    by_responses, r = prefilled(backend, lambda: client.responses.create(
        model="tiny", input=items, tools=[{"type": "function", **TOOLS[0]["function"]}], max_output_tokens=1))
    by_chat, _ = prefilled(backend, lambda: client.chat.completions.create(
        model="tiny", messages=chat, tools=TOOLS, max_tokens=1))
    assert by_responses == by_chat == hf.encode(expected, add_special_tokens=False), items
    assert r.usage.input_tokens == len(by_responses)


def test_reasoning_tokens_are_counted_to_the_end_of_the_thinking(setup):
    """usage's reasoning tokens (chat's completion_tokens_details, the Responses API's output_tokens_details): the
    output's tokens through its </think>, every one of them (the Responses API lost those whose text the parser held
    back; chat had none), streamed or not; none without thinking."""
    _, tokenizer, backend, client = setup
    rng = random.Random()
    thought, answer = words(rng), words(rng)
    script = tokenizer.encode(f"{thought}</think>\n\n{answer}")
    want = script.index(tokenizer.token_id("</think>")) + 1
    kw = dict(model="tiny", messages=[{"role": "user", "content": words(rng)}], max_tokens=100)
    backend.script = list(script)
    r = client.chat.completions.create(**kw)
    assert r.usage.completion_tokens_details.reasoning_tokens == want and r.usage.completion_tokens == len(script)
    backend.script = list(script)
    last = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == want
    backend.script = list(script)
    r = client.responses.create(model="tiny", input=words(rng), max_output_tokens=100)
    assert r.usage.output_tokens_details.reasoning_tokens == want
    backend.script = tokenizer.encode(answer)
    r = client.chat.completions.create(reasoning_effort="none", **kw)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
