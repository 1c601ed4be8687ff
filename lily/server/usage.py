"""What a request used: the usage object of a response, and the fields of its access-log line."""

from __future__ import annotations

from fastapi import Request

from lily.engine.generation import Finished, GenerationRequest
from lily.server.context import ServerContext


def usage(dones: list[Finished], n: int, reasoning: list | None = None) -> dict:
    """Each prompt counts once (the first of its n choices), every choice's output counts; with the choices'
    ReasoningTokens, their sum as completion_tokens_details.reasoning_tokens (OpenAI's)."""
    prompt = sum(d.prompt_tokens for d in dones[::n])
    out = sum(d.completion_tokens for d in dones)
    counts = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
              "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in dones[::n])}}
    if reasoning is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(r.count for r in reasoning)}
    return counts


class ReasoningTokens:
    """A choice's reasoning tokens: its output's tokens up to and including the first </think> when the prompt opened
    the thinking (the model's own token ends it, as the output parser reads it; all of them if it never does)."""

    def __init__(self, tokenizer, thinking: bool):
        self.count = 0
        self._end = tokenizer.token_id("</think>") if tokenizer.has_token("</think>") else None
        self._open = thinking

    def feed(self, tokens) -> None:
        for t in tokens:
            if not self._open:
                return
            self.count += 1
            self._open = t.token != self._end


def note(ctx: ServerContext, request: Request, gen: GenerationRequest, dones: list[Finished], n: int,
         prompt_text: str | None) -> None:
    """Hand the request's id and token counts (and, with --log-requests, its prompt) to the log line."""
    info = request.scope.setdefault("state", {}).setdefault("lily", {})
    info["id"] = gen.request_id
    if dones:
        counts = usage(dones, n)
        info.update(prompt_tokens=counts["prompt_tokens"], cached=counts["prompt_tokens_details"]["cached_tokens"],
                    completion_tokens=counts["completion_tokens"],
                    finish=",".join(sorted({d.finish_reason for d in dones})))
        # where the time went (the first choice's): waiting for a slot, the prompt, the first text from
        # submission; the time to the first byte a client sees adds the HTTP handling around these
        first = dones[0]
        info.update(queue_ms=f"{first.queue_s * 1e3:.0f}", prefill_ms=f"{first.prefill_s * 1e3:.0f}")
        if first.first_token_s is not None:
            info["first_text_ms"] = f"{first.first_token_s * 1e3:.0f}"
        if len(dones) > 1:
            info["choices"] = len(dones)
    if prompt_text is not None and ctx.settings.log_requests:
        info["prompt"] = prompt_text
