"""Between the event loop and the engine thread: queue an HTTP request's generations, follow their
events (a client that leaves cancels them), and write server-sent events."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from lily.engine.generation import Failed, Finished, GenerationRequest
from lily.engine.worker import QueueFullError, ShuttingDownError
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
    except ShuttingDownError as e:
        raise shutting_down(e) from None
    return queues


def shutting_down(why) -> APIError:
    """503: the server is stopping (its requests cancelled by the shutdown, not by their clients)."""
    return APIError(503, f"{why}; retry against a running server", code="shutting_down")


async def choice_events(queues: list[asyncio.Queue], gens: list[GenerationRequest], request: Request | None,
                        metrics: Metrics):
    """(choice index, event) of every generation as its events come, the choices interleaved (each one's in
    its order: a stream's later choices do not wait for the earlier ones to end), until each one's Finished;
    ends after a Failed. However it ends, what is still queued or running is cancelled. For a streamed
    response Starlette closes this generator when the client goes (a disconnect counted if a generation had
    not ended); otherwise (request given) a watcher waits for the client's disconnect message, so the worker
    stops at its next step."""
    watcher = asyncio.create_task(watch_disconnect(request, gens, metrics)) if request is not None else None
    running = set(range(len(queues)))
    gets: dict[int, asyncio.Future] = {}
    failed = False
    try:
        while running:
            for i in running - gets.keys():
                gets[i] = asyncio.ensure_future(queues[i].get())
            await asyncio.wait(gets.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in sorted(i for i, got in gets.items() if got.done()):
                ev = gets.pop(i).result()
                if isinstance(ev, (Finished, Failed)):
                    running.discard(i)
                failed = isinstance(ev, Failed)
                yield i, ev
                if failed:
                    return
    finally:
        for got in gets.values():
            got.cancel()
        if watcher is not None:
            watcher.cancel()
        elif running and not failed:  # its consumer stopped early: a streamed answer whose client left
            metrics.count_client_disconnect()
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


def failure(ev: Failed) -> APIError:
    """A generation's Failed as the client's error: the request's own doing (400) says why and names the field;
    a fault stays generic (its details are in the log)."""
    if ev.status == 400:
        return APIError(400, ev.message, param=ev.param)
    return APIError(500, "internal server error")


def stream_failure(ev: Failed) -> str:
    """The same once a stream has started (its status already sent): an error event, then [DONE]."""
    return sse(failure(ev).body()) + DONE


def event_stream_response(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def client_gone(ctx: ServerContext) -> PlainTextResponse:
    """A non-streamed request cancelled before its answer was ready: by its client, who went away (nobody reads
    this: nginx's 499 for the log), or by the server's shutdown, whose client is still there (a 503 it reads)."""
    if ctx.worker.stopping:
        raise shutting_down("the server is shutting down")
    return PlainTextResponse("", status_code=499)
