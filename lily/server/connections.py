"""Connections that never send a whole request: the deadline for a request's header, the process's open-file
limit, and the event loop's accept errors logged as one line a while.

uvicorn arms its keep-alive timer only once a response has ended, and cancels it on any byte received, so a
connection that sends nothing, or one header byte every few seconds (slowloris), was held for ever: with
`ulimit -n 1024`, 1,100 such sockets left no descriptor for a real client, and asyncio logged a traceback for
every failed accept (thousands a second). Here a connection must deliver a request's whole header within
`--header-timeout` seconds of opening, and of its previous response's end (a keep-alive connection), or it is
closed; the body's own deadline is the guard's (guard.py, `--body-timeout`), as nginx's client_header_timeout
and client_body_timeout."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("lily.server")

HEADER_TIMEOUT_S = 60.0  # nginx's client_header_timeout
BODY_TIMEOUT_S = 60.0    # nginx's client_body_timeout
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events.py)


def http_protocol(header_timeout: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (`base`, default the one uvicorn's "auto" picks: httptools where installed,
    else h11) with a deadline for each request's header: armed when the connection opens and when a response
    ends with no other request in flight, cancelled only once a request's header is complete (not by any byte,
    as uvicorn's keep-alive timer is); when it passes, the connection is closed."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class HeaderDeadlineProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._await_request()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_flight() or self.transport.get_protocol() is not self:  # (an upgrade took the transport)
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (may start a pipelined request already received)
            if not self._in_flight():
                self._await_request()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _in_flight(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _await_request(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and not self._in_flight():
                log.debug("closed a connection that sent no whole request header in %gs (%s)", header_timeout,
                          self.client)
                self.transport.close()

    HeaderDeadlineProtocol.__name__ = HeaderDeadlineProtocol.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol


def raise_open_file_limit() -> tuple[int, int] | None:
    """The process's soft RLIMIT_NOFILE raised to its hard limit (each connection holds a descriptor: the usual
    soft 1024 is a thousand idle clients); (old, new) when raised, None when already there or not possible."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = [hard] if hard != resource.RLIM_INFINITY else []
    targets += [1 << 20, 1 << 16]  # an unlimited hard limit: the kernel's nr_open caps what may be set
    for target in targets:
        if soft != resource.RLIM_INFINITY and target <= soft:
            return None
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return soft, target
    return None


def open_file_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class AcceptErrors:
    """An event-loop exception handler: asyncio's "socket.accept() out of system resource" (no descriptor left
    for a new connection) is logged as one warning line every `every` seconds, saying how many came since, with
    no traceback; asyncio logs it, with one, for each failed accept (up to the listen backlog's 2048 a try,
    every second: 140 MB of log in 20 s). Every other context goes to the handler that was there before."""

    def __init__(self, previous=None, every: float = 60.0, clock=time.monotonic):
        self.previous = previous
        self.every = every
        self.clock = clock
        self.count = 0        # failed accepts not yet reported
        self.last: float | None = None

    def __call__(self, loop, context: dict) -> None:
        if context.get("message") != ACCEPT_ERROR:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.count += 1
        now = self.clock()
        if self.last is None or now - self.last >= self.every:
            exc = context.get("exception")
            limit = open_file_limit()
            log.warning("cannot accept new connections: %s (open-file limit %s); %d failed accept%s, retrying (said "
                        "at most once every %.0fs)", getattr(exc, "strerror", None) or exc, limit, self.count,
                        "" if self.count == 1 else "s", self.every)
            self.last, self.count = now, 0


def install_accept_errors(loop: asyncio.AbstractEventLoop, every: float = 60.0) -> AcceptErrors:
    handler = AcceptErrors(loop.get_exception_handler(), every)
    loop.set_exception_handler(handler)
    return handler
