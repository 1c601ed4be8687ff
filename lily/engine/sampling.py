"""Choosing the next token from fp32 logits, with torch ops on the logits' own device.

Order: logit_bias and penalties on the raw logits, then temperature, then the top-k, top-p and min-p filters, then
the draw: temperature 0 is greedy. Top-p and min-p both read the softmax over the top-k set (transformers' order,
top-p before min-p; vLLM cuts by min-p first and takes top-p over what remains, which keeps fewer tokens when
both are set). The draw is lily.kernels.sample's race, keyed
by the request's seed and the token's index, so a seeded request's tokens depend on its logits only, whether the
host draws them here (the Triton kernels on CUDA, their torch reference elsewhere) or the device does inside a
decode step queued ahead (`row_sampling`). Logprobs are reported from the model's own distribution (log-softmax
of the raw logits), so they do not depend on the sampling knobs.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from lily.engine.constraints import apply_token_bitmask
from lily.kernels.sample import GREEDY_BELOW, RowSampling, draw_key, handles, sample_row_reference, sample_rows


class NoTokenLeft(RuntimeError):
    """The masks on a draw (grammar, allowed_token_ids, banned stop tokens) leave no token to draw."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0             # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit); -100 bans it
    allowed_token_ids: tuple[int, ...] | None = None  # only these can be drawn (None: any)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob), best first


class Sampler:
    """One request's sampler: its seed, the draws so far and the running token counts for the penalties."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device, prompt_ids: list[int]):
        self.params = params
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        # the draws' keys come from the seed and the draw's index (lily.kernels.sample.draw_key)
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.draws = 0
        needs_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device) if needs_counts else None
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
            for tok, bias in params.logit_bias:
                self._bias[tok] += bias
        self._banned = None  # the tokens outside allowed_token_ids
        if params.allowed_token_ids is not None:
            self._banned = torch.ones(vocab_size, dtype=torch.bool, device=self.device)
            self._banned[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=self.device)] = False
        self._seen = None
        if params.repetition_penalty != 1.0:  # applies to prompt and output tokens alike
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            if prompt_ids:
                ids = torch.tensor([i for i in prompt_ids if 0 <= i < vocab_size], dtype=torch.long, device=self.device)
                self._seen[ids] = True

    @property
    def plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits and nothing else is reported (a batch picks it for all
        such rows in one reduction)."""
        return (self.params.greedy and not self.params.logprobs and self._bias is None and self._seen is None
                and self._output_counts is None and self._banned is None)

    @property
    def picks_on_device(self) -> bool:
        """The token is a function of the raw logits and the draw's index alone (greedy, or a draw with no
        penalty, bias or log-probabilities): the device can choose it inside a step (`row_sampling`)."""
        p = self.params
        return self.plain_greedy or (not p.greedy and not p.logprobs and self._bias is None and self._seen is None
                                     and self._output_counts is None and self._banned is None
                                     and handles(p.top_k, self.vocab_size))

    def row_sampling(self, ahead: int = 0) -> RowSampling:
        """This request's next draw for lily.kernels.sample (ahead: draws not yet chosen before it)."""
        p = self.params
        if p.greedy:
            return RowSampling()
        return RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, draw_key(self.seed, self.draws + ahead))

    def chosen(self, token: int) -> SampledToken:
        """The token a picks_on_device sampler would choose, chosen outside it (the device's pick)."""
        self._count(token)
        return SampledToken(token)

    def _penalised(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self._bias is not None:
            logits = logits + self._bias
        if self._seen is not None:
            seen = logits[self._seen]
            logits = logits.clone()
            logits[self._seen] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if self._output_counts is not None:
            logits = logits - p.frequency_penalty * self._output_counts \
                - p.presence_penalty * (self._output_counts > 0).to(logits.dtype)
        if self._banned is not None:  # an exact ban, as vLLM's (a bias of -100 only makes a token unlikely)
            logits = logits.masked_fill(self._banned, float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, banned: bool = False) -> SampledToken:
        """The next token; `allowed` (a grammar's token bitmask, lily.engine.constraints) bans the tokens
        whose bit is 0 before the pick; banned: the caller set some logits to -inf. NoTokenLeft when the bans
        (those, allowed_token_ids) leave nothing to draw. Logprobs stay those of the raw logits."""
        logits = logits.float()
        vocab = logits.shape[-1]
        p = self.params
        scores = self._penalised(logits)
        if allowed is not None:
            scores = apply_token_bitmask(scores, allowed)
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            token = self._draw(scores)
        # every token banned: the argmax or the draw falls on a banned one (finite logits are checked before)
        if (banned or allowed is not None or self._banned is not None) and float(scores[token]) == float("-inf"):
            raise NoTokenLeft(f"every token is banned at draw {self.draws + 1}")
        out = SampledToken(token)
        if p.logprobs:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprob = float(logp[token])
            if p.top_logprobs > 0:
                vals, idx = torch.topk(logp, min(p.top_logprobs, vocab))
                out.top = list(zip(idx.tolist(), vals.tolist()))
        self._count(token)
        return out

    def _draw(self, scores: torch.Tensor) -> int:
        """A draw from softmax(scores / T) restricted by top-k, top-p and min-p (lily.kernels.sample)."""
        p = self.params
        pick = self.row_sampling()
        if scores.is_cuda and handles(p.top_k, scores.shape[-1]):
            return int(sample_rows(scores[None], [pick])[0])
        return sample_row_reference(scores, pick)

    def _count(self, token: int) -> None:
        self.draws += 1
        if self._output_counts is not None:
            self._output_counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
