"""One request, start to finish, on a backend: reuse a cached prefix, prefill, then sample and decode
until a stop condition, emitting text as it becomes final.

Events go to an `emit` callback (the worker forwards them to the HTTP side):
  Started   once, after prefill (how many prompt tokens came from the prefix cache; the prompt's own
            log-probabilities when the request asked for them)
  Delta     text that is final (no stop string can still start inside it), with the tokens behind it
  Finished  once, last: why it stopped and the token counts and timings
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lily.engine.prefix_cache import PrefixCache
from lily.engine.sampling import SampledToken, Sampler, SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # the stop tokens cannot be drawn before this many tokens (stop strings still end it)
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


@dataclass
class Failed:
    message: str


class StopMatcher:
    """Finds stop strings in streamed text, including ones split across tokens; holds back only the
    tail that could still be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit; text from it on is dropped)."""
        if not self.stops:
            return text, False
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self._pending[:min(hits)]
            self._pending = ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._pending)), keep, -1):
                if self._pending.endswith(s[:n]):
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


def check_finite(logits: torch.Tensor, request: GenerationRequest, where: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(f"request {request.request_id or '?'}: non-finite logits (NaN/Inf) after {where}")


def generate(backend, tokenizer, request: GenerationRequest, emit: Callable[[object], None],
             prefix_cache: PrefixCache | None = None) -> Finished:
    """Run one request. If it fails (NonFiniteLogits or any error) the prefix-cache snapshots it added
    are dropped again: a state that went bad after a snapshot may already have been bad at it. However
    it ends (finished, failed, cancelled), its state goes back to the backend (release_state)."""
    added: list[tuple[int, ...]] = []
    cached, state = _acquire_state(backend, request, prefix_cache)
    try:
        return _generate(backend, tokenizer, request, emit, prefix_cache, added, cached, state)
    except BaseException:
        for tokens in added:
            prefix_cache.discard(tokens)
        raise
    finally:
        release = getattr(backend, "release_state", None)
        if release is not None:
            release(state)


def _acquire_state(backend, request: GenerationRequest, prefix_cache: PrefixCache | None) -> tuple[int, object]:
    """(prompt tokens already in it, the state to run on): the backend's copy of the best cached prefix
    (restore_state: the fast backend copies it into a pooled state that keeps its decode graph), or an
    empty state. Backends without restore_state run on the cache's private copy itself."""
    cached, snapshot = (0, None)
    if prefix_cache is not None and request.prompt_logprobs is None:
        cached, snapshot = prefix_cache.lookup(request.prompt_ids, request.cache_key)
    if snapshot is None:
        return 0, backend.new_state()
    restore = getattr(backend, "restore_state", None)
    return cached, (restore(snapshot) if restore is not None else snapshot)


PROMPT_SCORING_PIECE = 256  # positions whose logits [piece, V] fp32 exist at once (256 MB at the real vocab)


def _prefill_scoring(backend, request: GenerationRequest, state) -> tuple[torch.Tensor, list[SampledToken]]:
    """Prefill the whole prompt from an empty state, in pieces, keeping each prompt token's log-probability
    given the tokens before it, and the top alternatives. (last position's logits, the prompt's tokens 1..)"""
    prompt, k = request.prompt_ids, request.prompt_logprobs
    scored: list[SampledToken] = []
    prev = None  # the logits of the position before this piece
    for s in range(0, len(prompt), PROMPT_SCORING_PIECE):
        piece = prompt[s:s + PROMPT_SCORING_PIECE]
        rows = backend.prefill_logits(piece, state)
        check_finite(rows, request, f"prefill to position {s + len(piece)}")
        before = rows[:-1] if prev is None else torch.cat([prev[None], rows[:-1]])
        logp = torch.log_softmax(before.float(), -1)
        targets = torch.as_tensor(piece[1:] if prev is None else piece, device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        tops = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k > 0 else None
        for j, (t, lp) in enumerate(zip(targets.tolist(), chosen)):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else None
            scored.append(SampledToken(token=t, logprob=lp, top=top))
        prev = rows[-1]
    return prev, scored


def _snapshot(cache: PrefixCache, tokens: list[int], state, key: str | None, added: list) -> None:
    new = tuple(tokens) not in cache
    if cache.insert(tokens, state, key) and new:
        added.append(tuple(tokens))


def _generate(backend, tokenizer, request: GenerationRequest, emit: Callable[[object], None],
              prefix_cache: PrefixCache | None, added: list, cached: int, state) -> Finished:
    prompt = request.prompt_ids
    cuts = sorted({p for p in request.snapshot_at if cached < p < len(prompt)}) if prefix_cache is not None else []
    t0 = time.perf_counter()
    start, scored = cached, None
    if request.prompt_logprobs is not None:  # every position's logits: the whole prompt, in pieces
        logits, scored = _prefill_scoring(backend, request, state)
        cuts = []
    for cut in cuts + ([len(prompt)] if scored is None else []):
        logits = backend.prefill(prompt[start:cut], state)
        check_finite(logits, request, f"prefill to position {cut}")
        start = cut
        if prefix_cache is not None and cut < len(prompt):
            _snapshot(prefix_cache, prompt[:cut], state, request.cache_key, added)
    if prefix_cache is not None and request.cache_prompt:
        _snapshot(prefix_cache, list(prompt), state, request.cache_key, added)
    prefill_s = time.perf_counter() - t0
    fed = list(prompt)
    emit(Started(len(prompt), cached, scored))

    sampler = Sampler(request.sampling, logits.shape[-1], logits.device, prompt)
    detok = tokenizer.detokenizer()
    stopper = StopMatcher(request.stop)
    finish, n_out, steps, decode_s, stop_hit = "length", 0, 0, 0.0, False
    pending_tokens: list[SampledToken] = []
    while request.max_tokens > 0:  # 0: the prompt only (scoring it, with prompt_logprobs)
        if request.cancelled.is_set():
            finish = "cancelled"
            break
        if n_out < request.min_tokens and request.stop_token_ids:
            logits = logits.clone()
            logits[list(request.stop_token_ids)] = float("-inf")
        tok = sampler.sample(logits)
        if tok.token in request.stop_token_ids:
            finish = "stop"
            break
        n_out += 1
        pending_tokens.append(tok)
        text, hit = stopper.push(detok.add(tok.token))
        if text or hit:
            emit(Delta(text, pending_tokens))
            pending_tokens = []
        if hit:
            finish, stop_hit = "stop", True
            break
        if n_out >= request.max_tokens:
            break
        t1 = time.perf_counter()
        logits = backend.decode(tok.token, state)
        decode_s += time.perf_counter() - t1
        check_finite(logits, request, f"decode step {steps + 1}")
        steps += 1
        fed.append(tok.token)
    if not stop_hit:  # release what was held back: an incomplete character, a partial stop string
        tail, hit = stopper.push(detok.flush())
        if not hit:
            tail += stopper.flush()
        if tail or pending_tokens:
            emit(Delta(tail, pending_tokens))
    if prefix_cache is not None and request.cache_output and len(fed) > len(prompt):
        _snapshot(prefix_cache, fed, state, request.cache_key, added)
    done = Finished(finish, len(prompt), n_out, cached, prefill_s, decode_s, steps)
    emit(done)
    return done
