"""The tool-call grammar (tool_choice required / named: lily.server.structured.tool_call_grammar) fed whole call
texts as a model writes them, token by token through the engine's own TokenConstraint (each token checked against
the mask it computed, then accepted), over the demo tokenizer: short, empty and exactly-maxLength strings, strings
with newlines, "<", "</param", non-ASCII, integers, booleans, enums, a const, JSON objects, several parameters,
optional ones left out, parallel calls; each accepted to its end with the call finished, and read back by the
output parser as written. Texts the schema refuses (a string over maxLength or under minLength, a missing required
parameter, a value holding </parameter> or another tag the parser reads as the call's structure, a value of the
wrong type, a second call where parallel calls are off) are refused, and not before what is wrong.
Values are fresh random text each run (the test's seed). A text value's tokens are also re-cut at random (a model
may write free text in other tokens than the canonical ones; llguidance lets the forced text of the format itself
be written only in its canonical tokens, so those stay as the tokenizer cuts the whole answer).
The grammar's value lexeme once ran on through "\\n</parameter" (llguidance lexes greedily), so a string could
close only at exactly its maxLength and one without maxLength never: a model writing Lyon\\n</parameter> was
masked into something else."""

import enum
import json
import random
import re
from types import SimpleNamespace
from typing import List, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from lily.demo_tokenizer import SPECIAL_TOKENS, write_tokenizer_files
from lily.engine.constraints import ConstraintSpec, GrammarError, Grammars
from lily.server.chat_parsing import ChatOutputParser
from lily.server.protocol import ChatCompletionRequest
from lily.server.structured import chat_constraint, tool_call_grammar
from lily.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": -5, "maximum": 100},
        "unit": {"type": "string", "enum": ["c", "cc", "f"]},
        "note": {"type": "string", "description": "free text"},
        "code": {"type": "string", "minLength": 3, "maxLength": 40},
        "exact": {"type": "boolean"},
        "kind": {"type": "string", "const": "memo"},
        "where": {"type": "object", "required": ["lat"], "additionalProperties": False,
                  "properties": {"lat": {"type": "number"}}}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}
# not strict, and other parameters than the declared ones allowed: its call keeps the loose form (any names, text
# values); a keyword the grammar cannot hold on one value loosens that value alone (test_a_non_strict_value_...)
MAIL = {"type": "function", "function": {"name": "mail", "parameters": {
    "type": "object", "properties": {"to": {"type": "string"}}, "additionalProperties": True}}}

# what random text is made of: pieces of the closing tag and of the other tags among ordinary text
PIECES = ["a", "b", "Lyon", "x y", " ", "\n", "\n\n", "\t", "<", ">", "/", "=", "</", "</param", "</parameter",
          "<parameter", "parameter", "</function", "function>", "</tool_call", "tool_call>", "<b>", "é", "中文", "😀",
          "{", "}", '"', "\\", "12", "-"]
# the tags the output parser reads as a call's structure wherever they stand: no value may hold them
STRUCTURE_TAGS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")
SPECIALS = tuple(SPECIAL_TOKENS)  # the demo vocabulary's added tokens (<tool_call>, </tool_call>, ...)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def strict(tool):
    fn = json.loads(json.dumps(tool["function"]))
    fn["strict"] = True
    if fn.get("parameters"):
        fn["parameters"]["additionalProperties"] = False
    return {"type": "function", "function": fn}


def grammar(tokenizer, grammars, tools, choice="required", parallel=None):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": choice if choice == "required" else {"type": "function", "function": {"name": choice}}}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    source = tool_call_grammar(SimpleNamespace(tokenizer=tokenizer), ChatCompletionRequest.model_validate(body))
    return grammars.lark(source)


# -- answers as a model writes them ---------------------------------------------------------------------
def random_text(rng, n: int) -> str:
    """n characters of random text holding no tag the parser reads as structure and no special token's text."""
    while True:
        text = ""
        while len(text) < n:
            text += rng.choice(PIECES)
        text = text[:n]
        if not any(t in text for t in STRUCTURE_TAGS + SPECIALS):
            return text


def random_value(rng, schema):
    """A valid value: (the text the model writes, the JSON value the client gets, whether the text is free)."""
    if "const" in schema:
        return schema["const"], schema["const"], False
    if "enum" in schema:
        v = rng.choice(schema["enum"])
        return v, v, False
    typ = schema.get("type")
    if typ == "integer":
        v = rng.randint(schema["minimum"], schema["maximum"])
        return str(v), v, False
    if typ == "boolean":
        v = rng.random() < 0.5
        return json.dumps(v), v, False
    if typ == "object":
        v = {"lat": round(rng.uniform(-90, 90), rng.randrange(4))}
        return json.dumps(v), v, False
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    pick = rng.random()
    if pick < 0.2:
        n = lo  # as short as allowed (empty where minLength allows)
    elif pick < 0.4 and hi is not None:
        n = hi  # exactly maxLength
    else:
        n = rng.randint(lo, min(hi if hi is not None else 60, lo + 60))
    v = random_text(rng, n)
    return v, v, True


def call_segments(name, params):
    """A call's text as [(text, free)]: free text is a parameter's own text (any tokens may write it)."""
    segs = [(f"<tool_call>\n<function={name}>\n", False)]
    for key, text, free in params:
        segs += [(f"<parameter={key}>\n", False), (text, free), ("\n</parameter>\n", False)]
    return segs + [("</function>\n</tool_call>", False)]


def random_call(rng, tool, omit=0.4):
    """(segments, name, arguments) of a valid call: the required parameters, each optional one or not."""
    fn = tool["function"]
    params = fn.get("parameters") or {}
    required = set(params.get("required", []))
    written, args = [], {}
    for name, schema in params.get("properties", {}).items():
        if name in required or rng.random() > omit:
            text, value, free = random_value(rng, schema)
            written.append((name, text, free))
            args[name] = value
    return call_segments(fn["name"], written), fn["name"], args


def tokens(tokenizer, rng, segs) -> list[int]:
    """The answer's tokens: the tokenizer's for the whole text (tags as their special tokens), then, at random,
    each token that lies inside free text cut into smaller ones (so the value's tokens fall otherwise)."""
    if isinstance(segs, str):
        segs = [(segs, False)]
    text = "".join(t for t, _ in segs)
    free, at = [], 0
    for t, is_free in segs:
        n = len(t.encode())
        if is_free:
            free.append((at, at + n))
        at += n
    ids, at = [], 0
    for t in tokenizer.encode(text):
        raw = bytes(tokenizer.token_bytes(t))
        inside = any(a <= at and at + len(raw) <= b for a, b in free)
        at += len(raw)
        try:
            piece = raw.decode()
        except UnicodeDecodeError:  # part of a character: kept whole
            piece = ""
        if inside and len(piece) > 1 and rng.random() < 0.6:
            cut = rng.randrange(1, len(piece))
            ids += tokenizer.encode(piece[:cut]) + tokenizer.encode(piece[cut:])
        else:
            ids.append(t)
    assert tokenizer.decode(ids) == text
    return ids


def plain(tokenizer, text: str) -> list[int]:
    """A tag's text in ordinary tokens ("</" then the rest), as a model could spell a special token out."""
    return tokenizer.encode(text[:2]) + tokenizer.encode(text[2:])


# -- the engine's constraint over them ------------------------------------------------------------------
def feed(grammar, ids, never=()):
    """Each token checked against the mask the engine's TokenConstraint computed, then accepted: the constraint
    and None when all are allowed, or the index of the first one refused. No token of `never` is allowed on the
    way."""
    c = ConstraintSpec(grammar).start("cpu")
    for k, t in enumerate(ids):
        assert not any(allowed(c, n) for n in never), (k, ids)
        if not allowed(c, t):
            return c, k
        c.accept(t)
    return c, None


def allowed(c, token: int) -> bool:
    mask = c.allowed()
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def assert_accepted(tokenizer, grammar, rng, segs, one_call: bool):
    ids = tokens(tokenizer, rng, segs)
    # in one call, the end of text or another control token (in a value too) never allowed before its end
    never = [tokenizer.token_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>", "<|im_start|>")]
    c, refused = feed(grammar, ids, never if one_call else ())
    assert refused is None, (f"refused {tokenizer.token_text(ids[refused])!r} after "
                             f"{tokenizer.decode(ids[:refused])!r}")
    if one_call:
        assert c.finished, segs  # the grammar is complete: only the end of text may follow
    else:  # complete: the end of text or another call may follow
        assert c.matcher.is_accepting() and allowed(c, tokenizer.eos_token_ids[0]), segs


def assert_refused(tokenizer, grammar, good: str, text: str, ids=None):
    """The text (or its tokens `ids`) is refused, and not before what is wrong: its first `good` text (what a
    valid call could begin with) is allowed, and the token refused reaches past it."""
    assert text.startswith(good)
    assert feed(grammar, tokenizer.encode(good))[1] is None, good
    ids = tokenizer.encode(text) if ids is None else ids
    _, refused = feed(grammar, ids)
    assert refused is not None, text
    assert len(tokenizer.decode(ids[:refused + 1]).encode()) > len(good.encode()), (text, refused)


def parsed(tools, text, rng, answer_else: bool = False):
    """The calls (name, arguments) and content the output parser reads from the text, streamed in random pieces
    (answer_else: as the routes read an answer under the calls-or-JSON grammar)."""
    parser = ChatOutputParser(False, tools, held=True, answer_else=answer_else)
    calls, content, i = [], "", 0
    while i < len(text):
        j = i + rng.randint(1, 12)
        d = parser.feed(text[i:j])
        calls += d.tool_calls
        content += d.content
        i = j
    d = parser.finish()
    return [(c.name, json.loads(c.arguments)) for c in calls + d.tool_calls], content + d.content


def joined(segs) -> str:
    return "".join(t for t, _ in segs)


# -- the tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_strict", [False, True])
def test_calls_a_model_writes_are_accepted_to_their_end_and_read_back_as_written(tokenizer, grammars, is_strict):
    rng = random.Random(random.getrandbits(64))
    tools = [strict(t) if is_strict else t for t in (WEATHER, TIME, PING)]
    by_name = {t["function"]["name"]: t for t in tools}
    many = grammar(tokenizer, grammars, tools)
    one = grammar(tokenizer, grammars, tools, parallel=False)
    named = grammar(tokenizer, grammars, tools, choice="get_weather", parallel=False)
    for _ in range(40):
        calls = [random_call(rng, rng.choice(tools)) for _ in range(rng.choice([1, 1, 2, 3]))]
        lead = [("".join(rng.choice(" \n") for _ in range(rng.randrange(3))), False)]
        segs = lead + [s for k, c in enumerate(calls) for s in ([("\n", False)] if k else []) + c[0]]
        assert_accepted(tokenizer, many, rng, segs, one_call=False)
        assert parsed(tools, joined(segs), rng) == ([(name, args) for _, name, args in calls], "")
        for _, name, args in calls:
            jsonschema.validate(args, by_name[name]["function"].get("parameters") or {})
        assert_accepted(tokenizer, one, rng, lead + calls[0][0], one_call=True)
        weather = random_call(rng, tools[0])
        assert_accepted(tokenizer, named, rng, weather[0], one_call=True)
        assert parsed(tools, joined(weather[0]), rng) == ([weather[1:]], "")


@pytest.mark.parametrize("value", ["Lyon", "", "a\nb", "\n", "\nLyon\n", "x</param", "<", "</", "</parameter",
                                   "<parameter", "a </function", "Zürich 😀", "x" * 16, "é" * 16])
def test_a_bounded_string_closes_at_any_length_within_its_bound(tokenizer, grammars, value):
    """The case that was masked: city (maxLength 16) closed before its bound, as a model writes it."""
    g = grammar(tokenizer, grammars, [WEATHER], parallel=False)
    segs = call_segments("get_weather", [("city", value, True)])
    assert_accepted(tokenizer, g, random.Random(random.getrandbits(64)), segs, one_call=True)
    assert parsed([WEATHER], joined(segs), random.Random(0)) == ([("get_weather", {"city": value})], "")


def test_loose_calls_close_their_values_too(tokenizer, grammars):
    """A tool without strict whose object the grammar cannot hold (other parameters allowed) keeps the loose form:
    any parameter names, text values, closed as the model closes them."""
    rng = random.Random(random.getrandbits(64))
    g = grammar(tokenizer, grammars, [MAIL], parallel=False)
    assert 'fn_0: "mail>\\n" ("<parameter=" PNAME' in g.source, g.source
    for _ in range(20):
        params = [(rng.choice(["to", "cc", "subject"]), random_text(rng, rng.randrange(30)))
                  for _ in range(rng.randrange(4))]
        segs = call_segments("mail", [(k, v, True) for k, v in params])
        assert_accepted(tokenizer, g, rng, segs, one_call=True)
        assert parsed([MAIL], joined(segs), rng) == ([("mail", dict(params))], "")


def test_calls_the_schema_does_not_allow_are_refused(tokenizer, grammars):
    rng = random.Random(random.getrandbits(64))
    g = grammar(tokenizer, grammars, [WEATHER, TIME], parallel=False)
    head = "<tool_call>\n<function=get_weather>\n"
    end = "</function>\n</tool_call>"
    for _ in range(8):
        city = random_text(rng, rng.randrange(1, 17))
        good = head + f"<parameter=city>\n{city}\n</parameter>\n"
        assert_accepted(tokenizer, g, rng, good + end, one_call=True)
        # a string over maxLength, one under minLength
        long = random_text(rng, 17 + rng.randrange(10))
        assert_refused(tokenizer, g, head + "<parameter=city>\n" + long[:16],
                       head + f"<parameter=city>\n{long}\n</parameter>\n" + end)
        short = random_text(rng, rng.randrange(3))
        assert_refused(tokenizer, g, good + "<parameter=code>\n" + short,
                       good + f"<parameter=code>\n{short}\n</parameter>\n" + end)
        # a missing required parameter (city), a parameter not declared
        assert_refused(tokenizer, g, head + "<parameter=", head + "<parameter=days>\n3\n</parameter>\n" + end)
        assert_refused(tokenizer, g, good + "<parameter=", good + "<parameter=town>\nx\n</parameter>\n" + end)
        # a tag the parser reads as the call's structure inside a value, its text in ordinary tokens too
        for tag in STRUCTURE_TAGS:
            a, b = random_text(rng, rng.randrange(6)), random_text(rng, rng.randrange(6))
            before, after = good + "<parameter=note>\n" + a, f"{b}\n</parameter>\n" + end
            assert_refused(tokenizer, g, before, before + tag + after)
            assert_refused(tokenizer, g, before, before + tag + after,
                           tokenizer.encode(before) + plain(tokenizer, tag) + tokenizer.encode(after))
        # values of the wrong type, beyond the bounds, an enum's non-value, not the const
        for name, value in [("days", "abc"), ("days", "1.5"), ("days", "101"), ("days", ""), ("exact", "yes"),
                            ("unit", "k"), ("unit", "ccc"), ("kind", "note"), ("where", '{"lon": 1}')]:
            assert_refused(tokenizer, g, good + f"<parameter={name}>\n",
                           good + f"<parameter={name}>\n{value}\n</parameter>\n" + end)
        # a second call where parallel calls are off
        assert_refused(tokenizer, g, good + end, good + end + "\n" + good + end)


def test_the_value_text_regex_is_any_text_without_the_tags():
    """The value regex (written out, not a negation) against Python's re on random text dense in tag pieces."""
    from lily.server.structured import VALUE_TEXT

    rng = random.Random(random.getrandbits(64))
    value = re.compile(VALUE_TEXT)
    pieces = PIECES + list(STRUCTURE_TAGS) + ["<tool_call", "/parameter>", "parameter=", "<<", "</>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
        assert bool(value.fullmatch(text)) == (not any(t in text for t in STRUCTURE_TAGS)), text


def test_an_enum_the_call_format_cannot_carry_is_refused(tokenizer, grammars):
    """An enum / const value holding a structure tag could never be read back, an empty enum has no valid value:
    a strict tool's 400 (a GrammarError naming the tool and the parameter); a tool without strict keeps the
    parameter, its value free text."""
    for enum in (["a</parameter>b"], ["ok", "x<parameter=y"], []):
        tool = {"type": "function", "function": {"name": "t", "parameters": {
            "type": "object", "properties": {"p": {"type": "string", "enum": enum}}}}}
        with pytest.raises(GrammarError, match="tool 't': parameter 'p': "):
            grammar(tokenizer, grammars, [strict(tool)])
        source = grammar(tokenizer, grammars, [tool]).source
        assert 'fn_0: "t>\\n" p_0_0?' in source and "v_0_0: TEXT" in source, source


# -- pydantic models as tools ($defs and $ref: a nested model, an Enum, Optional, List[Model], a recursive model) ----
class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Addr(BaseModel):
    city: str = Field(max_length=8)
    zip: int = Field(ge=0, le=99999)


class Node(BaseModel):
    v: int = Field(ge=-9, le=9)
    kids: List["Node"] = Field(max_length=3)


class Person(BaseModel):
    name: str = Field(max_length=10)
    addr: Addr
    color: Color
    other: Optional[Addr]
    many: List[Addr] = Field(max_length=3)
    tree: Node
    age: Optional[int] = Field(ge=0, le=150)
    nick: Optional[str] = Field(max_length=6)


def pydantic_tools():
    """Person as the openai SDK sends it (pydantic_function_tool: strict, $defs beside the properties), the same
    without strict, and Node, Person without strict as pydantic writes them (Node's root a $ref to its definition)."""
    sdk = openai.pydantic_function_tool(Person)
    plain = lambda name, model: {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
    return [sdk, {"type": "function", "function": {**sdk["function"], "strict": False}},
            plain("Node", Node), {**plain("Node", Node), "function": {**plain("Node", Node)["function"], "strict": True}},
            plain("Person", Person)]


def random_node(rng, depth=0) -> Node:
    return Node(v=rng.randint(-9, 9), kids=[random_node(rng, depth + 1) for _ in range(rng.randrange(3 - depth))]
                if depth < 2 else [])


def random_addr(rng) -> Addr:
    return Addr(city=random_text(rng, rng.randrange(9)), zip=rng.randrange(100000))


def random_person(rng) -> Person:
    return Person(name=random_text(rng, rng.randrange(11)), addr=random_addr(rng), color=rng.choice(list(Color)),
                  other=random_addr(rng) if rng.random() < 0.5 else None,
                  many=[random_addr(rng) for _ in range(rng.randrange(4))], tree=random_node(rng),
                  age=rng.randrange(151) if rng.random() < 0.5 else None,
                  nick=random_text(rng, rng.randrange(7)) if rng.random() < 0.7 else None)


def written(rng, args: dict, text_keys) -> list:
    """[(name, text, free)]: a string as its text, anything else as JSON, as a model writes them (an enum's value,
    color, in the tokens the tokenizer cuts it in: llguidance allows no other for a lexeme it forces; non-ASCII
    as itself: llguidance's JSON strings take no \\u escape of a printable character)."""
    out = []
    for key, value in args.items():
        if key in text_keys:
            out.append((key, value, key != "color"))
        else:
            out.append((key, json.dumps(value, ensure_ascii=False, indent=rng.choice([None, 1])), False))
    return out


def test_pydantic_models_as_tools_are_held_and_read_back(tokenizer, grammars):
    """Every pydantic model with a nested model or an Enum has $defs and $refs: each value's schema once compiled
    alone without them ("Pointer '/$defs/Addr' does not exist": the strict tool a 400, the tool without strict
    the loose call). Random instances written as a model writes them are accepted to their end, read back as the
    instance, valid against the whole schema; a wrong Enum value, a nested model missing a field, a required
    parameter left out are refused."""
    rng = random.Random(random.getrandbits(64))
    for tool in pydantic_tools():
        fn = tool["function"]
        g = grammar(tokenizer, grammars, [tool], choice=fn["name"], parallel=False)
        assert "PNAME" not in g.source.split("fn_0:")[1], g.source  # the declared parameters, not the loose call
        head = f"<tool_call>\n<function={fn['name']}>\n"
        for _ in range(12):
            if fn["name"] == "Node":
                args, text_keys = random_node(rng).model_dump(mode="json"), ()
                as_written = args
            else:
                # Optional[str] without strict is free text: None is written as the text null, read back as None
                args = random_person(rng).model_dump(mode="json")
                as_written = {**args, "nick": "null"} if not fn.get("strict") and args["nick"] is None else args
                text_keys = ("name", "color") + (("nick",) if not fn.get("strict") else ())
            segs = call_segments(fn["name"], written(rng, as_written, text_keys))
            assert_accepted(tokenizer, g, rng, segs, one_call=True)
            assert parsed([tool], joined(segs), rng) == ([(fn["name"], args)], "")
            jsonschema.validate(args, fn["parameters"])
        if fn["name"] == "Person":
            good = head + "<parameter=name>\nAl\n</parameter>\n"
            addr = "<parameter=addr>\n"
            assert_refused(tokenizer, g, good + addr + '{"city": "x"',
                           good + addr + '{"city": "x"}\n</parameter>\n</function>\n</tool_call>')
            ok = good + addr + '{"city": "x", "zip": 1}\n</parameter>\n<parameter=color>\n'
            assert_refused(tokenizer, g, ok, ok + "blue\n</parameter>\n</function>\n</tool_call>")
            assert_refused(tokenizer, g, head + "<parameter=", head + "<parameter=addr>\n{}\n</parameter>\n")


def test_a_non_strict_value_the_grammar_cannot_hold_is_free_text_the_call_still_held(tokenizer, grammars):
    """A tool without strict (OpenAI's default) whose one parameter the grammar cannot hold as written (Optional[str]
    as anyOf or a type list, a pattern, a format, a mixed enum without type, a $ref that does not resolve) keeps its
    parameter names and its required set: that value alone is free text, read back the loose way (its text, null
    where the schema admits it); the others held as before. The whole call once fell to the loose form, and a forced call came back as {}."""
    rng = random.Random(random.getrandbits(64))
    params = {"type": "object", "required": ["city", "days", "units", "code", "mail", "pick", "ref"], "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"anyOf": [{"type": "string", "enum": ["c", "f"]}, {"type": "null"}]},
        "code": {"type": ["string", "null"]},
        "mail": {"type": "string", "format": "email", "pattern": "^[a-z]+@x$"},
        "pick": {"enum": ["a", 1]},
        "ref": {"$ref": "#/$defs/Nowhere"},
        "later": {"type": "boolean"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    g = grammar(tokenizer, grammars, [tool], parallel=False)
    assert 'fn_0: "f>\\n" p_0_0 p_0_1 p_0_2 p_0_3 p_0_4 p_0_5 p_0_6 p_0_7?' in g.source, g.source
    free = ("units", "code", "mail", "pick", "ref")
    head = "<tool_call>\n<function=f>\n"
    for _ in range(20):
        args = {"city": random_text(rng, rng.randrange(9)), "days": rng.randint(1, 7),
                **{k: rng.choice([random_text(rng, rng.randrange(12)), "null", "1", "c"]) for k in free}}
        if rng.random() < 0.5:
            args["later"] = rng.random() < 0.5
        segs = call_segments("f", written(rng, args, ("city",) + free))
        assert_accepted(tokenizer, g, rng, segs, one_call=True)
        (name, got), = parsed([tool], joined(segs), rng)[0]
        # the free values as their text, but null where the schema admits it (Optional[str]'s None, as vLLM's)
        want = {k: None if k in ("units", "code") and v == "null" else v for k, v in args.items()}
        assert name == "f" and got == want, (got, want)
        held = {k: v for k, v in got.items() if k not in free}
        jsonschema.validate(held, {**params, "required": ["city", "days"]})
        # the required ones cannot be left out, an undeclared one not written, a held value not mistyped
        city = f"<parameter=city>\n{args['city']}\n</parameter>\n"
        assert_refused(tokenizer, g, head + "<parameter=", head + "<parameter=days>\n3\n</parameter>\n")
        assert_refused(tokenizer, g, head + city + "<parameter=", head + city + "<parameter=town>\nx\n</parameter>\n")
        assert_refused(tokenizer, g, head + city + "<parameter=days>\n",
                       head + city + "<parameter=days>\n9\n</parameter>\n")
        assert_refused(tokenizer, g, head + city + "<parameter=days>\n2\n</parameter>\n",
                       head + city + "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_non_strict_optional_values_no_string_fits_are_held_as_json(tokenizer, grammars):
    """Without strict, a schema no string is valid against (Optional[int], Optional[Model], an enum of numbers) is
    held as JSON and read back as JSON, so the client gets 5 and null, not "5" and "null"; a non-JSON text refused."""
    rng = random.Random(random.getrandbits(64))
    params = Person.model_json_schema()
    tool = {"type": "function", "function": {"name": "p", "parameters": params}}
    g = grammar(tokenizer, grammars, [tool], parallel=False)
    for _ in range(10):
        args = random_person(rng).model_dump(mode="json")
        args["nick"] = args["nick"] or "x"
        segs = call_segments("p", written(rng, args, ("name", "color", "nick")))
        assert_accepted(tokenizer, g, rng, segs, one_call=True)
        assert parsed([tool], joined(segs), rng) == ([("p", args)], "")
        jsonschema.validate(args, params)
    text = joined(call_segments("p", written(rng, random_person(rng).model_dump(mode="json"), ("name", "color"))))
    at = text.index("<parameter=age>\n") + len("<parameter=age>\n")
    assert_refused(tokenizer, g, text[:at], text[:at] + "old\n</parameter>\n")


@pytest.mark.parametrize("params, keyword", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                 "additionalProperties": False}]}, "'allOf'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "'minProperties'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, "'not'"),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]}, "'anyOf'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "'b'"),
    ({"$defs": {}, "$ref": "#/$defs/Gone"}, "'$ref'")])
def test_a_strict_tool_root_keyword_the_grammar_does_not_read_is_refused(tokenizer, grammars, params, keyword):
    """A strict tool's parameters keyword beyond properties / required / additionalProperties / $defs went unread, and
    the call broke it with a 200: now a GrammarError (the request's 400) naming the tool and the keyword. A root
    $ref that resolves is followed (pydantic's recursive model) rather than refused."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}
    with pytest.raises(GrammarError, match=f"tool 'f': parameters: .*{re.escape(keyword)}"):
        grammar(tokenizer, grammars, [tool])


def test_a_strict_tool_root_allof_of_properties_is_merged_and_held(tokenizer, grammars):
    """An allOf whose branches only name properties (and required ones) is merged into the parameters' object, as
    strict mode closes it (each branch closed alone refused the other's properties); the merged call is held."""
    rng = random.Random(random.getrandbits(64))
    names = rng.sample(["a", "b", "c", "d"], 2)
    params = {"allOf": [{"type": "object", "properties": {n: {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": [n]} for n in names]}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}
    g = grammar(tokenizer, grammars, [tool], parallel=False)
    values = {n: rng.randrange(10) for n in names}
    segs = call_segments("f", [(n, str(v), False) for n, v in values.items()])
    assert_accepted(tokenizer, g, rng, segs, one_call=True)
    assert parsed([tool], joined(segs), rng) == ([("f", values)], "")
    head = "<tool_call>\n<function=f>\n"
    assert_refused(tokenizer, g, head + f"<parameter={names[0]}>\n1\n</parameter>\n",
                   head + f"<parameter={names[0]}>\n1\n</parameter>\n</function>\n</tool_call>")


def test_a_strict_tool_closes_the_objects_inside_its_values(tokenizer, grammars):
    """strict: an object nested in a parameter's value takes only the properties it lists, as a strict json_schema's
    objects (structured.closed_objects); it took any other key. Not strict, the schema as written (other keys)."""
    rng = random.Random(random.getrandbits(64))
    inner = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = {"type": "object", "additionalProperties": False, "required": ["cfg"],
              "properties": {"cfg": {"type": "array", "items": {"$ref": "#/$defs/Inner"}, "maxItems": 2}
                             if rng.random() < 0.5 else inner}, "$defs": {"Inner": inner}}
    listed = params["properties"]["cfg"].get("type") == "array"
    for is_strict in (True, False):
        tool = {"type": "function", "function": {"name": "setup", "strict": is_strict, "parameters": params}}
        g = grammar(tokenizer, grammars, [tool], parallel=False)
        a = rng.randrange(100)
        ok, extra = {"a": a}, {"a": a, rng.choice(["b", "zz", "a2"]): rng.randrange(100)}
        value = lambda v: json.dumps([v] if listed else v)
        head = "<tool_call>\n<function=setup>\n<parameter=cfg>\n"
        end = "\n</parameter>\n</function>\n</tool_call>"
        assert_accepted(tokenizer, g, rng, head + value(ok) + end, one_call=True)
        if is_strict:
            good = value(extra)[:value(extra).index(str(a)) + len(str(a))]
            assert_refused(tokenizer, g, head + good, head + value(extra) + end)
        else:
            assert_accepted(tokenizer, g, rng, head + value(extra) + end, one_call=True)


def test_a_named_function_is_called_once(tokenizer, grammars):
    """tool_choice naming a function allows exactly one call, parallel_tool_calls left out or true (OpenAI: "call
    exactly one specific function"; vLLM's named path writes one); required still allows several."""
    rng = random.Random(random.getrandbits(64))
    for parallel in (None, True):
        named = grammar(tokenizer, grammars, [WEATHER, TIME], choice="get_time", parallel=parallel)
        many = grammar(tokenizer, grammars, [WEATHER, TIME], parallel=parallel)
        first, second = random_call(rng, TIME)[0], random_call(rng, TIME)[0]
        assert_accepted(tokenizer, named, rng, first, one_call=True)
        assert_refused(tokenizer, named, joined(first), joined(first) + "\n" + joined(second))
        assert_accepted(tokenizer, many, rng, first + [("\n", False)] + second, one_call=False)


# a strict tool whose values are JSON: their strings may hold any text, the call format's tags too (the grammar
# excludes them from text values only)
SNIPS = {"type": "function", "function": {"name": "snips", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["snips", "n"],
    "properties": {"snips": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                   "n": {"type": "integer"},
                   "meta": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}}}}}}}
JSON_TAGS = STRUCTURE_TAGS + ("<tool_call>", "<function=snips>", "</parameter></function></tool_call>")


def spelled(tokenizer, text: str, regions) -> list[int]:
    """The text's tokens, a special token (<tool_call>, </tool_call>) that lies inside one of `regions` (byte
    ranges: JSON values) spelled out in ordinary tokens, as a model writes it inside a JSON string (the grammar
    allows no special token there)."""
    ids, at = [], 0
    for t in tokenizer.encode(text):
        n = len(bytes(tokenizer.token_bytes(t)))
        inside = any(a <= at < b for a, b in regions)
        ids += plain(tokenizer, tokenizer.token_text(t)) if inside and tokenizer.token_text(t) in SPECIALS else [t]
        at += n
    assert tokenizer.decode(ids) == text
    return ids


def test_tags_inside_a_json_value_s_strings_are_read_back_as_written(tokenizer, grammars):
    """A JSON value's string holding </parameter>, </function>, <parameter=, </tool_call> (and the like) is
    allowed by the grammar and read back whole, streamed in random pieces, the calls after it too: the parser
    read the value up to the first tag (a string where the schema says array, a required key lost) with
    finish_reason tool_calls. Every call's arguments validate against the tool's schema."""
    rng = random.Random(random.getrandbits(64))
    tools = [SNIPS, TIME]
    g = grammar(tokenizer, grammars, tools)
    for _ in range(25):
        text, regions, want = "", [], []
        for k in range(rng.choice([1, 2, 3])):
            if k:
                text += "\n"
            if rng.random() < 0.3:
                segs, name, args = random_call(rng, TIME)
                text += joined(segs)
                want.append((name, args))
                continue
            strings = lambda: random_text(rng, rng.randrange(5)) + rng.choice(JSON_TAGS) + random_text(rng, rng.randrange(5))
            args = {"snips": [strings() for _ in range(rng.randrange(1, 4))], "n": rng.randrange(-50, 50)}
            if rng.random() < 0.5:
                args["meta"] = {"k": strings()}
            text += "<tool_call>\n<function=snips>\n"
            for key, value in args.items():
                written = json.dumps(value, ensure_ascii=False)  # (llguidance takes no \ud83d surrogate escape)
                text += f"<parameter={key}>\n"
                regions.append((len(text.encode()), len(text.encode()) + len(written.encode())))
                text += written + "\n</parameter>\n"
            text += "</function>\n</tool_call>"
            want.append(("snips", args))
        c, refused = feed(g, spelled(tokenizer, text, regions))
        assert refused is None and c.matcher.is_accepting(), text
        assert parsed(tools, text, rng) == (want, ""), text
        for name, args in want:
            jsonschema.validate(args, {"snips": SNIPS, "get_time": TIME}[name]["function"]["parameters"])


# -- tools under tool_choice auto with a response_format: the format's JSON or calls (structured.chat_constraint) --
def random_schema(rng) -> dict:
    """A random object schema: always a required bounded integer n and a bounded string s (what the refusals
    break), then random others of the kinds clients send (nested object, enum, Optional, array, number, bool)."""
    props = {"n": {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 60)},
             "s": {"type": "string", "maxLength": rng.randint(1, 20)}}
    kinds = [lambda: {"type": "boolean"},
             lambda: {"type": "string", "enum": rng.sample(["red", "green", "blue", "<b>", "é"], rng.randint(1, 3))},
             lambda: {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
             lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "maxItems": rng.randint(0, 4)},
             lambda: {"type": "number", "minimum": -10, "maximum": 10},
             lambda: {"type": "object", "additionalProperties": False, "required": ["k"],
                      "properties": {"k": {"type": "string", "maxLength": 8}}}]
    for i in range(rng.randrange(5)):
        props[f"p{i}"] = rng.choice(kinds)()
    required = ["n", "s"] + [k for k in props if k not in ("n", "s") and rng.random() < 0.5]
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props}


def random_instance(rng, schema):
    """A value valid against random_schema's kinds (its object's properties in their declared order)."""
    if "anyOf" in schema:
        return random_instance(rng, rng.choice(schema["anyOf"]))
    if "enum" in schema:
        return rng.choice(schema["enum"])
    typ = schema["type"]
    if typ == "object":
        return {k: random_instance(rng, s) for k, s in schema["properties"].items()
                if k in schema.get("required", []) or rng.random() < 0.5}
    if typ == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if typ == "number":
        # + 0.0: no -0.0, which llguidance's bounded number refuses (its quirk, not this grammar's)
        return round(rng.uniform(schema["minimum"], schema["maximum"]), rng.randrange(4)) + 0.0
    if typ == "boolean":
        return rng.random() < 0.5
    if typ == "null":
        return None
    if typ == "array":
        return [random_instance(rng, schema["items"]) for _ in range(rng.randint(0, schema["maxItems"]))]
    return random_text(rng, rng.randint(0, schema["maxLength"]))


def dumped(rng, value) -> str:
    # as a model writes JSON: compact or indented (within the grammar's whitespace bound), non-ASCII as itself
    return json.dumps(value, ensure_ascii=False, indent=rng.choice([None, None, 1, 2]))


def answer_spec(tokenizer, grammars, tools, fmt, choice=None, parallel=None):
    """The constraint chat_constraint builds for the request (thinking off: from the answer's first token)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "response_format": fmt}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    spec = chat_constraint(SimpleNamespace(tokenizer=tokenizer, grammars=grammars),
                           ChatCompletionRequest.model_validate(body), False)
    assert spec is not None and not spec.after_think
    return spec.grammar


@pytest.mark.parametrize("is_strict", [False, True])
@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_tools_with_a_response_format_allow_the_json_answer_or_calls(tokenizer, grammars, is_strict, choice):
    """tools (tool_choice auto or absent) + response_format json_schema, as the OpenAI Agents SDK sends them: the
    JSON grammar held the answer from its first token, so no call could ever be written. Now the answer is either
    a JSON value valid against the schema (content, validated by jsonschema) or calls in the forced-call grammar
    (read back exactly, arguments valid); parallel_tool_calls false allows one call."""
    rng = random.Random(random.getrandbits(64))
    tools = [strict(t) if is_strict else t for t in (WEATHER, TIME, PING)]
    by_name = {t["function"]["name"]: t for t in tools}
    for _ in range(6):
        schema = random_schema(rng)
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        many = answer_spec(tokenizer, grammars, tools, fmt, choice)
        one = answer_spec(tokenizer, grammars, tools, fmt, choice, parallel=False)
        for _ in range(5):
            lead = "".join(rng.choice(" \n") for _ in range(rng.randrange(3)))
            value = random_instance(rng, schema)
            text = lead + dumped(rng, value)
            for g in (many, one):
                assert_accepted(tokenizer, g, rng, text, one_call=True)
            assert parsed(tools, text, rng, answer_else=True) == ([], text)
            jsonschema.validate(json.loads(text), schema)
            calls = [random_call(rng, rng.choice(tools)) for _ in range(rng.choice([1, 1, 2, 3]))]
            segs = [(lead, False)] + [s for k, c in enumerate(calls) for s in ([("\n", False)] if k else []) + c[0]]
            assert_accepted(tokenizer, many, rng, segs, one_call=False)
            assert parsed(tools, joined(segs), rng, answer_else=True) == ([(name, args) for _, name, args in calls], "")
            for _, name, args in calls:
                jsonschema.validate(args, by_name[name]["function"].get("parameters") or {})
            assert_accepted(tokenizer, one, rng, [(lead, False)] + calls[0][0], one_call=True)


def test_auto_tools_with_a_response_format_refuse_what_is_neither(tokenizer, grammars):
    """Under the either grammar: a call to a tool not in tools, a call's invalid value, JSON that breaks the
    schema (an integer past its maximum, a string past maxLength, a required property left out, a property not
    declared), free text, JSON after a call or a call after the JSON, a second call without parallel calls:
    each refused, and not before what is wrong."""
    rng = random.Random(random.getrandbits(64))
    for _ in range(6):
        schema = random_schema(rng)
        n, s = schema["properties"]["n"], schema["properties"]["s"]
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        g = answer_spec(tokenizer, grammars, [WEATHER, strict(TIME)], fmt, "auto", parallel=False)
        head = "<tool_call>\n<function="
        assert_refused(tokenizer, g, head, head + "get_news>\n</function>\n</tool_call>")
        city = head + "get_weather>\n<parameter=city>\n"
        assert_refused(tokenizer, g, city + "x" * 16, city + "x" * 17 + "\n</parameter>\n</function>\n</tool_call>")
        assert_refused(tokenizer, g, head + "get_time>\n<parameter=zone>\n",
                       head + "get_time>\n<parameter=zone>\nPST\n</parameter>\n</function>\n</tool_call>")
        call = head + f"get_weather>\n<parameter=city>\n{random_text(rng, rng.randrange(17))}\n</parameter>\n" \
                      "</function>\n</tool_call>"
        value = random_instance(rng, schema)
        answer = dumped(rng, value)
        assert_accepted(tokenizer, g, rng, answer, one_call=True)
        assert_refused(tokenizer, g, call, call + "\n" + call)
        assert_refused(tokenizer, g, call, call + "\n" + answer)
        assert_refused(tokenizer, g, answer, answer + "\n" + call)
        assert_refused(tokenizer, g, "", random_text(rng, rng.randint(1, 12)).replace("{", "x").lstrip() or "x")
        over = {**value, "n": n["maximum"] + 1 + rng.randrange(100)}
        text = json.dumps(over, ensure_ascii=False)
        assert_refused(tokenizer, g, text[:text.index('"n": ') + 5], text)
        long = {**value, "s": random_text(rng, s["maxLength"] + 1 + rng.randrange(5))}
        text = json.dumps(long, ensure_ascii=False)
        at = text.index('"s": "') + 6
        assert_refused(tokenizer, g, text[:at] + json.dumps(long["s"][:s["maxLength"]], ensure_ascii=False)[1:-1], text)
        assert_refused(tokenizer, g, "{", "{}")  # n and s are required
        text = json.dumps({**value, "zz": 1}, ensure_ascii=False)
        assert_refused(tokenizer, g, text[:text.rindex(', "zz"')], text)


def test_a_json_answer_holding_call_text_stays_content(tokenizer, grammars):
    """A JSON answer whose string holds a whole call's text (in ordinary tokens: the grammar allows it there) is
    the answer, all of it content: the either grammar allows no call once the JSON began, so the parser reads none
    (without answer_else it read a call out of the string)."""
    fmt = {"type": "json_object"}
    g = answer_spec(tokenizer, grammars, [WEATHER], fmt)
    inner = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>"
    text = json.dumps({"a": inner})
    ids = []
    for piece in re.split(r"(<tool_call>|</tool_call>)", text):
        ids += plain(tokenizer, piece) if piece in ("<tool_call>", "</tool_call>") else tokenizer.encode(piece)
    assert tokenizer.decode(ids) == text
    c, refused = feed(g, ids)
    assert refused is None and c.finished, refused
    rng = random.Random(random.getrandbits(64))
    assert parsed([WEATHER], text, rng, answer_else=True) == ([], text)
    assert parsed([WEATHER], " \n" + text, rng, answer_else=True) == ([], " \n" + text)


@pytest.mark.parametrize("choice", ["none", "required", "named"])
def test_tool_choice_none_holds_the_format_alone_required_and_named_the_calls_alone(tokenizer, grammars, choice):
    """With tools and a response_format, tool_choice none allows the JSON answer and no call; required and a named
    function the calls and no JSON answer."""
    rng = random.Random(random.getrandbits(64))
    schema = random_schema(rng)
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = answer_spec(tokenizer, grammars, [WEATHER], fmt, named if choice == "named" else choice, parallel=False)
    answer = dumped(rng, random_instance(rng, schema))
    segs, name, args = random_call(rng, WEATHER)
    if choice == "none":
        assert_accepted(tokenizer, g, rng, answer, one_call=True)
        assert feed(g, tokenizer.encode(joined(segs)))[1] == 0
    else:
        assert_accepted(tokenizer, g, rng, segs, one_call=True)
        assert feed(g, tokenizer.encode(answer.lstrip()))[1] == 0
