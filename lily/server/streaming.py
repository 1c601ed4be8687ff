"""Between the event loop and the engine thread: queue an HTTP request's generations, follow their
events (a client that leaves cancels them), and write server-sent events."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from lily.engine.generation import Failed, Finished, GenerationRequest
from lily.engine.worker import QueueFullError
from lily.server.context import ServerContext
from lily.server.errors import APIError
from lily.server.metrics import Metrics


RETRY_AFTER_S = 1  # a full queue's 429 asks the client to wait this many seconds (the Retry-After header)


def submit(ctx: ServerContext, gens: list[GenerationRequest]) -> list[asyncio.Queue]:
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
        ctx.worker.submit_all(items)
    except QueueFullError as e:
        raise APIError(429, f"{e}; retry later", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return queues


async def event_stream(events: asyncio.Queue, gen: GenerationRequest, metrics: Metrics):
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
        if not done:  # its consumer stopped early: a streamed answer whose client left
            gen.cancelled.set()
            metrics.count_client_disconnect()


async def choice_events(queues: list[asyncio.Queue], gens: list[GenerationRequest], request: Request | None,
                        metrics: Metrics):
    """(choice index, event) of each generation in turn, until each one's Finished; ends after a
    Failed. However it ends, what is still queued or running is cancelled. For a streamed response
    Starlette closes this generator when the client goes; otherwise (request given) a watcher waits
    for the client's disconnect message, so the worker stops at its next step."""
    watcher = asyncio.create_task(watch_disconnect(request, gens, metrics)) if request is not None else None
    try:
        for i, (events, gen) in enumerate(zip(queues, gens)):
            async for ev in event_stream(events, gen, metrics):
                yield i, ev
                if isinstance(ev, Failed):
                    return
    finally:
        if watcher is not None:
            watcher.cancel()
        for gen in gens:  # a no-op for those already finished
            gen.cancelled.set()


async def watch_disconnect(request: Request, gens: list[GenerationRequest], metrics: Metrics):
    while True:  # the body was read already: the next message is the disconnect
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for gen in gens:
                gen.cancelled.set()
            metrics.count_client_disconnect()
            return


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(obj: dict) -> str:
    """A typed event, as the Responses API streams them (no [DONE] at the end)."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
# a fault after the stream started: the status is already sent, so the error goes in the stream
STREAM_FAULT = sse(APIError(500, "internal server error").body()) + DONE


def event_stream_response(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def client_gone() -> PlainTextResponse:
    """The client went away before the answer was ready: nobody reads this (nginx's 499 for the log)."""
    return PlainTextResponse("", status_code=499)
