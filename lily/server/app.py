"""The OpenAI-compatible HTTP API over one engine worker.

POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (each streams as server-sent
events), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics, GET /openapi.json.
Every response that is not a success is an OpenAI-shaped error; validation never answers 422, and an
unexpected fault answers a generic 500 and is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse, StreamingResponse

from lily.engine.generation import Delta, Failed, Finished, GenerationRequest, Started
from lily.engine.prefix_cache import PrefixCache
from lily.engine.sampling import SamplingParams
from lily.engine.worker import EngineWorker, QueueFullError
from lily.server.chat_parsing import ChatOutputParser
from lily.server.chat_prompt import build_chat_prompt
from lily.server.errors import APIError, validation_error
from lily.server.guard import GuardMiddleware
from lily.server.metrics import Metrics
from lily.server.protocol import (MAX_CHOICES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  ResponsesRequest, TokenizeChat, TokenizeRequest)
from lily.server.responses_api import ResponseAssembler, chat_request_from
from lily.tokenizer import TemplateError

log = logging.getLogger("lily.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


@dataclass
class ServerSettings:
    model_name: str
    max_seq: int
    api_key: str | None = None
    max_body: int = 4 * 1024 * 1024
    max_queue: int = 64
    enable_thinking: bool | None = None  # None: the chat template's own default
    log_requests: bool = False
    model_aliases: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default


def create_app(backend, tokenizer, settings: ServerSettings, prefix_cache: PrefixCache | None = None) -> FastAPI:
    metrics = Metrics()
    worker_box: dict = {}

    def on_finished(done: Finished):
        metrics.record_generation(
            prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
            cached_tokens=done.cached_tokens, prefill_tokens=done.prompt_tokens - done.cached_tokens,
            prefill_s=done.prefill_s, decode_tokens=done.decode_steps, decode_s=done.decode_s,
            cancelled=done.finish_reason == "cancelled")

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker_box["worker"].shutdown()

    app = FastAPI(title="lily", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Qwen3.6-35B-A3B", docs_url=None, redoc_url=None)
    worker = EngineWorker(backend, tokenizer, settings.max_queue, prefix_cache, on_finished=on_finished)
    worker_box["worker"] = worker
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.prefix_cache = prefix_cache
    thinking_default = settings.enable_thinking
    created = int(time.time())
    names = {settings.model_name, *settings.model_aliases}

    # -- errors ---------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no such endpoint: {request.method} {request.url.path}").response()
        if exc.status_code == 405:
            return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response(
                headers=dict(exc.headers or {}))
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response()

    # -- helpers ----------------------------------------------------------------------------------
    def encode_text(text: str, param: str) -> list[int]:
        """JSON may carry unpaired UTF-16 surrogates ("\\ud800"): not Unicode text, so refused here."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{param}: the text holds an unpaired UTF-16 surrogate ({text[e.start]!r}); "
                           "send valid Unicode", param=param) from None
        return tokenizer.encode(text)

    def render_chat(body, param: str) -> tuple[str, list[int], bool, list[dict] | None]:
        """(prompt text, its token ids, whether it opens a <think> block, the tools the parser knows)."""
        try:
            text, thinking, tools = build_chat_prompt(body, tokenizer, thinking_default)
        except TemplateError as e:
            raise APIError(400, str(e), param=param) from None
        return text, encode_text(text, param), thinking, tools

    def check_model(model: str):
        if model not in names:
            raise APIError(404, f"model {model!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")

    def budget(prompt_len: int, max_tokens: int | None, param: str, max_param: str = "max_tokens") -> int:
        if prompt_len == 0:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if max_tokens is None:
            if prompt_len >= settings.max_seq:
                raise APIError(400, f"the prompt has {prompt_len} tokens; this server's context is "
                               f"{settings.max_seq} tokens (--max-seq)", param=param, code="context_length_exceeded")
            return settings.max_seq - prompt_len
        if prompt_len + max_tokens > settings.max_seq:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this server's "
                           f"context of {settings.max_seq} tokens (--max-seq)", param=max_param,
                           code="context_length_exceeded")
        return max_tokens

    im_end = tokenizer.token_id("<|im_end|>") if tokenizer.has_token("<|im_end|>") else None
    newline = tokenizer.encode("\n")

    def turn_boundary(ids: list[int]) -> tuple[int, ...]:
        """Where the last full chat turn ends (after its <|im_end|> and newline). A follow-up request
        repeats the conversation up to there, while the assistant turn itself is re-rendered
        differently (templates drop the reasoning), so that is the state worth caching."""
        if im_end is None:
            return ()
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == im_end:
                end = i + 1
                if len(newline) == 1 and end < len(ids) and ids[end] == newline[0]:
                    end += 1
                return (end,)
        return ()

    def sampling_params(body, logprobs: bool, top_logprobs: int) -> SamplingParams:
        seed = None if body.seed is None else body.seed % (2 ** 64)
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=seed, logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=logit_bias(body.logit_bias))

    def stop_tokens(body) -> frozenset[int]:
        return frozenset() if body.ignore_eos else frozenset(tokenizer.eos_token_ids)

    def logit_bias(bias: dict | None) -> tuple:
        out = []
        for key, value in (bias or {}).items():  # keys are digit strings (the schema's pattern)
            if int(key) < tokenizer.vocab_size:
                out.append((int(key), float(value)))
        return tuple(out)

    def choices(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
        """n choices of one prompt, generated one after another. They share one cancel event (a client
        that leaves stops them all); with a seed, choice i samples with seed + i, so the choices differ
        and each is reproducible. The first snapshots its prompt but the last token (the cache serves
        strict prefixes only), so the others prefill one token."""
        if n == 1:
            return [gen]
        seed = gen.sampling.seed
        last = len(gen.prompt_ids) - 1
        return [replace(gen, snapshot_at=gen.snapshot_at + ((last,) if i == 0 and last > 0 else ()),
                        sampling=replace(gen.sampling, seed=None if seed is None else (seed + i) % (2 ** 64)))
                for i in range(n)]

    def submit(gens: list[GenerationRequest]) -> list[asyncio.Queue]:
        """Queue one HTTP request's generations (one place in the queue); an event queue for each."""
        loop = asyncio.get_running_loop()
        queues, items = [], []
        for gen in gens:
            events: asyncio.Queue = asyncio.Queue()

            def emit(ev, events=events, gen=gen):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, ev)
                except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                    gen.cancelled.set()

            queues.append(events)
            items.append((gen, emit))
        try:
            worker.submit_all(items)
        except QueueFullError as e:
            raise APIError(429, f"{e}; retry later", code="queue_full") from None
        return queues

    async def event_stream(events: asyncio.Queue, gen: GenerationRequest):
        """One generation's events until its Finished or Failed. Leaving early cancels it."""
        done = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, (Finished, Failed)):
                    done = True
                yield ev
                if done:
                    return
        finally:
            if not done:
                gen.cancelled.set()

    async def choice_events(queues: list[asyncio.Queue], gens: list[GenerationRequest], request: Request | None):
        """(choice index, event) of each generation in turn, until each one's Finished; ends after a
        Failed. However it ends, what is still queued or running is cancelled. For a streamed response
        Starlette closes this generator when the client goes; otherwise (request given) a watcher waits
        for the client's disconnect message, so the worker stops at its next step."""
        watcher = asyncio.create_task(watch_disconnect(request, gens)) if request is not None else None
        try:
            for i, (events, gen) in enumerate(zip(queues, gens)):
                async for ev in event_stream(events, gen):
                    yield i, ev
                    if isinstance(ev, Failed):
                        return
        finally:
            if watcher is not None:
                watcher.cancel()
            for gen in gens:  # a no-op for those already finished
                gen.cancelled.set()

    async def watch_disconnect(request: Request, gens: list[GenerationRequest]):
        while True:  # the body was read already: the next message is the disconnect
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for gen in gens:
                    gen.cancelled.set()
                return

    def note(request: Request, gen: GenerationRequest, dones: list[Finished], n: int, prompt_text: str | None):
        info = request.scope.setdefault("state", {}).setdefault("lily", {})
        info["id"] = gen.request_id
        if dones:
            counts = usage(dones, n)
            info.update(prompt_tokens=counts["prompt_tokens"], cached=counts["prompt_tokens_details"]["cached_tokens"],
                        completion_tokens=counts["completion_tokens"],
                        finish=",".join(sorted({d.finish_reason for d in dones})))
            if len(dones) > 1:
                info["choices"] = len(dones)
        if prompt_text is not None and settings.log_requests:
            info["prompt"] = prompt_text

    def usage(dones: list[Finished], n: int) -> dict:
        """Each prompt counts once (the first of its n choices), every choice's output counts."""
        prompt = sum(d.prompt_tokens for d in dones[::n])
        out = sum(d.completion_tokens for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in dones[::n])}}

    def lp(x: float) -> float:
        return max(float(x), LOGPROB_FLOOR)

    def chat_logprobs(tokens) -> list[dict]:
        out = []
        for t in tokens:
            if t.logprob is None:
                continue
            text = tokenizer.token_text(t.token)
            out.append({"token": text, "logprob": lp(t.logprob), "bytes": tokenizer.token_bytes(t.token),
                        "top_logprobs": [{"token": tokenizer.token_text(i), "logprob": lp(v),
                                          "bytes": tokenizer.token_bytes(i)}
                                         for i, v in (t.top or [])]})
        return out

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def sse_event(obj: dict) -> str:
        """A typed event, as the Responses API streams them (no [DONE] at the end)."""
        return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # a fault after the stream started: the status is already sent, so the error goes in the stream
    STREAM_FAULT = sse(APIError(500, "internal server error").body()) + "data: [DONE]\n\n"

    # -- routes -----------------------------------------------------------------------------------
    @app.get("/health", summary="liveness")
    async def health():
        if not worker._thread.is_alive():
            raise APIError(503, "the engine worker has stopped")
        return {"status": "ok"}

    @app.get("/v1/models", summary="the served model")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    def model_card():
        return {"id": settings.model_name, "object": "model", "created": created, "owned_by": "lily",
                "max_model_len": settings.max_seq}

    @app.get("/v1/models/{model:path}", summary="one model")
    async def get_model(model: str):
        check_model(model)
        return model_card()

    @app.post("/v1/responses", summary="a response (the Responses API: text, reasoning, function calls; stream or not)")
    async def responses(body: ResponsesRequest, request: Request):
        check_model(body.model)
        chat = chat_request_from(body)
        prompt_text, prompt_ids, thinking, tools = render_chat(chat, "input")
        max_tokens = budget(len(prompt_ids), chat.max_tokens, "input", "max_output_tokens")
        gen = GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling_params(chat, False, 0),
            stop_token_ids=stop_tokens(chat), cache_key=chat.prompt_cache_key,
            snapshot_at=turn_boundary(prompt_ids), cache_prompt=False, cache_output=False)
        parser = ChatOutputParser(thinking, tools)
        out = ResponseAssembler(body, settings.model_name)
        gen.request_id = out.response["id"]
        queues = submit([gen])
        reasoning_tokens = 0

        def feed(ev) -> list[dict]:  # a Delta's events; tokens that only extended the reasoning count as such
            nonlocal reasoning_tokens
            d = parser.feed(ev.text)
            if d.reasoning and not (d.content or d.tool_calls):
                reasoning_tokens += len(ev.tokens)
            return out.feed(d)

        def finish(done: Finished) -> list[dict]:
            note(request, gen, [done], 1, prompt_text)
            events = out.feed(parser.finish())
            return events + out.finish(done.finish_reason, {
                "input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "input_tokens_details": {"cached_tokens": done.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens}})

        if body.stream:
            async def stream():
                for ev in out.start():
                    yield sse_event(ev)
                async for _, ev in choice_events(queues, [gen], None):
                    if isinstance(ev, Delta):
                        events = feed(ev)
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

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        done = None
        async for _, ev in choice_events(queues, [gen], request):
            if isinstance(ev, Delta):
                feed(ev)
            elif isinstance(ev, Failed):
                raise APIError(500, "internal server error")
            elif isinstance(ev, Finished):
                done = ev
        if done is None or done.finish_reason == "cancelled":  # the client went away
            return PlainTextResponse("", status_code=499)
        finish(done)
        return out.response

    @app.post("/tokenize", summary="token ids of a text, or of chat messages as the chat template renders them")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if isinstance(body, TokenizeChat):
            ids = render_chat(body, "messages")[1]
        else:
            ids = encode_text(body.prompt, "prompt")
        return {"count": len(ids), "max_model_len": settings.max_seq, "tokens": ids}

    @app.post("/detokenize", summary="the text of token ids")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [i for i in body.tokens if i >= tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (size {tokenizer.vocab_size})",
                           param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def get_metrics():
        metrics.running = worker.running
        stats = prefix_cache.stats if prefix_cache is not None else None
        text = metrics.render(
            queue_depth=worker.queue_depth,
            cache_hits=stats.hits if stats else 0, cache_misses=stats.misses if stats else 0,
            cache_entries=len(prefix_cache) if prefix_cache is not None else 0,
            cache_bytes=prefix_cache.nbytes if prefix_cache is not None else 0)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions", summary="chat completion (stream or not)")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt_text, prompt_ids, thinking, tools = render_chat(body, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = budget(len(prompt_ids), max_tokens, "messages", param)
        n = body.n or 1
        gens = choices(GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens,
            sampling=sampling_params(body, bool(body.logprobs), body.top_logprobs or 0),
            stop=body.stop_list(), stop_token_ids=stop_tokens(body), min_tokens=body.min_tokens or 0,
            cache_key=body.prompt_cache_key, request_id="chatcmpl-" + uuid.uuid4().hex[:24],
            snapshot_at=turn_boundary(prompt_ids), cache_prompt=False, cache_output=False), n)
        parsers = [ChatOutputParser(thinking, tools) for _ in gens]
        queues = submit(gens)
        base = {"id": gens[0].request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": settings.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(chat_stream(request, gens, queues, parsers, base, include_usage, prompt_text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts = [([], [], [], []) for _ in gens]  # reasoning, content, tool calls, logprobs of each choice
        dones: list[Finished | None] = [None] * n
        async for i, ev in choice_events(queues, gens, request):
            reasoning, content, calls, lps = parts[i]
            if isinstance(ev, Delta):
                d = parsers[i].feed(ev.text)
                reasoning.append(d.reasoning), content.append(d.content), calls.extend(d.tool_calls)
                if gens[i].sampling.logprobs:
                    lps.extend(chat_logprobs(ev.tokens))
            elif isinstance(ev, Failed):
                raise APIError(500, "internal server error")
            elif isinstance(ev, Finished):
                dones[i] = ev
        if any(d is None or d.finish_reason == "cancelled" for d in dones):  # the client went away
            return PlainTextResponse("", status_code=499)
        out = []
        for i, ((reasoning, content, calls, lps), done) in enumerate(zip(parts, dones)):
            d = parsers[i].finish()
            reasoning.append(d.reasoning), content.append(d.content), calls.extend(d.tool_calls)
            message = {"role": "assistant", "content": "".join(content) or None}
            if thinking:
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            elif message["content"] is None:
                message["content"] = ""
            finish = "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason
            out.append({"index": i, "message": message, "finish_reason": finish,
                        "logprobs": {"content": lps} if gens[i].sampling.logprobs else None})
        note(request, gens[0], dones, n, prompt_text)
        return {"id": gens[0].request_id, "object": "chat.completion", "created": base["created"],
                "model": settings.model_name, "choices": out, "usage": usage(dones, n)}

    async def chat_stream(request, gens, queues, parsers, base, include_usage, prompt_text):
        def chunk(i: int, delta: dict, finish=None, logprobs=None) -> str:
            choice = {"index": i, "delta": delta, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = {"content": logprobs}
            return sse({**base, "choices": [choice]})

        n_calls = [0] * len(gens)
        dones: list[Finished] = []

        def deltas(i: int, d) -> list[dict]:
            out = []
            if d.reasoning:
                out.append({"reasoning_content": d.reasoning})
            if d.content:
                out.append({"content": d.content})
            for c in d.tool_calls:
                out.append({"tool_calls": [{"index": n_calls[i], "id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments}}]})
                n_calls[i] += 1
            return out

        current = 0
        yield chunk(0, {"role": "assistant", "content": ""})
        async for i, ev in choice_events(queues, gens, None):
            if i != current:  # the next choice's first event: its role first
                current = i
                yield chunk(i, {"role": "assistant", "content": ""})
            if isinstance(ev, Delta):
                pieces = deltas(i, parsers[i].feed(ev.text))
                logprobs = chat_logprobs(ev.tokens) if gens[i].sampling.logprobs else None
                if not pieces and logprobs:
                    pieces = [{}]
                for k, p in enumerate(pieces):
                    yield chunk(i, p, logprobs=logprobs if k == 0 else None)
            elif isinstance(ev, Failed):
                yield STREAM_FAULT
                return
            elif isinstance(ev, Finished):
                for p in deltas(i, parsers[i].finish()):
                    yield chunk(i, p)
                finish = "tool_calls" if n_calls[i] and ev.finish_reason == "stop" else ev.finish_reason
                yield chunk(i, {}, finish=finish)
                dones.append(ev)
        if len(dones) < len(gens):
            return
        note(request, gens[0], dones, len(gens), prompt_text)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(dones, len(gens))})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", summary="text completion (stream or not)")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = body.prompts()
        param = "prompt" if len(prompts) == 1 else "prompt[{}]"
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"n: {len(prompts)} prompts x n={n} is {len(prompts) * n} generations; at most "
                           f"{MAX_CHOICES} a request", param="n")
        want_lp = body.logprobs is not None
        request_id = "cmpl-" + uuid.uuid4().hex[:24]
        cancel = threading.Event()  # one for all the batch's generations, like one prompt's n choices
        gens, echoes, texts = [], [], []  # choice p * n + j is prompt p's choice j
        for p, prompt in enumerate(prompts):
            where = param.format(p)
            if isinstance(prompt, str):
                prompt_ids, prompt_text = encode_text(prompt, where), prompt
            else:
                bad = [i for i in prompt if i >= tokenizer.vocab_size]
                if bad:
                    raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary (size "
                                   f"{tokenizer.vocab_size})", param="prompt")
                prompt_ids, prompt_text = list(prompt), None
            max_tokens = budget(len(prompt_ids), body.max_tokens if body.max_tokens is not None else 16, where)
            gens += choices(GenerationRequest(
                prompt_ids=prompt_ids, max_tokens=max_tokens,
                sampling=sampling_params(body, want_lp, body.logprobs or 0),
                stop=body.stop_list(), stop_token_ids=stop_tokens(body), min_tokens=body.min_tokens or 0,
                cache_key=body.prompt_cache_key, request_id=request_id, cancelled=cancel,
                prompt_logprobs=body.logprobs if body.echo and want_lp else None), n)
            echo = ""
            if body.echo:
                echo = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)
            echoes += [echo] * n
            texts.append(prompt_text)
        prompt_text = texts[0] if len(texts) == 1 else None
        queues = submit(gens)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": settings.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(completion_stream(request, gens, queues, n, base, include_usage, echoes, prompt_text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = [[echo] for echo in echoes]
        toks: list[list] = [[] for _ in gens]
        starts: list[Started | None] = [None] * len(gens)
        dones: list[Finished | None] = [None] * len(gens)
        async for i, ev in choice_events(queues, gens, request):
            if isinstance(ev, Started):
                starts[i] = ev
            elif isinstance(ev, Delta):
                outs[i].append(ev.text)
                toks[i].extend(ev.tokens)
            elif isinstance(ev, Failed):
                raise APIError(500, "internal server error")
            elif isinstance(ev, Finished):
                dones[i] = ev
        if any(d is None or d.finish_reason == "cancelled" for d in dones):
            return PlainTextResponse("", status_code=499)
        note(request, gens[0], dones, n, prompt_text)
        return {**base, "choices": [{"index": i, "text": "".join(outs[i]), "finish_reason": done.finish_reason,
                                     "logprobs": joined(echo_logprobs(starts[i], gens[i]),
                                                        completion_logprobs(toks[i], len(echoes[i])))
                                     if want_lp else None}
                                    for i, done in enumerate(dones)],
                "usage": usage(dones, n)}

    def completion_logprobs(tokens, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = tokenizer.token_text(t.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp(t.logprob))
            top: dict[str, float] = {}
            for i, v in t.top or []:  # best first; tokens with the same text keep the best
                top.setdefault(tokenizer.token_text(i), lp(v))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def echo_logprobs(started: Started | None, gen: GenerationRequest) -> dict | None:
        """The echoed prompt's entries: its first token has no log-probability (nothing comes before it)."""
        if started is None or started.prompt_logprobs is None:
            return None
        first = tokenizer.token_text(gen.prompt_ids[0])
        rest = completion_logprobs(started.prompt_logprobs, len(first))
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def joined(*parts: dict | None) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for part in parts:
            for key, values in (part or {}).items():
                out[key] += values
        return out

    async def completion_stream(request, gens, queues, n, base, include_usage, echoes, prompt_text):
        def chunk(i, text, finish=None, logprobs=None):
            return sse({**base, "choices": [{"index": i, "text": text, "finish_reason": finish,
                                             "logprobs": logprobs}]})

        dones: list[Finished] = []
        offset = 0
        async for i, ev in choice_events(queues, gens, None):
            if isinstance(ev, Started):  # the echo (and the prompt's log-probabilities) once it has run
                offset = len(echoes[i])
                if echoes[i]:
                    yield chunk(i, echoes[i], logprobs=echo_logprobs(ev, gens[i]) if gens[i].sampling.logprobs
                                else None)
            elif isinstance(ev, Delta):
                lps = completion_logprobs(ev.tokens, offset) if gens[i].sampling.logprobs else None
                offset += len(ev.text)
                yield chunk(i, ev.text, logprobs=lps)
            elif isinstance(ev, Failed):
                yield STREAM_FAULT
                return
            elif isinstance(ev, Finished):
                yield chunk(i, "", finish=ev.finish_reason)
                dones.append(ev)
        if len(dones) < len(gens):
            return
        note(request, gens[0], dones, n, prompt_text)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(dones, n)})
        yield "data: [DONE]\n\n"

    app.openapi = lambda: openapi_schema(app, [settings.model_name, *settings.model_aliases])
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    if settings.cors_origins:  # added last, so outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key"], max_age=600)
    return app


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def openapi_schema(app: FastAPI, model_names: list[str]) -> dict:
    """FastAPI's schema, with the errors this server really returns instead of its 422, and the
    model ids this server serves."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        if body in comps:
            comps[body]["properties"]["model"]["enum"] = list(model_names)
    for op in schema.get("paths", {}).get("/v1/models/{model}", {}).values():
        for param in op.get("parameters", []):
            if param.get("name") == "model":
                param["schema"]["enum"] = list(model_names)
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["ErrorResponse"] = ERROR_SCHEMA
    err = {"description": "an OpenAI-shaped error",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    statuses = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model or path",
                "405": "method not allowed", "413": "body over the limit", "429": "queue full",
                "500": "internal fault", "503": "engine stopped"}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code, text in statuses.items():
                responses[code] = {**err, "description": text}
            if method == "post":
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": {
                    "type": "object", "description": "one server-sent event; data is a JSON chunk or [DONE]",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}})
    app.openapi_schema = schema
    return schema
