"""A tool-call round trip through the real server code, the real tiny checkpoint and the reference
backend, with the model's output scripted (helpers_scripted: a random model will not call a tool by itself)."""

import json
import random
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from helpers_gate import HANG_S
from helpers_scripted import scripted_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with scripted_server(tmp_path_factory.mktemp("tools")) as served:
        yield served


CALL_TEXT = ("The user wants the weather.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
             "São Paulo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_tool_call_round_trip(setup, tmp_path):
    ckpt, tokenizer, backend, client = setup
    messages = [{"role": "user", "content": "What's the weather in São Paulo?"}]
    backend.script = tokenizer.encode(CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather."
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "São Paulo", "days": 2}
    assert "<tools>" in tokenizer.decode(backend.prompts[-1])  # the tools reached the prompt

    # second turn: the call and its result go back; the model answers in text
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    backend.script = tokenizer.encode("Checked.</think>\n\nIt is sunny in São Paulo.")
    r2 = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=100)
    assert r2.choices[0].message.content == "It is sunny in São Paulo."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls

    # oracle for the rendered second prompt: transformers' chat template over the same files
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(ckpt) / name, tmp_path / name)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    hf_messages = json.loads(json.dumps(follow))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "São Paulo", "days": 2}
    expected = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert backend.prompts[-1] == hf.encode(expected, add_special_tokens=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in expected


def test_tool_call_streamed(setup):
    _, tokenizer, backend, client = setup
    backend.script = tokenizer.encode("Let me look.\n" + CALL_TEXT.split("</think>\n\n")[1])
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=100, stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look.\n" and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "São Paulo", "days": 2}


def test_tool_choice_none_hides_tools_and_parses_nothing(setup):
    _, tokenizer, backend, client = setup
    backend.script = tokenizer.encode(CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, tool_choice="none", max_tokens=100)
    assert "<tools>" not in tokenizer.decode(backend.prompts[-1])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "<tool_call>" in r.choices[0].message.content


FORECAST = [{"type": "function", "function": {
    "name": "get_forecast", "parameters": {"type": "object", "required": ["city", "days"],
                                           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_leaves_a_non_strict_tool_free(setup, stream):
    """tool_choice auto has no grammar: a call that breaks the tool's schema (a parameter it does not declare, the
    integer as text, a required one missing) comes back as the model wrote it, finish_reason "tool_calls" (with
    required or a named function the grammar would not have let the scripted tokens through)."""
    _, tokenizer, backend, client = setup
    days = random.choice(["soon", "a few", "next week"])
    backend.script = tokenizer.encode(f"<tool_call>\n<function=get_forecast>\n<parameter=town>\nLyon\n</parameter>\n"
                                      f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Forecast?"}], tools=FORECAST, tool_choice="auto",
              max_tokens=100, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for tc in chunk.choices[0].delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [tuple(calls[k]) for k in sorted(calls)]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [("get_forecast", {"town": "Lyon", "days": days})]


DAYS = [{"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "required": ["days"], "properties": {"days": {"type": "integer"}}}}}]


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_whitespace_before_a_call_streams_no_content(setup, tool_choice):
    """The model writes whitespace before its call (the free model, or the lead the call grammar allows): the
    streamed answer has no content delta, in chat and in the Responses API (no message item, no output_text
    event); the same whitespace before text stays that text's."""
    _, tokenizer, backend, client = setup
    lead = random.choice(["\n", "\n\n", " \n"])
    days = random.randrange(1, 30)
    call = f"<tool_call>\n<function=plan>\n<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>"
    choice = {"type": "function", "function": {"name": "plan"}} if tool_choice == "named" else tool_choice
    kw = dict(model="tiny", tools=DAYS, tool_choice=choice, max_tokens=100, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    backend.script = tokenizer.encode(lead + call)
    content, calls = [], []
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "Plan?"}], stream=True, **kw):
        delta = chunk.choices[0].delta
        content += [delta.content] if delta.content else []
        calls += [(tc.function.name, tc.function.arguments) for tc in delta.tool_calls or []]
    assert content == [] and [(n, json.loads(a)) for n, a in calls] == [("plan", {"days": days})]

    backend.script = tokenizer.encode(lead + call)
    rchoice = {"type": "function", "name": "plan"} if tool_choice == "named" else tool_choice
    events = list(client.responses.create(model="tiny", input="Plan?", tools=[{"type": "function", **DAYS[0]["function"]}],
                                          tool_choice=rchoice, parallel_tool_calls=False, max_output_tokens=100,
                                          reasoning={"effort": "none"}, stream=True))
    assert not [e for e in events if e.type.startswith("response.output_text")], events
    output = events[-1].response.output
    assert [(o.type, o.name, json.loads(o.arguments)) for o in output] == [("function_call", "plan", {"days": days})]

    if tool_choice == "auto":  # no call follows: the whitespace goes out with the text
        backend.script = tokenizer.encode(lead + "Sunny.")
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=[{"role": "user", "content": "Plan?"}], stream=True, **kw))
        assert text == lead + "Sunny."


EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh"]
WORDS = ["sun", "rain", "Paris", "São", "中文", "42", "?", "days"]


def words(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def random_chat_body(rng) -> dict:
    """A chat body the chat route accepts, with the fields that change the rendered prompt drawn at random:
    reasoning_effort, chat_template_kwargs, tools or the legacy functions, tool_choice or function_call."""
    messages = [{"role": rng.choice(["system", "developer"]), "content": words(rng)}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": words(rng)})
    if rng.random() < 0.4:  # a past call and its result
        call_id = f"call_{rng.randrange(10 ** 6)}"
        messages += [{"role": "assistant", "content": rng.choice([None, words(rng)]), "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": words(rng)})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": words(rng)}]
    body: dict = {"messages": messages}
    if rng.random() < 0.7:
        body["reasoning_effort"] = rng.choice(EFFORTS)
    if rng.random() < 0.4:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    tools = rng.sample(TOOLS + FORECAST + DAYS, rng.randint(1, 2))
    named = rng.choice([t["function"]["name"] for t in tools])
    kind = rng.choice(["no tools", "tools", "functions"])
    if kind == "tools":
        body["tools"] = tools
        choice = rng.choice([None, "none", "auto", "required", "named"])
        if choice is not None:
            body["tool_choice"] = {"type": "function", "function": {"name": named}} if choice == "named" else choice
    elif kind == "functions":
        body["functions"] = [t["function"] for t in tools]
        choice = rng.choice([None, "none", "auto", "named"])
        if choice is not None:
            body["function_call"] = {"name": named} if choice == "named" else choice
    return body


def post(client, path: str, body: dict) -> httpx.Response:
    return httpx.post(str(client.base_url).removesuffix("/v1/") + path, json=body, timeout=HANG_S)


def test_tokenize_counts_the_prompt_the_chat_request_renders(setup):
    """/tokenize with a chat body gives the very tokens the chat request with the same body prefills, whatever
    of its fields change the prompt; add_generation_prompt false leaves off just the assistant header."""
    _, tokenizer, backend, client = setup
    seed = random.randrange(2 ** 31)
    rng = random.Random(seed)
    for _ in range(12):
        body = random_chat_body(rng)
        r = post(client, "/tokenize", {"model": "tiny", **body})
        assert r.status_code == 200, (seed, body, r.text)
        tokens = r.json()["tokens"]
        backend.script, before = [], len(backend.prompts)
        fields = {k: v for k, v in body.items() if k != "chat_template_kwargs"}
        chat = client.chat.completions.create(model="tiny", max_tokens=1, **fields,
                                              extra_body={"chat_template_kwargs": body.get("chat_template_kwargs")})
        assert r.json()["count"] == len(tokens) == chat.usage.prompt_tokens, (seed, body)
        assert [t for p in backend.prompts[before:] for t in p] == tokens, (seed, body)

        bare = post(client, "/tokenize", {**body, "add_generation_prompt": False}).json()["tokens"]
        assert tokens[:len(bare)] == bare and len(bare) < len(tokens), (seed, body)
        header = post(client, "/detokenize", {"tokens": tokens[len(bare):]}).json()["prompt"]
        assert header.startswith("<|im_start|>assistant\n"), (seed, body, header)
        assert post(client, "/detokenize", {"tokens": bare}).json()["prompt"].endswith("<|im_end|>\n")


def test_tokenize_continues_the_final_message_as_transformers_does(setup, tmp_path):
    ckpt, tokenizer, backend, client = setup
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(ckpt) / name, tmp_path / name)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random()
    final = words(rng) + rng.choice(["", " ", ", and"])
    messages = [{"role": "user", "content": words(rng)}, {"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    for extra in ({}, {"add_generation_prompt": False}):
        r = post(client, "/tokenize", {"messages": messages, "continue_final_message": True, **extra})
        assert r.json()["tokens"] == hf.encode(expected, add_special_tokens=False), (messages, r.text)
    r = post(client, "/tokenize", {"messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt"
    r = post(client, "/tokenize", {"messages": messages[:1] + [{"role": "assistant", "content": " "}],
                                   "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_responses_function_output_as_input_text_parts(setup):
    """A function_call_output whose output is a list of input_text parts (OpenAI's API and the openai SDK allow
    it) reaches the model as the tool message of their joined text: the very prompt the string output gives.
    Image and file parts are a 400 naming the part; an unknown item type a 400 naming its type field."""
    _, tokenizer, backend, client = setup
    rng = random.Random()
    text = words(rng)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 3))))
    parts = [{"type": "input_text", "text": text[a:b]} for a, b in zip([0] + cuts, cuts + [len(text)])]
    question = {"role": "user", "content": words(rng)}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Lyon"}'}

    def prefilled(output) -> tuple[list[int], int]:
        backend.script, before = [], len(backend.prompts)
        r = client.responses.create(model="tiny", max_output_tokens=1, input=[
            question, call, {"type": "function_call_output", "call_id": "c1", "output": output}])
        return [t for p in backend.prompts[before:] for t in p], r.usage.input_tokens

    as_parts, as_string = prefilled(parts), prefilled(text)
    assert as_parts == as_string and as_parts[1] == len(as_parts[0]), (parts, text)
    assert f"<tool_response>\n{text}\n</tool_response>" in tokenizer.decode(as_parts[0])

    media = rng.choice([{"type": "input_image", "image_url": "https://example.com/a.png"},
                        {"type": "input_file", "file_id": "file_1"}])
    at = rng.randrange(len(parts) + 1)
    with pytest.raises(openai.BadRequestError) as e:
        prefilled(parts[:at] + [media] + parts[at:])
    assert e.value.body["param"] == f"input[2].output[{at}]" and media["type"] in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", max_output_tokens=1, input=[question, {"type": "web_search_call"}])
    assert e.value.body["param"] == "input[1].type" and "'web_search_call' is not one of" in e.value.body["message"]


def chat_answer(client, stream: bool, **kw) -> tuple[str, str, list, str]:
    """(reasoning, content, [(name, arguments as JSON)], finish_reason) of one chat answer, streamed or not."""
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
        return getattr(c.message, "reasoning_content", None) or "", c.message.content or "", calls, c.finish_reason
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [(n, json.loads(a)) for n, a in (calls[k] for k in sorted(calls))], finish


def chat_answer_raw(client, stream: bool, **kw) -> tuple[object, str, str]:
    """(the answer, finish_reason, its one call's arguments as sent, unparsed), streamed or not."""
    if not stream:
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        return r, r.choices[0].finish_reason, call.function.arguments
    args, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for tc in chunk.choices[0].delta.tool_calls or []:
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return None, finish, args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_stop_strings_do_not_cut_a_call(setup, stream, tool_choice):
    """The request's stop strings end the answer's text, not a call's arguments: one that occurs inside the call
    (its value, a newline of the format) leaves the call whole; after the call's end it still ends the output."""
    _, tokenizer, backend, client = setup
    city = random.choice(["Lyon", "São Paulo", "Oslo"])
    days = random.randrange(1, 30)
    call = (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}\n"
            f"</parameter>\n</function>\n</tool_call>")
    backend.script = tokenizer.encode(call + (" then more" if tool_choice == "auto" else ""))
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else tool_choice
    stops = [city.split()[-1], "\n", str(days)] + (["more"] if tool_choice == "auto" else [])
    got = chat_answer(client, stream, model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                      tool_choice=choice, stop=stops[:4], max_tokens=100,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got[1:] == (" then" if tool_choice == "auto" else "", [("get_weather", {"city": city, "days": days})],
                       "stop" if tool_choice == "named" else "tool_calls")


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_a_streamed_calls_only_answer_opens_with_null_content(setup, tool_choice):
    """Under tool_choice required or named the answer is calls: its streamed role chunk's content is null, as the
    answer not streamed says (and OpenAI's), so a client's accumulated message has content None either way; under
    auto, where text may come, it is the empty text."""
    _, tokenizer, backend, client = setup
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else tool_choice
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=choice,
              max_tokens=100, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    backend.script = tokenizer.encode(call)
    first = list(client.chat.completions.create(stream=True, **kw))[0].choices[0].delta  # (read whole: one script)
    backend.script = tokenizer.encode(call)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert first.role == "assistant" and first.content == (None if tool_choice != "auto" else "")
    assert whole.content is None and whole.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_one_call_ends_the_answer_but_not_the_reasoning(setup, stream):
    """parallel_tool_calls false under tool_choice auto: a </tool_call> the model writes while thinking does not end
    the output; the answer ends after its first call."""
    _, tokenizer, backend, client = setup
    calls = [f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{c}\n</parameter>\n</function>\n</tool_call>"
             for c in ("Lyon", "Oslo")]
    thought = "I could write <tool_call> or </tool_call> here."
    backend.script = tokenizer.encode(thought + "</think>\n\n" + calls[0] + "\n" + calls[1])
    got = chat_answer(client, stream, model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                      parallel_tool_calls=False, max_tokens=200)
    assert got == (thought, "", [("get_weather", {"city": "Lyon"})], "tool_calls")
    # the Responses API: that call is complete (its closing tag was the stop string, kept for the parser)
    backend.script = tokenizer.encode(thought + "</think>\n\n" + calls[0] + "\n" + calls[1])
    r = client.responses.create(model="tiny", input="Weather?", tools=[{"type": "function", **TOOLS[0]["function"]}],
                                parallel_tool_calls=False, max_output_tokens=200)
    assert [(o.type, o.status) for o in r.output] == [("reasoning", "completed"), ("function_call", "completed")]
    assert r.status == "completed" and json.loads(r.output[1].arguments) == {"city": "Lyon"}


def test_a_call_cut_by_max_tokens_is_incomplete_and_leaves_no_markup(setup):
    """A call cut by max_output_tokens is a function_call item with status incomplete in the Responses API, and in
    chat and the Responses API alike its arguments are left unclosed (an agent loop must not run it as complete);
    one cut before its name is whole leaves no markup as text, in the Responses API and in chat, under tool_choice
    required (the grammar was writing a call)."""
    _, tokenizer, backend, client = setup
    city = random.choice(["Lyon", "Oslo", "Rio de Janeiro", "New York"])  # (a cut inside a character: no prefix)
    call = tokenizer.encode(f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
                            "</function>\n</tool_call>")
    named = len(tokenizer.encode("<tool_call>\n<function=get_weather>"))
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    for stream in (False, True):  # the Responses API's cut arguments: unclosed, as chat's (they were "{}")
        cut = random.randrange(named, len(call))
        backend.script = list(call)
        kw = dict(model="tiny", input="Weather?", tools=tools, tool_choice="required", max_output_tokens=cut,
                  reasoning={"effort": "none"})
        if stream:
            events = list(client.responses.create(stream=True, **kw))
            (item,) = events[-1].response.output
            sent = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            assert sent == [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
            assert sent == [item.arguments], (sent, item)
        else:
            (item,) = client.responses.create(**kw).output
        with pytest.raises(json.JSONDecodeError):
            json.loads(item.arguments)
        held = json.loads(item.arguments + "}")  # what was read of it, its last brace dropped
        assert item.status == "incomplete" and set(held) <= {"city"} and city.startswith(held.get("city", "")), item
    ids = tokenizer.encode("<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n"
                           "</tool_call>")
    name_end = len(tokenizer.encode("<tool_call>\n<function=get_weather>"))
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    for cut, status in ((len(ids) + 1, "completed"), (len(ids) - 2, "incomplete")):  # (+1: the end of text)
        backend.script = list(ids)
        r = client.responses.create(model="tiny", input="Weather?", tools=tools, tool_choice="required",
                                    max_output_tokens=cut, reasoning={"effort": "none"})
        assert [(o.type, o.status) for o in r.output] == [("function_call", status)], r.output
        assert r.status == ("completed" if status == "completed" else "incomplete")
    # chat: the cut call's arguments are left unclosed, as OpenAI's, so a client's JSON parse refuses them (the
    # Agents SDK ran a call cut by max_tokens with what it held); finish_reason length, streamed or not
    for stream in (False, True):
        backend.script = list(ids)
        r, finish, args = chat_answer_raw(client, stream, model="tiny", messages=[{"role": "user", "content": "W?"}],
                                          tools=TOOLS, tool_choice="required", max_tokens=len(ids) - 2,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert finish == "length" and '{"city": "Lyon"}'.startswith(args) and args, args
        with pytest.raises(json.JSONDecodeError):
            json.loads(args)
    cut = random.randrange(2, name_end - 1)
    backend.script = list(ids)
    r = client.responses.create(model="tiny", input="Weather?", tools=tools, tool_choice="required",
                                max_output_tokens=cut, reasoning={"effort": "none"})
    assert r.output == [] and r.status == "incomplete"
    backend.script = list(ids)
    got = chat_answer(client, False, model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                      tool_choice="required", max_tokens=cut,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got == ("", "", [], "length")
