"""A greedy decode step in flight, read back without waiting for the steps queued after it.

The engine's lone greedy stream runs one step ahead (lily.engine.worker): it queues step n+1, whose input
is step n's pick still on the device (`token_dev`), before it reads step n's token and does that token's
host work (detokenizing, stop strings, the client's stream). `result()` waits for step n's own event only,
so that host work overlaps step n+1 on the GPU. A batch of greedy streams does the same with a BatchGreedyStep:
every row's pick stays on the device for the next batched step, which is queued before this one is read.
"""

from __future__ import annotations

import time

import torch


class GreedyStep:
    """token_dev: int32 [1], the step's greedy pick on the device (copied: the model reuses its buffer);
    logits: the step's logits, only checked for NaN/Inf (on the device, read back with the token);
    launched_at: when the step was started (perf_counter; default now: a step that is only queued)."""

    def __init__(self, token_dev: torch.Tensor, logits: torch.Tensor, launched_at: float | None = None):
        self.launched_at = time.perf_counter() if launched_at is None else launched_at
        self.token_dev = token_dev.reshape(1).to(torch.int32, copy=True)
        self._host, self._event = _to_host(torch.cat([self.token_dev,
                                                      torch.isfinite(logits).all().reshape(1).to(torch.int32)]))

    def result(self) -> tuple[int, bool]:
        """(the chosen token, whether the step's logits were all finite), once this step has run."""
        if self._event is not None:
            self._event.synchronize()
        token, finite = self._host.tolist()
        return token, bool(finite)


class BatchGreedyStep:
    """A batched greedy step in flight: token_dev int32 [n], each row's argmax of `logits` [n, V] on the device
    (the next batched step's input); read back with each row's finite flag."""

    def __init__(self, logits: torch.Tensor, launched_at: float | None = None):
        self.launched_at = time.perf_counter() if launched_at is None else launched_at
        self.rows = logits.shape[0]
        self.token_dev = logits.argmax(-1).to(torch.int32)
        self._host, self._event = _to_host(torch.cat([self.token_dev,
                                                      torch.isfinite(logits).all(-1).to(torch.int32)]))

    def result(self) -> tuple[list[int], list[bool]]:
        """(each row's chosen token, whether its logits were all finite), once this step has run."""
        if self._event is not None:
            self._event.synchronize()
        flags = self._host.tolist()
        return flags[:self.rows], [bool(f) for f in flags[self.rows:]]


def _to_host(flags: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of the int32 `flags` on the host and the event after it (pinned, queued, on CUDA; None: done)."""
    if not flags.is_cuda:
        return flags, None
    host = torch.empty(flags.shape, dtype=torch.int32, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
