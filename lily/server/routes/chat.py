"""POST /v1/chat/completions: messages through the chat template, n choices, the reasoning (as reasoning_content and
reasoning, vLLM's older and current names) and tool_calls parsed from the model's text; one JSON answer or a
stream of chunks."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from lily.engine.generation import Delta, Failed, Finished, GenerationRequest
from lily.server.chat_parsing import ChatOutputParser
from lily.server.chat_prompt import prompt_ending
from lily.server.context import server
from lily.server.generations import choices, sampling_params, stop_tokens, turn_boundary
from lily.server.logprobs import chat_logprobs
from lily.server.protocol import ChatCompletionRequest, NamedToolChoice
from lily.server.structured import calls_held, calls_or_answer, chat_constraint, check_tool_choice, chat_stops
from lily.server.streaming import (DONE, choice_events, client_gone, event_stream_response, failure, sse,
                                   stream_failure, submit)
from lily.server.usage import ReasoningTokens, note, usage
from lily.server.validation import (budget, check_fields, check_min_tokens, check_model, fit_for, render_chat,
                                   truncated_prompt)

router = APIRouter()


@router.post("/v1/chat/completions", summary="chat completion (stream or not)")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = server(request)
    tokenizer = ctx.tokenizer
    check_model(ctx, body.model)
    check_fields(body)
    check_tool_choice(body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # rendering and tokenizing grow with the messages (a 4 MB prompt: seconds): off the event loop, and none of
    # it for a text that cannot fit the context whatever its tokens
    prompt_text, prompt_ids, thinking, tools = await run_in_threadpool(
        render_chat, ctx, body, "messages", *prompt_ending(body),
        fit=fit_for(asked, "messages", param, truncate=body.truncate_prompt_tokens))
    prompt_ids = truncated_prompt(ctx, prompt_ids, body.truncate_prompt_tokens)
    # compiling a new grammar can take a while (the first one also reads the vocabulary): off the event loop
    constraint = await run_in_threadpool(chat_constraint, ctx, body, thinking)
    defaults = ctx.settings.sampling_defaults
    max_tokens = budget(ctx, len(prompt_ids), asked, "messages", param, default=defaults.max_tokens)
    if asked is None:
        check_min_tokens(body, max_tokens, param, "what it is when left out: the room the context leaves"
                         + (", at most the checkpoint's max_new_tokens" if defaults.max_tokens is not None else ""))
    n = body.n or 1
    gens = choices(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens,
        sampling=sampling_params(tokenizer, body, bool(body.logprobs), body.top_logprobs or 0, defaults),
        stop=chat_stops(body, constraint, thinking), stop_token_ids=stop_tokens(tokenizer, body), min_tokens=body.min_tokens or 0,
        cache_key=body.prompt_cache_key, request_id="chatcmpl-" + uuid.uuid4().hex[:24],
        snapshot_at=turn_boundary(tokenizer, prompt_ids), cache_prompt=False, cache_output=False,
        constraint=constraint), n)
    parsers = [ChatOutputParser(thinking, tools, held=calls_held(body), answer_else=calls_or_answer(body)) for _ in gens]
    reasoning_tokens = [ReasoningTokens(tokenizer, thinking) for _ in gens]
    queues = submit(ctx, gens)
    base = {"id": gens[0].request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": ctx.settings.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream_response(chat_stream(request, gens, queues, parsers, base, include_usage, prompt_text,
                                                 body.legacy_functions, calls_finish_reason(body),
                                                 bool(body.return_tokens_as_token_ids),
                                                 calls_held(body) and not calls_or_answer(body), reasoning_tokens))
    parts = [([], [], [], []) for _ in gens]  # reasoning, content, tool calls, logprobs of each choice
    dones: list[Finished | None] = [None] * n
    async for i, ev in choice_events(queues, gens, request, ctx.metrics):
        reasoning, content, calls, lps = parts[i]
        if isinstance(ev, Delta):
            reasoning_tokens[i].feed(ev.tokens)
            d = parsers[i].feed(ev.text)
            reasoning.append(d.reasoning), content.append(d.content), calls.extend(d.tool_calls)
            if gens[i].sampling.logprobs:
                lps.extend(chat_logprobs(tokenizer, ev.tokens, bool(body.return_tokens_as_token_ids)))
        elif isinstance(ev, Failed):
            raise failure(ev)
        elif isinstance(ev, Finished):
            dones[i] = ev
    if any(d is None or d.finish_reason == "cancelled" for d in dones):  # the client went away, or the shutdown
        return client_gone(ctx)
    out = []
    for i, ((reasoning, content, calls, lps), done) in enumerate(zip(parts, dones)):
        d = parsers[i].finish()
        reasoning.append(d.reasoning), content.append(d.content), calls.extend(d.tool_calls)
        text = "".join(content)
        message = {"role": "assistant", "content": None if calls and not text.strip() else (text or None)}
        if thinking:  # under both names: vLLM's older one and its current one
            message["reasoning_content"] = message["reasoning"] = "".join(reasoning)
        if calls and body.legacy_functions:  # the legacy API answers with one function_call
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].sent_arguments}
        elif calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.sent_arguments}} for c in calls]
        elif message["content"] is None:
            message["content"] = ""
        finish = done.finish_reason
        if calls and finish == "stop":
            finish = calls_finish_reason(body)
        out.append({"index": i, "message": message, "finish_reason": finish,
                    "logprobs": {"content": lps} if gens[i].sampling.logprobs else None})
    note(ctx, request, gens[0], dones, n, prompt_text)
    return {"id": gens[0].request_id, "object": "chat.completion", "created": base["created"],
            "model": ctx.settings.model_name, "choices": out, "usage": usage(dones, n, reasoning_tokens)}


def calls_finish_reason(body) -> str:
    """A choice that stopped with tool calls: "tool_calls" ("function_call" for the legacy API) under tool_choice
    auto or required, "stop" when tool_choice named the function (as OpenAI and vLLM answer a forced call)."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return "stop"
    return "function_call" if body.legacy_functions else "tool_calls"


async def chat_stream(request, gens, queues, parsers, base, include_usage, prompt_text, legacy_functions=False,
                      calls_finish="tool_calls", as_ids=False, calls_only=False, reasoning_tokens=None):
    """calls_only: the answer is tool calls (tool_choice required or named): its role chunk's content is null, as
    OpenAI's and as the answer not streamed says."""
    ctx = server(request)
    role = {"role": "assistant", "content": None if calls_only else ""}

    def chunk(i: int, delta: dict, finish=None, logprobs=None) -> str:
        choice = {"index": i, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return sse({**base, "choices": [choice]})

    n_calls = [0] * len(gens)
    dones: list[Finished | None] = [None] * len(gens)  # (by choice: they end in any order)

    def deltas(i: int, d) -> list[dict]:
        out = []
        if d.reasoning:
            # one name a delta: a client reading both (the OpenAI Agents SDK) would get the reasoning twice
            out.append({"reasoning_content": d.reasoning})
        if d.content:
            out.append({"content": d.content})
        for c in d.tool_calls:
            if legacy_functions and n_calls[i] == 0:
                out.append({"function_call": {"name": c.name, "arguments": c.sent_arguments}})
            elif not legacy_functions:
                out.append({"tool_calls": [{"index": n_calls[i], "id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": c.sent_arguments}}]})
            n_calls[i] += 1
        return out

    opened = [False] * len(gens)  # a choice's role goes before its first delta
    opened[0] = True
    yield chunk(0, role)
    async for i, ev in choice_events(queues, gens, None, ctx.metrics):
        if not opened[i]:
            opened[i] = True
            yield chunk(i, role)
        if isinstance(ev, Delta):
            if reasoning_tokens is not None:
                reasoning_tokens[i].feed(ev.tokens)
            pieces = deltas(i, parsers[i].feed(ev.text))
            logprobs = chat_logprobs(ctx.tokenizer, ev.tokens, as_ids) if gens[i].sampling.logprobs else None
            if not pieces and logprobs:
                pieces = [{}]
            for k, p in enumerate(pieces):
                yield chunk(i, p, logprobs=logprobs if k == 0 else None)
        elif isinstance(ev, Failed):
            yield stream_failure(ev)
            return
        elif isinstance(ev, Finished):
            for p in deltas(i, parsers[i].finish()):
                yield chunk(i, p)
            finish = ev.finish_reason
            if n_calls[i] and finish == "stop":
                finish = calls_finish
            yield chunk(i, {}, finish=finish)
            dones[i] = ev
    if None in dones:
        return
    note(ctx, request, gens[0], dones, len(gens), prompt_text)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(dones, len(gens), reasoning_tokens)})
    yield DONE
