"""The Responses API pieces without a model: a Responses request becomes the chat request that renders
the same prompt, and the assembler's output items and stream events (replayed the way a client does)
agree with each other whatever the order of reasoning, text and tool calls. Then the route itself, over the demo
tokenizer and a stand-in backend (random fixed logits): its answers and events hold to the openai SDK's types,
the request fields it echoes, truncation, and its 400s."""

from __future__ import annotations

import json
import random

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from helpers_standin import FixedLogitsBackend as FixedBackend
from lily.demo_tokenizer import write_tokenizer_files
from lily.server.app import ServerSettings, create_app
from lily.server.chat_parsing import ParsedDelta, ParsedToolCall
from lily.server.errors import APIError
from lily.server.protocol import ResponsesRequest
from lily.server.responses_api import ResponseAssembler, chat_request_from
from lily.tokenizer import Tokenizer


def body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_input_items_become_the_equivalent_chat_messages():
    b = body(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "developer", "content": "answer in French"}],
        tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "weather"}, reasoning={"effort": "minimal"})
    chat = chat_request_from(b)
    got = [(m.role, m.content, [c.function.name for c in getattr(m, "tool_calls", None) or []]) for m in chat.messages]
    assert got == [("system", "be brief", []), ("user", "weather in Paris?", []),
                   ("assistant", "Let me look.", ["weather", "time"]), ("tool", "sunny", []),
                   ("developer", "answer in French", [])]
    assert chat.messages[3].tool_call_id == "c1"
    assert [t.function.name for t in chat.tools] == ["weather"] and chat.tool_choice.function.name == "weather"
    assert chat.reasoning_effort == "minimal"
    assert chat_request_from(body(reasoning={"effort": "high"})).reasoning_effort == "high"
    assert chat_request_from(body()).reasoning_effort is None  # the server's default


def test_function_output_parts_become_one_tool_message_of_their_text():
    rng = random.Random()
    pieces = ["".join(rng.choice("ab \n{}é") for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 4))]
    b = body(input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1",
                     "output": [{"type": "input_text", "text": p} for p in pieces]}])
    tool = chat_request_from(b).messages[-1]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "c1", "".join(pieces))


def test_reasoning_items_become_the_reasoning_of_the_turn_they_open():
    """A reasoning item's text (its content parts joined, else its summary's paragraphs) is the reasoning_content of
    the assistant turn its message or function_call items make; an item with no text (encrypted, empty) adds
    nothing; one that nothing of its turn follows (a turn cut short) is an assistant turn of its own."""
    rng = random.Random()

    def word() -> str:
        return "".join(rng.choice("ab é\n") for _ in range(rng.randint(1, 8)))

    def call(call_id: str) -> dict:
        return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}

    thought, summary, both, alone = word(), [word() for _ in range(rng.randint(1, 3))], word(), word()
    cuts = sorted(rng.sample(range(1, len(thought)), min(len(thought) - 1, rng.randint(0, 3))))
    parts = [thought[a:b] for a, b in zip([0] + cuts, cuts + [len(thought)])]
    b = body(input=[
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": p} for p in parts]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call("c1"),
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in summary]},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        call("c2"), call("c3"),
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "not this"}],
         "content": [{"type": "reasoning_text", "text": both}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": alone}]},
        {"role": "user", "content": "and?"}])
    got = [(m.role, m.content, getattr(m, "reasoning_content", None),
            [c.function.name for c in getattr(m, "tool_calls", None) or []]) for m in chat_request_from(b).messages]
    assert got == [("user", "q", None, []), ("assistant", "Let me look.", thought, ["f"]), ("tool", "sunny", None, []),
                   ("assistant", "", "\n\n".join(summary), ["f", "f"]), ("tool", "rain", None, []),
                   ("assistant", "", both + "\n\n" + alone, []), ("user", "and?", None, [])]


@pytest.mark.parametrize("fields,param", [
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "reasoning"}]}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        chat_request_from(body(**fields))
    assert e.value.status == 400 and e.value.param == param


def replay(events: list[dict]) -> list[dict]:
    """The output a client rebuilds from the stream alone."""
    items: dict[int, dict] = {}
    for ev in events:
        i = ev.get("output_index")
        if ev["type"] == "response.output_item.added":
            items[i] = ev["item"] | {"text": "", "arguments": ev["item"].get("arguments", "")}
        elif ev["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[i]["text"] += ev["delta"]
        elif ev["type"] == "response.function_call_arguments.delta":
            items[i]["arguments"] += ev["delta"]
        elif ev["type"] == "response.output_item.done":
            done = ev["item"]
            text = done["content"][0]["text"] if "content" in done else None
            assert text is None or text == items[i]["text"]
            assert done.get("arguments", items[i]["arguments"]) == items[i]["arguments"]
            items[i] = done
    return [items[i] for i in sorted(items)]


def test_stream_events_rebuild_the_final_output_in_order():
    rng = random.Random()
    a = ResponseAssembler(body(stream=True), "m")
    events = a.start()
    expected = []  # (kind, text) runs, merged as the assembler merges them
    for _ in range(rng.randint(3, 12)):
        kind = rng.choice(["reasoning", "content", "call"])
        if kind == "call":
            call = ParsedToolCall(name=f"f{rng.randrange(9)}", arguments=json.dumps({"x": rng.randrange(99)}))
            events += a.feed(ParsedDelta(tool_calls=[call]))
            expected.append(("function_call", call.arguments))
            continue
        text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 6)))
        events += a.feed(ParsedDelta(**{kind: text}))
        item_type = "reasoning" if kind == "reasoning" else "message"
        if expected and expected[-1][0] == item_type:
            expected[-1] = (item_type, expected[-1][1] + text)
        else:
            expected.append((item_type, text))
    usage = {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}
    events += a.finish(rng.choice(["stop", "length"]), usage)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[0]["type"] == "response.created" and final["usage"] == usage
    assert final["output"] == a.response["output"] == replay(events)
    got = [(o["type"], o["arguments"] if o["type"] == "function_call" else o["content"][0]["text"])
           for o in final["output"]]
    assert got == expected
    if final["status"] == "incomplete":
        assert events[-1]["type"] == "response.incomplete"
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert events[-1]["type"] == "response.completed" and final["incomplete_details"] is None
    assert len({o["id"] for o in final["output"]}) == len(final["output"])


def test_a_failed_response_ends_the_stream_with_its_error():
    a = ResponseAssembler(body(stream=True), "m")
    events = a.start() + a.feed(ParsedDelta(content="partial"))
    events += a.fail("cancelled", "the server is shutting down")
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "cancelled", "message": "the server is shutting down"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_instructions_and_leading_system_messages_are_one_system_message():
    """Instructions and a developer message before the conversation (a Codex-style request) render as one system
    message, the texts a blank line apart: Qwen's template refuses a system message after the first. A system
    message later in the conversation stays where it is."""
    from lily.server.chat_prompt import template_messages

    rng = random.Random()
    texts = ["".join(rng.choice("ab \né") for _ in range(rng.randint(1, 8))) for _ in range(3)]
    chat = chat_request_from(body(instructions=texts[0], input=[
        {"role": "developer", "content": texts[1]}, {"role": "system", "content": texts[2]},
        {"role": "user", "content": "hi"}, {"role": "developer", "content": "later"}]))
    got = [(m["role"], m["content"]) for m in template_messages(chat)]
    assert got == [("system", "\n\n".join(texts)), ("user", "hi"), ("system", "later")]
    alone = chat_request_from(body(instructions=texts[0]))
    assert [(m["role"], m["content"]) for m in template_messages(alone)] == [("system", texts[0]), ("user", "hi")]


# -- the route, over the demo tokenizer and a stand-in backend ------------------------------------------------

MODEL = "tiny"
MAX_SEQ = 1024


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tokenizer = Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))
    seed = random.randrange(2 ** 31)
    print("seed", seed)
    logits = torch.randn(tokenizer.vocab_size, generator=torch.Generator().manual_seed(seed))
    app = create_app(FixedBackend(logits), tokenizer, ServerSettings(model_name=MODEL, max_seq=MAX_SEQ))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def sdk_response(data: dict):
    """The answer as the openai SDK's Response type, validated (the SDK's own parse does not validate)."""
    from openai.types.responses import Response
    return TypeAdapter(Response).validate_python(data)


def sdk_event(data: dict):
    """A stream event as the openai SDK's type of its kind, validated."""
    import typing

    from openai.types.responses import ResponseStreamEvent
    for kind in typing.get_args(typing.get_args(ResponseStreamEvent)[0]):
        if kind.model_fields["type"].annotation == typing.Literal[data["type"]]:
            return TypeAdapter(kind).validate_python(data)
    raise AssertionError(f"no SDK event type {data['type']!r}")


def stream_events(client, body: dict) -> list[dict]:
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    for ev in events:
        sdk_event(ev)
    return events


def request(**fields) -> dict:
    return {"model": MODEL, "input": random.choice(["alpha beta", "gamma", "delta epsilon zeta"]),
            "max_output_tokens": random.randint(1, 4), "reasoning": {"effort": "none"}, **fields}


def test_usage_holds_to_the_sdk_s_type_streamed_or_not(client):
    """usage.input_tokens_details.cache_write_tokens, which the SDK's ResponseUsage requires, is there (0: lily
    does not count what its prefix cache keeps) in the answer and in the stream's final event."""
    body = request()
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    usage = sdk_response(r.json()).usage
    assert usage.input_tokens_details.cache_write_tokens == 0 and usage.input_tokens > 0
    final = stream_events(client, body)[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert final["response"]["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


def test_an_assistant_refusal_part_is_the_turn_s_text(client):
    """An assistant message's refusal part (as OpenAI returns it, sent back in the history) is that turn's text, as
    in chat: the prompt is the plain text's (it was a 400)."""
    said = f"I can't help with that ({random.randrange(10 ** 6)})."
    parts = [{"type": "refusal", "refusal": said}]
    if random.random() < 0.5:
        parts.append({"type": "output_text", "text": " But ask me another."})
    as_text = "".join(p.get("refusal") or p.get("text") for p in parts)

    def turn(content) -> list[dict]:
        return [{"role": "user", "content": "help"}, {"type": "message", "role": "assistant", "content": content},
                {"role": "user", "content": "why?"}]

    assert chat_request_from(body(input=turn(parts))).messages[1].content == as_text
    r = client.post("/v1/responses", json=request(input=turn(parts)))
    assert r.status_code == 200, r.text
    plain = client.post("/v1/responses", json=request(input=turn(as_text)))
    assert sdk_response(r.json()).usage.input_tokens == sdk_response(plain.json()).usage.input_tokens


def test_an_empty_input_list_says_it_needs_an_item(client):
    """input: [] read 'Input should be a valid string', as if a list were not allowed: it says the list is short."""
    r = client.post("/v1/responses", json=request(input=[]))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input" and "at least 1 item" in err["message"], r.text
    assert "valid string" not in err["message"]


def random_word(rng) -> str:
    return "".join(rng.choice("abcdefgh é") for _ in range(rng.randint(1, 10)))


def test_request_fields_are_echoed_as_openai_s_response_carries_them(client):
    """metadata, user, safety_identifier, prompt_cache_key and text.verbosity come back as sent (they were
    dropped); service_tier as 'default', the one way lily serves; reasoning.summary as null, since lily writes no
    summaries (a client's 'auto', as the Agents SDK and Codex send, is served); truncation as sent. The answer and
    the stream's response events alike."""
    rng = random.Random()
    metadata = {random_word(rng)[:64]: random_word(rng) for _ in range(rng.randint(0, 16))}
    fields = {"metadata": metadata, "user": random_word(rng), "safety_identifier": random_word(rng),
              "prompt_cache_key": random_word(rng), "text": {"verbosity": rng.choice(["low", "medium", "high"])},
              "service_tier": rng.choice(["auto", "default", "flex", "priority"]),
              "reasoning": {"effort": "none", "summary": rng.choice(["auto", "concise", "detailed", None])},
              "truncation": rng.choice(["auto", "disabled"])}
    r = client.post("/v1/responses", json=request(**fields))
    assert r.status_code == 200, r.text
    stream = stream_events(client, request(**fields))
    for got in [r.json()] + [ev["response"] for ev in stream if "response" in ev]:
        echo = sdk_response(got)
        assert (echo.metadata, echo.user, echo.safety_identifier, echo.prompt_cache_key) == (
            metadata, fields["user"], fields["safety_identifier"], fields["prompt_cache_key"])
        assert echo.text.verbosity == fields["text"]["verbosity"] and echo.text.format.type == "text"
        assert echo.service_tier == "default" and echo.reasoning.summary is None
        assert echo.truncation == fields["truncation"]
    plain = sdk_response(client.post("/v1/responses", json=request()).json())
    assert (plain.metadata, plain.user, plain.text.verbosity, plain.truncation) == ({}, None, None, "disabled")
    too_many = {f"k{i}": "v" for i in range(rng.randint(17, 30))}
    r = client.post("/v1/responses", json=request(metadata=too_many))
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(client):
    """truncation auto: an input over the context loses whole items from the start of the conversation, the fewest
    that make it fit, never the instructions nor the leading developer message (it was served as 'disabled': the
    context-length 400). The oracle: the same requests under 'disabled', from each item on. An input that fits is
    served whole; one whose last user message alone cannot fit is the same 400 as under 'disabled'."""
    rng = random.Random()

    def words(n: int) -> str:
        return " ".join(random_word(rng) for _ in range(n))

    def user(n: int) -> dict:
        return {"role": "user", "content": words(n)}

    head = [{"role": "developer", "content": words(3)}]
    fields = {"instructions": words(4), "max_output_tokens": rng.randint(1, 8),
              "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}

    def served(truncation: str, items: list[dict]):
        return client.post("/v1/responses", json=request(input=head + items, truncation=truncation, **fields))

    conversation, t = [user(3)], 0
    while served("disabled", conversation).status_code == 200:  # turns before the last question, until too long
        turn = [user(rng.randint(2, 8))]
        if rng.random() < 0.5:  # a tool round: the call opens an assistant turn; its output is not a start
            if rng.random() < 0.5:  # the turn's reasoning and text before its call: items of their own (QA: they
                # were dropped with the call, one chat message, when dropping them alone fitted)
                turn += [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": words(4)}]}] * (
                    rng.random() < 0.5) + [{"role": "assistant", "content": words(rng.randint(20, 60))}]
            turn += [{"type": "function_call", "call_id": f"c{t}", "name": "f",
                      "arguments": json.dumps({"q": words(2)})},
                     {"type": "function_call_output", "call_id": f"c{t}", "output": words(3)}]
        conversation = turn + [{"role": "assistant", "content": words(rng.randint(2, 8))}] + conversation
        t += 1
    assert served("disabled", conversation).json()["error"]["code"] == "context_length_exceeded"
    start = next(i for i, item in enumerate(conversation) if item.get("type") != "function_call_output"
                 and served("disabled", conversation[i:]).status_code == 200)
    print("dropped", [item.get("type") or item["role"] for item in conversation[:start]])
    expected = sdk_response(served("disabled", conversation[start:]).json())
    r = served("auto", conversation)
    assert r.status_code == 200, r.text
    got = sdk_response(r.json())
    assert got.truncation == "auto" and got.usage.input_tokens == expected.usage.input_tokens, (start, got.usage)
    assert got.usage.input_tokens + fields["max_output_tokens"] <= MAX_SEQ

    short = conversation[-3:] if conversation[-3].get("role") == "user" else conversation[-1:]
    assert sdk_response(served("auto", short).json()).usage.input_tokens == \
        sdk_response(served("disabled", short).json()).usage.input_tokens
    too_long = conversation + [user(400)]
    for truncation in ("auto", "disabled"):
        r = served(truncation, too_long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
