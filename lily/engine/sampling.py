"""Choosing the next token from fp32 logits, with torch ops on the logits' own device.

Order (as in vLLM / transformers): logit_bias and penalties on the raw logits, then temperature, then the top-k,
top-p and min-p filters, then a draw from a per-request seeded torch.Generator. temperature 0 is
greedy. Logprobs are reported from the model's own distribution (log-softmax of the raw logits),
so they do not depend on the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5  # temperatures this small are argmax in all but name
LIMIT = 1e30         # finite bound for scaled scores


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
    """One request's sampler: owns its generator and the running token counts for the penalties."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device, prompt_ids: list[int]):
        self.params = params
        self.device = torch.device(device)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=self.device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()
        needs_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device) if needs_counts else None
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
            for tok, bias in params.logit_bias:
                self._bias[tok] += bias
        self._seen = None
        if params.repetition_penalty != 1.0:  # applies to prompt and output tokens alike
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            if prompt_ids:
                ids = torch.tensor([i for i in prompt_ids if 0 <= i < vocab_size], dtype=torch.long, device=self.device)
                self._seen[ids] = True

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
        return logits

    def sample(self, logits: torch.Tensor) -> SampledToken:
        logits = logits.float()
        vocab = logits.shape[-1]
        p = self.params
        scores = self._penalised(logits)
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            # extreme knobs (a tiny temperature or penalty) must not overflow into inf/nan
            scores = torch.nan_to_num(scores / p.temperature, nan=-LIMIT, posinf=LIMIT, neginf=-LIMIT).clamp(-LIMIT, LIMIT)
            if 0 < p.top_k < vocab:
                kth = torch.topk(scores, p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if p.min_p > 0.0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
                drop = before >= p.top_p
                drop[0] = False  # the best token always stays (a tiny top_p rounds to 0 in fp32)
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        out = SampledToken(token)
        if p.logprobs:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprob = float(logp[token])
            if p.top_logprobs > 0:
                vals, idx = torch.topk(logp, min(p.top_logprobs, vocab))
                out.top = list(zip(idx.tolist(), vals.tolist()))
        self._count(token)
        return out

    def _count(self, token: int) -> None:
        if self._output_counts is not None:
            self._output_counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
