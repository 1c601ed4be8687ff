"""Backend steps that wait on the test, so server tests are driven by events, not by the clock.

A StepGate stands before every prefill (or every decode step) of a backend. Open (the default), steps
pass freely. Held, each step waits for a permit from the test. So a test can let a request run exactly
k steps and then keep it running, unable to finish, for as long as it needs (to queue another request
behind it, to disconnect its client, to send SIGTERM), and count the steps that ran. Waiting on the
gate never assumes a speed: HANG_S only turns a hang (a bug) into a failure instead of a stuck run.

GateServer serves the same gates to a `lily serve` process started through tests/gated_serve.py: that
process's backend asks the test process before each step over an authenticated loopback connection.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Client, Listener
from pathlib import Path

HANG_S = 180.0
KINDS = ("prefill", "decode")
LAUNCHER = Path(__file__).resolve().parent / "gated_serve.py"


class StepGate:
    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._permits: int | None = None  # None: open
        self.waiting = 0   # steps waiting at the gate now
        self.passed = 0    # steps let through, ever

    def hold(self) -> None:
        """From now on each step waits for a permit."""
        with self._cond:
            self._permits = 0

    def allow(self, n: int = 1) -> None:
        """Let n more steps through (the gate stays held after them)."""
        with self._cond:
            self._permits = (self._permits or 0) + n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    @contextmanager
    def held(self):
        """Held inside the block; opened however it ends, so a failing test leaves no step stuck."""
        self.hold()
        try:
            yield self
        finally:
            self.open()

    def enter(self) -> None:
        """Called by the backend before a step: returns when the step may run."""
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._permits != 0)
            if self._permits is not None:
                self._permits -= 1
            self.waiting -= 1
            self.passed += 1
            self._cond.notify_all()

    def wait_for(self, predicate, what: str) -> None:
        """Block until predicate(gate) holds; it is re-checked whenever a step arrives or passes."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), HANG_S):
                raise AssertionError(f"{self.name} gate: {what} did not happen in {HANG_S:.0f}s "
                                     f"(waiting {self.waiting}, passed {self.passed})")

    def wait_waiting(self) -> int:
        """Until a step waits at the (held) gate; returns how many steps had passed by then."""
        self.wait_for(lambda g: g.waiting > 0, "a step arriving")
        return self.passed


def poll_until(predicate, what, timeout: float = HANG_S, every: float = 0.01):
    """For what no gate announces (a queue's depth, a server's counter): poll until predicate() is true
    (returns its value); fails after `timeout`, which only a hang reaches. `what` (text, or a function
    giving it) names what was awaited in the failure."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"waited {timeout:.0f}s for {what() if callable(what) else what}"
        time.sleep(every)
    return value


class StepGates:
    """One gate per kind of step."""

    def __init__(self):
        self.prefill = StepGate("prefill")
        self.decode = StepGate("decode")

    def __getitem__(self, kind: str) -> StepGate:
        return getattr(self, kind)

    def open(self) -> None:
        for kind in KINDS:
            self[kind].open()


class GateServer(StepGates):
    """Gates served to another process (tests/gated_serve.py) over a loopback connection; a context
    manager. `launcher()` is the command prefix that runs `lily ...` behind these gates."""

    def __init__(self):
        super().__init__()
        self._authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def launcher(self) -> list[str]:
        host, port = self._listener.address
        return [sys.executable, str(LAUNCHER), f"{host}:{port}", self._authkey.hex()]

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            while True:
                try:
                    kind = conn.recv()
                except (EOFError, OSError):  # the process ended
                    return
                self[kind].enter()
                conn.send(True)

    def close(self) -> None:
        self.open()
        self._listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GatedBackend:
    """A real backend whose prefills and decode steps (run ahead or not) first pass `enter(kind)`; everything
    else is the backend's own (state pooling, restore, sizes)."""

    def __init__(self, inner, enter):
        self.inner = inner
        self._enter = enter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, ids, state):
        self._enter("prefill")
        return self.inner.prefill(ids, state)

    def prefill_logits(self, ids, state):
        self._enter("prefill")
        return self.inner.prefill_logits(ids, state)

    def decode(self, token, state):
        self._enter("decode")
        return self.inner.decode(token, state)

    def decode_batch(self, tokens, states):  # one step for the whole batch
        self._enter("decode")
        return self.inner.decode_batch(tokens, states)

    # (the steps a stream runs ahead on: greedy or drawn on the device, lone or batched)
    def launch_greedy(self, state, token=None, after=None, **kw):
        self._enter("decode")
        return self.inner.launch_greedy(state, token, after, **kw)

    def launch_batch_greedy(self, states, tokens=None, after=None, **kw):
        self._enter("decode")
        return self.inner.launch_batch_greedy(states, tokens, after, **kw)


def remote_enter(address: str, authkey_hex: str):
    """enter(kind) for a process whose gates a GateServer at address ("host:port") holds."""
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(authkey_hex))
    lock = threading.Lock()

    def enter(kind: str) -> None:
        with lock:
            conn.send(kind)
            conn.recv()

    return enter
