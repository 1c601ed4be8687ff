"""Structured outputs: what a chat request's output rule and tool_choice (or a text completion's rule) ask of
the model's answer, as a grammar for lily.engine.constraints. The rule (lily.server.output_rules) comes from
response_format, or vLLM's structured_outputs / guided_* fields:

  response_format {"type": "json_object"}                 any JSON object
  response_format {"type": "json_schema", "json_schema"}  a JSON value valid against its schema
  structured_outputs {"regex" | "choice" | "grammar"}     a regex's full match, one of the strings, a grammar
  tool_choice "required" / {"function": {"name": N}}      a tool call (to N), in the template's format:
      <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
      with the tool's parameters as its `parameters` schema declares them, strict or not (as vLLM does):
      only the declared ones, in order, the required ones present, values valid (strings as text within
      their enum / const / length bounds, anything else as JSON against its schema); parallel_tool_calls
      false or a named function allows one call. A text value is any text without
      the tags the parser reads as the call's structure (</parameter>, <parameter=, </function>,
      </tool_call>), lexed as one with the \\n</parameter>\\n after it, so it ends where the model closes it.
  tools, tool_choice auto (or absent), a rule (a json_object / json_schema response_format, a regex, ...)
                                                          either the rule's answer or tool calls as above, as
      OpenAI answers (the OpenAI Agents SDK sends tools plus its output_type's schema); a grammar cannot stand
      beside calls (a 400). tool_choice auto with no rule has no grammar; tool_choice none holds the rule alone.

$defs / $ref (pydantic's nested models, Enums, recursive models) are followed (`tool_values.tool_schema`).
What the call grammar cannot express: for a strict tool a 400 naming the tool (a string parameter's pattern,
format, ...; an unsupported JSON Schema keyword; a root keyword such as allOf or minProperties); a tool without
strict keeps that value free text (its parameter names and required set still held), or, for an object it
cannot express (other parameters allowed), the loose form (any parameter names, values as text), so its schema
never makes the request a 400.
The grammar starts where the answer starts: after the model's </think> when the prompt opened a thinking
block (a text completion has no thinking: its first token). A schema the engine cannot honour is a 400
naming the keyword.
"""

from __future__ import annotations

import json

from lily.engine.generation import StopString
from lily.engine.constraints import (WHITESPACE, ConstraintSpec, GrammarError, check_json_schema, json_rule,
                                     lark_literal)
from lily.server.chat_parsing import THINK_END, TOOL_END, TOOL_START
from lily.server.tool_values import DEFINITIONS, STRING_KEYWORDS, closed_objects, tool_schema, value_form
from lily.server.context import ServerContext
from lily.server.errors import APIError
from lily.server.output_rules import OutputRule, has_output_rule, output_rule
from lily.server.protocol import NamedToolChoice

# A text value and the "\n</parameter>\n" that closes it are one lexeme: llguidance lexes greedily, so a value
# lexeme of its own ran on through "\n</parameter" (text a value may hold) and the closing could never start; in
# one lexeme the value ends where the closing does. The value holds none of the tags the output parser reads as
# the call's structure (`chat_parsing.parse_tool_call` would end the value, or the call, there).
CLOSE = "\n</parameter>\n"
STRUCTURE_TAGS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")


def _no_tags_regex(tags) -> str:
    """A regex (a Lark /.../ body) of the text that holds none of `tags` (each opening with "<", none holding
    another): the text up to the first "<", then each "<" and the text up to the next, which does not begin with
    a tag's rest. Written out rather than as ~/.*(tags).*/: llguidance's `.` is a UTF-8 character, so under a
    negation its lexer could not tell a bounded `.{lo,hi}` & ~... apart from empty once a tag was read, and gave
    up ("too many expressions constructed": at a maxLength of 100, not yet at 64)."""
    trie: dict = {}
    for tag in tags:
        node = trie
        for ch in tag[1:]:
            node = node.setdefault(ch, {})
        node[None] = {}

    def esc(ch: str) -> str:
        return "\\" + ch if ch in "/\\^-[]().*+?{}|$" else ch

    def rest(node: dict) -> str | None:  # the run after "<" with `node`'s prefix read: None if a tag ended
        if None in node:
            return None
        alts = ["", f"[^<{''.join(esc(c) for c in sorted(node))}][^<]*"]
        alts += [esc(c) + sub for c in sorted(node) if (sub := rest(node[c])) is not None]
        return "(?:" + "|".join(alts) + ")"

    return f"(?s:[^<]*(?:<{rest(trie)})*)"


VALUE_TEXT = _no_tags_regex(STRUCTURE_TAGS)
TEXT_VALUE = f"/{VALUE_TEXT}/ {lark_literal(CLOSE)}"  # any text without the tags, then the closing
PARAM_NAME = r"/[^>\n]+/"


STRICT_ALL_OF = ("; strict mode closes every object (additionalProperties false where the schema says nothing), "
                 "and an allOf branch that is more than properties and required is closed on its own, so it refuses "
                 "the other branches' properties: list them in one object, or give the branches "
                 "additionalProperties yourself")


def _strict_hint(message: str, schema) -> str:
    """A strict schema's 'unsatisfiable' refusal where it has an allOf: what strict mode did to it."""
    return message + STRICT_ALL_OF if "nsatisfiable" in message and '"allOf"' in json.dumps(schema) else message


def chat_constraint(ctx: ServerContext, body, thinking: bool) -> ConstraintSpec | None:
    """The grammar a chat request's output must follow, or None (free text)."""
    rule = output_rule(body)
    param = rule.param if rule is not None else "tools"
    try:
        if calls_held(body) and not calls_or_answer(body):
            param = "tools"
            return _spec(ctx, ctx.grammars.lark(tool_call_grammar(ctx, body)), thinking, "tools")
        if rule is None:
            return None
        if not calls_or_answer(body):
            return _spec(ctx, rule.grammar(ctx.grammars), thinking, rule.param, rule.kind)
        answer = rule.answer_rule()
        if answer is None:
            raise APIError(400, f"{rule.param}: a grammar cannot stand beside tool calls (tool_choice auto lets the "
                           "model call a tool instead); send tool_choice none to hold the answer to the grammar, "
                           "or leave the grammar out", param=rule.param)
        # either the answer's rule or tool calls: each part checked alone first, so that a 400 names its field
        rule.grammar(ctx.grammars)
        param = "tools"
        source = tool_call_grammar(ctx, body, answer=answer)
        ctx.grammars.lark(tool_call_grammar(ctx, body))
        # a rule the engine gives up on while generating is most likely the answer's (named in that 400)
        return _spec(ctx, ctx.grammars.lark(source), thinking, rule.param, rule.kind)
    except GrammarError as e:
        raise _refusal(e, param, rule) from None


def _refusal(e: GrammarError, param: str, rule: OutputRule | None) -> APIError:
    why = _strict_hint(str(e), rule.schema) if rule is not None and param == rule.param and rule.strict else str(e)
    return APIError(400, f"{param}: cannot be enforced by constrained decoding: {why}", param=param)


def calls_held(body) -> bool:
    """Whether the request's tool calls are written under the call grammar (tool_choice required or a named
    function, with tools; or `calls_or_answer`): the output parser then reads their values as the grammar wrote
    them."""
    return bool(body.tools) and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
                                 or calls_or_answer(body))


def calls_or_answer(body) -> bool:
    """Whether the answer is either tool calls or what its rule holds (tools, tool_choice auto or absent, and a
    response_format, structured_outputs or guided_* rule): the output parser then reads an answer that begins as
    anything but a call as that answer, all of it content."""
    return bool(body.tools) and body.tool_choice in (None, "auto") and has_output_rule(body)


def _spec(ctx: ServerContext, grammar, thinking: bool, param: str, kind: str = "json") -> ConstraintSpec:
    tok = ctx.tokenizer
    think_end = tok.token_id("</think>") if tok.has_token("</think>") else None
    return ConstraintSpec(grammar, after_think=thinking and think_end is not None, think_end=think_end, param=param,
                          kind=kind)


def tool_call_grammar(ctx: ServerContext, body, answer: str | None = None) -> str:
    """Lark source: one tool call (or several, parallel_tool_calls allowing) to the allowed tools, after bounded
    whitespace; with `answer` (a rule body: the request's rule, `OutputRule.answer_rule`), that answer instead of
    the calls is allowed too."""
    tok = ctx.tokenizer
    tools = [t.function for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        tools = [f for f in tools if f.name == body.tool_choice.function.name]
    open_tag, close_tag = (_token(tok, "<tool_call>"), _token(tok, "</tool_call>"))
    # one call where parallel_tool_calls is false or the choice names a function (OpenAI: "call exactly one
    # specific function"; vLLM's named path writes one call)
    one = body.parallel_tool_calls is False or isinstance(body.tool_choice, NamedToolChoice)
    calls = "call" + ("" if one else ' ("\\n" call)*')
    lines = [f"start: LEAD {calls}" if answer is None else f"start: LEAD calls | answer\ncalls: {calls}\n"
             f"answer: {answer}",
             f"LEAD: /{WHITESPACE}/",
             f'call: {open_tag} "\\n<function=" fn "</function>\\n" {close_tag}',
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
             f"TEXT: {TEXT_VALUE}",
             f"PNAME: {PARAM_NAME}"]
    for i, f in enumerate(tools):
        head = lark_literal(f"{f.name}>\n")
        if f.applied_strict:
            params = closed_objects(f.parameters or {})  # its objects closed, as a strict json_schema's
            try:
                _check_object(params, strict=True)
                lines += _schema_rules(i, head, params, strict=True)
            except GrammarError as e:  # the request's 400, naming the tool
                raise GrammarError(f"tool {f.name!r}: {_strict_hint(str(e), params)}") from None
            continue
        try:
            _check_object(f.parameters, strict=False)
        except GrammarError:
            # an object this grammar cannot express (other parameters than the declared ones allowed, a keyword
            # beyond them, a name the parser would not read back): the tool is not strict, so its call keeps the
            # loose form (any parameters, values as text) rather than a 400
            lines.append(f'fn_{i}: {head} ("<parameter=" PNAME ">\\n" TEXT)*')
            continue
        lines += _schema_rules(i, head, f.parameters or {}, strict=False)
    return "\n".join(lines) + "\n"


def holds_strictly(parameters: dict | None) -> bool:
    """Whether a strict tool's call grammar can hold these parameters. A Responses API tool that leaves strict
    out is strict where it can be (OpenAI's Responses API reads it as strict) and otherwise keeps a tool's loose
    form: a client that never asked for strict gets no 400 for a schema only lily cannot hold."""
    params = closed_objects(parameters or {})
    try:
        _check_object(params, strict=True)
        _schema_rules(0, '"probe"', params, strict=True)
    except GrammarError:
        return False
    return True


def _schema_rules(i: int, head: str, params: dict, strict: bool) -> list[str]:
    """Rules for tool i's call: its declared parameters, in order, the required ones present. A value the grammar
    cannot hold is, for a strict tool, a GrammarError naming the parameter; for a tool without strict free text
    (`TEXT`), the parameter still named and still required: the parser reads it the loose way, as `value_form`
    says (None: `_read_loose`; "text": its text; "json": JSON where it parses, the loose reading of a type
    without "string"), so the reading needs no word from the grammar."""
    lines: list[str] = []
    obj, props, defs = tool_schema(params)
    required = set(obj.get("required") or [])
    parts = []
    for j, (name, schema) in enumerate(props.items()):
        lines.append(f'p_{i}_{j}: {lark_literal(f"<parameter={name}>" + chr(10))} v_{i}_{j}')
        value: list[str] = []
        try:
            rule = _value_rule(schema, f"T_{i}_{j}", value, strict, params, defs)
        except GrammarError as e:
            if strict:
                raise GrammarError(f"parameter {name!r}: {e}") from None
            rule, value = "TEXT", []
        lines += value + [f"v_{i}_{j}: {rule}"]
        parts.append(f"p_{i}_{j}" + ("" if name in required else "?"))
    lines.append(f"fn_{i}: {head} " + " ".join(parts))
    return lines


# the keywords of a tool's parameters schema the call grammar expresses (closed to the declared properties,
# as a strict tool's and vLLM's are); with any other, a strict tool is a 400 and a tool without strict keeps the
# loose call. $defs / definitions: where the values' $refs point (a root $ref is followed first: `tool_schema`)
OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                   "$id", "$comment", "default", "examples"} | set(DEFINITIONS)


def _check_object(params, strict: bool) -> None:
    """GrammarError unless the parameters schema is an object the call grammar expresses exactly: named
    properties (absent: none), the required ones among them, each name one the output parser reads back as
    written, no keyword beyond these (allOf, minProperties, ... would go unenforced: a strict tool's 400,
    as response_format's refusal of what the engine cannot honour is). Not strict, also no other properties
    allowed (additionalProperties): the call then keeps the loose form, which writes any. A strict tool's call
    is closed to the declared properties whatever additionalProperties says (OpenAI requires it false)."""
    if params is None:
        return  # no parameters (OpenAI: omitting parameters defines an empty parameter list)
    if not isinstance(params, dict):
        raise GrammarError("parameters is not an object schema")
    obj, _, _ = tool_schema(params)
    unknown = sorted(set(obj) - OBJECT_KEYWORDS)
    if unknown:
        raise GrammarError(f"parameters: {', '.join(map(repr, unknown))} cannot be enforced on the call "
                           f"(supported: properties, required, additionalProperties, $defs)")
    if obj.get("type", "object") != "object":
        raise GrammarError("parameters: type is not 'object'")
    if not strict and obj.get("additionalProperties", False) is not False:
        raise GrammarError("parameters: additionalProperties (other parameters than the declared ones)")
    props = obj.get("properties", {})
    required = obj.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        raise GrammarError("parameters: properties / required malformed")
    missing = [r for r in required if not isinstance(r, str) or r not in props]
    if missing:
        raise GrammarError(f"parameters: the required {', '.join(map(repr, missing))} not among the properties")
    for name in props:
        if not name or name != name.strip() or ">" in name or "\n" in name:
            raise GrammarError(f"parameters: the name {name!r} does not survive the call format")


def _value_rule(schema, lexeme: str, lines: list[str], strict: bool = True, root: dict | None = None,
                defs: dict | None = None) -> str:
    """A parameter value and the closing "\\n</parameter>\\n" after it, the value as the output parser reads it
    back (`tool_values.value_form`, which both follow): a text one is the text itself (enum or const: one of its
    values; minLength / maxLength bound it), with the closing one lexeme `lexeme` (see TEXT_VALUE), a JSON one a
    JSON value valid against the schema, which carries the root's definitions `defs` so that its $refs resolve.
    A schema the grammar cannot hold is a GrammarError (a strict tool's 400; not strict, the value is free text)."""
    form = value_form(schema, strict, root)
    if form is None:
        raise GrammarError(f"a parameter of type {schema.get('type')!r}: the parser reads it as text, the grammar "
                           f"as JSON")
    if form == "json":
        if defs and isinstance(schema, dict) and '"$ref"' in json.dumps(schema):
            # the value's schema is compiled alone: the definitions its $refs name go with it (its own win)
            schema = {**schema, **{k: {**v, **schema.get(k, {})} for k, v in defs.items()}}
        check_json_schema(schema)  # llguidance's refusal, named with the parameter rather than at compile
        return f"{json_rule(schema)} {lark_literal(CLOSE)}"  # a JSON value's last lexeme cannot take a raw newline
    if not isinstance(schema, dict):
        return "TEXT"
    schema = {**schema, "type": "string"}  # not strict, also annotations only or an enum / const of strings
    enum = schema.get("enum")
    if not strict and (("const" in schema and not isinstance(schema["const"], str)) or (
            "enum" in schema and not (isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum)))):
        raise GrammarError("a string parameter's enum / const holds other values than strings")
    unknown = sorted(set(schema) - STRING_KEYWORDS)
    if unknown:
        raise GrammarError(f"a strict tool's string parameter: {', '.join(map(repr, unknown))} cannot be "
                           f"enforced on the parameter's text (supported: enum, const, minLength, maxLength)")
    values = None
    if "const" in schema:
        values = [str(schema["const"])]
    elif isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        values = schema["enum"]
    if values is not None:
        if not values:
            raise GrammarError("a string parameter's enum is empty: no value is valid")
        if any(tag in v for v in values for tag in STRUCTURE_TAGS):
            raise GrammarError(f"a string parameter's enum / const value holds one of {', '.join(STRUCTURE_TAGS)}, "
                               f"which the call format cannot carry")
        lines.append(f"{lexeme}: ({' | '.join(lark_literal(v) for v in values)}) {lark_literal(CLOSE)}")
        return lexeme
    lo = schema.get("minLength", 0)
    hi = schema.get("maxLength")
    if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
        raise GrammarError(f"a strict tool's string parameter: minLength {lo!r} / maxLength {hi!r} are not "
                           f"a valid length range")
    if lo or hi is not None:
        lines.append(f"{lexeme}: (/(?s:.{{{lo},{'' if hi is None else hi}}})/ & /{VALUE_TEXT}/) {lark_literal(CLOSE)}")
        return lexeme
    return "TEXT"


def _token(tok, text: str) -> str:
    """A tag as its own token when the vocabulary has it (the model writes it as one), else as text."""
    if tok.has_token(text):
        return f"<[{tok.token_id(text)}]>"
    return lark_literal(text)


def check_tool_choice(body) -> None:
    """tool_choice naming a function not in tools, or required with no tools: a 400."""
    choice = body.tool_choice
    names = [t.function.name for t in body.tools or []]
    if choice == "required" and not names:
        raise APIError(400, "tool_choice: 'required' needs tools; this request has none", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(map(repr, names)) or 'none'})", param="tool_choice")


def chat_stops(body, constraint, thinking: bool) -> list[StopString]:
    """A chat answer's stop strings: the request's own, looked for outside tool-call blocks when it has tools (a
    call's arguments are its schema's, not the answer's text: a stop string there would cut a call short), and
    with parallel_tool_calls false and no grammar (tool_choice auto) </tool_call>, which ends the output at the
    first call's end (kept: the parser reads the call it closed as complete), looked for once the reasoning is
    over."""
    skip = (TOOL_START, TOOL_END) if body.tools else None
    stops = [StopString(s, skip=skip) for s in body.stop_list()]
    if body.tools and body.parallel_tool_calls is False and constraint is None and body.tool_choice != "none":
        stops.append(StopString(TOOL_END, after=THINK_END if thinking else None, keep=True))
    return stops


def completion_constraint(ctx: ServerContext, body) -> ConstraintSpec | None:
    """The grammar a text completion's output must follow (its response_format, structured_outputs or guided_*
    rule) from its first token, or None."""
    rule = output_rule(body)
    if rule is None:
        return None
    try:
        return _spec(ctx, rule.grammar(ctx.grammars), False, rule.param, rule.kind)
    except GrammarError as e:
        raise _refusal(e, rule.param, rule) from None
