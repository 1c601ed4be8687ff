"""A stand-in for a model backend in server tests: the state is the list of tokens fed so far, and a
subclass says what logits that history gives (`_logits`)."""

from __future__ import annotations

import torch


class HistoryBackend:
    device = torch.device("cpu")

    def _logits(self, history: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def new_state(self):
        return []

    def prefill(self, ids, s):
        s.extend(ids)
        return self._logits(s)

    def decode(self, t, s):
        s.append(t)
        return self._logits(s)

    def clone_state(self, s):
        return list(s)

    def state_nbytes(self, s):
        return 8 * len(s) + 64


class RandomLogitsBackend(HistoryBackend):
    """Fresh random logits every step, seeded by the whole history (so runs are reproducible)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def _logits(self, s):
        g = torch.Generator().manual_seed((hash(tuple(s)) + self.seed) % 2 ** 31)
        return torch.randn(self.vocab, generator=g) * 3


class FixedLogitsBackend(HistoryBackend):
    """The same logits every step (drawn once by the test: the oracle of a sampled token is their log_softmax)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def _logits(self, history):
        return self.logits.clone()
