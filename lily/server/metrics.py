"""Server counters, exposed at GET /metrics in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import sys
import threading
from collections import Counter


def cuda_memory_bytes() -> dict[str, int] | None:
    """{"allocated": .., "reserved": ..} of the current CUDA device (torch's caching allocator: tensors
    alive, and what it holds from the driver), or None when this process has not initialised CUDA."""
    torch = sys.modules.get("torch")  # a server on the GPU has imported it; never import it just for this
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved())}


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter()          # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0            # tokens actually run through prefill (not reused)
        self.prefill_seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.last_prefill_tps = 0.0
        self.last_decode_tps = 0.0
        self.cancelled = 0
        self.client_disconnects = 0
        self.running = 0
        self.device_memory = cuda_memory_bytes  # replaceable (tests)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def count_client_disconnect(self) -> None:
        with self._lock:
            self.client_disconnects += 1

    def record_generation(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                          prefill_tokens: int, prefill_s: float, decode_tokens: int, decode_s: float,
                          cancelled: bool) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cached_tokens += cached_tokens
            self.prefill_tokens += prefill_tokens
            self.prefill_seconds += prefill_s
            self.decode_tokens += decode_tokens
            self.decode_seconds += decode_s
            if prefill_s > 0 and prefill_tokens:
                self.last_prefill_tps = prefill_tokens / prefill_s
            if decode_s > 0 and decode_tokens:
                self.last_decode_tps = decode_tokens / decode_s
            self.cancelled += int(cancelled)

    def render(self, *, queue_depth: int, cache_hits: int, cache_misses: int, cache_entries: int,
               cache_bytes: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value:.17g}" if isinstance(value, float) else f"{name}{labels} {value}")

        with self._lock:
            req = sorted(self.requests.items())
            metric("lily_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in req])
            metric("lily_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [("", self.prompt_tokens)])
            metric("lily_completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
            metric("lily_prefix_cache_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
                   [("", self.cached_tokens)])
            metric("lily_prefill_tokens_total", "counter", "Tokens run through prefill.", [("", self.prefill_tokens)])
            metric("lily_prefill_seconds_total", "counter", "Time spent in prefill.", [("", float(self.prefill_seconds))])
            metric("lily_decode_tokens_total", "counter", "Decode steps run.", [("", self.decode_tokens)])
            metric("lily_decode_seconds_total", "counter", "Time spent in decode steps.", [("", float(self.decode_seconds))])
            metric("lily_prefill_tokens_per_second", "gauge", "Prefill speed of the last request.",
                   [("", float(self.last_prefill_tps))])
            metric("lily_decode_tokens_per_second", "gauge", "Decode speed of the last request.",
                   [("", float(self.last_decode_tps))])
            metric("lily_requests_cancelled_total", "counter", "Generations stopped because the client went away.",
                   [("", self.cancelled)])
            metric("lily_client_disconnects_total", "counter",
                   "Requests whose client went away before the answer ended (their generations are cancelled).",
                   [("", self.client_disconnects)])
            metric("lily_requests_running", "gauge", "Generations running now.", [("", self.running)])
        metric("lily_queue_depth", "gauge", "Requests waiting for the engine.", [("", queue_depth)])
        metric("lily_prefix_cache_hits_total", "counter", "Prompts that reused a cached state.", [("", cache_hits)])
        metric("lily_prefix_cache_misses_total", "counter", "Prompts that found no cached prefix.", [("", cache_misses)])
        metric("lily_prefix_cache_entries", "gauge", "States held by the prefix cache.", [("", cache_entries)])
        metric("lily_prefix_cache_bytes", "gauge", "Memory held by the prefix cache.", [("", cache_bytes)])
        mem = self.device_memory()
        if mem is not None:  # absent on the CPU
            metric("lily_device_memory_allocated_bytes", "gauge", "GPU memory in live tensors (torch allocator).",
                   [("", mem["allocated"])])
            metric("lily_device_memory_reserved_bytes", "gauge",
                   "GPU memory held by the torch caching allocator (allocated + cached free blocks).",
                   [("", mem["reserved"])])
        return "\n".join(lines) + "\n"
