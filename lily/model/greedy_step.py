"""A decode step in flight whose token the device picks, read back without waiting for the steps queued after it.

The engine's lone greedy or sampled stream runs one step ahead (lily.engine.worker): it queues step n+1, whose
input is step n's pick still on the device (`token_dev`), before it reads step n's token and does that token's
host work (detokenizing, stop strings, the client's stream). `result()` waits for step n's own event only,
so that host work overlaps step n+1 on the GPU. A batch of such streams does the same with a BatchGreedyStep:
every row's pick stays on the device for the next batched step, which is queued before this one is read.
The pick is the argmax, or a row's draw (lily.kernels.sample.RowSampling) by lily.kernels.sample.
"""

from __future__ import annotations

import time

import torch

from lily.kernels.sample import RowSampling, sample_rows


def pick_tokens(logits: torch.Tensor, picks: list[RowSampling | None] | None = None) -> torch.Tensor:
    """Each row's token of logits [B, V] on their device, int32 [B], queued: the argmax where picks (or a
    row's) is None or greedy, else that row's draw."""
    if not picks or all(p is None or p.greedy for p in picks):
        return logits.argmax(-1).to(torch.int32)
    return sample_rows(logits, [p or RowSampling() for p in picks])


class GreedyStep:
    """token_dev: int32 [1], the step's pick on the device (copied: the model reuses its buffer);
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
    """A batched step in flight: token_dev int32 [n], each row's pick from `logits` [n, V] on the device (the
    next batched step's input; pick_tokens: picks None is the argmax of every row); read back with each row's
    finite flag."""

    def __init__(self, logits: torch.Tensor, launched_at: float | None = None,
                 picks: list[RowSampling | None] | None = None):
        self.launched_at = time.perf_counter() if launched_at is None else launched_at
        self.rows = logits.shape[0]
        self.token_dev = pick_tokens(logits, picks)
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
