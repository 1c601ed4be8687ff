"""Checks a request must pass before it is queued, beyond its body's schema (protocol.py): the model
name, the rules between fields, text that is valid Unicode, a chat that renders through the template, and the
context length."""

from __future__ import annotations

from dataclasses import dataclass

from lily.server.chat_prompt import build_chat_prompt
from lily.server.context import ServerContext
from lily.server.errors import APIError
from lily.tokenizer import LONG_TEXT, TemplateError


def check_model(ctx: ServerContext, model: str | None) -> None:
    """A request may leave the model out (the one served, as vLLM answers); one it names must be served."""
    if model is not None and model not in ctx.model_names:
        raise APIError(404, f"model {model!r} does not exist; this server serves {ctx.settings.model_name!r}",
                       param="model", code="model_not_found")


def check_fields(body) -> None:
    """The rules between a chat or text completion's fields that a schema cannot state (OpenAI and vLLM
    refuse the same): each a 400 naming the field and saying what to send instead."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true; set stream to true or leave "
                       "stream_options out", param="stream_options")
    if getattr(body, "top_logprobs", None) is not None and body.logprobs is not True:
        raise APIError(400, "top_logprobs: only allowed when logprobs is true; set logprobs to true or leave "
                       "top_logprobs out", param="top_logprobs")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, f"best_of: {body.best_of} with n={n}: lily generates no extra candidates to rank and "
                       f"return the best; leave best_of out (or equal to n) and ask for n choices", param="best_of")
    limit = getattr(body, "max_completion_tokens", None)
    limit, name = (limit, "max_completion_tokens") if limit is not None else (body.max_tokens, "max_tokens")
    if limit is not None:
        check_min_tokens(body, limit, name)


def check_min_tokens(body, max_tokens: int, name: str = "max_tokens", why: str = "") -> None:
    """min_tokens at most the max_tokens the generation runs with: the request's own, or (`why` says which)
    the one the server resolved where it was left out."""
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        shown = f"{max_tokens}, {why}" if why else f"{max_tokens}"
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than {name} ({shown}); lower min_tokens or "
                       f"{'set' if why else 'raise'} {name}", param="min_tokens")


@dataclass(frozen=True)
class Fit:
    """What a prompt's text must leave room for, checked before it is tokenized: a long text (over LONG_TEXT
    characters, whose tokenizing takes a while) whose fewest possible tokens (its bytes over the longest token's,
    Tokenizer.fewest_tokens) plus `completion` already exceed the context is refused at once, as budget() would
    refuse it once tokenized (same param, same message but 'at least'), with no tokenization spent on it. A
    shorter one is tokenized, so its message gives OpenAI's exact counts."""
    completion: int   # tokens the completion needs at least (max_tokens, or 1 where it is left out)
    param: str        # the field named, as budget() names it
    prompt_kind: str  # "messages", "prompt", "input"


def fit_for(max_tokens: int | None, param: str, max_param: str = "max_tokens", prompt_kind: str = "messages",
            truncate: int | None = None) -> Fit | None:
    """The Fit of a prompt that budget(prompt_len, max_tokens, param, max_param, prompt_kind) will check; None
    where the prompt is cut to fit (truncate_prompt_tokens)."""
    if truncate is not None:
        return None
    return Fit(1, param, prompt_kind) if max_tokens is None else Fit(max_tokens, max_param, prompt_kind)


def encode_text(ctx: ServerContext, text: str, param: str, fit: Fit | None = None) -> list[int]:
    """JSON may carry unpaired UTF-16 surrogates ("\\ud800"): not Unicode text, so refused here. Its work grows
    with the text (a 4 MB prompt takes seconds): call it off the event loop."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: the text holds an unpaired UTF-16 surrogate ({text[e.start]!r}); "
                       "send valid Unicode", param=param) from None
    max_seq = ctx.settings.max_seq
    # (a token holds a byte at least: cheap first; a text under LONG_TEXT is counted, for OpenAI's exact message)
    if fit is not None and len(text) > LONG_TEXT and size + fit.completion > max_seq:
        fewest = ctx.tokenizer.fewest_tokens(text)
        if fewest + fit.completion > max_seq:
            raise context_length_exceeded(max_seq, fewest, fit.completion, fit.prompt_kind, fit.param, at_least=True)
    return ctx.tokenizer.encode(text)


def render_chat(ctx: ServerContext, body, param: str, add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                fit: Fit | None = None) -> tuple[str, list[int], bool, list[dict] | None]:
    """(prompt text, its token ids, whether it opens a <think> block, the tools the parser knows). Its work grows
    with the messages (the template's rendering, the tokenization): call it off the event loop."""
    try:
        text, thinking, tools = build_chat_prompt(body, ctx.tokenizer, ctx.settings.enable_thinking,
                                                  add_generation_prompt, continue_final_message)
    except TemplateError as e:
        raise APIError(400, str(e), param=param) from None
    return text, encode_text(ctx, text, param, fit), thinking, tools


def truncated_prompt(ctx: ServerContext, ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context length); None: all of it."""
    if keep is None:
        return ids
    keep = ctx.settings.max_seq if keep == -1 else keep
    return ids[len(ids) - keep:] if len(ids) > keep else ids


def budget(ctx: ServerContext, prompt_len: int, max_tokens: int | None, param: str,
           max_param: str = "max_tokens", prompt_kind: str = "messages", default: int | None = None) -> int:
    """The tokens a generation may produce: max_tokens, or when it is not given what the context leaves (at
    most `default`, the checkpoint's max_new_tokens, as vLLM's get_max_tokens caps it).
    Over the context, the message reads as OpenAI's ("This model's maximum context length is N tokens.
    However, you requested M tokens ..."): client libraries match that text to raise their own
    context-window errors."""
    max_seq = ctx.settings.max_seq
    if prompt_len == 0:
        raise APIError(400, f"{param}: the prompt is empty", param=param)
    if max_tokens is None:
        if prompt_len >= max_seq:
            raise context_length_exceeded(max_seq, prompt_len, 1, prompt_kind, param)
        return max_seq - prompt_len if default is None else min(default, max_seq - prompt_len)
    if prompt_len + max_tokens > max_seq:
        raise context_length_exceeded(max_seq, prompt_len, max_tokens, prompt_kind, max_param)
    return max_tokens


def context_length_exceeded(max_seq: int, prompt_len: int, completion: int, prompt_kind: str,
                            param: str, at_least: bool = False) -> APIError:
    """at_least: prompt_len is a lower bound (Fit), the text refused before it was tokenized."""
    most = "at least " if at_least else ""
    return APIError(400, f"This model's maximum context length is {max_seq} tokens. However, you requested "
                    f"{most}{prompt_len + completion} tokens ({most}{prompt_len} in the {prompt_kind}, {completion} in the "
                    f"completion). Please reduce the length of the {prompt_kind} or completion. (lily serve "
                    f"--max-seq sets the context length.)", param=param, code="context_length_exceeded")
