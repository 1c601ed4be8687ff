"""lily's side of the benchmark: a Backend (docs/internals.md) driven through the contract's Engine API."""

from __future__ import annotations

import inspect

import torch


def accepts(fn, name: str) -> bool:
    """Whether fn takes a keyword argument `name`: by that name, or through its **kwargs (FastBackend hands
    kv_dtype and rec_dtype on to FastModel that way)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class BackendEngine:
    """Greedy generation on a lily backend, one sequence at a time. Uses the backend's own pipelined
    greedy loop (`decode_greedy(token, state, n)`) when it has one, else `decode` plus an argmax."""

    def __init__(self, backend, name: str = "lily"):
        self.backend = backend
        self.name = name
        self.device = torch.device(getattr(backend, "device", "cpu"))
        self.state = None
        self.context = 0
        self.peak_mem_bytes: dict[int, int] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset(self, max_seq: int) -> None:
        # a state of the same size is emptied and reused with its captured decode graph, as the server's
        # state pool does (the capture and the graph's first launch are per-state one-off work)
        recycle = getattr(self.backend, "recycle_state", None)
        if recycle is not None and self.state is not None and getattr(self.state, "max_seq", None) == max_seq:
            recycle(self.state)
        else:
            self.state = None                       # free the old state before allocating the new one
            new_state = self.backend.new_state
            self.state = new_state(max_seq=max_seq) if accepts(new_state, "max_seq") else new_state()
            self._prepare(self.state)
        if self.device.type == "cuda":
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _prepare(self, state) -> None:
        """Per-state one-off work (the fast backend captures its decode CUDA graph per state) belongs
        to allocation, not to the timed decode: do it here. `prepare_state` is the public hook; until a
        backend has it, the fast model's own capture (position-independent: it reads pos on the device)."""
        prepare = getattr(self.backend, "prepare_state", None)
        if prepare is not None:
            prepare(state)
            return
        model = getattr(self.backend, "model", None)
        if getattr(model, "use_graph", False) and hasattr(model, "_capture") and getattr(state, "graph", 1) is None:
            model._capture(state)

    def prefill(self, ids: list[int]) -> int:
        self.context = len(ids)
        logits = self.backend.prefill(ids, self.state)
        return int(torch.argmax(logits.reshape(-1)).item())   # .item() waits for the device

    def decode_greedy(self, token: int, steps: int) -> list[int]:
        own = getattr(self.backend, "decode_greedy", None)
        if own is not None:
            out = [int(t) for t in own(token, self.state, steps)]
        else:
            out = []
            for _ in range(steps):
                token = int(torch.argmax(self.backend.decode(token, self.state).reshape(-1)).item())
                out.append(token)
        self._sync()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_mem_bytes[self.context] = max(peak, self.peak_mem_bytes.get(self.context, 0))
        return out
