"""What a request asks its answer to follow, whichever field says it, as one `OutputRule`:

  response_format {"type": "json_object"} / {"type": "json_schema", ...}     OpenAI's
  structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}  vLLM's (one of them)
  guided_json / guided_regex / guided_choice / guided_grammar                  vLLM's older names

A request gives one of them at most (two are a 400 naming both: vLLM refuses them too). A regex is matched by
the whole answer (llguidance's syntax: Rust's regex crate, no look-around or back-references); a choice is one of
its strings exactly; a grammar is Lark (llguidance's dialect, rule `start`) or GBNF (`root ::= ...`, as vLLM's
other engines take it), converted to Lark by llguidance. lily.server.structured turns the rule into the grammar
the engine holds the answer to, alone or beside tool calls.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from lily.engine.constraints import WHITESPACE, Grammar, GrammarError, Grammars, json_rule
from lily.server.errors import APIError
from lily.server.protocol import ResponseFormatJsonSchema
from lily.server.tool_values import closed_objects

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class OutputRule:
    """kind: "json" (`schema`: a JSON Schema, None for any JSON object), "regex" or "grammar" (`text`) or
    "choice" (`choices`); param: the request field it came from, named in a 400; strict: a strict json_schema
    (its objects closed by it)."""
    kind: str
    param: str
    schema: dict | None = None
    text: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False

    def grammar(self, grammars: Grammars) -> Grammar:
        """The compiled grammar of the whole answer (GrammarError: one the engine cannot compile)."""
        if self.kind == "json":
            return grammars.json(self.schema)
        if self.kind == "grammar":
            return grammars.lark(lark_source(self.text, self.param))
        return grammars.lark("start: " + self.answer_rule())

    def answer_rule(self) -> str | None:
        """A Lark rule body of the whole answer, to stand beside tool calls (None for a grammar: its rules are its
        own): a JSON value after bounded whitespace, as `Grammars.json` holds it alone; a regex's match or a
        choice from the answer's first character."""
        if self.kind == "json":
            return f"/{WHITESPACE}/ {json_rule(self.schema)}"
        if self.kind == "regex":
            return regex_literal(self.text)
        if self.kind == "choice":  # one regex: as Lark alternatives, 2,000 strings passed the parser's row limit
            return regex_literal("|".join(regex_escape(c) for c in self.choices))
        return None


def regex_literal(pattern: str) -> str:
    """`pattern` as a Lark regex terminal: /.../ with each unescaped / escaped (an escape pair is copied whole)."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        out.append("\\/" if ch == "/" else ch)
        i += 1
    return "/" + "".join(out) + "/"


# the regex crate's meta characters: escaped, every other character stands for itself
REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def regex_escape(text: str) -> str:
    """`text` as a regex that matches it alone (Rust's regex crate, as llguidance reads it)."""
    return "".join("\\" + ch if ch in REGEX_META else ch for ch in text)


# the largest grammar taken: GBNF is turned into Lark by llguidance's converter, Python that holds the interpreter
# for a time growing with the square of the rules (a 42 KB chain: 1.9 s, every stream stalled); Lark is compiled
# in Rust (a 64 KB chain: 0.1 s)
GBNF_MAX_BYTES = 16 * 1024
LARK_MAX_BYTES = 64 * 1024
_LARK = re.compile(r"(?m)^\s*(%llguidance\b|%ignore\b|%import\b|[?!]?start\s*:)")


def lark_source(text: str, param: str) -> str:
    """A grammar in Lark as sent (it has a start rule, as vLLM's examples' ?start:), or GBNF (root ::= ...)
    converted to Lark by llguidance (GrammarError where it cannot be; a 400 past the size the server takes)."""
    size = len(text.encode())
    gbnf = _LARK.search(text) is None and "::=" in text
    limit = GBNF_MAX_BYTES if gbnf else LARK_MAX_BYTES
    if size > limit:
        raise APIError(400, f"{param}: {size:,} bytes of {'GBNF' if gbnf else 'Lark'}; at most {limit:,}"
                       + (f" (as Lark, up to {LARK_MAX_BYTES:,})" if gbnf else ""), param=param)
    if not gbnf:
        return text
    return _gbnf_to_lark(text)


@functools.lru_cache(maxsize=64)
def _gbnf_to_lark(text: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as e:  # (GbnfToLarkError, and the converter's own errors on text it cannot read)
        raise GrammarError(f"not a Lark grammar (rule start: ...) and not GBNF (root ::= ...): {e}") from None


def format_schema(fmt) -> dict | None:
    """A json_schema response_format's schema (objects closed when strict), {} without one, None for json_object."""
    if not isinstance(fmt, ResponseFormatJsonSchema):
        return None
    schema = fmt.json_schema.schema_ or {}
    return closed_objects(schema) if fmt.json_schema.strict else schema


def _schema(value, param: str, closed: bool) -> dict:
    """A JSON Schema sent as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"{param}: not a JSON Schema: a string here must be a schema's JSON text ({e})",
                           param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: a JSON Schema is a JSON object, got {type(value).__name__}", param=param)
    return closed_objects(value) if closed else value


def _structured_outputs(so) -> OutputRule:
    given = [k for k in KINDS if getattr(so, "json_" if k == "json" else k) not in (None, False)]
    if len(given) != 1:
        sent = f"; this request gives {' and '.join(given)}" if given else ""
        raise APIError(400, f"structured_outputs: give exactly one of {', '.join(KINDS)}{sent}",
                       param="structured_outputs")
    kind, param = given[0], f"structured_outputs.{given[0]}"
    if kind == "json":
        return OutputRule("json", param, schema=_schema(so.json_, param, bool(so.disable_additional_properties)),
                          strict=bool(so.disable_additional_properties))
    if kind == "json_object":
        return OutputRule("json", param)
    if kind == "choice":
        return OutputRule("choice", param, choices=tuple(so.choice))
    return OutputRule(kind, param, text=getattr(so, kind))


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


def has_output_rule(body) -> bool:
    """Whether the request gives a rule at all (output_rule is then a rule or a 400), without reading it: the
    routes ask this for each choice's parser, output_rule parses a schema's text and closes its objects."""
    fmt = getattr(body, "response_format", None)
    return (fmt is not None and fmt.type != "text") or getattr(body, "structured_outputs", None) is not None \
        or any(getattr(body, name, None) is not None for name in GUIDED_FIELDS)


def output_rule(body) -> OutputRule | None:
    """The rule a chat or completion request holds its answer to, or None (free text); a 400 where it gives more
    than one, or one that is not well formed."""
    rules = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        schema = format_schema(fmt)
        strict = isinstance(fmt, ResponseFormatJsonSchema) and bool(fmt.json_schema.strict)
        param = "response_format.json_schema.schema" if schema is not None else "response_format"
        rules.append(OutputRule("json", param, schema=schema, strict=strict))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        rules.append(_structured_outputs(so))
    if getattr(body, "guided_json", None) is not None:
        rules.append(OutputRule("json", "guided_json", schema=_schema(body.guided_json, "guided_json", False)))
    for kind in ("regex", "grammar"):
        if getattr(body, f"guided_{kind}", None) is not None:
            rules.append(OutputRule(kind, f"guided_{kind}", text=getattr(body, f"guided_{kind}")))
    if getattr(body, "guided_choice", None) is not None:
        rules.append(OutputRule("choice", "guided_choice", choices=tuple(body.guided_choice)))
    if len(rules) > 1:
        names = [r.param.split(".")[0] if r.param.startswith("response_format") else r.param for r in rules]
        raise APIError(400, f"{names[1]}: the answer can be held to one rule only, and {names[0]} gives one too; "
                       "send one of them", param=names[1])
    return rules[0] if rules else None
