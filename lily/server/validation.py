"""Checks a request must pass before it is queued, beyond its body's schema (protocol.py): the model
name, text that is valid Unicode, a chat that renders through the template, and the context length."""

from __future__ import annotations

from lily.server.chat_prompt import build_chat_prompt
from lily.server.context import ServerContext
from lily.server.errors import APIError
from lily.tokenizer import TemplateError


def check_model(ctx: ServerContext, model: str) -> None:
    if model not in ctx.model_names:
        raise APIError(404, f"model {model!r} does not exist; this server serves {ctx.settings.model_name!r}",
                       param="model", code="model_not_found")


def encode_text(ctx: ServerContext, text: str, param: str) -> list[int]:
    """JSON may carry unpaired UTF-16 surrogates ("\\ud800"): not Unicode text, so refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: the text holds an unpaired UTF-16 surrogate ({text[e.start]!r}); "
                       "send valid Unicode", param=param) from None
    return ctx.tokenizer.encode(text)


def render_chat(ctx: ServerContext, body, param: str) -> tuple[str, list[int], bool, list[dict] | None]:
    """(prompt text, its token ids, whether it opens a <think> block, the tools the parser knows)."""
    try:
        text, thinking, tools = build_chat_prompt(body, ctx.tokenizer, ctx.settings.enable_thinking)
    except TemplateError as e:
        raise APIError(400, str(e), param=param) from None
    return text, encode_text(ctx, text, param), thinking, tools


def budget(ctx: ServerContext, prompt_len: int, max_tokens: int | None, param: str,
           max_param: str = "max_tokens", prompt_kind: str = "messages") -> int:
    """The tokens a generation may produce: max_tokens, or what the context leaves when it is not given.
    Over the context, the message reads as OpenAI's ("This model's maximum context length is N tokens.
    However, you requested M tokens ..."): client libraries match that text to raise their own
    context-window errors."""
    max_seq = ctx.settings.max_seq
    if prompt_len == 0:
        raise APIError(400, f"{param}: the prompt is empty", param=param)
    if max_tokens is None:
        if prompt_len >= max_seq:
            raise context_length_exceeded(max_seq, prompt_len, 1, prompt_kind, param)
        return max_seq - prompt_len
    if prompt_len + max_tokens > max_seq:
        raise context_length_exceeded(max_seq, prompt_len, max_tokens, prompt_kind, max_param)
    return max_tokens


def context_length_exceeded(max_seq: int, prompt_len: int, completion: int, prompt_kind: str,
                            param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_seq} tokens. However, you requested "
                    f"{prompt_len + completion} tokens ({prompt_len} in the {prompt_kind}, {completion} in the "
                    f"completion). Please reduce the length of the {prompt_kind} or completion. (lily serve "
                    f"--max-seq sets the context length.)", param=param, code="context_length_exceeded")
