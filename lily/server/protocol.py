"""Request bodies of the OpenAI-compatible API, as pydantic models.

They are both the validator and the published OpenAPI schema, so what the schema says is accepted is
exactly what is accepted. Strict types: "0.5" is not a number and 1 is not a boolean. Unknown fields
are ignored (clients send many optional OpenAI fields); fields lily cannot honour (OpenAI's or vLLM's, each
of which would change the output) are declared with only their no-op values accepted (`refused`), so any
other value is a 400 naming the field and saying what to use instead. Rules between fields (top_logprobs
needs logprobs, ...) are checked in validation.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      ValidationError, WithJsonSchema, field_validator, model_validator)

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n, and prompts x n for a batch of completions: each choice is one generation in the queue


def _integral(v):
    """JSON Schema counts 2.0 as an integer; so do we (strict mode alone would refuse it)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]


def int_in(lo: int | None = None, hi: int | None = None):
    """An integer field's type with its bounds inside, so the schema shows them as minimum/maximum."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_integral)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON object in a string")


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class RefusalPart(_Body):
    """An assistant turn's refusal, as OpenAI returns it and clients send it back in the history: its text."""
    type: Literal["refusal"]
    refusal: str


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)


Content = Union[str, list[TextPart]]
AssistantContent = Union[str, list[Annotated[Union[TextPart, RefusalPart], Field(discriminator="type")]]]


class SystemMessage(_Body):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Body):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: Union[AssistantContent, None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(default=None, description="vLLM's current name for reasoning_content: the same "
                                                             "(if both are sent they must be equal)")
    function_call: FunctionCall | None = Field(default=None, description="legacy: the turn's one call, as "
                                                                         "tool_calls with one call")


class ToolMessage(_Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


class FunctionMessage(_Body):
    """Legacy: a function's result, as a tool message."""
    role: Literal["function"]
    name: str
    content: Union[Content, None] = None


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage],
                        Field(discriminator="role")]


def message_text(m) -> str:
    return _text(m.content)


def _callable_name(name: str) -> str:
    """A tool's name as the chat template writes it in a call, <function=NAME>, and the output parser reads it back
    (stripped, up to the '>'): a '>' or a line break would end it early, whitespace at its ends would be lost."""
    if ">" in name or "\n" in name or name != name.strip():
        raise ValueError("a tool's name may not hold '>' or a line break, nor begin or end with whitespace: a call "
                         "names its tool as <function=NAME>, which this name would break")
    return name


ToolName = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_callable_name)]


class FunctionDef(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, description="with tool_choice required or named: the call's "
                                                          "arguments are held to `parameters`")
    # strict where `strict` is left out, as the server decided (a Responses tool's); not shown to the template
    _strict_default: bool = PrivateAttr(default=False)

    @property
    def applied_strict(self) -> bool:
        """Whether the call grammar holds this tool's arguments to its parameters."""
        return self.strict if self.strict is not None else self._strict_default


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Format(_Body):
    """response_format (text.format) and its json_schema: an unknown field here is a 400 (`unknown_format_field`),
    not ignored as elsewhere, since a schema sent under another name would leave the answer unconstrained."""
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Format):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="a JSON Schema")
    strict: bool | None = None


class ResponseFormatText(_Format):
    type: Literal["text"]


class ResponseFormatJsonObject(_Format):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema],
                          Field(discriminator="type")]


def unknown_format_field(loc) -> str:
    """The 400's text for a field response_format (text.format on the Responses API) or its json_schema does not
    take, `loc` pydantic's location of it: what to send instead."""
    parts = [p for p in loc if isinstance(p, str)]
    field = parts[-1] if parts else "?"
    responses = "response_format" not in parts
    at = max((i for i, p in enumerate(parts[:-1]) if p in ("response_format", "format")), default=-1)
    kind = parts[at + 1] if 0 <= at < len(parts) - 1 else None  # the union's tag: the format's type
    where = "text.format" if responses else "response_format"
    schema_at = "text.format.schema" if responses else "response_format.json_schema.schema"
    send = (f"{{\"type\": \"json_schema\", \"name\": ..., \"schema\": {{...}}}}" if responses else
            f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}")
    if kind == "json_object":
        why = (f"json_object takes no other field (any JSON object is allowed); to hold the answer to a JSON Schema "
               f"send {where} {send}")
    elif kind == "text":
        why = "text takes no other field"
    elif not responses and parts.count("json_schema") >= 2:
        why = ("json_schema takes name, description, schema and strict; send the JSON Schema as "
               "response_format.json_schema.schema")
    else:
        why = (f"{where} takes type, name, description, schema and strict; send the JSON Schema as {schema_at}"
               if responses else "response_format takes type and json_schema; send the JSON Schema as "
               "response_format.json_schema.schema")
    return f"unknown field {field!r} (it would be ignored, leaving the answer unconstrained): {why}"


class NamedFunctionCall(_Body):
    name: str


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: refused(
        "only false is supported: usage comes once, in the last chunk (include_usage)", (None, False)) = Field(
        default=None, description="vLLM's; only false: usage comes in the last chunk")


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    enable_thinking: bool | None = None


# a seed as vLLM takes it (int64): a wider one would be read modulo 2**64, so two seeds the client tells apart gave one
# output
Seed = int_in(-2 ** 63, 2 ** 63 - 1)
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Stop = Union[Annotated[str, Field(min_length=1)],
             Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)], None]


TOKEN_KEY = r"^[0-9]{1,9}$"
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_KEY)], Bias], WithJsonSchema({
    "type": "object", "patternProperties": {TOKEN_KEY: {"type": "number", "minimum": -100.0, "maximum": 100.0}},
    "additionalProperties": False})]


def _same(value, accepted) -> bool:
    return any(value is a or (type(value) is type(a) and value == a) for a in accepted)


def refused(message: str, accepted: tuple = (None,)):
    """The type of a field lily cannot honour: its no-op values (`accepted`, exactly: 0 is not false) pass and
    the schema lists only them; any other value is a 400 naming the field with `message`, what to do instead."""
    def check(value):
        if not _same(value, accepted):
            raise ValueError(message)
        return value
    return Annotated[Any, BeforeValidator(check), WithJsonSchema({"enum": list(accepted)})]


GUIDED_SCHEMA = Union[dict[str, Any], str]  # a JSON Schema, as an object or as its JSON text (vLLM takes both)


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar and json_object. An unknown field
    is a 400 (`unknown_structured_field`): a constraint sent under another name would leave the answer free."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_: GUIDED_SCHEMA | None = Field(default=None, alias="json", description="a JSON Schema the answer is valid "
                                                                                "against")
    regex: Annotated[str, Field(min_length=1)] | None = Field(default=None, description="a regular expression the "
                                                                                       "whole answer matches")
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(default=None, description="the answer is one "
                                                                                               "of these strings")
    grammar: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="a context-free grammar of the answer: Lark (llguidance's dialect) or GBNF")
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    disable_additional_properties: bool | None = Field(
        default=None, description="true: json's objects take only the properties they list")
    disable_fallback: bool | None = Field(
        default=None, description="accepted: lily has one grammar engine and never falls back to another")
    disable_any_whitespace: refused(
        "only false is supported: lily allows up to 12 whitespace characters between a JSON value's tokens",
        (None, False)) = Field(default=None, description="only false")
    whitespace_pattern: refused("not supported: lily sets the whitespace a JSON value may hold") = Field(
        default=None, description="refused")
    structural_tag: refused("not supported; use tools with tool_choice, or one of json, regex, choice, "
                            "grammar") = Field(default=None, description="refused")


def unknown_structured_field(loc) -> str:
    """The 400's text for a field structured_outputs does not take."""
    field = [p for p in loc if isinstance(p, str)][-1]
    return (f"unknown field {field!r} (it would be ignored, leaving the answer unconstrained): structured_outputs "
            "takes one of json, regex, choice, grammar and json_object, with disable_additional_properties and "
            "disable_fallback")


class _Sampling(_Body):
    """Fields shared by chat and text completions."""
    model: str | None = Field(default=None, description="the served model's id (optional, as in vLLM: lily serves one)")
    max_tokens: int_in(1) | None = None
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int_in(-1) | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: Seed | None = Field(default=None, description="a 64-bit signed integer (as vLLM's)")
    stop: Stop = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)
    n: int_in(1, MAX_CHOICES) | None = Field(
        default=None, description="choices per prompt, generated together (seed s: choice i uses s + i)")
    logit_bias: LogitBias | None = Field(
        default=None, description="token id (as a string) -> bias added to its logit; -100 bans the token; "
                                  "an id outside the vocabulary is a 400")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    prompt_cache_key: str | None = None
    ignore_eos: bool | None = Field(default=None, description="keep generating past end-of-text tokens (not an "
                                                                "OpenAI field; as vLLM's, for benchmarks)")
    min_tokens: int_in(0) | None = Field(default=None, description="no end-of-text or stop token, and no stop "
                                                                  "string, before this many tokens (not an OpenAI "
                                                                  "field; as vLLM's); at most max_tokens")
    stop_token_ids: list[int_in(0)] | None = Field(
        default=None, description="vLLM's: the generation ends when one of these tokens is drawn (it is not part of the "
                    "output; finish_reason stop), as at an end-of-text token, ignore_eos or not")
    allowed_token_ids: Annotated[list[int_in(0)], Field(min_length=1)] | None = Field(
        default=None, description="vLLM's: only these tokens can be drawn (end-of-text tokens too: leave them out "
                                  "and the output runs to max_tokens)")
    skip_special_tokens: refused(
        "only true is supported: special tokens are always left out of the output text; leave it out or send "
        "true", (None, True)) = Field(
        default=None, description="vLLM's; only true: special tokens are left out of the text")
    bad_words: refused(
        "not supported; to keep single tokens out of the output, give them a logit_bias of -100 or list the "
        "tokens that may be drawn in allowed_token_ids", (None, [])) = Field(
        default=None, description="vLLM's; refused: use logit_bias or allowed_token_ids")
    best_of: int_in(1) | None = Field(default=None, description="only equal to n: lily generates no extra "
                                                                "candidates to rank")
    include_stop_str_in_output: refused(
        "only false is supported: the matched stop string is never part of the output; leave it out (or false) "
        "and append the stop string yourself where finish_reason is \"stop\"", (None, False)) = Field(
        default=None, description="vLLM's; only false: the stop string is never part of the output")
    prompt_logprobs: refused(
        "not supported; to score a prompt, send it to /v1/completions with echo: true and logprobs") = Field(
        default=None, description="vLLM's; refused: /v1/completions with echo and logprobs scores a prompt")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's: the answer held to a JSON Schema, a regex, a choice of strings or a grammar "
                                  "by constrained decoding (one of them; not with response_format)")
    guided_json: GUIDED_SCHEMA | None = Field(default=None, description="vLLM's older name of structured_outputs.json")
    guided_regex: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        default=None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="vLLM's older name of structured_outputs.grammar")
    guided_decoding_backend: str | None = Field(
        default=None, description="vLLM's; accepted and unused: lily has one grammar engine (llguidance)")
    guided_whitespace_pattern: refused("not supported: lily sets the whitespace a JSON value may hold") = Field(
        default=None, description="vLLM's; refused")
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description="vLLM's: logprobs name each token as \"token_id:N\" rather than its text")
    truncate_prompt_tokens: Union[Literal[-1], int_in(1), None] = Field(
        default=None, description="vLLM's: keep only the prompt's last N tokens (-1: the context length), the rest "
                                  "dropped from its start")
    use_beam_search: refused(
        "only false is supported: lily has no beam search; leave it out and ask for n sampled choices",
        (None, False)) = Field(default=None, description="vLLM's; only false: no beam search")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:  # (the union's own message would say "a valid string")
            raise ValueError(f"{len(v)} stop strings were sent; at most {MAX_STOP}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def sampling_field(name: str, value):
    """`value` validated as a request's `name` field (the same type and bounds): the value a request would
    hold, or ValueError saying why not. The server's sampling defaults (generation_config.py) pass this too."""
    try:
        return getattr(_Sampling.model_validate({"model": "", name: value}), name)
    except ValidationError as e:
        raise ValueError(e.errors()[0]["msg"]) from None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def thinks(effort: str) -> bool:
    """Qwen3.6 thinks or does not: none and minimal answer directly, any other effort thinks first."""
    return effort not in ("none", "minimal")


class ChatPrompt(_Body):
    """The fields that decide a chat's rendered prompt: a chat completion's and /tokenize's, so that /tokenize
    renders (and counts) exactly the prompt the chat route would for the same body."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: ReasoningEffort | None = Field(
        default=None, description="none or minimal: answer without thinking; any other: think first "
                                  "(chat_template_kwargs.enable_thinking, if given, wins)")
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one tool call")
    functions: list[FunctionDef] | None = Field(default=None, description="legacy: tools of type function")
    function_call: Union[Literal["none", "auto"], NamedFunctionCall, None] = Field(
        default=None, description="legacy: tool_choice")
    chat_template: refused(
        "not supported: lily renders the checkpoint's own chat template; render the prompt yourself and send it "
        "to /v1/completions") = Field(default=None, description="vLLM's; refused: the checkpoint's template renders")

    @model_validator(mode="after")
    def _legacy_functions(self):
        """functions / function_call (the legacy API) become tools / tool_choice, one call at most: the legacy
        reply holds a single function_call."""
        if self.functions and not self.tools:
            self.tools = [Tool(type="function", function=f) for f in self.functions]
            if self.parallel_tool_calls is None:
                self.parallel_tool_calls = False
        if self.function_call is not None and self.tool_choice is None:
            fc = self.function_call
            self.tool_choice = fc if isinstance(fc, str) else NamedToolChoice(
                type="function", function=NamedFunction(name=fc.name))
        return self

    @property
    def legacy_functions(self) -> bool:
        return bool(self.functions) and self.tools is not None and all(
            t.function in self.functions for t in self.tools)


class ChatCompletionRequest(ChatPrompt, _Sampling):
    max_completion_tokens: int_in(1) | None = None
    logprobs: bool | None = None
    top_logprobs: int_in(0, MAX_TOP_LOGPROBS) | None = None
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object or json_schema: the answer is held to it by constrained decoding")
    add_generation_prompt: bool | None = Field(
        default=None, description="vLLM's; false: no assistant header after the messages (default true, or false "
                                  "with continue_final_message)")
    continue_final_message: bool | None = Field(
        default=None, description="vLLM's; true: the final message (an assistant's prefill) left open and "
                                  "continued; the answer is the continuation")
    echo: refused(
        "only false is supported: the answer never repeats the last message; to score or continue a text, send it "
        "as the prompt of /v1/completions (with echo there)", (None, False)) = Field(
        default=None, description="vLLM's; only false: the answer never repeats the last message")
    modalities: refused("only [\"text\"] is supported: lily answers in text", (None, ["text"])) = Field(
        default=None, description="only [\"text\"]")
    audio: refused("not supported: lily answers in text only; leave audio out") = Field(
        default=None, description="refused: text only")


TokenIds = Annotated[list[int_in(0)], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[Annotated[str, Field(min_length=1)], TokenIds,
                  Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]] = Field(
        description="text or token ids, or a batch of them (each prompt gets n choices)")
    max_tokens: int_in(0) | None = Field(default=None, description="default 16; 0 generates nothing (with echo "
                                                              "and logprobs: scores the prompt)")
    logprobs: int_in(0, MAX_TOP_LOGPROBS) | None = Field(default=None,
                                 description="number of top alternatives per token (legacy completions API); "
                                             "with echo, the prompt's tokens get them too")
    echo: bool | None = None
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object or json_schema: the output is held to it by constrained decoding "
                                  "from its first token")
    suffix: refused("not supported (lily has no fill-in-the-middle); put the text before the insertion in "
                    "prompt and leave suffix out", (None, "")) = Field(
        default=None, description="refused: no fill-in-the-middle (an empty suffix is accepted)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_size(cls, v):
        if isinstance(v, list) and len(v) > MAX_CHOICES and all(isinstance(x, (str, list)) for x in v):
            raise ValueError(f"a batch of {len(v)} prompts was sent; at most {MAX_CHOICES} a request")
        if isinstance(v, list) and all(isinstance(x, (str, list)) for x in v):  # a batch: name the empty one
            for i, x in enumerate(v):
                if len(x) == 0:
                    raise ValueError(f"prompt[{i}] is empty; every prompt of a batch needs text or token ids")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TokenizeChat(ChatPrompt):
    """POST /tokenize with chat messages: rendered by the chat template as a chat request would be."""
    model: str | None = Field(default=None, description="optional: the served model is the only one")
    add_generation_prompt: bool | None = Field(
        default=None, description="vLLM's; false: no assistant header after the messages (default true, or false "
                                  "with continue_final_message)")
    continue_final_message: bool | None = Field(
        default=None, description="vLLM's; true: the final message left open (no end of its turn) to be continued")


class TokenizeText(_Body):
    model: str | None = Field(default=None, description="optional: the served model is the only one")
    prompt: str


TokenizeRequest = Union[TokenizeChat, TokenizeText]


class DetokenizeRequest(_Body):
    model: str | None = Field(default=None, description="optional: the served model is the only one")
    tokens: list[int_in(0)]


# -- the Responses API (POST /v1/responses): the subset a local model can honour --------------------------

class ResponsesText(_Body):
    type: Literal["input_text", "output_text"]
    text: str


# (a refusal part, as OpenAI returns an assistant turn's, is the message's text, as in chat; taken in any role, as
# output_text is, so that the schema says what is served)
ResponsesContent = Union[str, list[Annotated[Union[ResponsesText, RefusalPart], Field(discriminator="type")]]]


class ResponsesMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: ResponsesContent


class ResponsesFunctionCall(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON object in a string")
    id: str | None = None


class ResponsesInputText(_Body):
    type: Literal["input_text"]
    text: str


def _text_part_only(part):
    """OpenAI lets a tool's output hold image and file parts too; the model reads text only."""
    if isinstance(part, dict) and part.get("type") in ("input_image", "input_file"):
        raise ValueError(f"{part['type']} parts are not supported: the model reads text only; send the tool's "
                         "output as text (a string, or input_text parts)")
    return part


class ResponsesFunctionOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Annotated[ResponsesInputText, BeforeValidator(_text_part_only)]]] = Field(
        description="the tool's output: text, or input_text parts (joined)")


class ResponsesReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ResponsesSummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ResponsesReasoning(BaseModel):
    """A reasoning item sent back by a client: the reasoning of the assistant turn it opens (its content's text, else
    its summary's); other fields (id, status, encrypted_content) are accepted and unused."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["reasoning"]
    summary: list[ResponsesSummaryText] | None = None
    content: list[ResponsesReasoningText] | None = Field(default=None, description="the reasoning's text, in parts")


def _item_type(item) -> str:
    """The tag of an input item: its type, "message" where left out (OpenAI's easy input message has none)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return "message" if kind is None else str(kind)


# tagged by type, so a bad item's error names its own problem, not every other kind's
ResponsesItem = Annotated[Union[Annotated[ResponsesMessage, Tag("message")],
                                Annotated[ResponsesFunctionCall, Tag("function_call")],
                                Annotated[ResponsesFunctionOutput, Tag("function_call_output")],
                                Annotated[ResponsesReasoning, Tag("reasoning")]], Discriminator(_item_type)]


class ResponsesTool(_Body):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, description="left out or null: strict where the call grammar can "
                                                         "hold the parameters (OpenAI's Responses API reads such a "
                                                         "tool as strict), else not strict rather than a 400")


class ResponsesNamedTool(_Body):
    type: Literal["function"]
    name: str


class ResponsesReasoningConfig(_Body):
    effort: ReasoningEffort | None = Field(
        default=None, description="none or minimal: answer without thinking; any other: think first")
    # (any value taken, since the OpenAI Agents SDK and Codex send one: the reasoning item holds the reasoning itself)
    summary: str | None = Field(default=None, description="lily writes no summaries: the reasoning item carries "
                                                          "the reasoning as content; echoed as null")


class ResponsesJsonSchemaFormat(_Format):
    type: Literal["json_schema"]
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="a JSON Schema")
    strict: bool | None = None


ResponsesFormat = Annotated[Union[ResponseFormatText, ResponseFormatJsonObject, ResponsesJsonSchemaFormat],
                            Field(discriminator="type")]


class ResponsesTextConfig(_Body):
    format: ResponsesFormat | None = Field(default=None, description="json_object or json_schema: held to it "
                                                                     "by constrained decoding")
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="echoed; the model is not told it (its answers are as long as it writes them)")


RESPONSES_RULES = ("not supported on /v1/responses: hold the answer to a JSON Schema with text.format, or send a "
                   "regex, choice or grammar rule to /v1/chat/completions or /v1/completions")


class ResponsesRequest(_Body):
    model: str | None = Field(default=None, description="the served model's id (optional: lily serves one)")
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[ResponsesItem], Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: int_in(1) | None = None
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Seed | None = Field(default=None, description="a 64-bit signed integer (not an OpenAI field)")
    stream: bool | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesNamedTool, None] = None
    reasoning: ResponsesReasoningConfig | None = None
    previous_response_id: refused("lily stores no responses; send the whole conversation as input") = Field(
        default=None, description="refused: lily stores no responses")
    conversation: refused("not supported: lily stores no conversations; send the conversation's items in input") = \
        Field(default=None, description="refused: lily stores no conversations")
    prompt: refused("not supported: lily stores no prompt templates; send the instructions and input") = Field(
        default=None, description="refused: no stored prompt templates")
    include: list[str] | None = Field(default=None, description="output_text logprobs refused; the rest (the "
                                                               "outputs of tools lily does not run) is empty")
    top_logprobs: refused("not supported in the Responses API; use /v1/chat/completions with logprobs and "
                          "top_logprobs", (None, 0)) = Field(default=None, description="refused: use chat completions")
    max_tool_calls: refused("not supported; parallel_tool_calls false asks for at most one call") = Field(
        default=None, description="refused: use parallel_tool_calls false for one call")
    background: refused("only false is supported: lily stores no responses, so it has none to fetch later; "
                        "send the request without it (stream: true shows progress)", (None, False)) = Field(
        default=None, description="only false: lily stores no responses to run in the background")
    prompt_cache_key: str | None = None
    text: ResponsesTextConfig | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's rules on chat and completions: refused by name here rather than ignored (an answer left free)
    structured_outputs: refused(RESPONSES_RULES) = Field(default=None, description="refused: use text.format")
    guided_json: refused(RESPONSES_RULES) = Field(default=None, description="refused: use text.format")
    guided_regex: refused(RESPONSES_RULES) = Field(default=None, description="refused: use /v1/chat/completions")
    guided_choice: refused(RESPONSES_RULES) = Field(default=None, description="refused: use /v1/chat/completions")
    guided_grammar: refused(RESPONSES_RULES) = Field(default=None, description="refused: use /v1/chat/completions")
    truncation: Literal["auto", "disabled"] | None = Field(
        default=None, description="auto: an input over the context loses whole conversation messages from its start "
                                  "(never the instructions and leading system messages, nor the last user "
                                  "message) until it fits; disabled (the default): such an input is a 400")
    # echoed, as OpenAI's Response carries them
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16, description="up to 16 pairs (keys up to 64 characters, values 512), echoed")
    user: str | None = Field(default=None, description="echoed")
    safety_identifier: str | None = Field(default=None, description="echoed")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = Field(
        default=None, description="answered as 'default', the one way lily serves a request")
