"""The engine worker: one thread owns the model and runs requests one at a time from a bounded queue.

The model (and its GPU stream) is touched only from this thread. The HTTP side submits a request (one
generation, or several run in turn: an HTTP request's n choices or batch of prompts take one place in
the queue) with an `emit` callback for each (thread-safe, e.g. loop.call_soon_threadsafe onto an
asyncio.Queue) and sets the request's `cancelled` event when its client goes away; the generation loop
checks it every step.
"""

from __future__ import annotations

import logging
import queue
import threading

from lily.engine.generation import Failed, Finished, GenerationRequest, generate
from lily.engine.prefix_cache import PrefixCache

log = logging.getLogger("lily.engine")


class QueueFullError(RuntimeError):
    pass


class EngineWorker:
    def __init__(self, backend, tokenizer, max_queue: int = 64, prefix_cache: PrefixCache | None = None,
                 on_finished=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.on_finished = on_finished  # callback(Finished), for metrics
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_queue))
        self._thread = threading.Thread(target=self._loop, name="lily-engine", daemon=True)
        self._stopping = False
        self._current: GenerationRequest | None = None
        self.running = 0
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def submit(self, request: GenerationRequest, emit) -> None:
        """Queue a request; QueueFullError when --max-queue requests are already waiting."""
        self.submit_all([(request, emit)])

    def submit_all(self, items: list[tuple[GenerationRequest, object]]) -> None:
        """Queue generations that run one after another, in one place of the queue."""
        if self._stopping:
            raise QueueFullError("the server is shutting down")
        try:
            self._queue.put_nowait(list(items))
        except queue.Full:
            raise QueueFullError(f"the request queue is full ({self._queue.maxsize} waiting)") from None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        current = self._current
        if current is not None:  # stop the running generation at its next step
            current.cancelled.set()
        # cancel what waits, then wake the loop
        while True:
            try:
                items = self._queue.get_nowait()
            except queue.Empty:
                break
            for request, emit in items or ():
                request.cancelled.set()
                emit(Finished("cancelled", len(request.prompt_ids), 0, 0, 0.0, 0.0, 0))
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            items = self._queue.get()
            if items is None:
                return
            for request, emit in items:
                self._run(request, emit)

    def _run(self, request: GenerationRequest, emit) -> None:
        # its client left while it waited, or shutdown began after this loop took it off the queue
        # (then shutdown's drain missed it): either way its stream still gets its final event
        if request.cancelled.is_set() or self._stopping:
            done = Finished("cancelled", len(request.prompt_ids), 0, 0, 0.0, 0.0, 0)
            emit(done)
            self._report(done)
            return
        self.running = 1
        self._current = request
        if self._stopping:  # shutdown read _current just before this line: it could not cancel us
            request.cancelled.set()
        try:
            done = generate(self.backend, self.tokenizer, request, emit, self.prefix_cache)
            self._report(done)
        except Exception:  # a real fault: log it, tell the client generically, keep serving
            log.exception("generation failed for request %s", request.request_id)
            emit(Failed("internal error during generation"))
        finally:
            self.running = 0
            self._current = None

    def _report(self, done: Finished) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(done)
            except Exception:
                log.exception("metrics callback failed")
