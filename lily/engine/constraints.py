"""Constrained decoding: a grammar (JSON Schema, any JSON object, a tool call) turned into a token mask
for each step, by llguidance (a maintained grammar engine: Earley parser over a token trie, in Rust).

  Grammars          compiles grammars for one tokenizer; each compiled grammar (a pristine matcher) is
                    cached by its source, so a schema is compiled once and each request gets a copy
  ConstraintSpec    what a GenerationRequest carries: the grammar, and whether it starts at once or after
                    the model's </think> (thinking text is left free; the grammar starts with the answer)
  TokenConstraint   one generation's grammar state: `prepare()` fills the next token's bitmask on the
                    CPU while the device runs the step, `allowed()` hands it to the sampler (before the
                    grammar starts: every token but the stop tokens), `accept(token)` advances the grammar
  apply_token_bitmask   -inf for every token whose bit is 0 (torch, on the logits' device)

Whitespace inside constrained JSON is bounded (WHITESPACE), so a weak model cannot stall in it. A schema
keyword the engine cannot honour is a GrammarError naming it (the server answers 400); a schema it gives up on
while generating (llguidance's parser limits) a RequestError naming the request's field (400 too).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from lily.engine.request_error import RequestError

# at most this many whitespace characters (space, newline, tab) between two JSON tokens and before the
# value: room for pretty-printed nesting, no room to stall
WHITESPACE_MAX = 12
WHITESPACE = r"[\x20\x0A\x09]{0,%d}" % WHITESPACE_MAX
ANY_JSON_OBJECT = {"type": "object"}
CACHE_SIZE = 128
# the stack a grammar is compiled on: llguidance recurses once a level of a grammar's nesting, and a client's
# chain of 3,000 Lark rules overflowed a thread's 8 MB (the server died of it); 256 MB takes 20,000 (virtual
# memory: only what the recursion touches is used)
COMPILE_STACK_BYTES = 256 * 2 ** 20
_STACK_SIZE_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A grammar the engine cannot compile or honour (e.g. an unsupported JSON Schema keyword)."""


def _llguidance():
    import llguidance  # imported on first use: a server that never constrains never loads it

    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: `matcher` is pristine and only ever copied."""
    source: str
    matcher: object  # llguidance.LLMatcher
    vocab_size: int  # the mask's width in tokens (the model's vocabulary)


class Grammars:
    """Grammar compilation for one tokenizer, cached by source (least recently used out)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (not served from the cache)

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:  # about a second for a 248K vocabulary: once, on first use
            llg = _llguidance()
            self._ll_tokenizer = llg.LLTokenizer(self.tokenizer.tokenizer_json(), n_vocab=self.vocab_size,
                                                 eos_token=list(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def json(self, schema: dict | None = None) -> Grammar:
        """Any JSON object (schema None), or a value valid against `schema`, after bounded whitespace."""
        check_json_schema(schema)
        return self.lark("start: LEAD body\nLEAD: /%s/\nbody: %s\n" % (WHITESPACE, json_rule(schema)))

    def lark(self, source: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (JSON Schema inline as `%json {...}`)."""
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        compiled = Grammar(source, on_large_stack(self._compile, source), self.vocab_size)
        with self._lock:
            self.compiled += 1
            self._cache[source] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, source: str):
        llg = _llguidance()
        grammar = llg.LLMatcher.grammar_from_lark(source)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(_one_line(messages[0] if messages else "invalid grammar"))
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_one_line(matcher.get_error()))
        return matcher


def on_large_stack(fn, *args):
    """fn(*args) on a thread of its own with COMPILE_STACK_BYTES of stack; its result, or its exception raised."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # (handed to the caller's thread)
            out["error"] = e

    with _STACK_SIZE_LOCK:  # (the size applies to threads started while it is set)
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="lily-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


# where a JSON Schema keeps its subschemas: keyword -> a schema / a list of schemas / a map of name -> schema
SCHEMA_VALUE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "additionalItems", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # (items as a list: draft 4-7's tuples)
SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def subschemas(schema, path: str = ""):
    """Every schema object in `schema` (itself first) with its JSON pointer: what the keywords above hold, so a
    property *named* "format" or "x-guidance" is a name, not a keyword, and enum / const / default values are
    not walked."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in SCHEMA_VALUE:
        if isinstance(schema.get(key), dict):
            yield from subschemas(schema[key], f"{path}/{key}")
    for key in SCHEMA_LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from subschemas(sub, f"{path}/{key}/{i}")
    for key in SCHEMA_MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from subschemas(sub, f"{path}/{key}/{str(name).replace('~', '~0').replace('/', '~1')}")


def _free_keys(schema: dict) -> bool:
    """Whether an object schema lets keys other than its named properties in (patternProperties, or an
    additionalProperties other than false: JSON Schema's default is any key)."""
    return bool(schema.get("patternProperties")) or schema.get("additionalProperties", True) is not False


def _refuse(schema: dict) -> None:
    """GrammarError for what llguidance would take but not honour as JSON Schema says:
    - an `x-guidance` key: llguidance's own options (separators that are not JSON's, coerce_one_of, ...), not
      JSON Schema: lily sets the ones it needs, a client's would change the answer's syntax or relax oneOf;
    - minProperties / maxProperties on an object whose keys are not all named properties: the grammar does not
      track the keys written, so a free-form key may repeat ({"a": 6, "a": 6}) and count twice (a JSON parser
      keeps one: too few properties, with finish_reason stop)."""
    for path, sub in subschemas(schema):
        where = f" (at {path})" if path else ""
        if "x-guidance" in sub:
            raise GrammarError(f"'x-guidance'{where} is the grammar engine's own option, not JSON Schema, and is not "
                               f"accepted from a request; leave it out")
        counts = [k for k in ("minProperties", "maxProperties") if k in sub]
        named = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
        least = sub.get("minProperties")
        if isinstance(least, int) and not isinstance(least, bool) and not _free_keys(sub) and least > len(named):
            # (llguidance writes the object anyway, with too few properties)
            raise GrammarError(f"minProperties {least}{where} asks for more properties than the {len(named)} the "
                               "object names and takes (additionalProperties false): no object satisfies it")
        if counts and _free_keys(sub):
            raise GrammarError(
                f"{' / '.join(counts)}{where} cannot be enforced on an object whose keys are not all named in "
                f"properties (patternProperties, additionalProperties, a dict): constrained decoding does not track "
                f"the keys written, so a free-form key may repeat; name the properties (additionalProperties "
                f"false) or leave {' and '.join(counts)} out")


def map_schemas(schema, fn, before=None):
    """`schema` rebuilt: `before` (if given) applied to every schema object in it on the way down (before its
    subschemas are mapped), `fn` on the way up (after); the client's dicts never changed in place."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema if before is None else before(schema))
    for key in SCHEMA_VALUE:
        if isinstance(out.get(key), dict):
            out[key] = map_schemas(out[key], fn, before)
    for key in SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = [map_schemas(v, fn, before) for v in out[key]]
    for key in SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: map_schemas(v, fn, before) for k, v in out[key].items()}
    return fn(out)


# date / time / date-time as Python's datetime (so pydantic) and jsonschema's format checker read them:
# llguidance's own regexes took Feb 29 in every year, second 60 (a leap second, which Python refuses) and year
# 0000. Seconds 00-59, a fraction of 1-6 digits (microseconds), Feb 29 only in a leap year (divisible by 4 and
# not by 100, or by 400), years 0001-9999; a time carries its offset (RFC 3339's full-time, as llguidance's).
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
DATE_FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}


def _tighten(schema: dict) -> dict:
    pattern = DATE_FORMATS.get(schema.get("format")) if isinstance(schema.get("format"), str) else None
    if pattern is None:
        return schema
    out = {k: v for k, v in schema.items() if k != "format"}
    if "pattern" not in out:
        out["pattern"] = pattern
    else:  # both hold (JSON Schema has one pattern a schema)
        out["allOf"] = [*(out.get("allOf") or []), {"pattern": pattern}]
    return out


def tighten_formats(schema):
    """`schema` with its date / time / date-time formats as patterns Python's datetime parses (`DATE_FORMATS`)."""
    return map_schemas(schema, _tighten)


# llguidance's messages that tell a client to set one of its own options, which a request cannot (and lily
# refuses: `_refuse`): what the client can do instead
_REWORDED = (("coerce_one_of", "oneOf: its branches may overlap (a value valid against more than one of them), "
                               "which constrained decoding cannot exclude; use anyOf if a value may match several "
                               "branches, or make the branches disjoint (different types, or a const property "
                               "that tells them apart)"),)


def _message(message) -> str:
    text = _one_line(message)
    for needle, reworded in _REWORDED:
        if needle in text:
            return reworded
    return text


def check_json_schema(schema: dict | None) -> None:
    """GrammarError naming what the engine cannot honour (e.g. 'Unimplemented keys: ["if"]')."""
    if schema is None:
        return
    _refuse(schema)
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json_rule(schema)[len("%json "):])
    except ValueError as e:
        raise GrammarError(_message(e)) from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(_message(messages[0] if messages else "invalid schema"))


def json_rule(schema: dict | None) -> str:
    """A Lark rule body for a JSON value valid against `schema` (None: any JSON object), whitespace bounded, its
    date / time / date-time formats as Python reads them (`tighten_formats`). llguidance's options are lily's
    alone (a request's x-guidance is refused: `check_json_schema`)."""
    schema = tighten_formats(dict(ANY_JSON_OBJECT if schema is None else schema))
    schema["x-guidance"] = {"whitespace_pattern": WHITESPACE, "lenient": False}
    return "%json " + json.dumps(schema)


def lark_literal(text: str) -> str:
    return json.dumps(text)


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request asks for: `grammar` on its output, from the first token, or (after_think) from the
    token after the model's </think> (`think_end`), so the reasoning before it is free. `param` is the request
    field the grammar comes from, named in a 400 when the grammar engine gives up on it mid-generation."""
    grammar: Grammar
    after_think: bool = False
    think_end: int | None = None
    param: str = "response_format"
    kind: str = "json"  # what the grammar holds: "json", "regex", "choice", "grammar" or "tools" (in a 400's advice)

    def start(self, device, stop_ids=()) -> "TokenConstraint":
        return TokenConstraint(self, device, stop_ids)


class TokenConstraint:
    """One generation's grammar state and its next-token bitmask (int32 words, bit i of word w = token
    32 w + i allowed; llguidance's layout). `stop_ids`: the tokens that end the generation, banned while the
    grammar waits for the end of the thinking (an answer must follow, under the grammar)."""

    def __init__(self, spec: ConstraintSpec, device, stop_ids=()):
        self.spec = spec
        self.active = not spec.after_think
        self.matcher = spec.grammar.matcher.deep_copy()
        self.device = torch.device(device)
        self.words = (spec.grammar.vocab_size + 31) // 32
        pin = self.device.type == "cuda"
        self._host = torch.empty(self.words, dtype=torch.int32, pin_memory=pin)
        self._ready: torch.Tensor | None = None  # the prepared mask on the device
        self.accepted = 0  # tokens the grammar took
        self._thinking = None  # while the grammar waits: every token but the stop tokens
        if not self.active and stop_ids:
            mask = torch.full((self.words,), -1, dtype=torch.int32)
            for t in stop_ids:
                if 0 <= t < 32 * self.words:
                    mask[t // 32] &= ~(1 << (t % 32))
            self._thinking = mask.to(self.device)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing can follow (only an end-of-text token is allowed now)."""
        return self.active and self.matcher.is_stopped()

    def prepare(self) -> None:
        """Compute the next token's mask (CPU; llguidance drops the GIL) and start its copy to the device.
        Called while the device runs the step, so the two overlap."""
        if not self.active or self._ready is not None or self.matcher.is_error():
            return
        self._host.fill_(0)  # never a stale bit: the matcher writes every word it allows
        self.matcher.unsafe_compute_mask_ptr(self._host.data_ptr(), self.words * 4)
        self._ready = self._host.to(self.device, non_blocking=True)

    def allowed(self) -> torch.Tensor | None:
        """The bitmask [words] for the next token on the device: while the grammar waits for the end of the
        thinking, every token but the stop tokens (None when there are none to ban). RequestError if the grammar
        engine gave up (its mask is then all zero: nothing may be drawn from it)."""
        if not self.active:
            return self._thinking
        self.prepare()
        if self.matcher.is_error():
            raise self._gave_up()
        return self._ready

    def accept(self, token: int) -> None:
        """The token was chosen: advance the grammar (or, before it starts, look for the end of thinking).
        RequestError if the grammar engine gives up on it (llguidance's limits, e.g. a row of its Earley parser
        past 2,000 items for an object of many optional properties: it refuses a token its mask allowed)."""
        self._ready = None
        if not self.active:
            if token == self.spec.think_end:
                self.active = True
            return
        if not self.matcher.consume_token(token):
            word = int(self._host[token // 32]) if token < 32 * self.words else 0
            if not (word >> (token % 32)) & 1:  # a token its mask banned was drawn: the engine's fault
                raise RuntimeError(f"token {token} was drawn against the grammar's mask: {self.matcher.get_error()}")
            raise self._gave_up()
        self.accepted += 1

    def _gave_up(self) -> RequestError:
        why = _one_line(self.matcher.get_error().split("<state>")[0])[:300]  # (after it: its state and the grammar)
        simpler = ("a simpler schema (fewer optional properties or anyOf branches)" if self.spec.kind == "json"
                   else "a smaller grammar (or longer lexemes: many one-character alternatives weigh most)")
        return RequestError(
            f"{self.spec.param}: too complex for the grammar engine, which gave up at token {self.accepted + 1} of "
            f"the answer ({why}); {simpler} avoids this", param=self.spec.param)


def apply_token_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """scores [..., V] with -inf where the token's bit is 0 (tokens past the mask's 32 * words are banned).
    A new tensor on scores' device; bitmask [..., words] int32."""
    vocab = scores.shape[-1]
    bits = (bitmask.to(scores.device)[..., :, None] >> torch.arange(32, device=scores.device, dtype=torch.int32)) & 1
    keep = bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab].bool()
    if keep.shape[-1] < vocab:
        keep = torch.nn.functional.pad(keep, (0, vocab - keep.shape[-1]))
    return scores.masked_fill(~keep, float("-inf"))
