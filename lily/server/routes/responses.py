"""POST /v1/responses: the Responses API as a chat request (responses_api.py converts it), answered as
output items or a stream of typed events."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from lily.engine.generation import Delta, Failed, Finished, GenerationRequest
from lily.server.chat_parsing import ChatOutputParser
from lily.server.context import server
from lily.server.errors import APIError
from lily.server.generations import sampling_params, stop_tokens, turn_boundary
from lily.server.protocol import ChatCompletionRequest, ResponsesRequest
from lily.server.responses_api import ResponseAssembler, chat_request_from
from lily.server.structured import calls_held, calls_or_answer, chat_constraint, check_tool_choice, chat_stops
from lily.server.streaming import choice_events, client_gone, event_stream_response, failure, sse_event, submit
from lily.server.usage import ReasoningTokens, note
from lily.server.validation import budget, check_model, fit_for, render_chat

router = APIRouter()


@router.post("/v1/responses", summary="a response (the Responses API: text, reasoning, function calls; stream or not)")
async def responses(body: ResponsesRequest, request: Request):
    ctx = server(request)
    tokenizer = ctx.tokenizer
    check_model(ctx, body.model)
    chat = chat_request_from(body)
    check_tool_choice(chat)
    # (off the event loop: rendering and tokenizing grow with the input; none for a text that cannot fit)
    if body.truncation == "auto":
        chat, (prompt_text, prompt_ids, thinking, tools) = await run_in_threadpool(render_truncated, ctx, chat)
    else:
        prompt_text, prompt_ids, thinking, tools = await run_in_threadpool(
            render_chat, ctx, chat, "input", fit=fit_for(chat.max_tokens, "input", "max_output_tokens", "input"))
    defaults = ctx.settings.sampling_defaults
    max_tokens = budget(ctx, len(prompt_ids), chat.max_tokens, "input", "max_output_tokens", "input",
                        default=defaults.max_tokens)
    try:
        constraint = await run_in_threadpool(chat_constraint, ctx, chat, thinking)
    except APIError as e:  # name the Responses API's field, not the chat request's
        if e.param and e.param.startswith("response_format"):
            raise APIError(400, responses_param(e.message), param="text.format") from None
        raise
    if constraint is not None and constraint.param.startswith("response_format"):  # (named in a later 400)
        constraint = replace(constraint, param=responses_param(constraint.param))
    gen = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling_params(tokenizer, chat, False, 0, defaults),
        stop=chat_stops(chat, constraint, thinking), stop_token_ids=stop_tokens(tokenizer, chat), cache_key=chat.prompt_cache_key,
        snapshot_at=turn_boundary(tokenizer, prompt_ids), cache_prompt=False, cache_output=False,
        constraint=constraint)
    parser = ChatOutputParser(thinking, tools, held=calls_held(chat), answer_else=calls_or_answer(chat))
    out = ResponseAssembler(body, ctx.settings.model_name, gen.sampling, chat)
    gen.request_id = out.response["id"]
    queues = submit(ctx, [gen])
    reasoning = ReasoningTokens(tokenizer, thinking)

    def feed(ev) -> list[dict]:  # a Delta's events
        reasoning.feed(ev.tokens)
        return out.feed(parser.feed(ev.text))

    def finish(done: Finished) -> list[dict]:
        note(ctx, request, gen, [done], 1, prompt_text)
        events = out.feed(parser.finish())
        return events + out.finish(done.finish_reason, {
            "input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            # (the SDK requires cache_write_tokens; lily does not count what its prefix cache keeps of a prompt)
            "input_tokens_details": {"cached_tokens": done.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning.count}})

    if body.stream:
        async def stream():
            for ev in out.start():
                yield sse_event(ev)
            async for _, ev in choice_events(queues, [gen], None, ctx.metrics):
                if isinstance(ev, Delta):
                    events = feed(ev)
                elif isinstance(ev, Failed) and ev.status == 400:  # the request's own doing: say why
                    events = out.fail("invalid_request_error", ev.message)
                elif isinstance(ev, Failed):
                    events = out.fail()
                elif isinstance(ev, Finished) and ev.finish_reason == "cancelled":  # shutdown
                    events = out.fail("cancelled", "the server is shutting down")
                elif isinstance(ev, Finished):
                    events = finish(ev)
                else:
                    continue
                for e in events:
                    yield sse_event(e)

        return event_stream_response(stream())
    done = None
    async for _, ev in choice_events(queues, [gen], request, ctx.metrics):
        if isinstance(ev, Delta):
            feed(ev)
        elif isinstance(ev, Failed):
            raise failure(ev)
        elif isinstance(ev, Finished):
            done = ev
    if done is None or done.finish_reason == "cancelled":  # the client went away, or the shutdown
        return client_gone(ctx)
    finish(done)
    return out.response


def render_truncated(ctx, chat: ChatCompletionRequest) -> tuple[ChatCompletionRequest, tuple]:
    """truncation auto, OpenAI's: where the input does not fit the context, whole items are dropped from the start
    of the conversation, the fewest that make it fit; never the leading system messages (instructions, developer
    messages), nor the last user message (the turn answered); a tool's output goes with its call, and the reasoning
    and text items before a call (one chat message with it) can go without it. The chat
    rendered and render_chat's answer; where nothing fits, the whole input's (budget() then refuses it with the
    context-length 400, as under truncation disabled)."""
    fit = fit_for(chat.max_tokens, "input", "max_output_tokens", "input")
    room = ctx.settings.max_seq - (chat.max_tokens or 1)  # the prompt tokens budget() lets through
    whole = None
    try:
        whole = render_chat(ctx, chat, "input", fit=fit)
        if len(whole[1]) <= room:
            return chat, whole
    except APIError as e:  # (any other 400 is the input's own, dropped messages or not)
        if e.code != "context_length_exceeded":
            raise
    messages = chat.messages
    system = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
    # the conversations to try, fewest items dropped first, as (first message kept, its index): from each message
    # on, and where an assistant message holds the items before its calls (a reasoning item, its text), from each
    # of those on, the calls kept
    starts = []
    for i in range(system + 1, last_user + 1):
        m = messages[i]
        if m.role == "tool":
            continue
        starts.append((m, i))
        if m.role == "assistant" and m.tool_calls:
            if m.reasoning_content or m.reasoning:
                m = m.model_copy(update={"reasoning_content": None, "reasoning": None})
                starts.append((m, i))
            if m.content:
                starts.append((m.model_copy(update={"content": None}), i))

    def fitting(start: tuple):
        first, i = start
        shorter = chat.model_copy(update={"messages": messages[:system] + [first] + messages[i + 1:]})
        try:
            rendered = render_chat(ctx, shorter, "input", fit=fit)
        except APIError:  # too long before tokenizing, or a conversation the template refuses
            return None
        return (shorter, rendered) if len(rendered[1]) <= room else None

    lo, hi, found = 0, len(starts), None  # a bisection: the more dropped, the shorter
    while lo < hi:
        mid = (lo + hi) // 2
        shorter = fitting(starts[mid])
        if shorter is not None:
            found, hi = shorter, mid
        else:
            lo = mid + 1
    if found is not None:
        return found
    return chat, whole if whole is not None else render_chat(ctx, chat, "input", fit=fit)  # (the latter: its 400)


def responses_param(text: str) -> str:
    """A chat request's response_format field in `text` as the Responses API names it (text.format)."""
    return text.replace("response_format.json_schema.schema", "text.format.schema").replace("response_format",
                                                                                           "text.format")
