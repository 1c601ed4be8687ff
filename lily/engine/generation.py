"""A generation request, the events it emits, stop-string matching, and `generate`: one request run alone
(lily.engine.sequence holds the per-request logic it shares with the worker's batched step loop).

Events go to an `emit` callback (the worker forwards them to the HTTP side):
  Started   once, after prefill (how many prompt tokens came from the prefix cache; the prompt's own
            log-probabilities when the request asked for them)
  Delta     text that is final (no stop string can still start inside it), with the tokens behind it
  Finished  once, last: why it stopped and the token counts and timings
  Failed    instead of Finished: a fault (status 500), or the request's own doing (400, a RequestError)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lily.engine.prefix_cache import PrefixCache
from lily.engine.sampling import SampledToken, SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str | StopString] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # the stop tokens cannot be drawn, nor stop strings end it, before this many tokens
    cache_key: str | None = None
    # prefix-cache snapshots: after these prompt positions (e.g. the end of the last chat turn, which a
    # follow-up request repeats), after the whole prompt, and after prompt + output
    snapshot_at: tuple[int, ...] = ()
    cache_prompt: bool = True
    cache_output: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    request_id: str = ""
    # the prompt's log-probabilities (each token given the ones before it) with this many alternatives;
    # None: not wanted. They need every position's logits, so such a request does not start from the cache.
    prompt_logprobs: int | None = None
    # structured output: a grammar the output must follow (lily.engine.constraints.ConstraintSpec)
    constraint: object | None = None


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list[SampledToken] | None = None  # prompt tokens 1 .. T-1 (the first has none)


@dataclass
class Delta:
    text: str
    tokens: list[SampledToken]


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    queue_s: float = 0.0                   # from submission to its start (a state taken)
    first_token_s: float | None = None     # from submission to its first text, or None (no text)


@dataclass
class Failed:
    message: str
    status: int = 500          # 400: the request's own doing (a RequestError), naming `param`; 500: a fault
    param: str | None = None


@dataclass(frozen=True)
class StopString:
    """A stop string looked for only where it applies: not inside a `skip` region of the output (open, close tags:
    a tool call's block, whose text is the call's arguments, not the answer's), and only once `after` is in the
    output (the end of the reasoning). A plain str stop applies everywhere and is left out of the output."""
    text: str
    skip: tuple[str, str] | None = None
    after: str | None = None
    keep: bool = False  # the output keeps the stop string itself (a closing tag the output's reader needs)


class StopMatcher:
    """Finds stop strings in streamed text, including ones split across tokens; holds back only the
    tail that could still be the start of a stop string."""

    def __init__(self, stops: list[str | StopString]):
        self.stops = [s if isinstance(s, StopString) else StopString(s) for s in stops]
        self.stops = [s for s in self.stops if s.text]
        self._pending = ""
        # every text pushed, kept only where a stop has a scope to look back at; in pieces, joined when a scope is
        # read (at a candidate hit, rare), not copied at every push
        self._scoped = any(s.skip is not None or s.after is not None for s in self.stops)
        self._pieces: list[str] = []
        self._length = 0

    def _seen(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _applies(self, stop: StopString, at: int) -> bool:
        """Whether `stop` found at absolute position `at` of the output is in its scope."""
        if stop.after is None and stop.skip is None:
            return True
        seen = self._seen()
        if stop.after is not None and seen.find(stop.after, 0, at) < 0:
            return False
        if stop.skip is not None:
            opened, closed = (seen.rfind(tag, 0, at) for tag in stop.skip)
            return opened < 0 or closed > opened
        return True

    def _first_hit(self, stop: StopString, start: int) -> int:
        """The first position of `stop` in the pending text from `start` that is in its scope, or -1."""
        base = self._length - len(self._pending)
        i = self._pending.find(stop.text, start)
        while i >= 0 and not self._applies(stop, base + i):
            i = self._pending.find(stop.text, i + 1)
        return i

    def push(self, text: str, check: bool = True) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit; text from it on is dropped). check=False (before
        min_tokens): no stop string ends in `text`, and a later push matches only one that ends in its own text,
        as vLLM looks for stop strings in each token's new text only once min_tokens are out."""
        if not self.stops:
            return text, False
        old = len(self._pending)
        self._pending += text
        self._length += len(text)
        if self._scoped:
            self._pieces.append(text)
        hits = [(i, s) for i, s in ((self._first_hit(s, max(0, old - len(s.text) + 1)), s) for s in self.stops)
                if i >= 0] if check else []
        if hits:
            i, stop = min(hits, key=lambda h: h[0])
            out = self._pending[:i + (len(stop.text) if stop.keep else 0)]
            self._pending = ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s.text) - 1, len(self._pending)), keep, -1):
                if self._pending.endswith(s.text[:n]):
                    keep = n
                    break
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or Inf: this request's state is corrupt, so it ends and none of it is cached."""


def non_finite(request: GenerationRequest, where: str) -> NonFiniteLogits:
    return NonFiniteLogits(f"request {request.request_id or '?'}: non-finite logits (NaN/Inf) after {where}")


def check_finite(logits: torch.Tensor, request: GenerationRequest, where: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise non_finite(request, where)


def generate(backend, tokenizer, request: GenerationRequest, emit: Callable[[object], None],
             prefix_cache: PrefixCache | None = None) -> Finished:
    """Run one request alone, start to finish (the worker runs many at once through the same Sequence). If it
    fails (NonFiniteLogits or any error) the prefix-cache snapshots it added are dropped again and the error
    propagates; however it ends, its state goes back to the backend (release_state)."""
    from lily.engine.sequence import Sequence, Status

    seq = Sequence(request, emit, tokenizer, prefix_cache)
    seq.start(backend)
    try:
        while seq.status is Status.PREFILL:
            seq.prefill_step(backend)
        while seq.status is Status.DECODE:
            t0 = time.perf_counter()
            logits = backend.decode(seq.next_token, seq.state)
            seq.prepare_mask()  # while the device runs the step
            seq.decoded(logits, time.perf_counter() - t0)
        return seq.done
    except BaseException:
        seq.abort()
        raise
    finally:
        seq.release(backend)
