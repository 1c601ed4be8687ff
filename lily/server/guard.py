"""The first layer every HTTP request meets, before any routing: the request id (x-request-id, echoed
or made), the API key (compared in constant time; /health and the chat page are open), the body-size
limit (declared or streamed), the body's deadline, the per-request metrics and the one log line (no prompt text
and no rejection reason unless --log-requests, never a key). A response the client stops reading (a stream closed
early) still gets its line and its count, with status 499 (nginx's "client closed request").

The body is read here, whole, before any route: a body that stops coming for --body-timeout seconds (or trickles
in slower than MIN_BODY_RATE bytes a second once that much time has passed) is answered 408, and one still
arriving when the shutdown's grace ends 503 (shutting_down), each closing the connection; without them a client
could hold a connection (and, at SIGTERM, the exit) for as long as it liked."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time

from lily.server.errors import APIError
from lily.server.metrics import Metrics
from lily.server.request_ids import HEADER, request_id
from lily.server.routes.page import PAGE_PATHS
from lily.server.streaming import shutting_down

log = logging.getLogger("lily.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
             "/tokenizer_info", "/health", "/version", "/metrics", "/openapi.json", *PAGE_PATHS)
OPEN_PATHS = ("/health", *PAGE_PATHS)  # no API key needed: liveness, and the chat page (which asks for the key)
CLIENT_CLOSED = 499
# a slow body still gets this many bytes a second past its first --body-timeout seconds (Apache's mod_reqtimeout
# MinRate): one byte every few seconds, under the timeout between chunks, must not hold a connection for days
MIN_BODY_RATE = 500
CLOSE = {"Connection": "close"}  # the body was not read to its end: the connection cannot carry another request


class Draining:
    """Set (from any thread) when the shutdown's grace ends: a body still being read is then answered 503."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def set(self) -> None:
        with self._lock:
            self._set = True
            events = list(self._events)
        for loop, event in events:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # (that loop is closed)
                pass

    def is_set(self) -> bool:
        return self._set

    def event(self) -> asyncio.Event:
        """An event of the running loop, set once this is."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for owner, event in self._events:
                if owner is loop:
                    return event
            event = asyncio.Event()
            if self._set:
                event.set()
            self._events.append((loop, event))
            return event


class GuardMiddleware:
    """API key, body-size limit, per-request metrics and the one log line, before any routing."""

    def __init__(self, app, settings, metrics: Metrics, draining: Draining | None = None):  # app.ServerSettings
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.draining = draining or Draining()
        self._key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        info = scope.setdefault("state", {}).setdefault("lily", {})
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = request_id(headers)
        info["rid"] = rid
        box = {"status": 500, "started": False, "logged": False}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                box["status"], box["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), rid.encode())]}
            elif message["type"] == "http.response.body" and box["status"] >= 400 and "reason" not in info:
                info["reason"] = _error_message(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                box["logged"] = True
                self._finish(scope, endpoint, box["status"], t0, info)

        failed = False
        try:
            await self._guarded(scope, receive, send_wrapper, path, headers)
        except BaseException:
            failed = True
            raise
        finally:
            if not box["logged"]:  # the client left before the answer ended (a stream closed early), or a fault
                self._finish(scope, endpoint, 500 if failed and not box["started"] else CLIENT_CLOSED, t0, info)

    async def _guarded(self, scope, receive, send_wrapper, path: str, headers: dict):
        if self._key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return await APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                  code="invalid_api_key").response(
                headers={"WWW-Authenticate": "Bearer"})(scope, receive, send_wrapper)
        limit = self.settings.max_body
        declared = headers.get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                return await APIError(400, "invalid Content-Length header").response()(scope, receive, send_wrapper)
            if too_big:
                return await self._too_big(scope, receive, send_wrapper)
        # read the whole body (bounded), then replay it; later receives (disconnect) pass through
        chunks, size = [], 0
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            timeout = self.settings.body_timeout
            start = time.monotonic()
            while True:
                wait = min(timeout, start + timeout + size / MIN_BODY_RATE - time.monotonic())
                message = await self._next_chunk(receive, wait)
                if message == "timeout":
                    return await APIError(
                        408, f"the request body did not arrive in time (the server waits {timeout:g}s for each "
                        f"part, and at least {MIN_BODY_RATE} bytes a second after that); send it whole and promptly",
                        code="request_timeout").response(headers=CLOSE)(scope, receive, send_wrapper)
                if message == "draining":
                    return await shutting_down("the server is shutting down before the request body arrived").response(
                        headers=CLOSE)(scope, receive, send_wrapper)
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await self._too_big(scope, receive, send_wrapper)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send_wrapper)

    async def _next_chunk(self, receive, wait: float):
        """The next body message; "timeout" when none came in `wait` seconds, "draining" when the shutdown's grace
        ended first."""
        if wait <= 0:
            return "timeout"
        if self.draining.is_set():
            return "draining"
        got = asyncio.ensure_future(receive())
        stop = asyncio.ensure_future(self.draining.event().wait())
        try:
            done, _ = await asyncio.wait((got, stop), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (got, stop):
                if not task.done():
                    task.cancel()
        if got in done:
            return got.result()
        return "draining" if stop in done else "timeout"

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("x-api-key", "")
        return hmac.compare_digest(token.strip().encode(), self._key)

    async def _too_big(self, scope, receive, send):
        await APIError(413, f"the request body is larger than the limit of {self.settings.max_body} bytes",
                       code="request_too_large").response()(scope, receive, send)

    def _finish(self, scope, endpoint, status, t0, info):
        self.metrics.count_request(endpoint, status)
        ms = (time.perf_counter() - t0) * 1000
        extra = " ".join(f"{k}={v}" for k, v in info.items() if k not in ("prompt", "reason"))
        path = scope.get("path", "")
        if not path.isprintable():  # a crafted path must not forge log lines
            path = path.encode("unicode_escape").decode("ascii")
        line = f'{scope.get("method")} {path} {status} {ms:.0f}ms {extra}'.rstrip()
        if self.settings.log_requests and "prompt" in info:
            line += f" prompt={info['prompt']!r}"
        if self.settings.log_requests and info.get("reason"):
            line += f" reason={info['reason']!r}"
        log.info(line)


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI-shaped error body (what a rejected request is told), or None."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None
