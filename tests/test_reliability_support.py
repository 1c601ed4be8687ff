"""Shared pieces of the reliability tests (this file holds no tests): the tiny checkpoint, a backend
wrapper whose steps wait on the test (helpers_gate) or are poisoned, lily's app served by uvicorn in a
thread on a loopback port, and the `lily serve` process runner from scripts/load_test.py (gated too)."""

from __future__ import annotations

import importlib.util
import random
import socket
import sys
import threading
from pathlib import Path

import httpx
import torch

from helpers_gate import HANG_S, GateServer, StepGates, poll_until

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("lily_load_test", ROOT / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


load_test = _load_script()
LilyServer = load_test.LilyServer


def make_tiny_checkpoint(directory: Path) -> Path:
    from lily.synthetic import make_synthetic

    return make_synthetic("tiny", directory / "ckpt", seed=random.randrange(10_000))


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    """The body is exactly OpenAI's error shape; returns the inner object."""
    if status is not None:
        assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    return err


class InstrumentedBackend:
    """A real backend with knobs: a gate before each prefill and each decode step (helpers_gate; open
    unless a test holds it), call counts, the prompts prefilled, and a one-shot poison that makes the
    state (or the logits) of the next prefill non-finite."""

    def __init__(self, inner):
        self.inner = inner
        self.config = inner.config
        self.device = inner.device
        self.gates = StepGates()
        self.prefills = 0
        self.decodes = 0
        self.prefilled: list[list[int]] = []          # the ids of each prefill call, in order
        self.poison_next_prefill: str | None = None  # "state-nan" | "logits-inf"
        self.poison_next_decode = False               # NaN logits from the next decode
        self.suppress: list[int] = []                 # token ids made (finitely) unlikely, e.g. EOS
        self.lock = threading.Lock()

    def reset(self):
        self.gates.open()
        self.gates = StepGates()
        self.prefills = self.decodes = 0
        self.prefilled = []
        self.poison_next_prefill = None
        self.poison_next_decode = False
        self.suppress = []

    def _suppressed(self, logits):
        if self.suppress:
            logits = logits.clone()
            logits[self.suppress] = -1e4
        return logits

    def new_state(self):
        return self.inner.new_state()

    def prefill(self, ids, state):
        with self.lock:
            self.prefilled.append(list(ids))
        self.gates.prefill.enter()
        logits = self._suppressed(self.inner.prefill(ids, state))
        with self.lock:
            self.prefills += 1
            poison, self.poison_next_prefill = self.poison_next_prefill, None
        if poison == "state-nan":  # the logits still look fine: only the next step would show it
            next(iter(state.recurrent.values())).fill_(float("nan"))
        elif poison == "logits-inf":
            logits = logits.clone()
            logits[random.randrange(logits.numel())] = float("inf")
        return logits

    def decode(self, token, state):
        self.gates.decode.enter()
        logits = self._suppressed(self.inner.decode(token, state))
        with self.lock:
            self.decodes += 1
            poison, self.poison_next_decode = self.poison_next_decode, False
        if poison:
            logits = torch.full_like(logits, float("nan"))
        return logits

    def clone_state(self, state):
        return self.inner.clone_state(state)

    def state_nbytes(self, state):
        return self.inner.state_nbytes(state)


def state_is_finite(state) -> bool:
    tensors = [t for d in (state.keys, state.values, state.conv, state.recurrent) for t in d.values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def free_loopback_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class ThreadedServer:
    """An ASGI app served by uvicorn in a background thread on a free loopback port (real TCP, so real
    disconnects), stopped the way a signal would stop it."""

    def __init__(self, app, **config):  # config: more of uvicorn.Config's arguments (http=...)
        import uvicorn

        self.sock = free_loopback_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    lifespan="on", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        poll_until(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start")
        assert self.server.started, "uvicorn did not start"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(HANG_S)
        self.sock.close()


_http = httpx.Client(timeout=HANG_S)  # one client: a new one per poll costs more than the poll (TLS setup)


def read_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """GET /metrics as {name{labels}: value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return load_test.parse_metrics(_http.get(url + "/metrics", headers=headers).text)


def wait_until_idle(url: str, timeout: float = HANG_S, api_key: str | None = None) -> dict[str, float]:
    """Poll /metrics until no request waits or runs; the last metrics read. Fails after `timeout` (a hang)."""
    return wait_metrics(url, lambda m: m["lily_queue_depth"] == 0 and m["lily_requests_running"] == 0,
                        "the engine to become idle", timeout, api_key)


def wait_metrics(url: str, predicate, what: str, timeout: float = HANG_S, api_key: str | None = None) -> dict[str, float]:
    """Poll /metrics until predicate(metrics) holds; that read. Fails after `timeout` (a hang, not a slow run)."""
    seen = {}

    def check():
        seen["m"] = read_metrics(url, api_key)
        return predicate(seen["m"])

    poll_until(check, lambda: f"{what}; the last /metrics: {seen['m']}", timeout)
    return seen["m"]


def gated(server: LilyServer, gate_server: GateServer) -> LilyServer:
    """The same `lily serve` command, its backend behind gate_server's step gates (tests/gated_serve.py)."""
    assert server.cmd[1:4] == ["-m", "lily", "serve"], server.cmd
    server.cmd = gate_server.launcher() + server.cmd[3:]
    return server
