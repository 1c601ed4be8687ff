"""Reasoning / tool-call parsing and stop strings, on real model-format strings cut at every boundary."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily.engine.generation import StopMatcher, StopString
from lily.server.chat_parsing import ChatOutputParser, parse_tool_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=opts>\n{\"unit\": \"c\"}\n</parameter>\n</function>\n</tool_call>")
CALL2 = "<tool_call>\n<function=now>\n</function>\n</tool_call>"


def run_split(text, cuts, thinking, tools):
    p = ChatOutputParser(thinking, tools)
    pieces, last = [], 0
    for c in sorted(cuts) + [len(text)]:
        pieces.append(text[last:c])
        last = c
    out = {"reasoning": "", "content": "", "calls": []}
    for d in [p.feed(x) for x in pieces] + [p.finish()]:
        out["reasoning"] += d.reasoning
        out["content"] += d.content
        out["calls"] += [(c.name, json.loads(c.arguments)) for c in d.tool_calls]
    return out


def cuts_of(text):
    return st.lists(st.integers(0, len(text)), max_size=12)


REASONED = "Let me think.\nIt is < 5 and </thin is not a tag.</think>\n\nThe answer is 4."


@settings(max_examples=80, deadline=None)
@given(cuts_of(REASONED))
def test_reasoning_then_content_at_any_split(cuts):
    out = run_split(REASONED, cuts, thinking=True, tools=None)
    assert out == {"reasoning": "Let me think.\nIt is < 5 and </thin is not a tag.", "content": "The answer is 4.", "calls": []}


def test_thinking_off_is_all_content_and_unclosed_reasoning_stays_reasoning():
    assert run_split("plain </ answer", [3], thinking=False, tools=None)["content"] == "plain </ answer"
    out = run_split("still thinking <", [5], thinking=True, tools=None)
    assert out["reasoning"] == "still thinking <" and out["content"] == ""


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 12), max_size=4))
def test_reasoning_of_only_newlines_is_kept(n, cuts):
    """A (tiny random) model that writes only newlines: every token it wrote reaches the reply as reasoning,
    as it does when newlines precede words (the parser holds leading newlines back only to see whether
    the model repeats the <think> the prompt opened)."""
    text = "\n" * n
    assert run_split(text, [c for c in cuts if c <= n], thinking=True, tools=None)["reasoning"] == text
    assert run_split(text + "ok", [], thinking=True, tools=None)["reasoning"] == text + "ok"
    assert run_split("\n<think>\nok", [], thinking=True, tools=None)["reasoning"] == "\nok"


TOOLED = "Checking.</think>\n\nI will look it up.\n" + CALL + "\n" + CALL2


@settings(max_examples=80, deadline=None)
@given(cuts_of(TOOLED))
def test_tool_calls_at_any_split(cuts):
    out = run_split(TOOLED, cuts, thinking=True, tools=TOOLS)
    assert out["reasoning"] == "Checking."
    assert out["content"] == "I will look it up.\n"
    assert out["calls"] == [("get_weather", {"city": "São Paulo", "days": 3, "opts": {"unit": "c"}}), ("now", {})]


def deltas_at_every_split(text, thinking=False, tools=TOOLS):
    """The parser's deltas for `text` fed whole, in two pieces cut at each position, and one character at a time."""
    cuts = [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cut in cuts:
        p = ChatOutputParser(thinking, tools)
        pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
        yield [p.feed(x) for x in pieces] + [p.finish()]


@pytest.mark.parametrize("lead", ["\n", "\n\n", " \n\t ", "\n\n\n "])
def test_whitespace_before_a_call_is_no_content(lead):
    """The whitespace a model (or the call grammar's lead) writes before the answer's first call is dropped: no
    content delta at all, however the text is cut; after reasoning too; between and after calls as before."""
    for text, thinking in ((lead + CALL, False), ("Hm.</think>" + lead + CALL + "\n" + CALL2 + lead, True)):
        for deltas in deltas_at_every_split(text, thinking):
            assert all(not d.content for d in deltas), (text, deltas)
            calls = [c.name for d in deltas for c in d.tool_calls]
            assert calls == ["get_weather"] + (["now"] if thinking else []), (text, deltas)


@pytest.mark.parametrize("text", ["  hello", "\n\nhello <tool_call", "\n", " \n ", "\n<tool_cal", "\n<tool_call>nonsense",
                                  "\n<tool_call>\nnonsense\n</tool_call>\n", "\nI will call.\n" + CALL2])
def test_leading_whitespace_without_a_call_after_it_is_kept(text):
    """Leading whitespace held for a call that does not come goes out with the text that follows it, or at the
    end as the answer it is (a whitespace-only answer, a tag that is no call): nothing lost, no content delta of
    whitespace alone before the text."""
    expected = text.replace(CALL2, "")
    for deltas in deltas_at_every_split(text):
        content = [d.content for d in deltas if d.content]
        assert "".join(content) == expected, (text, deltas)
        assert not content[:-1] or content[0].strip(), (text, deltas)  # no whitespace alone before the text
    assert run_split("  hello", [1], False, None)["content"] == "  hello"  # no tools: nothing held


def test_without_tools_the_markup_is_plain_content():
    out = run_split(CALL, [7], thinking=False, tools=None)
    assert out["content"] == CALL and out["calls"] == []


def test_unparseable_or_truncated_call_falls_back_to_content():
    assert run_split("<tool_call>\nnonsense\n</tool_call>", [], False, TOOLS)["content"] == "<tool_call>\nnonsense\n</tool_call>"
    truncated = "<tool_call>\n<function=now>\n"
    out = run_split(truncated, [4], False, TOOLS)  # max_tokens cut it short: the name is still known
    assert out["calls"] == [("now", {})]


@pytest.mark.parametrize("held", [False, True])
def test_a_call_cut_by_max_tokens_is_marked_incomplete_and_a_held_one_leaves_no_markup(held):
    whole = "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    for end, complete in ((len(whole), True), (len(whole) - 3, False), (len("<tool_call>\n<function=now>"), False)):
        p = ChatOutputParser(False, TOOLS, held=held)
        d = [p.feed(whole[:end]), p.finish()]
        calls = [c for x in d for c in x.tool_calls]
        assert [(c.name, c.complete) for c in calls] == [("now", complete)], end
    cut = "<tool_call>\n<function=no"   # the name not yet whole: a held call (the grammar's) has no text to show
    p = ChatOutputParser(False, TOOLS, held=held)
    d = [p.feed(cut), p.finish()]
    assert "".join(x.content for x in d) == ("" if held else cut) and not any(x.tool_calls for x in d)


def test_json_form_and_untyped_values():
    call = parse_tool_call('{"name": "get_weather", "arguments": {"city": "Oslo"}}', TOOLS)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    call = parse_tool_call("<function=unknown>\n<parameter=x>\n12\n</parameter>\n</function>", TOOLS)
    assert json.loads(call.arguments) == {"x": "12"}  # no schema: kept as the text written


ODD = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {"type": "object", "properties": {
    "note": {"description": "free"}, "any": {}, "maybe": {"type": ["string", "null"]}, "pick": {"enum": ["a", 1, None]},
    "name": {"type": "string"}, "n": {"type": "integer"}}}}}
ODD_CALL = ('<tool_call>\n<function=odd>\n<parameter=note>\n"abc"\n</parameter>\n<parameter=any>\n[1, "x"]\n'
            '</parameter>\n<parameter=maybe>\nnull\n</parameter>\n<parameter=pick>\n1\n</parameter>\n<parameter=name>\n'
            '"quoted"\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>')


@settings(max_examples=40, deadline=None)
@given(cuts_of(ODD_CALL))
def test_a_strict_call_under_the_grammar_is_read_as_the_grammar_wrote_it(cuts):
    """tool_choice required / named (held): a strict tool's values with no type, a type list with "string" or a
    mixed enum are JSON (as the call grammar writes them); a string type stays its text, quotes and all. Without
    the grammar (auto), or for a tool without strict, the text reading, but for a null where the type admits it
    (Optional[str]'s None, as vLLM reads it)."""
    p = ChatOutputParser(False, [ODD], held=True)
    calls = [c for d in [p.feed(ODD_CALL[a:b]) for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(ODD_CALL)])]
             + [p.finish()] for c in d.tool_calls]
    assert [json.loads(c.arguments) for c in calls] == [
        {"note": "abc", "any": [1, "x"], "maybe": None, "pick": 1, "name": '"quoted"', "n": 3}]
    text_reading = {"note": '"abc"', "any": '[1, "x"]', "maybe": None, "pick": "1", "name": '"quoted"', "n": 3}
    assert run_split(ODD_CALL, cuts, False, [ODD])["calls"] == [("odd", text_reading)]
    loose = {"type": "function", "function": {**ODD["function"], "strict": False}}
    block = ODD_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert json.loads(parse_tool_call(block, [loose], held=True).arguments) == text_reading
    # cut short by max_tokens: the JSON value's text as it is
    cut = "<function=odd>\n<parameter=note>\n\"ab"
    assert json.loads(parse_tool_call(cut, [ODD], held=True).arguments) == {"note": '"ab'}


@settings(max_examples=40, deadline=None)
@given(st.integers(-10**12, 10**12), st.text(alphabet="ab <>/\nxyz", min_size=1, max_size=12),
       st.integers(0, len("\n</parameter>") - 1), st.booleans())
def test_a_call_cut_inside_a_closing_tag_keeps_the_value_written(n, text, cut, held):
    """max_tokens may end the generation inside "\n</parameter>": the value is what came before the tag (an
    integer stays one), not the value with part of the tag in it."""
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object",
              "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}]
    tail = "\n</parameter>"[:cut]
    args = json.loads(parse_tool_call(f"<function=f>\n<parameter=n>\n{n}{tail}", tools, held=held).arguments)
    assert args == {"n": n}
    whole = f"<function=f>\n<parameter=s>\n{text}\n</parameter>\n<parameter=n>\n{n}{tail}"
    args = json.loads(parse_tool_call(whole, tools, held=held).arguments)
    assert args == {"s": text, "n": n}
    # streamed and cut there: the parser's finish reads the same call
    streamed = run_split(f"<tool_call>\n{whole}", [], False, tools)
    assert streamed["calls"] == [("f", {"s": text, "n": n})]


def strict_json(text: str):
    """json.loads as a strict client reads it: NaN / Infinity are no JSON (Python's reader takes them)."""
    def refuse(name):
        raise ValueError(f"{name} in a tool call's arguments")
    return json.loads(text, parse_constant=refuse)


NUMBERS = {"type": "function", "function": {"name": "scale", "strict": True, "parameters": {"type": "object",
           "properties": {"by": {"type": "number"}, "n": {"type": "integer"}, "any": {}}}}}


@settings(max_examples=60, deadline=None)
@given(st.integers(309, 100000), st.sampled_from(["", "-"]), st.floats(-1e300, 1e300), st.integers(-10**30, 10**30),
       st.sampled_from(["NaN", "Infinity", "-Infinity"]), st.booleans())
def test_tool_arguments_stay_json_whatever_number_the_model_writes(exp, sign, ok_float, big_int, literal, held):
    """A number past float's range (Python reads 1e999 as inf) or the NaN / Infinity literals would come back
    out of json.dumps as no JSON at all: such a value stays the text written; every other number keeps its
    value, a big integer exactly."""
    huge = f"{sign}1.5e{exp}"
    values = {"by": huge, "n": str(big_int), "any": f'{{"x": {literal}, "y": {ok_float!r}}}'}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    for tools in ([NUMBERS], [{"type": "function", "function": {**NUMBERS["function"], "strict": False}}]):
        call = parse_tool_call(f"<function=scale>\n{body}</function>", tools, held=held)
        args = strict_json(call.arguments)
        assert args["by"] == huge and args["n"] == big_int
        assert args["any"] == values["any"]
    call = parse_tool_call(f"<function=scale>\n<parameter=by>\n{ok_float!r}\n</parameter>\n</function>",
                           [NUMBERS], held=held)
    assert strict_json(call.arguments) == {"by": ok_float}
    # the older JSON form: a number out of range is no call (the text stays content), a finite one is one
    assert parse_tool_call(f'{{"name": "scale", "arguments": {{"by": {huge}}}}}', [NUMBERS]) is None
    call = parse_tool_call(f'{{"name": "scale", "arguments": {{"by": {ok_float!r}, "n": {big_int}}}}}', [NUMBERS])
    assert strict_json(call.arguments) == {"by": ok_float, "n": big_int}


def test_the_grammar_and_the_parser_decide_text_or_json_in_one_place():
    """Each parameter schema: the call grammar's value rule is a JSON rule exactly where value_form says "json"
    (what the parser decodes), for strict tools and not."""
    from lily.engine.constraints import GrammarError
    from lily.server.tool_values import value_form
    from lily.server.structured import _value_rule

    schemas = [{}, {"description": "x"}, {"type": "string"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
               {"const": "a"}, {"enum": ["a", 1, None]}, {"type": ["string", "null"]}, {"type": ["integer", "null"]},
               {"type": "integer"}, {"type": "object"}, {"anyOf": [{"type": "string"}, {"type": "null"}]}, True]
    for strict in (True, False):
        for schema in schemas:
            form = value_form(schema, strict)
            try:
                rule = _value_rule(schema, "T", [], strict)
            except GrammarError:
                assert form is None and not strict, (schema, strict)
                continue
            assert form == ("json" if rule.startswith("%json") else "text"), (schema, strict, rule)


STOP_TEXT = "alpha beta STOP gamma"


@settings(max_examples=60, deadline=None)
@given(cuts_of(STOP_TEXT), st.sampled_from([["STOP"], ["ST", "xyz"], ["a beta"], ["never"]]))
def test_stop_strings_across_chunk_boundaries(cuts, stops):
    m = StopMatcher(stops)
    out, hit, last = "", False, 0
    for c in sorted(cuts) + [len(STOP_TEXT)]:
        piece, last = STOP_TEXT[last:c], c
        text, hit = m.push(piece)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    first = min((STOP_TEXT.find(s) for s in stops if s in STOP_TEXT), default=-1)
    assert hit == (first >= 0)
    assert out == (STOP_TEXT[:first] if first >= 0 else STOP_TEXT)


def test_stop_matcher_holds_back_only_a_possible_start():
    m = StopMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("Nx") == ("ENx", False)
    random_text = "".join(random.choice("xyz") for _ in range(20))
    assert m.push(random_text) == (random_text, False)


def push_all(m: StopMatcher, text: str, cuts) -> tuple[str, bool]:
    out, last = "", 0
    for c in sorted(cuts) + [len(text)]:
        piece, last = text[last:c], c
        got, hit = m.push(piece)
        out += got
        if hit:
            return out, True
    return out + m.flush(), False


SCOPED = "<think>\nplan: <tool_call> a </tool_call> b\n</think>\n\nok <tool_call>\n<function=f>\n<parameter=x>\nred\n" \
         "</parameter>\n</function>\n</tool_call> after red"


@settings(max_examples=60, deadline=None)
@given(cuts_of(SCOPED))
def test_scoped_stop_strings_skip_call_blocks_and_wait_for_the_reasoning_end(cuts):
    """A stop string scoped to skip tool-call blocks ignores its text inside one (a call's arguments) and ends the
    output at its first place outside; one scoped `after` </think> ignores the reasoning; a plain one hits first."""
    skip = ("<tool_call>", "</tool_call>")
    first_outside = SCOPED.index("red", SCOPED.index("</tool_call> after"))
    assert push_all(StopMatcher([StopString("red", skip=skip)]), SCOPED, cuts) == (SCOPED[:first_outside], True)
    assert push_all(StopMatcher(["red"]), SCOPED, cuts) == (SCOPED[:SCOPED.index("red")], True)
    end_call = SCOPED.index("</tool_call>", SCOPED.index("</think>"))
    assert push_all(StopMatcher([StopString("</tool_call>", after="</think>")]), SCOPED, cuts) == (SCOPED[:end_call], True)
    kept = SCOPED[:end_call + len("</tool_call>")]   # keep: the output ends with the stop string itself
    assert push_all(StopMatcher([StopString("</tool_call>", after="</think>", keep=True)]), SCOPED, cuts) == (kept, True)
    assert push_all(StopMatcher(["</tool_call>"]), SCOPED, cuts) == (SCOPED[:SCOPED.index("</tool_call>")], True)
    # "plan" is in the reasoning only and "b" inside nothing: a skip scope does not hide them
    assert push_all(StopMatcher([StopString("plan", skip=skip)]), SCOPED, cuts) == (SCOPED[:SCOPED.index("plan")], True)
    assert push_all(StopMatcher([StopString("never", skip=skip)]), SCOPED, cuts) == (SCOPED, False)


@pytest.mark.parametrize("strict", [True, False])
def test_a_call_written_freely_reads_optional_values_as_their_types(strict):
    """tool_choice auto (nothing held the model): pydantic's / the Agents SDK's Optional[int], Optional[Model] and
    Optional[str] (anyOf with null, the model behind a $ref) come back as the required path reads them, numbers and
    objects as JSON and null as None, not as strings the tool's schema refuses."""
    params = {"$defs": {"Addr": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
              "type": "object", "required": ["hour", "addr", "note"],
              "properties": {"hour": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                             "addr": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}]},
                             "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    tools = [{"type": "function", "function": {"name": "book", "parameters": params, "strict": strict}}]
    want = {"hour": random.choice([None, random.randrange(24)]),
            "addr": random.choice([None, {"zip": random.randrange(10 ** 5)}]),
            "note": random.choice([None, "call me", "at 5"])}
    text = "<tool_call>\n<function=book>\n" + "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in want.items()) \
        + "</function>\n</tool_call>"
    for held in (False, True):
        p = ChatOutputParser(False, tools, held=held)
        calls = p.feed(text).tool_calls + p.finish().tool_calls
        assert json.loads(calls[0].arguments) == want, held
