"""Splitting the model's streamed text into reasoning, content and tool calls.

Qwen3.6 writes `...reasoning...</think>\n\ncontent` (the generation prompt already opened <think>),
and calls tools with
    <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>
The parser is incremental: text arrives in arbitrary pieces, a tag may be split across pieces, so
any tail that could still become a tag is held back until the next piece (or the end) decides it.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

from lily.server.tool_values import admits_null, closed_objects, tool_schema, value_form

THINK_END = "</think>"
THINK_START = "<think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    complete: bool = True  # False: the output ended inside it (max_tokens), before its </tool_call>

    @property
    def sent_arguments(self) -> str:
        """The arguments as the chat API sends them: a call cut short is left unclosed (its last brace dropped), as
        OpenAI's cut arguments are, so a client's JSON parse refuses it rather than run the call with half of it."""
        return self.arguments if self.complete else self.arguments[:-1]


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number's value; one past float's range (1e999) is no value the arguments' JSON could carry back."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _read_json(value: str):
    """The JSON value of a parameter's text; the text as it is where it is not one: cut short (max_tokens),
    written freely, or a number Python would read as infinite / the NaN and Infinity literals, which json.dumps
    would write back as no JSON at all (the arguments string must parse in every client)."""
    try:
        return json.loads(value, parse_float=_finite, parse_constant=_not_json_constant)
    except (json.JSONDecodeError, ValueError):
        return value


def _read_loose(value: str, schema, root: dict) -> object:
    """A value whose schema lets it be a string or more (no type, a type list with "string", an anyOf of a
    string and others): the text, but for "null" where the schema admits null (Optional[str]'s None, as vLLM
    reads it) and JSON where its type list leaves out "string"."""
    if value.strip() == "null" and admits_null(schema, root):
        return None
    typ = schema.get("type") if isinstance(schema, dict) else None
    if typ is None or typ == "string" or (isinstance(typ, list) and "string" in typ):
        return value
    return _read_json(value)


def _convert(value: str, schema, strict: bool, held: bool, root: dict | None = None):
    """A parameter's text to its JSON value: as a grammar writes a value of its schema (`value_form`): under the
    call grammar (`held`) exactly so; written freely (tool_choice auto) as a tool without strict's, since nothing
    held the model to a strict tool's JSON (Optional[int]'s "5" is 5 either way, a string's text its text)."""
    form = value_form(schema, strict if held else False, root)
    if form == "text":
        return value
    if form == "json":
        return _read_json(value)
    return _read_loose(value, schema, root or {})


PARAMETER_END = "</parameter>"
FUNCTION_END = "</function>"
FUNCTION_OPEN = "<function="
_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER_OPEN = "<parameter="
_JSON = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json_constant)


def _tool(tools, name: str) -> tuple[dict, bool, dict]:
    """The named tool's (properties as the grammar reads them, $refs followed; strict; parameters schema)."""
    props, strict, root = {}, False, {}
    for t in tools or []:
        fn = t.get("function", t)
        if fn.get("name") == name:
            root = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            strict = fn.get("strict") is True
            if strict:  # as the call grammar holds it: its objects closed, allOf's plain branches merged
                root = closed_objects(root)
            _, props, _ = tool_schema(root)
    return props, strict, root


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


_WAIT = object()  # a value still being written whose end the text so far does not yet tell


def _held_value(text: str, start: int, schema, strict: bool, root: dict, final: bool):
    """The value that starts at `start` (after "<parameter=P>\n") as the call grammar wrote it, and the position
    after its </parameter> (None: the text ends first). A value the grammar writes as JSON is read as JSON, to its
    last character: a string in it may hold "</parameter>", "</function>" or "<parameter=", which the grammar
    does not exclude from JSON strings (it does from text values). Where the text is no JSON value closed by
    </parameter> (a tool without strict whose value's schema the grammar could not compile writes it as text,
    as the loose form does), it is read as text up to its </parameter>, which text cannot hold. Not `final`, a
    value that does not parse yet and has a quote before that </parameter> may be a JSON string still open:
    _WAIT."""
    if value_form(schema, strict, root) == "json":
        try:
            value, end = _JSON.raw_decode(text, _skip_space(text, start))
        except ValueError:
            pass
        else:
            after = _skip_space(text, end)
            if text.startswith(PARAMETER_END, after):
                return value, after + len(PARAMETER_END)
            if not final and PARAMETER_END.startswith(text[after:]):
                return _WAIT, None
        i = text.find(PARAMETER_END, start)
        if not final and '"' in text[start:i if i >= 0 else len(text)]:
            return _WAIT, None
    i = text.find(PARAMETER_END, start)
    value = text[start:i] if i >= 0 else text[start:len(text) - _partial_suffix(text[start:], PARAMETER_END)]
    if value.endswith("\n"):
        value = value[:-1]
    return _convert(value, schema, strict, True, root), (i + len(PARAMETER_END) if i >= 0 else None)


def read_held_call(block: str, tools, final: bool = True):
    """A call written under the call grammar (`<function=NAME>`, its parameters, `</function>`), read as the
    grammar wrote it: (name, arguments, the position after its </function> or None where the text ends before
    it), or None where the block does not open with <function=NAME>. Not `final`, the arguments are _WAIT while
    a value's end is not yet told."""
    m = _FUNCTION_OPEN.match(block)
    if not m:
        return None
    name = m.group(1).strip()
    props, strict, root = _tool(tools, name)
    args: dict = {}
    pos = m.end()
    while True:
        pos = _skip_space(block, pos)
        if block.startswith(FUNCTION_END, pos):
            return name, args, pos + len(FUNCTION_END)
        close = block.find(">", pos)
        if not block.startswith(_PARAMETER_OPEN, pos) or close < 0 or "\n" in block[pos:close]:
            return name, args, None  # cut short (or not the grammar's: the end reads what there is)
        pname = block[pos + len(_PARAMETER_OPEN):close].strip()
        start = close + 1 + block.startswith("\n", close + 1)
        value, pos = _held_value(block, start, props.get(pname), strict, root, final)
        if value is _WAIT:
            return name, _WAIT, None
        args[pname] = value
        if pos is None:
            return name, args, None


def held_call_end(buf: str, tools) -> int:
    """Where the </tool_call> that closes a call written under the call grammar is in `buf` (the text after its
    <tool_call>), -1 if the text so far does not yet tell: the one after the call's </function>, not one inside
    a JSON string of its values."""
    read = read_held_call(buf, tools, final=False)
    if read is None:  # <function=NAME> not (yet) there: wait while it may still come
        rest = buf.lstrip()
        may_open = FUNCTION_OPEN.startswith(rest) or (rest.startswith(FUNCTION_OPEN) and not set(">\n") & set(rest))
        return -1 if may_open else buf.find(TOOL_END)
    if read[2] is None:
        return -1
    j = _skip_space(buf, read[2])
    if buf.startswith(TOOL_END, j):
        return j
    return -1 if TOOL_END.startswith(buf[j:]) else buf.find(TOOL_END, j)


def parse_tool_call(block: str, tools: list[dict] | None = None, held: bool = False) -> ParsedToolCall | None:
    """One <tool_call> body (tags excluded) to a call, or None if it is not a recognisable call. `held`: the
    call was written under the call grammar (tool_choice required / named), so its values are read back as
    the grammar wrote them (`read_held_call`: a JSON value whole, whatever its strings hold)."""
    if held:
        read = read_held_call(block, tools)
        if read is not None:
            return ParsedToolCall(read[0], json.dumps(read[1], ensure_ascii=False))
    body = block.strip()
    m = _FUNCTION.search(body)
    if m:
        name = m.group(1).strip()
        props, strict, root = _tool(tools, name)  # as the grammar reads it: $refs followed
        args = {}
        for pm in _PARAMETER.finditer(m.group(2)):
            pname = pm.group(1).strip()
            value = pm.group(2)
            if pm.end() == len(m.group(2)) and not pm.group(0).endswith(PARAMETER_END):
                value = value[:len(value) - _partial_suffix(value, PARAMETER_END)]  # cut short inside the tag
            # the format puts the value on its own lines: drop exactly one newline each side
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[pname] = _convert(value, props.get(pname), strict, held, root)
        return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))
    try:  # the older JSON form: {"name": ..., "arguments": {...}} (a number past float's range: no call)
        obj = json.loads(body, parse_float=_finite, parse_constant=_not_json_constant)
    except (json.JSONDecodeError, ValueError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return ParsedToolCall(obj["name"], args)
        return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return None


class ChatOutputParser:
    """Feed text deltas in order; get back reasoning / content / tool-call deltas.

    With tools, whitespace that may precede a tool call is held until what follows decides: the answer's
    leading whitespace (nothing but whitespace written so far) is dropped when a call follows (a tool-call
    answer has no content, as OpenAI's), goes out with the text that follows it, or at the end, with no call,
    as the answer it is; whitespace between and after calls is dropped. `held`: the calls are written under
    the call grammar (tool_choice required / named, or `answer_else`), so their values are read as it wrote them.
    `answer_else`: the answer is either calls or what the request's rule holds (a JSON value, a regex's match, ...:
    `structured.calls_or_answer`), so one that begins as anything but a call is that answer, whole: a <tool_call>
    inside it (a JSON string's text) is its content."""

    def __init__(self, thinking: bool, tools: list[dict] | None = None, held: bool = False, answer_else: bool = False):
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.held = held
        self.answer_else = answer_else
        self.parse_tools = bool(tools)
        self._buf = ""
        self._strip_leading_newlines = False
        self._at_reasoning_start = thinking
        self._spoke = False  # content other than whitespace has gone out
        self._dropped = ""  # the whitespace dropped before the open <tool_call> (its content if it is no call)
        self.n_tool_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ParsedDelta:
        return self._drain(final=True)

    def _holds_whitespace(self) -> bool:
        """Whether whitespace written now may be dropped: it may precede a call that begins the answer, or
        sit between or after calls."""
        return self.parse_tools and (self.n_tool_calls > 0 or not self._spoke)

    def _content(self, out: ParsedDelta, text: str) -> None:
        out.content += text
        if text.strip():
            self._spoke = True
            if self.answer_else and not self.n_tool_calls:
                self.parse_tools = False  # the rule's answer began: no call follows (the grammar's either / or)

    def _drain(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.mode == "reasoning":
                if self._at_reasoning_start:  # a model may repeat the opening tag the prompt wrote
                    stripped = self._buf.lstrip("\n")
                    if not final and (not stripped or THINK_START.startswith(stripped)):
                        return out
                    if not stripped:  # the model wrote only newlines: they are its reasoning
                        out.reasoning += self._buf
                        self._buf = ""
                        return out
                    if stripped.startswith(THINK_START):
                        self._buf = stripped[len(THINK_START):]
                    self._at_reasoning_start = False
                i = self._buf.find(THINK_END)
                if i >= 0:
                    out.reasoning += self._buf[:i]
                    self._buf = self._buf[i + len(THINK_END):]
                    self.mode = "content"
                    self._strip_leading_newlines = True
                    continue
                keep = 0 if final else _partial_suffix(self._buf, THINK_END)
                out.reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            if self.mode == "content":
                if self._strip_leading_newlines:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf and not final:
                        return out
                    self._strip_leading_newlines = False
                i = self._buf.find(TOOL_START) if self.parse_tools else -1
                if i >= 0:
                    before = self._buf[:i]
                    if not before.strip() and self._holds_whitespace():
                        self._dropped = before
                    else:
                        self._content(out, before)
                    self._buf = self._buf[i + len(TOOL_START):]
                    self.mode = "tool"
                    continue
                keep = _partial_suffix(self._buf, TOOL_START) if self.parse_tools and not final else 0
                emit = self._buf[:len(self._buf) - keep]
                if not emit.strip() and self._holds_whitespace():
                    if not final:
                        return out  # whitespace that may precede a call: held, with any partial tag after it
                    if not self.n_tool_calls:
                        out.content += emit  # the end, no call: the answer is this whitespace
                else:
                    self._content(out, emit)
                self._buf = self._buf[len(self._buf) - keep:] if keep else ""
                return out
            # mode == "tool"
            i = self._buf.find(TOOL_END)
            if i >= 0 and self.held:  # (the call's own one, not one inside a JSON string of its values)
                i = held_call_end(self._buf, self.tools)
            if i < 0 and not final:
                return out
            block = self._buf[:i] if i >= 0 else self._buf
            call = parse_tool_call(block, self.tools, self.held)
            if call is None and self.held and i < 0:
                pass  # a call the grammar was writing, cut before its name was whole: no call, and no markup
            elif call is None:  # not a call: its text (and the whitespace held before it) is content
                self._content(out, self._dropped + TOOL_START + block + (TOOL_END if i >= 0 else ""))
            else:
                call.complete = i >= 0
                out.tool_calls.append(call)
                self.n_tool_calls += 1
            self._dropped = ""
            self._buf = self._buf[i + len(TOOL_END):] if i >= 0 else ""
            self.mode = "content"
            if final and not self._buf:
                return out
