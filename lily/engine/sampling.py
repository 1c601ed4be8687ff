"""Choosing the next token from fp32 logits, with torch ops on the logits' own device.

Order (as in vLLM / transformers): logit_bias and penalties on the raw logits, then temperature, then the top-k,
top-p and min-p filters, then a draw from a per-request seeded torch.Generator. temperature 0 is
greedy. Logprobs are reported from the model's own distribution (log-softmax of the raw logits),
so they do not depend on the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lily.engine.constraints import apply_token_bitmask


GREEDY_BELOW = 1e-5  # temperatures this small are argmax in all but name
LIMIT = 1e30         # finite bound for scaled scores
SORT_WINDOW = 1024   # tokens sorted first when filtering; widened only if the kept set reaches its end


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

    @property
    def plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits and nothing else is reported (a batch picks it for all
        such rows in one reduction)."""
        return (self.params.greedy and not self.params.logprobs and self._bias is None and self._seen is None
                and self._output_counts is None)

    def chosen(self, token: int) -> SampledToken:
        """The token a plain_greedy sampler would pick, chosen outside it (a batch's argmax)."""
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
        return logits

    def sample(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> SampledToken:
        """The next token; `allowed` (a grammar's token bitmask, lily.engine.constraints) bans the tokens
        whose bit is 0 before the pick. Logprobs stay those of the raw logits."""
        logits = logits.float()
        vocab = logits.shape[-1]
        p = self.params
        scores = self._penalised(logits)
        if allowed is not None:
            scores = apply_token_bitmask(scores, allowed)
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            # a tiny temperature or penalty must not overflow into inf (softmax would give nan)
            token = self._draw((scores / p.temperature).clamp_(-LIMIT, LIMIT))
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
        """A draw from softmax(scores) restricted by top-k, top-p and min-p.

        Each filter keeps a prefix of the tokens sorted by probability (top-p by the mass above a
        token, min-p by its ratio to the best), so only that prefix is ever sorted: a window of the
        best tokens, widened until the kept prefix ends inside it. No full-vocabulary sort per step.
        """
        p, vocab = self.params, scores.shape[-1]
        allowed = p.top_k if 0 < p.top_k < vocab else vocab
        if allowed == vocab and p.top_p >= 1.0 and p.min_p <= 0.0:
            return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=self.generator))
        lse = torch.logsumexp(torch.topk(scores, allowed).values if allowed < vocab else scores, -1)
        window = min(allowed, SORT_WINDOW)
        while True:
            vals, idx = torch.topk(scores, window)          # best first
            probs = torch.exp(vals - lse)                     # normalised over the top-k set
            keep = (torch.cumsum(probs, -1) - probs < p.top_p) & (probs >= p.min_p * probs[0])
            keep[0] = True  # the best token always stays (a tiny top_p rounds to 0 in fp32)
            if window == allowed or not bool(keep[-1]):
                break
            window = min(allowed, window * 8)
        return int(idx[torch.multinomial(probs * keep, 1, generator=self.generator)])

    def _count(self, token: int) -> None:
        if self._output_counts is not None:
            self._output_counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
