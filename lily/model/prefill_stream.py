"""A prompt piece in flight on a CUDA stream of its own, beside the decode steps.

Under load a 4K-token prompt takes ~80 ms of the GPU, and while the engine ran it on the one stream every
running stream waited for it. The decode steps are bound by memory latency and the prefill by the tensor
cores, so they share the GPU well: `PrefillStream.launch` queues the piece on a second stream (after what the
decode stream had queued: the state's reset or restore) and returns at once; the engine keeps stepping the
running sequences and takes the piece's logits once `ready()` says it has run. Nothing here waits on the host.

Beside a prefill on a stream of the same priority, a decode kernel waits until the block scheduler has handed out
every tile of the prefill kernel queued before it, so the decode steps crawl (~20 ms a step beside a 4K prompt on
an H200, scripts/gpu_prefill_overlap.py). `engine_stream()` puts the engine thread's work on a stream of the
device's highest priority: each SM a prefill tile frees goes to a waiting decode kernel first.
"""

from __future__ import annotations

import contextlib
import os

import torch

# the engine thread's stream of the highest priority while prompts run beside the decodes (LILY_DECODE_PRIORITY=0:
# the default stream, as the prefill's)
DECODE_PRIORITY = os.environ.get("LILY_DECODE_PRIORITY", "1") != "0"


class PendingPrefill:
    """A prompt piece queued on the prefill stream: `ready()` without waiting, `result()` its output (the
    caller's stream ordered after the piece), `settle()` that ordering alone (its state may be reused)."""

    def __init__(self, out, event: torch.cuda.Event | None = None, device=None):
        self._out, self._event, self._device = out, event, device

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def settle(self) -> None:
        """Order the current stream after the piece: what it queues next (a reset of the state, a copy of
        the logits) runs after the piece has."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None

    def result(self):
        self.settle()
        return self._out


class PrefillStream:
    """Runs prompt pieces on a stream of their own on a CUDA device (made on first use); elsewhere in place."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None

    @contextlib.contextmanager
    def engine_stream(self):
        """The engine thread's work (decode steps, the states' resets and copies) on a stream of the device's
        highest priority, ordered after what the current stream holds (the weights, the warm-up), while inside;
        elsewhere (no CUDA, DECODE_PRIORITY off) the current stream."""
        if self.device.type != "cuda" or not DECODE_PRIORITY:
            yield
            return
        urgent = torch.cuda.Stream(self.device, priority=-8)   # (clamped to the device's highest)
        urgent.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(urgent):
            yield
        torch.cuda.current_stream(self.device).wait_stream(urgent)

    def launch(self, run) -> PendingPrefill:
        """Queue run() (a prefill: its kernels and the tensor it returns) and return without waiting."""
        if self.device.type != "cuda":
            return PendingPrefill(run())
        main = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream
        side.wait_stream(main)   # the state's reset, restore or previous piece, queued on the decode stream
        with torch.cuda.stream(side):
            out = run()
            event = torch.cuda.Event()
            event.record(side)
        if isinstance(out, torch.Tensor):
            out.record_stream(main)   # made on the prefill stream, read on the decode stream: not reused before
        return PendingPrefill(out, event, self.device)
