"""A greedy decode step in flight, read back without waiting for the steps queued after it.

The engine's lone greedy stream runs one step ahead (lily.engine.worker): it queues step n+1, whose input
is step n's pick still on the device (`token_dev`), before it reads step n's token and does that token's
host work (detokenizing, stop strings, the client's stream). `result()` waits for step n's own event only,
so that host work overlaps step n+1 on the GPU.
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
        flags = torch.cat([self.token_dev, torch.isfinite(logits).all().reshape(1).to(torch.int32)])
        if flags.is_cuda:
            self._host = torch.empty(2, dtype=torch.int32, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = flags, None

    def result(self) -> tuple[int, bool]:
        """(the chosen token, whether the step's logits were all finite), once this step has run."""
        if self._event is not None:
            self._event.synchronize()
        token, finite = self._host.tolist()
        return token, bool(finite)
