"""POST /v1/completions: text or token-id prompts (a batch of them, n choices each), echo and prompt
scoring with logprobs, response_format held by constrained decoding; one JSON answer or a stream of chunks."""

from __future__ import annotations

import threading
import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from lily.engine.generation import Delta, Failed, Finished, GenerationRequest, Started
from lily.server.context import server
from lily.server.errors import APIError
from lily.server.generations import choices, sampling_params, stop_tokens
from lily.server.logprobs import TextOffsets, completion_logprobs, echo_logprobs, joined
from lily.server.protocol import MAX_CHOICES, CompletionRequest
from lily.server.structured import completion_constraint
from lily.server.streaming import (DONE, choice_events, client_gone, event_stream_response, failure, sse,
                                   stream_failure, submit)
from lily.server.usage import note, usage
from lily.server.validation import (budget, check_fields, check_min_tokens, check_model, encode_text, fit_for,
                                   truncated_prompt)

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens where the request leaves it out (OpenAI's and vLLM's)


@router.post("/v1/completions", summary="text completion (stream or not)")
async def completions(body: CompletionRequest, request: Request):
    ctx = server(request)
    tokenizer = ctx.tokenizer
    check_model(ctx, body.model)
    check_fields(body)
    prompts = body.prompts()
    param = "prompt" if len(prompts) == 1 else "prompt[{}]"
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(400, f"n: {len(prompts)} prompts x n={n} is {len(prompts) * n} generations; at most "
                       f"{MAX_CHOICES} a request", param="n")
    want_lp = body.logprobs is not None
    as_ids = bool(body.return_tokens_as_token_ids)
    # compiling a new grammar can take a while (the first one also reads the vocabulary): off the event loop
    constraint = await run_in_threadpool(completion_constraint, ctx, body)
    request_id = "cmpl-" + uuid.uuid4().hex[:24]
    asked = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    cancel = threading.Event()  # one for all the batch's generations, like one prompt's n choices
    gens, echoes, texts = [], [], []  # choice p * n + j is prompt p's choice j
    for p, prompt in enumerate(prompts):
        where = param.format(p)
        if isinstance(prompt, str):  # (off the event loop: a 4 MB prompt takes seconds; none if it cannot fit)
            fit = fit_for(asked, where, prompt_kind="prompt", truncate=body.truncate_prompt_tokens)
            prompt_ids, prompt_text = await run_in_threadpool(encode_text, ctx, prompt, where, fit), prompt
        else:
            bad = [i for i in prompt if i >= tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary (size "
                               f"{tokenizer.vocab_size})", param="prompt")
            prompt_ids, prompt_text = list(prompt), None
        if body.truncate_prompt_tokens is not None:
            kept = truncated_prompt(ctx, prompt_ids, body.truncate_prompt_tokens)
            prompt_ids, prompt_text = kept, (prompt_text if len(kept) == len(prompt_ids) else None)
        max_tokens = budget(ctx, len(prompt_ids), asked, where, prompt_kind="prompt")
        if body.max_tokens is None:
            check_min_tokens(body, max_tokens, "max_tokens", "its default when left out")
        gens += choices(GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens,
            sampling=sampling_params(tokenizer, body, want_lp, body.logprobs or 0, ctx.settings.sampling_defaults),
            stop=body.stop_list(), stop_token_ids=stop_tokens(tokenizer, body), min_tokens=body.min_tokens or 0,
            cache_key=body.prompt_cache_key, request_id=request_id, cancelled=cancel,
            prompt_logprobs=body.logprobs if body.echo and want_lp else None, constraint=constraint), n)
        echo = ""
        if body.echo:
            echo = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)
        echoes += [echo] * n
        texts.append(prompt_text)
    prompt_text = texts[0] if len(texts) == 1 else None
    queues = submit(ctx, gens)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": ctx.settings.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream_response(
            completion_stream(request, gens, queues, n, base, include_usage, echoes, prompt_text, as_ids))
    outs = [[echo] for echo in echoes]
    toks: list[list] = [[] for _ in gens]
    starts: list[Started | None] = [None] * len(gens)
    dones: list[Finished | None] = [None] * len(gens)
    async for i, ev in choice_events(queues, gens, request, ctx.metrics):
        if isinstance(ev, Started):
            starts[i] = ev
        elif isinstance(ev, Delta):
            outs[i].append(ev.text)
            toks[i].extend(ev.tokens)
        elif isinstance(ev, Failed):
            raise failure(ev)
        elif isinstance(ev, Finished):
            dones[i] = ev
    if any(d is None or d.finish_reason == "cancelled" for d in dones):
        return client_gone(ctx)
    note(ctx, request, gens[0], dones, n, prompt_text)
    return {**base, "choices": [{"index": i, "text": "".join(outs[i]), "finish_reason": done.finish_reason,
                                 "logprobs": joined(echo_logprobs(tokenizer, starts[i], gens[i], as_ids),
                                                    completion_logprobs(tokenizer, toks[i],
                                                                        TextOffsets(tokenizer, len(echoes[i])),
                                                                        as_ids))
                                 if want_lp else None}
                                for i, done in enumerate(dones)],
            "usage": usage(dones, n)}


async def completion_stream(request, gens, queues, n, base, include_usage, echoes, prompt_text, as_ids=False):
    ctx = server(request)
    tokenizer = ctx.tokenizer

    def chunk(i, text, finish=None, logprobs=None):
        return sse({**base, "choices": [{"index": i, "text": text, "finish_reason": finish,
                                         "logprobs": logprobs}]})

    dones: list[Finished | None] = [None] * len(gens)  # (by choice: they end in any order)
    offsets = [TextOffsets(tokenizer) for _ in gens]  # each choice's log-probabilities' text_offset
    async for i, ev in choice_events(queues, gens, None, ctx.metrics):
        if isinstance(ev, Started):  # the echo (and the prompt's log-probabilities) once it has run
            offsets[i] = TextOffsets(tokenizer, len(echoes[i]))
            if echoes[i]:
                yield chunk(i, echoes[i], logprobs=echo_logprobs(tokenizer, ev, gens[i], as_ids) if gens[i].sampling.logprobs
                            else None)
        elif isinstance(ev, Delta):
            lps = completion_logprobs(tokenizer, ev.tokens, offsets[i], as_ids) if gens[i].sampling.logprobs else None
            yield chunk(i, ev.text, logprobs=lps)
        elif isinstance(ev, Failed):
            yield stream_failure(ev)
            return
        elif isinstance(ev, Finished):
            yield chunk(i, "", finish=ev.finish_reason)
            dones[i] = ev
    if None in dones:
        return
    note(ctx, request, gens[0], dones, n, prompt_text)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(dones, n)})
    yield DONE
