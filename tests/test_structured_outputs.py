"""Structured outputs: response_format (json_object, json_schema) on chat and text completions, text.format on
the Responses API, tool_choice required / named with strict tools and tools without strict, parallel_tool_calls
false, legacy functions; checked with jsonschema as the oracle, against a stand-in model of random logits (every
step a fresh random draw) and a real `lily serve` of the tiny random model through the openai client
(chat.completions.parse, forced tool calls) and a LangChain-style json_schema request; text completions'
response_format through the openai client too."""

import enum
import json
import random

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from conftest import seed_of
from helpers_standin import RandomLogitsBackend as RandomBackend
from lily.demo_tokenizer import write_tokenizer_files
from lily.engine.constraints import (ConstraintSpec, GrammarError, Grammars, WHITESPACE_MAX, apply_token_bitmask)
from lily.server.app import ServerSettings, create_app
from lily.synthetic import make_synthetic
from lily.tokenizer import Tokenizer
from test_reliability_support import load_test

MODEL = "tiny"
SEED = seed_of("test_structured_outputs.py") % 2 ** 31   # the random model's, from the run's seed (LILY_TEST_SEED)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "pet": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                                                               "required": ["kind"],
                                                               "properties": {"kind": {"enum": ["cat", "dog"]}}}]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}}}}}
# a tool as clients mostly send one: no strict, no additionalProperties (the bounds only so that a random model ends
# its values: an unbounded string or integer may run to max_tokens)
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "the forecast for a city",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "days": {"type": "integer", "minimum": -100, "maximum": 100},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def client(tokenizer):
    app = create_app(RandomBackend(tokenizer.vocab_size, SEED), tokenizer, ServerSettings(model_name=MODEL, max_seq=2048))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.app_state = app.state
        yield c


def chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            "reasoning_effort": "none", "temperature": 1.0}
    body.update(kw)
    return body


def json_schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- the engine pieces ----------------------------------------------------------------------------------
def test_apply_token_bitmask_matches_a_bit_by_bit_oracle():
    g = torch.Generator().manual_seed(SEED)
    for vocab in (1, 31, 32, 33, 500, 1000):
        scores = torch.randn(3, vocab, generator=g)
        words = (vocab + 31) // 32
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
        got = apply_token_bitmask(scores, mask)
        for b in range(3):
            for t in range(vocab):
                on = (int(mask[b, t // 32]) >> (t % 32)) & 1
                assert got[b, t] == (scores[b, t] if on else float("-inf"))


def test_grammars_are_compiled_once_per_schema_and_refuse_what_they_cannot_honour(tokenizer):
    grammars = Grammars(tokenizer)
    a = grammars.json(PERSON)
    assert grammars.json(json.loads(json.dumps(PERSON))) is a and grammars.compiled == 1
    grammars.json(None)
    assert grammars.compiled == 2
    with pytest.raises(GrammarError, match='"if"'):
        grammars.json({"type": "object", "if": {"required": ["a"]}, "then": {}})


def test_thinking_is_free_but_for_the_stop_tokens_until_the_end_of_thinking_token(tokenizer):
    """Before </think> every token may be drawn but those that end the generation (an answer under the grammar
    must follow); after it, the grammar's mask."""
    grammars = Grammars(tokenizer)
    think_end = tokenizer.token_id("</think>")
    assert ConstraintSpec(grammars.json(None), after_think=True, think_end=think_end).start("cpu").allowed() is None
    others = [t for t in range(tokenizer.vocab_size) if t != think_end]
    stops = set(tokenizer.eos_token_ids) | set(random.sample(others, 3))
    c = ConstraintSpec(grammars.json(None), after_think=True, think_end=think_end).start("cpu", stops)
    for t in random.sample([t for t in others if t not in stops], 20):
        mask = c.allowed()
        assert [t for t in range(tokenizer.vocab_size) if not (int(mask[t // 32]) >> (t % 32)) & 1] == sorted(stops)
        c.accept(t)
    c.accept(think_end)
    mask = c.allowed()
    allowed = [t for t in range(tokenizer.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert tokenizer.token_id("{") in allowed
    assert all(tokenizer.token_text(t).strip() == "" or tokenizer.token_text(t).lstrip().startswith("{")
               for t in allowed)


def many_optional_properties():
    """A schema llguidance compiles but gives up on at the answer's first token (an Earley row past its 2,000
    items): one object of 600+ optional properties, or an anyOf of 40+ objects of 40 properties."""
    if random.random() < 0.5:
        return {"type": "object", "additionalProperties": False,
                "properties": {f"f{j}": {"type": ["string", "null"], "maxLength": 5}
                               for j in range(random.randint(600, 900))}}
    obj = lambda i: {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(40)},
                     "required": [f"p{i}"], "additionalProperties": False}
    return {"anyOf": [obj(i) for i in range(random.randint(40, 50))]}


# -- the chat API, over a model of random logits ---------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_json_schema_answers_validate(client, seed):
    r = client.post("/v1/chat/completions", json=chat(seed=seed, n=2, response_format=json_schema_format(PERSON)))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def open_nested(rng) -> dict:
    """A schema whose objects say nothing of additionalProperties, nested through properties, items, anyOf, $defs."""
    leaf = {"type": rng.choice(["integer", "boolean"])}
    inner = {"type": "object", "properties": {"x": leaf}}
    return {"type": "object", "properties": {"a": {"type": "array", "items": inner, "maxItems": 2},
                                             "b": {"anyOf": [{"$ref": "#/$defs/d"}, {"type": "null"}]}},
            "required": ["a", "b"], "$defs": {"d": {"type": "object", "properties": {"y": leaf}}}}


@pytest.mark.parametrize("seed", range(3))
def test_a_strict_schema_s_objects_take_no_other_keys(client, seed):
    """strict: true reads every object as closed (OpenAI's strict mode; JSON Schema's default lets the random model
    add keys): the answers validate against the schema with additionalProperties false on every object, whose
    extra keys the schema as sent would have allowed. Without strict, the schema is taken as written."""
    from lily.server.structured import closed_objects

    rng = random.Random(seed)
    schema = open_nested(rng)
    closed = closed_objects(schema)
    assert "additionalProperties" not in json.dumps(schema)
    assert json.dumps(closed).count('"additionalProperties": false') == 3
    r = client.post("/v1/chat/completions", json=chat(seed=seed, n=3, response_format=json_schema_format(schema)))
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), closed)
    loose = json_schema_format(schema)
    loose["json_schema"]["strict"] = False
    r = client.post("/v1/chat/completions", json=chat(seed=seed, n=3, response_format=loose))
    for choice in r.json()["choices"]:  # (free keys: the random model may not close them within max_tokens)
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_whitespace_bound(client):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.post("/v1/chat/completions", json=chat(seed=SEED % 1000, response_format=json_schema_format(schema)))
    text = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    run = max((len(s) for s in "".join(c if c in " \n\t" else "|" for c in text).split("|")), default=0)
    assert run <= WHITESPACE_MAX
    # any object: the random model need not close it, but what it writes is always a JSON object's start
    r = client.post("/v1/chat/completions", json=chat(seed=SEED % 997, max_tokens=60,
                                                      response_format={"type": "json_object"}))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_streamed_json_schema_answer_validates(client):
    r = client.post("/v1/chat/completions", json=chat(seed=SEED % 991, stream=True,
                                                      response_format=json_schema_format(PERSON)))
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_keyword_the_engine_cannot_honour_is_a_400_naming_it(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}
    r = client.post("/v1/chat/completions", json=chat(response_format=json_schema_format(schema)))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and '"if"' in err["message"]
    assert "\n" not in err["message"]


def test_a_schema_too_complex_for_the_grammar_engine_is_a_400_naming_it(client):
    """It compiles, then llguidance gives up while generating: a 400 naming the field (an error event once the
    stream has started), never a 500, on chat, text completions and the Responses API; the server goes on."""
    schema = many_optional_properties()
    for path, body, param in (
            ("/v1/chat/completions", chat(response_format=json_schema_format(schema)), "response_format.json_schema.schema"),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 20,
                                 "response_format": json_schema_format(schema)}, "response_format.json_schema.schema"),
            ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 20, "reasoning": {"effort": "none"},
                               "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}},
             "text.format.schema")):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param + ": too complex"), err
        assert "Current row has" in err["message"] and "<state>" not in err["message"]
    r = client.post("/v1/chat/completions", json=chat(stream=True, response_format=json_schema_format(schema)))
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["param"] == "response_format.json_schema.schema"
    assert not any(json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]), events  # (the lead may come)
    r = client.post("/v1/chat/completions", json=chat(seed=SEED % 89, response_format=json_schema_format(PERSON)))
    assert r.status_code == 200
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)


def test_allowed_token_ids_the_grammar_never_allows_are_a_400(client, tokenizer):
    """allowed_token_ids and the grammar's mask with nothing in common: a 400 naming allowed_token_ids (a token the
    mask banned was drawn, and the grammar's refusal was a 500)."""
    schema = {"const": "".join(random.choice("abcdefgh") for _ in range(3))}
    mask = ConstraintSpec(Grammars(tokenizer).json(schema)).start("cpu").allowed()
    banned = [t for t in range(tokenizer.vocab_size) if not (int(mask[t // 32]) >> (t % 32)) & 1]
    ids = random.sample(banned, 4)
    for path, body in (("/v1/chat/completions", chat(max_tokens=20)),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 20})):
        r = client.post(path, json={**body, "allowed_token_ids": ids, "response_format": json_schema_format(schema)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "allowed_token_ids" and "at output token 1" in err["message"], err
        r = client.post(path, json={**body, "response_format": json_schema_format(schema)})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("held", ["response_format", "tool_choice", "either"])
def test_an_end_of_text_cannot_end_the_thinking_while_a_grammar_waits(client, tokenizer, held, stream):
    """Thinking on and a grammar after it: the end-of-text token (biased to win every draw) cannot end the output
    inside the reasoning (it was a 200 'stop' with no answer); </think> (biased next) comes, then the answer under
    its grammar, ended where the grammar is complete."""
    bias = {str(t): 100 for t in tokenizer.eos_token_ids} | {str(tokenizer.token_id("</think>")): 50}
    fields = {"response_format": json_schema_format(PERSON)} if held == "response_format" else \
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    if held == "either":  # tools under auto + response_format: the reasoning first, then a call or the JSON
        fields = {"response_format": json_schema_format(PERSON), "tools": [WEATHER], "parallel_tool_calls": False}
    r = client.post("/v1/chat/completions", json=chat(reasoning_effort="high", seed=random.randrange(2 ** 31),
                                                      logit_bias=bias, stream=stream, **fields))
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [tc["function"] for d in deltas for tc in d.get("tool_calls") or []]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    else:
        choice = r.json()["choices"][0]
        content, calls = choice["message"]["content"], [c["function"] for c in choice["message"].get("tool_calls") or []]
        finish = [choice["finish_reason"]]
    if held == "response_format" or (held == "either" and not calls):
        assert finish == ["stop"], r.text
        jsonschema.validate(json.loads(content), PERSON)
    else:
        assert finish == ["tool_calls"] and len(calls) == 1 and calls[0]["name"] == "get_weather", r.text
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_gives_valid_strict_calls(client, seed):
    # parallel calls allowed: after each call the random model goes on to another about a third of the time
    # (1 call 79 times in 120, 5 calls once), so the room for a chain of ~15 calls, not 400 tokens' ~5
    r = client.post("/v1/chat/completions", json=chat(seed=seed, tools=[WEATHER, TIME], tool_choice="required",
                                                      max_tokens=1400))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        jsonschema.validate(args, tool["function"]["parameters"])


@pytest.mark.parametrize("seed", range(3))
def test_named_tool_choice_and_one_call_without_parallel_calls(client, seed):
    r = client.post("/v1/chat/completions", json=chat(
        seed=seed, tools=[TIME, WEATHER], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "stop" and len(calls) == 1  # a forced function: "stop", as OpenAI's
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])


def _calls_and_finish(r, stream: bool):
    """A chat answer's tool calls [(name, arguments)] and finish_reason, streamed (deltas joined) or not."""
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] is None, choice
        return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"] or []], \
            choice["finish_reason"]
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    calls, finish = {}, None
    for chunk in chunks:
        for c in chunk["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                name, args = calls.get(tc["index"], ("", ""))
                calls[tc["index"]] = (name + (tc["function"].get("name") or ""),
                                      args + (tc["function"].get("arguments") or ""))
            # no content at all, not even the whitespace the grammar lets the model write before, between and
            # after the calls (the role's opening chunk carries content "", as vLLM's)
            assert not c["delta"].get("content"), chunk
            finish = c["finish_reason"] or finish
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_whitespace_before_a_forced_call_streams_no_content(client, tokenizer, tool_choice):
    """The call grammar lets the model write whitespace before the call (here pushed to its bound by a bias on
    newline): a streamed tool-call answer still has no content delta, as OpenAI's; the whitespace is in the
    output (its logprobs) but not in the answer."""
    newline = tokenizer.encode("\n")[0]
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=chat(
            seed=random.randrange(2 ** 31), tools=[TIME], stream=True, parallel_tool_calls=False, logprobs=True,
            logit_bias={str(newline): 15},
            tool_choice={"type": "function", "function": {"name": "get_time"}} if tool_choice == "named" else "required"))
        chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        written = "".join(t["token"] for c in chunks for ch in c["choices"] for t in (ch.get("logprobs") or {}).get(
            "content") or [])
        assert written.startswith("\n") and written.lstrip().startswith("<tool_call>"), written
        calls, finish = _calls_and_finish(r, True)
        assert [name for name, _ in calls] == ["get_time"], calls
        jsonschema.validate(json.loads(calls[0][1]), TIME["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_call_is_function_call_items_only(client, stream):
    """The Responses API: a forced call's answer is function_call items, no message item of the whitespace before
    the call, and no output_text event; the strict tool's JSON values read back as JSON."""
    for _ in range(3):
        r = client.post("/v1/responses", json={
            "model": MODEL, "input": "hi", "max_output_tokens": 1200, "reasoning": {"effort": "none"},
            "temperature": 1.0, "seed": random.randrange(2 ** 31), "stream": stream, "tool_choice": "required",
            "tools": [{"type": "function", **ODD["function"]}]})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
            assert not [e for e in events if e["type"].startswith("response.output_text")], events
            body = events[-1]["response"]
        else:
            body = r.json()
        assert body["status"] == "completed", body
        assert body["output"] and all(item["type"] == "function_call" for item in body["output"]), body["output"]
        for item in body["output"]:
            args = json.loads(item["arguments"])
            jsonschema.validate(args, ODD["function"]["parameters"])
            assert not any(isinstance(args.get(k), str) and len(args[k]) >= 2 and args[k][0] == args[k][-1] == '"'
                           for k in ("note", "maybe", "pick", "either")), args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_to_a_non_strict_tool_follow_its_parameters(client, tool_choice, stream):
    """required and a named function hold every call to its tool's parameters whether or not the tool is strict
    (as vLLM does; the loose grammar let the model name any parameter, write untyped text or none at all):
    the required ones present, the integer an integer, the enum one of its values; finish_reason "tool_calls"
    for required, "stop" for a named function, which is called exactly once (parallel_tool_calls left out)."""
    tools = {"get_forecast": FORECAST, "get_time": TIME}
    named = tool_choice == "named"
    for _ in range(3):
        r = client.post("/v1/chat/completions", json=chat(
            seed=random.randrange(2 ** 31), tools=[TIME, FORECAST], stream=stream, max_tokens=1400,
            tool_choice={"type": "function", "function": {"name": "get_forecast"}} if named else "required"))
        calls, finish = _calls_and_finish(r, stream)
        assert calls and finish == ("stop" if named else "tool_calls"), (calls, finish)
        assert len(calls) == 1 or not named, calls  # a named function: exactly one call
        for name, arguments in calls:
            assert name == "get_forecast" or not named
            jsonschema.validate(json.loads(arguments), tools[name]["function"]["parameters"])


# a strict tool whose values the call grammar writes as JSON although their schema allows text: no type, a type list
# with "string", an enum of mixed values (bounded so that the random model ends them); and a string, written as text
ODD = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["note", "maybe", "pick", "name"],
    "properties": {"note": {"description": "free", "maxLength": 8, "minimum": -1000, "maximum": 1000, "maxItems": 2,
                            "items": {"type": "integer", "minimum": 0, "maximum": 9}, "additionalProperties": False},
                   "maybe": {"type": ["string", "null"], "maxLength": 8},
                   "pick": {"enum": ["a", 1, None]},
                   "either": {"type": ["integer", "string"], "maxLength": 6, "minimum": 0, "maximum": 99},
                   "name": {"type": "string", "maxLength": 8}}}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_strict_values_the_grammar_writes_as_json_are_read_back_as_json(client, tool_choice, stream):
    """A strict tool's parameter with no type, a type list with "string" or a mixed enum is written as JSON under
    required / named: the client gets the JSON value ("abc", null, 1), never its text ('"abc"', "null", "1")."""
    params = ODD["function"]["parameters"]
    named = tool_choice == "named"
    for _ in range(4):
        r = client.post("/v1/chat/completions", json=chat(
            seed=random.randrange(2 ** 31), tools=[TIME, ODD] if named else [ODD], stream=stream, max_tokens=1200,
            tool_choice={"type": "function", "function": {"name": "odd"}} if named else "required"))
        calls, finish = _calls_and_finish(r, stream)
        assert calls and finish == ("stop" if named else "tool_calls"), (calls, finish)
        assert len(calls) == 1 or not named, calls  # a named function: exactly one call
        for name, arguments in calls:
            assert name == "odd"
            args = json.loads(arguments)
            jsonschema.validate(args, ODD["function"]["parameters"])
            for key in ("note", "maybe", "pick", "either"):
                value = args.get(key)
                assert not (isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"'), (key, args)
            assert args.get("maybe") != "null" and args.get("pick") not in ("null", "1"), args


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"to": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "properties": {"to": {"type": "string"}}, "patternProperties": {"^x": {}}},
    {"anyOf": [{"type": "object", "properties": {"to": {"type": "string"}}}]},
    {"type": "object", "required": ["cc"], "properties": {"to": {"type": "string"}}},
    {"type": "object", "properties": {"bad>name": {"type": "integer"}}}])
def test_a_non_strict_schema_the_call_grammar_cannot_express_keeps_the_loose_call(client, tokenizer, parameters):
    """Not strict, an object the grammar cannot express: the tool's call falls back to any parameters with text
    values (the request is answered); the same schema on a strict tool is a 400 naming the tool, but for
    additionalProperties, which its call (closed to the declared parameters, as OpenAI's strict) satisfies."""
    from types import SimpleNamespace

    from lily.server.protocol import ChatCompletionRequest
    from lily.server.structured import tool_call_grammar

    tool = {"type": "function", "function": {"name": "mail", "parameters": parameters}}
    body = ChatCompletionRequest.model_validate(chat(tools=[tool, FORECAST], tool_choice="required"))
    source = tool_call_grammar(SimpleNamespace(tokenizer=tokenizer), body)
    assert 'fn_0: "mail>\\n" ("<parameter=" PNAME' in source, source  # the loose form
    assert 'fn_1: "get_forecast>\\n" p_1_0 p_1_1 p_1_2?' in source, source  # the other tool still held
    Grammars(tokenizer).lark(source)  # compiles
    r = client.post("/v1/chat/completions", json=chat(seed=random.randrange(2 ** 31), tools=[tool],
                                                      tool_choice="required", max_tokens=40))
    assert r.status_code == 200, r.text
    tool["function"]["strict"] = True
    r = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required", max_tokens=40))
    if "additionalProperties" in parameters:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert r.json()["error"]["message"].startswith("tools: cannot be enforced by constrained decoding: tool 'mail': ")


@pytest.mark.parametrize("value", [
    {"type": "string", "pattern": "^[a-z]+$"}, {"type": "string", "format": "email", "maxLength": 9},
    {"anyOf": [{"type": "string", "enum": ["c", "f"]}, {"type": "null"}]}, {"type": ["string", "null"]},
    {"type": "integer", "if": {"minimum": 1}, "then": {}}, {"enum": ["a", 1]}, {"$ref": "#/$defs/Gone"}])
def test_a_non_strict_value_the_call_grammar_cannot_hold_is_free_text(client, value):
    """Not strict, one value the grammar cannot hold as written: that value is free text, the call still held to
    the tool's parameter names and its required set (the whole call fell to the loose form, and a forced call
    came back as {}); the random model's calls carry city and days, valid, and no other name than the declared."""
    params = {"type": "object", "required": ["city", "days", "odd"], "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "odd": {**value, "maxLength": 6} if value.get("type") == "string" else value}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    for _ in range(3):
        r = client.post("/v1/chat/completions", json=chat(
            seed=random.randrange(2 ** 31), tools=[tool], tool_choice="required", parallel_tool_calls=False,
            max_tokens=200))
        # a random model seldom closes free text (finish_reason length): the call, cut inside odd, is read still,
        # its arguments sent unclosed (as OpenAI's cut arguments), the written part whole
        ((name, arguments),), finish = _calls_and_finish(r, False)
        args = json.loads(arguments + "}" if finish == "length" else arguments)
        assert name == "get_weather" and {"city", "days"} <= set(args) <= {"city", "days", "odd"}, args
        jsonschema.validate({k: args[k] for k in ("city", "days")}, {**params, "required": ["city", "days"]})


def test_a_non_strict_tool_without_parameters_is_called_with_none(client):
    """OpenAI: leaving out parameters declares an empty parameter list; a forced call writes none."""
    tool = {"type": "function", "function": {"name": "ping"}}
    r = client.post("/v1/chat/completions", json=chat(seed=random.randrange(2 ** 31), tools=[tool],
                                                      tool_choice={"type": "function", "function": {"name": "ping"}},
                                                      parallel_tool_calls=False))
    calls, finish = _calls_and_finish(r, False)
    assert calls == [("ping", "{}")] and finish == "stop"


@pytest.mark.parametrize("seed", range(2))
def test_strict_string_lengths_and_const_hold(client, seed):
    note = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["text", "kind"],
        "properties": {"text": {"type": "string", "minLength": 5, "maxLength": 9, "description": "the note"},
                       "kind": {"type": "string", "const": "memo"}}}}}
    r = client.post("/v1/chat/completions", json=chat(seed=seed, tools=[note], tool_choice="required"))
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls, r.json()
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), note["function"]["parameters"])


@pytest.mark.parametrize("keyword", [{"pattern": "^[a-z]+$"}, {"format": "email"}])
def test_a_strict_string_keyword_the_grammar_cannot_enforce_is_a_400(client, keyword):
    tool = {"type": "function", "function": {"name": "mail", "strict": True, "parameters": {
        "type": "object", "required": ["to"], "properties": {"to": {"type": "string", **keyword}}}}}
    r = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required"))
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["param"] == "tools" and repr(next(iter(keyword))) in err["message"]
    # the same tool, not strict, is fine: its values are free text
    tool["function"]["strict"] = False
    assert client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required")).status_code == 200


@pytest.mark.parametrize("params, keyword", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 1}]},
     "allOf")])
def test_a_strict_tool_root_keyword_the_grammar_does_not_read_is_a_400(client, params, keyword):
    """The call went out breaking it ({} against minProperties 1, a without allOf's required a) with a 200."""
    tool = {"type": "function", "function": {"name": "count", "strict": True, "parameters": params}}
    r = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and f"tool 'count': parameters: '{keyword}'" in err["message"], err


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_min_max_properties_on_free_form_keys_are_a_400(client):
    """An object whose keys are free-form (additionalProperties a schema or left out, patternProperties, pydantic's
    dict[str, X]) may repeat a key under the grammar ({"a": 6, "a": 6}: llguidance does not track the keys
    written), which a JSON parser reads as fewer properties than minProperties: refused, naming the keyword,
    in response_format and a strict tool's value; where every key is a named property (all required, closed)
    the answers hold it."""
    rng = random.Random(random.getrandbits(64))
    lo = rng.randint(1, 3)
    counts = rng.choice([{"minProperties": lo}, {"maxProperties": lo}, {"minProperties": lo, "maxProperties": lo + 2}])
    value = {"type": "integer", "minimum": 0, "maximum": 9}
    free = rng.choice([{"additionalProperties": value}, {"patternProperties": {"^[a-c]$": value},
                                                         "additionalProperties": False}, {}])
    obj = {"type": "object", **free, **counts}
    inner = rng.random() < 0.5  # at the root, or nested
    schema = {"type": "object", "properties": {"scores": obj}, "required": ["scores"],
              "additionalProperties": False} if inner else obj
    fmt = json_schema_format(schema)
    fmt["json_schema"]["strict"] = bool(free) and rng.random() < 0.5  # (strict closes an open object)
    err = _error(client.post("/v1/chat/completions", json=chat(response_format=fmt)))
    assert err["param"] == "response_format.json_schema.schema", err
    assert next(iter(counts)) in err["message"] and "repeat" in err["message"], err
    assert (" (at /properties/scores)" in err["message"]) == inner, err
    # (strict closes an object that leaves additionalProperties out: the tool's keeps them free by a schema)
    tool_obj = obj if free else {**obj, "additionalProperties": value}
    tool = {"type": "function", "function": {"name": "score", "strict": True, "parameters": {
        "type": "object", "required": ["scores"], "properties": {"scores": tool_obj}, "additionalProperties": False}}}
    err = _error(client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required")))
    assert err["param"] == "tools" and "tool 'score': parameter 'scores'" in err["message"], err
    assert next(iter(counts)) in err["message"], err
    named = {"type": "object", "properties": {k: value for k in "abc"}, "required": list("abc"),
             "additionalProperties": False, "minProperties": 3, "maxProperties": 3}
    r = client.post("/v1/chat/completions", json=chat(seed=rng.randrange(2 ** 31), n=2,
                                                      response_format=json_schema_format(named)))
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), named)


def test_min_properties_beyond_a_closed_objects_properties_is_a_400():
    """minProperties above the properties a closed object names (what strict mode makes of an object that names
    none): no object satisfies it, and llguidance wrote one with too few; refused, naming it. At or below the
    count, or with maxProperties alone, accepted."""
    from lily.engine.constraints import check_json_schema

    names = random.sample("abcdef", random.randint(0, 3))
    closed = {"type": "object", "properties": {k: {"type": "integer"} for k in names}, "required": names,
              "additionalProperties": False}
    with pytest.raises(GrammarError, match=f"minProperties {len(names) + 1} .*no object satisfies it"):
        check_json_schema({**closed, "minProperties": len(names) + 1})
    check_json_schema({**closed, "minProperties": len(names)})
    check_json_schema({**closed, "maxProperties": len(names) + 1})


def test_dates_and_times_are_ones_python_parses(tokenizer):
    """format date / date-time / time: the grammar takes exactly the dates Python's datetime (pydantic's
    datetime, date and time; jsonschema's format checker) takes: Feb 29 of a leap year only, no second 60, no year
    0000 (llguidance's own regexes took 2023-02-29 and 12:00:60Z); fresh random dates each run."""
    import datetime

    grammars = Grammars(tokenizer)
    rng = random.Random(random.getrandbits(64))
    date, when, time = (grammars.json({"type": "string", "format": f}) for f in ("date", "date-time", "time"))

    def takes(grammar, text: str) -> bool:
        m = grammar.matcher.deep_copy()
        return m.consume_tokens(tokenizer.encode(json.dumps(text))) and m.is_accepting()

    def python(parse, text: str) -> bool:
        try:
            parse(text)
            return True
        except ValueError:
            return False

    years = [0, 1, 1900, 2000, 2023, 2024, 2100, 2400, 9999] + [rng.randrange(10000) for _ in range(40)]
    for year in years:
        for month, day in [(2, 29), (2, 28), (2, 30), (rng.randint(1, 12), rng.randint(1, 31))]:
            text = f"{year:04d}-{month:02d}-{day:02d}"
            assert takes(date, text) == python(datetime.date.fromisoformat, text), text
    for _ in range(40):
        clock = f"{rng.randint(0, 25):02d}:{rng.randint(0, 60):02d}:{rng.choice([rng.randint(0, 59), 60]):02d}"
        clock += rng.choice(["", f".{rng.randrange(10 ** 6):06d}", f".{rng.randrange(10)}"])
        clock += rng.choice(["Z", "z", f"+{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", "-00:00"])
        day = rng.choice(["2024-02-29", "2023-02-29", "2023-02-28"])
        ok_time = python(lambda t: datetime.time.fromisoformat(t.upper().replace("Z", "+00:00")), clock)
        assert takes(time, clock) == ok_time, clock
        stamp = day + rng.choice("Tt") + clock
        ok = python(lambda t: datetime.datetime.fromisoformat(t.upper().replace("Z", "+00:00")), stamp)
        assert takes(when, stamp) == ok, stamp


def test_date_answers_pass_pydantic_and_the_format_checker(client):
    from pydantic import TypeAdapter
    import datetime

    class Event(BaseModel):
        when: datetime.datetime
        day: datetime.date
        at: datetime.time

    schema = Event.model_json_schema()
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    r = client.post("/v1/chat/completions", json=chat(seed=random.randrange(2 ** 31), n=4, max_tokens=300,
                                                      response_format=json_schema_format(schema, "Event")))
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            checker.validate(value)
            TypeAdapter(Event).validate_python(value)


@pytest.mark.parametrize("where", ["root", "property", "$defs", "items"])
def test_x_guidance_in_a_schema_is_a_400(client, where):
    """llguidance reads an `x-guidance` key as its own options (separators that are not JSON's, coerce_one_of):
    a request's is refused wherever it stands, naming it; a property *named* x-guidance is just a name."""
    option = random.choice([{"item_separator": ";"}, {"key_separator": "=>"}, {"coerce_one_of": True},
                            {"whitespace_flexible": True}])
    leaf = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "properties": {"a": leaf, "b": {"$ref": "#/$defs/B"},
                                               "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
              "required": ["a", "b", "c"], "additionalProperties": False, "$defs": {"B": {"type": "boolean"}}}
    target = {"root": schema, "property": schema["properties"]["a"], "$defs": schema["$defs"]["B"],
              "items": schema["properties"]["c"]["items"]}[where]
    target["x-guidance"] = option
    err = _error(client.post("/v1/chat/completions", json=chat(response_format=json_schema_format(schema))))
    assert err["param"] == "response_format.json_schema.schema" and "'x-guidance'" in err["message"], err
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    err = _error(client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required")))
    assert err["param"] == "tools" and "x-guidance" in err["message"], err
    named = {"type": "object", "properties": {"x-guidance": {"type": "boolean"}}, "required": ["x-guidance"],
             "additionalProperties": False}
    r = client.post("/v1/chat/completions", json=chat(seed=random.randrange(2 ** 31),
                                                      response_format=json_schema_format(named)))
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), named)


def test_one_of_and_strict_all_of_messages(client):
    """oneOf llguidance cannot prove disjoint: the 400 says the branches may overlap and to use anyOf (not
    llguidance's 'Enable coerce_one_of', an option no request can set). A strict allOf of objects that only name
    properties is merged before strict mode closes it (each branch closed alone: 'required property is
    unsatisfiable'): its answers hold every branch, closed; a branch beyond that gets a 400 saying what strict did."""
    one_of = {"type": "object", "required": ["v"], "additionalProperties": False, "properties": {"v": {"oneOf": [
        {"type": "integer", "minimum": 0, "maximum": 5}, {"type": "number", "minimum": 0, "maximum": 5}]}}}
    err = _error(client.post("/v1/chat/completions", json=chat(response_format=json_schema_format(one_of))))
    assert "anyOf" in err["message"] and "overlap" in err["message"] and "coerce" not in err["message"], err
    rng = random.Random(random.getrandbits(64))
    names = rng.sample("abcdef", 3)
    leaf = {"type": "integer", "minimum": 0, "maximum": 9}
    all_of = {"allOf": [{"type": "object", "properties": {n: leaf}, "required": [n]} for n in names]}
    r = client.post("/v1/chat/completions", json=chat(seed=rng.randrange(2 ** 31), n=2,
                                                      response_format=json_schema_format(all_of)))
    closed = {"type": "object", "properties": {n: leaf for n in names}, "required": names,
              "additionalProperties": False}
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), closed)
    all_of["allOf"][0]["minProperties"] = 1  # a branch that is more than properties: closed on its own
    err = _error(client.post("/v1/chat/completions", json=chat(response_format=json_schema_format(all_of))))
    assert "unsatisfiable" in err["message"] and "allOf branch" in err["message"], err


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_unknown_response_format_fields_are_a_400(client, api):
    """A schema sent under a name lily does not read (json_object's schema, json_schema.parameters, schema beside
    json_schema) left the answer unconstrained with a 200: now a 400 naming the field and saying where the schema
    goes. Unknown fields elsewhere in the body are still ignored (clients send many)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    odd = random.choice(["parameters", "json_schema", "format"])  # (each a field of some other object)
    if api == "chat":
        cases = [({"type": "json_object", "schema": schema}, "response_format.schema", '"type": "json_schema"'),
                 ({"type": "json_schema", "json_schema": {"name": "o", odd: schema}},
                  f"response_format.json_schema.{odd}", "response_format.json_schema.schema"),
                 ({"type": "json_schema", "json_schema": {"name": "o"}, "schema": schema},
                  "response_format.schema", "response_format.json_schema.schema"),
                 ({"type": "text", odd: schema}, f"response_format.{odd}", "no other field")]
    else:
        cases = [({"type": "json_object", "schema": schema}, "text.format.schema", '"type": "json_schema"'),
                 ({"type": "json_schema", "name": "o", odd: schema}, f"text.format.{odd}", "text.format.schema")]
    for fmt, param, says in cases:
        if api == "chat":
            r = client.post("/v1/chat/completions", json=chat(response_format=fmt, max_tokens=20))
        else:
            r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 20,
                                                   "text": {"format": fmt}})
        err = _error(r)
        assert err["param"] == param and says in err["message"], (fmt, err)
    r = client.post("/v1/chat/completions", json=chat(max_tokens=5, **{f"x_{random.randrange(99)}": 1},
                                                      response_format={"type": "json_object"}))
    assert r.status_code == 200, r.text


def test_responses_function_tools_are_strict_unless_false(client):
    """OpenAI's Responses API reads a function tool without strict (or with strict null) as strict, chat's tools
    are not strict unless they say so. Left out, a tool is strict where the call grammar can hold its parameters
    (held to them, listed as strict) and otherwise keeps the loose form, not a 400 the client never asked for; said
    true, a parameter the grammar cannot hold (a string's pattern or format) is the 400; said false, loose."""
    from lily.server.chat_prompt import request_tools
    from lily.server.protocol import ResponsesRequest
    from lily.server.responses_api import chat_request_from

    unholdable = {"type": "object", "required": ["to"], "additionalProperties": False,
                  "properties": {"to": {"type": "string", "maxLength": 8, **random.choice(
                      [{"pattern": "^[a-z]+$"}, {"format": "email"}])}}}
    holdable = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 1,
                                                                          "maximum": random.randrange(2, 9)}}}
    cases = [(unholdable, None, False), (unholdable, "absent", False), (unholdable, True, None),
             (unholdable, False, False), (holdable, None, True), (holdable, "absent", True), (holdable, False, False)]
    for params, strict, want in cases:
        tool = {"type": "function", "name": "mail", "parameters": params}
        if strict != "absent":
            tool["strict"] = strict
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [tool], "tool_choice": "required",
                                               "max_output_tokens": 60, "reasoning": {"effort": "none"}})
        if want is None:   # strict said, and not holdable
            assert _error(r)["param"] == "tools", r.text
            continue
        body = ResponsesRequest.model_validate({"input": "hi", "tools": [tool], "tool_choice": "required"})
        request = chat_request_from(body)
        assert request.tools[0].function.applied_strict is want, (params, strict)
        # the template shows the tool as it was sent: no strict the client left out
        assert ("strict" in request_tools(request)[0]["function"]) is (strict in (True, False)), (params, strict)
        assert r.status_code == 200 and r.json()["tools"][0]["strict"] is want, r.text
        if want:   # held to its parameters
            calls = [i for i in r.json()["output"] if i["type"] == "function_call"]
            for call in calls if r.json()["status"] == "completed" else []:
                jsonschema.validate(json.loads(call["arguments"]), {**params, "additionalProperties": False})
    tool = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [tool], "max_output_tokens": 5,
                                           "reasoning": {"effort": "none"}})
    assert r.status_code == 200 and r.json()["tools"][0]["strict"] is True, r.text


def test_a_strict_tool_closes_the_objects_in_its_values(client):
    """A strict tool's values hold their nested objects to the properties they list, as a strict json_schema's
    (the random model added keys to them); answers validate against the closed schema."""
    from lily.server.structured import closed_objects

    rng = random.Random(random.getrandbits(64))
    params = open_nested(rng)
    params["additionalProperties"] = False
    tool = {"type": "function", "function": {"name": "nest", "strict": True, "parameters": params}}
    for _ in range(3):
        r = client.post("/v1/chat/completions", json=chat(seed=rng.randrange(2 ** 31), tools=[tool],
                                                          tool_choice="required", max_tokens=600))
        calls, finish = _calls_and_finish(r, False)
        if finish == "length":
            continue
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), closed_objects(params))


def test_tool_choice_errors(client):
    r = client.post("/v1/chat/completions", json=chat(tools=[TIME], tool_choice={
        "type": "function", "function": {"name": "nope"}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and "nope" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat(tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_one_call_without_a_grammar_ends_at_the_first_call(client, tokenizer):
    """tool_choice auto with parallel_tool_calls false: the output stops at the first </tool_call> (a stop
    string) and the parser reads that one call; with parallel calls allowed, nothing stops it there."""
    from lily.server.chat_parsing import ChatOutputParser
    from lily.server.protocol import ChatCompletionRequest
    from lily.engine.generation import StopString
    from lily.server.structured import chat_stops

    one = ChatCompletionRequest.model_validate(chat(tools=[TIME], parallel_tool_calls=False))
    assert chat_stops(one, None, False) == [StopString("</tool_call>", keep=True)]
    assert chat_stops(one, None, True) == [StopString("</tool_call>", after="</think>", keep=True)]  # not in reasoning
    assert chat_stops(ChatCompletionRequest.model_validate(chat(tools=[TIME])), None, False) == []
    zone = random.choice(["UTC", "CET"])
    text = f"<tool_call>\n<function=get_time>\n<parameter=zone>\n{zone}\n</parameter>\n</function>\n</tool_call>"
    cut = text  # what the stop string leaves of two calls: the first, its closing tag kept
    parser = ChatOutputParser(False, [TIME])
    calls = parser.feed(cut).tool_calls + parser.finish().tool_calls
    assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [("get_time", {"zone": zone}, True)]


@pytest.mark.parametrize("seed", range(4))
def test_legacy_functions_and_function_call(client, seed):
    """The legacy reply holds one function_call, so the request allows one call: the output ends after it (it
    had let the random model chain calls until max_tokens, finish_reason "length", on ~1 seed in 60)."""
    fn = WEATHER["function"]
    r = client.post("/v1/chat/completions", json=chat(seed=(SEED + seed) % 89, functions=[fn],
                                                      function_call={"name": fn["name"]}, logprobs=True))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the function named: "stop", as a named tool_choice
    call = choice["message"]["function_call"]
    assert call["name"] == fn["name"] and "tool_calls" not in choice["message"]
    jsonschema.validate(json.loads(call["arguments"]), fn["parameters"])
    text = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert text.count("<tool_call>") == 1, text


def test_legacy_functions_allow_one_call():
    """functions (the legacy API) become tools with parallel_tool_calls false unless the request says otherwise
    (what the tool-call grammar reads), and function_call auto stops at the first </tool_call>."""
    from lily.server.protocol import ChatCompletionRequest
    from lily.engine.generation import StopString
    from lily.server.structured import chat_stops

    fn = WEATHER["function"]
    named = ChatCompletionRequest.model_validate(chat(functions=[fn], function_call={"name": fn["name"]}))
    auto = ChatCompletionRequest.model_validate(chat(functions=[fn], function_call="auto"))
    assert named.parallel_tool_calls is False and auto.parallel_tool_calls is False
    assert chat_stops(auto, None, False) == [StopString("</tool_call>", keep=True)]
    assert ChatCompletionRequest.model_validate(chat(tools=[WEATHER])).parallel_tool_calls is None


def test_responses_text_format(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 400,
                                           "reasoning": {"effort": "none"}, "text": {"format": {
                                               "type": "json_schema", "name": "person", "schema": PERSON,
                                               "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["text"]["format"]["name"] == "person"
    text = body["output"][-1]["content"][0]["text"]
    jsonschema.validate(json.loads(text), PERSON)
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    assert '"if"' in r.json()["error"]["message"] and "text.format.schema" in r.json()["error"]["message"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": [random.randint(0, 9)]}}})  # pydantic's own path, no union tag
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text


def test_grammar_starts_after_thinking(client, tokenizer):
    """Thinking on: the end-of-thinking token first (biased), then the answer under the grammar."""
    think_end = tokenizer.token_id("</think>")
    r = client.post("/v1/chat/completions", json=chat(reasoning_effort="high", seed=SEED % 83,
                                                      logit_bias={str(think_end): 100},
                                                      response_format=json_schema_format(PERSON)))
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == ""
    jsonschema.validate(json.loads(message["content"]), PERSON)


# -- text completions' response_format: from the first token (no thinking) ------------------------------------
@pytest.fixture(scope="module")
def sdk(client):
    """The openai client over the in-process app of random logits (response_format is not a parameter of its
    completions.create: sent in extra_body)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=client)


@pytest.mark.parametrize("k", range(3))
def test_completions_json_schema_answers_validate(sdk, k):
    done = sdk.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=400, n=2, seed=SEED + k,
                                  temperature=1.0, extra_body={"response_format": json_schema_format(PERSON)})
    assert len(done.choices) == 2
    for choice in done.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), PERSON)


@pytest.mark.parametrize("k", range(3))
def test_streamed_completions_json_schema_answers_validate(sdk, k):
    texts, finish = {}, {}
    for chunk in sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=400, n=2, seed=SEED + 100 + k,
                                        stream=True, extra_body={"response_format": json_schema_format(PERSON)}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_json_object_and_echo(sdk):
    """Any JSON object; with echo, the prompt comes first and the grammar holds only what follows it."""
    prompt = "x = "
    done = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=60, seed=SEED + 7, echo=True,
                                  extra_body={"response_format": {"type": "json_object"}})
    choice = done.choices[0]
    assert choice.text.startswith(prompt) and choice.text[len(prompt):].lstrip().startswith("{"), choice
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text[len(prompt):]), dict)
    done = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, seed=SEED + 7,
                                  extra_body={"response_format": {"type": "text"}})  # text: no grammar
    assert done.choices[0].finish_reason in ("stop", "length")


def test_completions_schema_the_engine_cannot_honour_is_a_400_naming_it(client):
    schema = {"type": "object", "if": {"required": ["a"]}, "then": {}}
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                             "response_format": json_schema_format(schema)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and '"if"' in err["message"]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


# -- a real `lily serve` of the tiny model, through the openai client ----------------------------------------
class Pet(BaseModel):
    kind: str = Field(pattern="^(cat|dog)$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    pet: Pet | None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_synthetic("tiny", tmp_path_factory.mktemp("so") / "ckpt", seed=SEED % 1000)
    with load_test.LilyServer(ckpt, "--served-model-name", MODEL, "--max-seq", "2048",
                              log_path=tmp_path_factory.mktemp("log") / "serve.log") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_openai_parse_against_lily_serve(served):
    for seed in range(2):
        done = served.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "a person"}],
                                             response_format=Person, max_tokens=300, seed=SEED + seed,
                                             reasoning_effort="none")
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


class Size(str, enum.Enum):
    small = "small"
    large = "large"


class Room(BaseModel):
    name: str = Field(max_length=8)
    size: Size


class House(BaseModel):
    rooms: list[Room] = Field(max_length=2)
    garden: Room | None
    floors: int | None = Field(ge=0, le=9)


def test_openai_pydantic_tool_parse_against_lily_serve(served):
    """openai.pydantic_function_tool of a model with nested models, an Enum, Optional and List[Model] ($defs and
    $refs: a 400 "Pointer '/$defs/Room' does not exist"), through parse() with the function named, fresh seeds:
    the arguments valid against the tool's whole schema and parsed back into the model."""
    tool = openai.pydantic_function_tool(House)
    for _ in range(2):
        done = served.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "a house"}], tools=[tool], max_tokens=1000, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "House"}}, seed=random.randrange(2 ** 31),
            reasoning_effort="none")
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        call, = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert isinstance(call.function.parsed_arguments, House)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_to_a_non_strict_tool_validate_against_lily_serve(served, stream):
    """The tiny model through the openai client: required and a named function on a tool without strict, fresh
    seeds; every call's arguments are valid against its parameters (the named call's finish_reason "stop")."""
    params = FORECAST["function"]["parameters"]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_forecast"}}):
        for _ in range(2):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "the forecast for Lyon"}], tools=[FORECAST],
                      tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=500,
                      seed=random.randrange(2 ** 31), reasoning_effort="none")
            if stream:
                calls, finish = {}, None
                for chunk in served.chat.completions.create(stream=True, **kw):
                    for c in chunk.choices:
                        for tc in c.delta.tool_calls or []:
                            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
                        finish = c.finish_reason or finish
                calls = [tuple(calls[k]) for k in sorted(calls)]
            else:
                choice = served.chat.completions.create(**kw).choices[0]
                calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
                finish = choice.finish_reason
            assert calls and finish == ("tool_calls" if tool_choice == "required" else "stop"), (calls, finish)
            for name, arguments in calls:
                assert name == "get_forecast"
                jsonschema.validate(json.loads(arguments), params)


def test_langchain_style_json_schema_request_against_lily_serve(served):
    """The body LangChain's with_structured_output(method="json_schema") sends."""
    r = served.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "describe a person"}], max_tokens=300,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, seed=SEED,
        response_format={"type": "json_schema", "json_schema": {
            "name": "Person", "description": "A person.", "schema": PERSON, "strict": False}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_against_lily_serve(served, stream):
    for k in range(2):
        kw = dict(model=MODEL, prompt="A person:", max_tokens=300, seed=SEED + 31 * k + stream,
                  extra_body={"response_format": json_schema_format(PERSON)})
        if stream:
            chunks = list(served.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            done = served.completions.create(**kw)
            text, finish = done.choices[0].text, [done.choices[0].finish_reason]
        assert finish == ["stop"], text
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_too_complex_for_the_grammar_engine_against_lily_serve(served, stream):
    """Through the openai client: a 400 it raises as BadRequestError, or streamed the error event it raises on;
    the server answers the next request."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30, reasoning_effort="none",
              response_format=json_schema_format(many_optional_properties()))
    if stream:
        with pytest.raises(openai.APIError, match="response_format.json_schema.schema: too complex") as e:
            for chunk in served.chat.completions.create(stream=True, **kw):
                assert not (chunk.choices and chunk.choices[0].finish_reason), chunk
        assert e.value.body["param"] == "response_format.json_schema.schema"
    else:
        with pytest.raises(openai.BadRequestError, match="too complex for the grammar engine") as e:
            served.chat.completions.create(**kw)
        assert e.value.body["param"] == "response_format.json_schema.schema"
    done = served.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          reasoning_effort="none")
    assert done.choices[0].finish_reason in ("stop", "length")


def test_an_end_of_text_cannot_end_the_thinking_while_a_grammar_waits_against_lily_serve(served, tokenizer):
    """The tiny model through the openai client, thinking on, the end-of-text biased to win every draw and </think>
    next: the answer comes under its grammar (it was a 'stop' with no answer at the first token)."""
    bias = {str(t): 100 for t in tokenizer.eos_token_ids} | {str(tokenizer.token_id("</think>")): 50}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    for _ in range(2):
        done = served.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=300, temperature=1.0,
            seed=random.randrange(2 ** 31), reasoning_effort="high", response_format=json_schema_format(schema),
            logit_bias=bias)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


# -- tools under tool_choice auto (or absent) with a response_format: tool calls or the format's JSON -----------
def _answer(served, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason) of one chat answer through the openai client."""
    if not stream:
        choice = served.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in served.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [tuple(calls[k]) for k in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("push", ["call", "json", None])
def test_auto_tools_with_a_response_format_call_or_answer_against_lily_serve(served, tokenizer, push, stream):
    """What the OpenAI Agents SDK sends (tools, tool_choice auto or absent, its output_type as json_schema): the
    JSON grammar held the answer from its first token, so a call could never be written (QA
    repro_tools_plus_format.py). Now, with <tool_call> biased up the tiny model calls (arguments valid against the
    tool's parameters, strict or not), biased out it answers JSON valid against the schema, unbiased either."""
    call_id = tokenizer.token_id("<tool_call>")
    tools = [WEATHER, FORECAST]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for _ in range(2):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "the weather in Lyon"}], tools=tools,
                  response_format=json_schema_format(PERSON), parallel_tool_calls=False, max_tokens=600,
                  temperature=1.0, seed=random.randrange(2 ** 31), reasoning_effort="none")
        if random.random() < 0.5:
            kw["tool_choice"] = "auto"
        if push is not None:
            kw["logit_bias"] = {str(call_id): 30 if push == "call" else -100}
        content, calls, finish = _answer(served, stream, **kw)
        assert bool(calls) == (push == "call") or push is None, (content, calls)
        if calls:
            assert finish == "tool_calls" and len(calls) == 1 and content is None, (content, calls, finish)
            name, arguments = calls[0]
            jsonschema.validate(json.loads(arguments), params[name])
        else:
            assert finish == "stop", (content, finish)
            jsonschema.validate(json.loads(content), PERSON)


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_auto_tools_with_a_pydantic_output_type_parse_against_lily_serve(served, tokenizer):
    """chat.completions.parse with a pydantic tool and a pydantic response_format (strict both), as an agent sends
    them: biased to <tool_call>, a call parsed into the tool's model; biased away, the answer parsed into the
    output type."""
    call_id = tokenizer.token_id("<tool_call>")
    for bias in (30, -100):
        done = served.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "a forecast"}], max_tokens=600, temperature=1.0,
            tools=[openai.pydantic_function_tool(Forecast)], response_format=Person, parallel_tool_calls=False,
            seed=random.randrange(2 ** 31), reasoning_effort="none", logit_bias={str(call_id): bias})
        message = done.choices[0].message
        if bias > 0:
            call, = message.tool_calls
            assert isinstance(call.function.parsed_arguments, Forecast) and message.parsed is None, message
        else:
            assert not message.tool_calls and isinstance(message.parsed, Person), message


class PushedBackend(RandomBackend):
    """Random logits with one token pushed up wherever the grammar allows it (the Responses API has no logit_bias)."""

    def __init__(self, vocab: int, seed: int, token: int):
        super().__init__(vocab, seed)
        self.token = token

    def _logits(self, s):
        logits = super()._logits(s)
        logits[self.token] += 30
        return logits


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("push", ["<tool_call>", "{"])
def test_responses_tools_with_a_text_format_call_or_answer(tokenizer, push, stream):
    """The Responses API (tools + text.format, through the same chat_constraint) through the openai client: with
    <tool_call> pushed up the answer is function_call items, arguments valid; with "{" a message whose text
    validates against the format's schema."""
    token = tokenizer.token_id(push) if push == "<tool_call>" else tokenizer.encode(push)[0]
    app = create_app(PushedBackend(tokenizer.vocab_size, random.randrange(2 ** 31), token), tokenizer,
                     ServerSettings(model_name=MODEL, max_seq=2048))
    with TestClient(app) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)
        kw = dict(model=MODEL, input="the weather in Lyon", max_output_tokens=600, reasoning={"effort": "none"},
                  tools=[{"type": "function", **WEATHER["function"]}], parallel_tool_calls=False,
                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        if stream:
            events = list(sdk.responses.create(stream=True, **kw))
            response = events[-1].response
        else:
            response = sdk.responses.create(**kw)
    assert response.status == "completed", response
    if push == "<tool_call>":
        item, = response.output
        assert item.type == "function_call" and item.name == "get_weather", response.output
        jsonschema.validate(json.loads(item.arguments), WEATHER["function"]["parameters"])
    else:
        assert [item.type for item in response.output] == ["message"], response.output
        jsonschema.validate(json.loads(response.output_text), PERSON)


def test_auto_tools_with_a_response_format_400s_name_their_field(client):
    """Under the either grammar a 400 names the part it cannot enforce: a strict tool's pattern the tool (as under
    tool_choice required), the format's unsupported keyword response_format.json_schema.schema (text.format on
    the Responses API)."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}}}
    r = client.post("/v1/chat/completions", json=chat(tools=[tool], response_format=json_schema_format(PERSON)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tool 'f': parameter 'a'" in r.json()["error"]["message"], r.text
    bad = {"type": "object", "if": {"required": ["a"]}, "then": {}}
    r = client.post("/v1/chat/completions", json=chat(tools=[WEATHER], response_format=json_schema_format(bad)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [{"type": "function", **WEATHER["function"]}],
                                           "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_a_tool_name_the_call_format_cannot_carry_is_a_400_and_any_other_round_trips(client):
    """A call names its tool as <function=NAME>: a name with '>' or a line break (which end it early), or with
    whitespace at its ends (stripped when read back), is a 400 naming the field (it came back as another tool's
    name with broken arguments, or as markup in the content); any other name (spaces, dots, '<', non-ASCII, long)
    comes back exactly under a forced call, in chat and in the Responses API."""
    rng = random.Random(SEED + 41)
    params = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    for bad in ("a>b", "a\nb", " lead", "trail ", "x>", rng.choice(["get>weather", "get\nweather"])):
        tool = {"type": "function", "function": {"name": bad, "parameters": params}}
        r = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name", r.text
        assert "<function=NAME>" in r.json()["error"]["message"]
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [{
            "type": "function", "name": bad, "parameters": params}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name", r.text
    for good in ("get weather", "v1.get_weather", "a<b", "météo", "x" * rng.randint(60, 200), "a=b"):
        tool = {"type": "function", "function": {"name": good, "strict": True, "parameters": params}}
        named = {"type": "function", "function": {"name": good}}
        r = client.post("/v1/chat/completions", json=chat(seed=rng.randrange(1000), tools=[tool], tool_choice=named))
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == good and json.loads(call["arguments"])["x"] in range(10), r.text
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "none"},
                                               "tools": [{"type": "function", "name": good, "parameters": params}],
                                               "tool_choice": {"type": "function", "name": good}})
        items = [i for i in r.json()["output"] if i["type"] == "function_call"]
        assert items and items[0]["name"] == good, r.text
