"""Structured outputs: what a chat request's response_format and tool_choice (or a text completion's
response_format) ask of the model's answer, as a grammar for lily.engine.constraints.

  response_format {"type": "json_object"}                 any JSON object
  response_format {"type": "json_schema", "json_schema"}  a JSON value valid against its schema
  tool_choice "required" / {"function": {"name": N}}      a tool call (to N), in the template's format:
      <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
      with, for a strict tool, exactly its parameters (required ones present, values valid: strings as
      text within their enum / const / length bounds, other string keywords such as pattern refused; anything
      else as JSON against its schema); parallel_tool_calls false allows one call.

The grammar starts where the answer starts: after the model's </think> when the prompt opened a thinking
block (a text completion has no thinking: its first token). A schema the engine cannot honour is a 400
naming the keyword.
"""

from __future__ import annotations

from lily.engine.constraints import WHITESPACE, ConstraintSpec, GrammarError, json_rule, lark_literal
from lily.server.context import ServerContext
from lily.server.errors import APIError
from lily.server.protocol import NamedToolChoice, ResponseFormatJsonSchema

NO_CLOSE = r"~/(?s:.*<\/parameter>.*)/"  # a parameter's text: anything without </parameter> in it
TEXT_VALUE = r"/(?s:.*)/ & " + NO_CLOSE
PARAM_NAME = r"/[^>\n]+/"


def chat_constraint(ctx: ServerContext, body, thinking: bool) -> ConstraintSpec | None:
    """The grammar a chat request's output must follow, or None (free text)."""
    try:
        if body.tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)):
            return _spec(ctx, ctx.grammars.lark(tool_call_grammar(ctx, body)), thinking)
        fmt = body.response_format
        if fmt is None or fmt.type == "text":
            return None
        if isinstance(fmt, ResponseFormatJsonSchema):
            return _spec(ctx, ctx.grammars.json(fmt.json_schema.schema_ or {}), thinking)
        return _spec(ctx, ctx.grammars.json(None), thinking)
    except GrammarError as e:
        param = "tools" if body.tool_choice not in (None, "none", "auto") else "response_format"
        if param == "response_format" and isinstance(body.response_format, ResponseFormatJsonSchema):
            param = "response_format.json_schema.schema"
        raise APIError(400, f"{param}: cannot be enforced by constrained decoding: {e}", param=param) from None


def _spec(ctx: ServerContext, grammar, thinking: bool) -> ConstraintSpec:
    tok = ctx.tokenizer
    think_end = tok.token_id("</think>") if tok.has_token("</think>") else None
    return ConstraintSpec(grammar, after_think=thinking and think_end is not None, think_end=think_end)


def tool_call_grammar(ctx: ServerContext, body) -> str:
    """Lark source: one tool call (or several, parallel_tool_calls allowing) to the allowed tools."""
    tok = ctx.tokenizer
    tools = [t.function for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        tools = [f for f in tools if f.name == body.tool_choice.function.name]
    open_tag, close_tag = (_token(tok, "<tool_call>"), _token(tok, "</tool_call>"))
    lines = ["start: LEAD call" + ("" if body.parallel_tool_calls is False else ' ("\\n" call)*'),
             f"LEAD: /{WHITESPACE}/",
             f'call: {open_tag} "\\n<function=" fn "</function>\\n" {close_tag}',
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
             f"TEXT: {TEXT_VALUE}",
             f"PNAME: {PARAM_NAME}"]
    for i, f in enumerate(tools):
        params = f.parameters or {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        head = lark_literal(f"{f.name}>\n")
        if not f.strict:  # any parameters, values as text
            lines.append(f'fn_{i}: {head} ("<parameter=" PNAME ">\\n" TEXT "\\n</parameter>\\n")*')
            continue
        required = set(params.get("required") or [])
        parts = []
        for j, (name, schema) in enumerate(props.items()):
            lines.append(f'p_{i}_{j}: {lark_literal(f"<parameter={name}>" + chr(10))} v_{i}_{j} '
                         f'"\\n</parameter>\\n"')
            lines.append(f"v_{i}_{j}: " + _value_rule(schema, f"T_{i}_{j}", lines))
            parts.append(f"p_{i}_{j}" + ("" if name in required else "?"))
        lines.append(f"fn_{i}: {head} " + " ".join(parts))
    return "\n".join(lines) + "\n"


# what a strict tool's string parameter may say and the grammar still enforces (annotations included);
# anything else about the text (pattern, format, ...) is refused rather than silently ignored
STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "description", "title", "default", "examples",
                   "deprecated", "readOnly", "writeOnly", "$comment"}


def _value_rule(schema, lexeme: str, lines: list[str]) -> str:
    """A parameter value as the output parser reads it: a string type is the text itself (enum or const: one
    of its values; minLength / maxLength bound it), anything else a JSON value valid against the schema."""
    if not isinstance(schema, dict):
        return "TEXT"
    if schema.get("type") == "string":
        unknown = sorted(set(schema) - STRING_KEYWORDS)
        if unknown:
            raise GrammarError(f"a strict tool's string parameter: {', '.join(map(repr, unknown))} cannot be "
                               f"enforced on the parameter's text (supported: enum, const, minLength, maxLength)")
        if "const" in schema:
            return lark_literal(str(schema["const"]))
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return " | ".join(lark_literal(v) for v in schema["enum"])
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            raise GrammarError(f"a strict tool's string parameter: minLength {lo!r} / maxLength {hi!r} are not "
                               f"a valid length range")
        if lo or hi is not None:
            lines.append(f"{lexeme}: /(?s:.{{{lo},{'' if hi is None else hi}}})/ & {NO_CLOSE}")
            return lexeme
        return "TEXT"
    return json_rule(schema)


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


def one_call_stop(body, constraint) -> list[str]:
    """parallel_tool_calls false without a grammar (tool_choice auto): the output ends at the first call's
    </tool_call> (the stop string; the parser reads the call it closed)."""
    if body.tools and body.parallel_tool_calls is False and constraint is None and body.tool_choice != "none":
        return ["</tool_call>"]
    return []


def completion_constraint(ctx: ServerContext, body) -> ConstraintSpec | None:
    """The grammar a text completion's output must follow (its response_format) from its first token, or None."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = (fmt.json_schema.schema_ or {}) if isinstance(fmt, ResponseFormatJsonSchema) else None
    try:
        return _spec(ctx, ctx.grammars.json(schema), False)
    except GrammarError as e:
        param = "response_format.json_schema.schema" if schema is not None else "response_format"
        raise APIError(400, f"{param}: cannot be enforced by constrained decoding: {e}", param=param) from None
