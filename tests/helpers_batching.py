"""Shared pieces of the continuous-batching tests (this file holds no tests).

    rec = Recorder(backend)        # what the worker asked of the backend, in order; hooks; a step gate
    eng = Engine(backend)          # an EngineWorker over a Recorder, shut down at the end
    run = Run(request)             # one request's events, and an Event set when it ended
    tokens = solo(backend, request)   # the oracle: the same request run alone

Everything is driven by events: the gate (tests/helpers_gate.py) holds the worker thread at its next model
call until the test opens it, and hooks run on the worker thread after a given decode step, so what is
concurrent with what never depends on how fast the machine is.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from helpers_detok import ByteTok
from helpers_gate import HANG_S, StepGate

from lily.engine.generation import Delta, Failed, Finished, GenerationRequest, Started, generate
from lily.engine.worker import EngineWorker

WAIT_S = 4 * HANG_S  # a safety net against a hung worker, never part of the logic (the interpreter is slow)


class Recorder:
    """A backend wrapper: records each call the worker makes (("prefill", n), ("decode", batch size),
    ("release", state id)), runs `after_decode[step]` hooks on the worker thread after that decode step
    (steps count from 1), and with `hold()` stops the worker at its next prefill or decode until `release()`
    (`wait_held()` returns once it waits there)."""

    def __init__(self, inner):
        self.inner = inner
        self.config, self.device = inner.config, inner.device
        if hasattr(inner, "max_batch"):
            self.max_batch = inner.max_batch
        self.calls: list[tuple[str, int]] = []
        self.after_decode: dict[int, list] = {}
        self.steps = 0
        self.gate = StepGate("model call")

    def hold(self) -> None:
        self.gate.hold()

    def release(self) -> None:
        self.gate.open()

    def wait_held(self) -> None:
        self.gate.wait_waiting()

    def _gate(self) -> None:
        self.gate.enter()

    def on_step(self, step: int, fn) -> None:
        self.after_decode.setdefault(step, []).append(fn)

    def decode_sizes(self) -> list[int]:
        return [n for kind, n in self.calls if kind == "decode"]

    def new_state(self):
        return self.inner.new_state()

    def restore_state(self, snapshot):
        return self.inner.restore_state(snapshot)

    def release_state(self, state) -> None:
        self.calls.append(("release", id(state)))
        self.inner.release_state(state)

    def clone_state(self, state):
        return self.inner.clone_state(state)

    def state_nbytes(self, state) -> int:
        return self.inner.state_nbytes(state)

    def prefill(self, ids, state):
        self._gate()
        self.calls.append(("prefill", len(ids)))
        return self.inner.prefill(ids, state)

    def prefill_logits(self, ids, state):
        self._gate()
        self.calls.append(("prefill", len(ids)))
        return self.inner.prefill_logits(ids, state)

    def decode_batch(self, tokens, states):
        self._gate()
        out = self.inner.decode_batch(tokens, states)
        self.calls.append(("decode", len(tokens)))
        self.steps += 1
        for fn in self.after_decode.pop(self.steps, []):
            fn()
        return out


class Engine:
    """An EngineWorker (ByteTok, the `cache` prefix cache, other keywords its own) over a `recorder` of the
    backend (Recorder by default), shut down at the end."""

    def __init__(self, backend, recorder=Recorder, **kw):
        self.rec = recorder(backend)
        self.cache = kw.pop("cache", None)
        self.worker = EngineWorker(self.rec, ByteTok(), prefix_cache=self.cache, **kw)

    def submit(self, request: GenerationRequest) -> "Run":
        run = Run(request)
        self.worker.submit(request, run.emit)
        return run

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.rec.release()
        self.worker.shutdown()


class Run:
    """One submitted request's events; `ended` is set by its Finished or Failed."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: list = []
        self.ended = threading.Event()
        self.on_event = None  # optional callback(run, event), on the worker thread

    def emit(self, ev) -> None:
        self.events.append(ev)
        if self.on_event is not None:
            self.on_event(self, ev)
        if isinstance(ev, (Finished, Failed)):
            self.ended.set()

    def wait(self) -> "Run":
        assert self.ended.wait(WAIT_S), "the request never ended"
        return self

    @property
    def tokens(self) -> list[int]:
        return [t.token for e in self.events if isinstance(e, Delta) for t in e.tokens]

    @property
    def logprobs(self) -> list:
        return [(t.logprob, t.top) for e in self.events if isinstance(e, Delta) for t in e.tokens]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def finished(self) -> Finished | None:
        return next((e for e in self.events if isinstance(e, Finished)), None)

    @property
    def started(self) -> Started | None:
        return next((e for e in self.events if isinstance(e, Started)), None)


def solo(backend, request: GenerationRequest, pieces: list[int] | None = None) -> Run:
    """The request run alone (lily.engine.generation.generate) on `backend`; with `pieces`, its prompt is
    prefilled in exactly those pieces first (the arithmetic a chunked prefill in a batch ran)."""
    run = Run(replace(request, cancelled=threading.Event()))
    if pieces is None:
        generate(backend, ByteTok(), run.request, run.emit)
        return run

    class Chunked:  # the backend, but its prompt prefill split as given
        def __getattr__(self, name):
            return getattr(backend, name)

        def prefill(self, ids, state):
            out, at = None, 0
            for n in pieces:
                out = backend.prefill(ids[at:at + n], state)
                at += n
            assert at == len(ids)
            return out
    generate(Chunked(), ByteTok(), run.request, run.emit)
    return run
