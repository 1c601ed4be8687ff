"""Which sequences run in the next engine step.

Sequences wait in arrival order. A step decodes every running sequence together and adds at most one
prefill piece: the oldest sequence that is still prefilling continues, or, when a slot is free, the next
waiting one starts. While others decode, the piece is limited to the step's token budget (the decodes
count one token each), so a long prompt delays the running streams by at most one piece a step; with
nothing to decode it runs whole (the backend bounds its own scratch). One prefill at a time keeps the
prompts in arrival order, so a request's later choices find the prefix its first choice cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lily.engine.sequence import Sequence, Status

MIN_PIECE_SHARE = 8  # a step still takes 1/8 of its budget of prefill when the decodes alone fill it


@dataclass
class Step:
    decode: list[Sequence] = field(default_factory=list)
    prefill: Sequence | None = None  # starts it first if it is still WAITING
    prefill_limit: int | None = None  # None: the rest of its prompt

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, max_running: int, step_tokens: int):
        if max_running < 1 or step_tokens < 1:
            raise ValueError(f"max_running {max_running} and step_tokens {step_tokens} must be at least 1")
        self.max_running = max_running
        self.step_tokens = step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # each holds a state: prefilling or decoding, in start order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """The next step's work. A sequence it hands out to prefill from the waiting queue is moved to
        running (the caller starts it); sequences that are DONE are dropped first."""
        self.running = [s for s in self.running if s.status is not Status.DONE]
        decode = [s for s in self.running if s.status is Status.DECODE]
        prefill = next((s for s in self.running if s.status is not Status.DECODE), None)
        if prefill is None and self.waiting and len(self.running) < self.max_running:
            prefill = self.waiting.popleft()
            self.running.append(prefill)
        limit = None
        if decode and prefill is not None:
            limit = max(self.step_tokens // MIN_PIECE_SHARE, self.step_tokens - len(decode), 1)
        return Step(decode, prefill, limit)

    def drop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
