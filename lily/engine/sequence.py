"""One generation in flight: its request, the state it owns, and how its logits become text.

A Sequence moves WAITING -> PREFILL -> DECODE -> DONE. The engine (the worker's step loop, or
`lily.engine.generation.generate` for a lone request) drives it:
  start(backend, cache)          take a state: a cached prefix restored into one, or an empty one
  prefill_step(backend, limit)   run the next piece of the prompt (at most `limit` tokens, never past a
                                 snapshot position); after the last piece: Started, the first token
                                 (= prefill_launch, then prefill_finish: a driver may keep decoding others
                                 between the two while the piece runs, prefill_ready() polls it)
  prepare_mask()                 with a grammar (request.constraint): the next token's mask, computed on
                                 the CPU while the device runs the decode step
  decoded(logits, seconds)       the logits of the decode step that fed `next_token`: the next token
  cancel() / abort()             end early (cancelled: Finished; a fault: snapshots dropped, no event)
  release(backend)               hand the state back (exactly once, however it ended)
Prefill pieces run on the backend here; decode steps are run by the driver (for many sequences at once),
so one sequence alone and sixteen in a batch go through the same sampling, stop and caching code.
"""

from __future__ import annotations

import enum
import time

import torch

from lily.engine.generation import (Delta, Finished, GenerationRequest, StopMatcher, Started, check_finite,
                                    non_finite)
from lily.engine.prefix_cache import PrefixCache
from lily.engine.request_error import RequestError
from lily.engine.sampling import NoTokenLeft, SampledToken, Sampler
from lily.model.prefill_stream import PendingPrefill

PROMPT_SCORING_PIECE = 256  # positions whose logits [piece, V] fp32 exist at once (256 MB at the real vocab)


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Sequence:
    def __init__(self, request: GenerationRequest, emit, tokenizer, prefix_cache: PrefixCache | None = None):
        self.request = request
        self.emit = emit
        self.tokenizer = tokenizer
        self.cache = prefix_cache
        self.status = Status.WAITING
        self.state = None
        self.cached = 0
        self.next_token: int | None = None  # the token the next decode step feeds
        self.done: Finished | None = None
        self._added: list[tuple[int, ...]] = []  # snapshots this sequence put in the cache
        self._released = False
        self._in_flight = None   # (PendingPrefill, piece, end) of a prompt piece launched, its logits not taken
        self.ahead = False  # the driver queued a step past the last token (its state is one token further)
        self._submitted = time.perf_counter()   # (the log line's queue and first-text times count from here)
        self._first_token_s: float | None = None

    # -- start -----------------------------------------------------------------------------------
    def start(self, backend) -> None:
        """Take a state: the backend's copy of the best cached prefix (restore_state: the fast backend copies
        it into a slot that keeps its decode graph), or an empty one. Backends without restore_state run on
        the cache's private copy itself. A prompt-scoring request needs every position's logits, so it
        never starts from the cache."""
        req = self.request
        snapshot = self._hit_logits = None
        if self.cache is not None and req.prompt_logprobs is None:
            self.cached, snapshot, self._hit_logits = self.cache.lookup(req.prompt_ids, req.cache_key)
        if snapshot is None:
            self.cached, self.state = 0, backend.new_state()
        else:
            restore = getattr(backend, "restore_state", None)
            self.state = restore(snapshot) if restore is not None else snapshot
        prompt = req.prompt_ids
        self._cursor = self.cached
        self._cuts = sorted({p for p in req.snapshot_at if self.cached < p < len(prompt)}) \
            if self.cache is not None and req.prompt_logprobs is None else []
        self._scored: list[SampledToken] | None = [] if req.prompt_logprobs is not None else None
        self._prev_row = None  # scoring: the logits of the position before the next piece
        self._t0 = time.perf_counter()
        self.status = Status.PREFILL

    # -- prefill ---------------------------------------------------------------------------------
    def prefill_step(self, backend, limit: int | None = None) -> None:
        """Run the next prompt piece: up to `limit` tokens (None: no limit), ending at the next snapshot
        position, and at most PROMPT_SCORING_PIECE positions when every position's logits are kept."""
        self.prefill_launch(backend, limit)
        self.prefill_finish()

    def prefill_launch(self, backend, limit: int | None = None, overlap: bool = False) -> None:
        """Start the next prompt piece (prefill_step's); prefill_finish() takes its logits. overlap: through the
        backend's launch_prefill where it has one (the piece queued beside the decode steps, prefill_ready()
        tells when it has run), unless every position's logits are kept; otherwise it runs here."""
        prompt = self.request.prompt_ids
        end = len(prompt)
        for cut in self._cuts:
            if cut > self._cursor:
                end = cut
                break
        if self._scored is not None:
            end = min(end, self._cursor + PROMPT_SCORING_PIECE)
        if limit is not None:
            end = min(end, self._cursor + max(1, limit))
        piece = prompt[self._cursor:end]
        launch = getattr(backend, "launch_prefill", None) if overlap and self._scored is None else None
        if not piece:   # the whole prompt came from the cache, with the logits after it
            pending, self._hit_logits = PendingPrefill(self._hit_logits), None
        elif launch is not None:
            pending = launch(piece, self.state)
        else:
            pending = PendingPrefill(backend.prefill_logits(piece, self.state) if self._scored is not None
                                     else backend.prefill(piece, self.state))
        self._in_flight = (pending, piece, end)

    @property
    def prefill_in_flight(self) -> bool:
        """A piece was launched and its logits not yet taken."""
        return self._in_flight is not None

    def prefill_ready(self) -> bool:
        """The piece in flight has run (prefill_finish will not wait)."""
        return self._in_flight is not None and self._in_flight[0].ready()

    def prefill_finish(self) -> None:
        """Take the launched piece's logits: the prompt's next snapshot, or after its last piece Started and the
        first token."""
        pending, piece, end = self._in_flight
        self._in_flight = None
        out = pending.result()
        if self._scored is not None:
            check_finite(out, self.request, f"prefill to position {end}")
            self._score(piece, out)
            logits = out[-1]
        else:
            logits = out
            check_finite(logits, self.request, f"prefill to position {end}")
        self._cursor = end
        prompt = self.request.prompt_ids
        if end < len(prompt):
            if end in self._cuts:
                self._snapshot(prompt[:end])
            return
        if self.request.cache_prompt:
            self._snapshot(list(prompt), logits)
        self._begin_output(logits)

    def _score(self, piece: list[int], rows: torch.Tensor) -> None:
        """Each prompt token's log-probability given the tokens before it, and the top alternatives."""
        k = self.request.prompt_logprobs
        prev = self._prev_row
        before = rows[:-1] if prev is None else torch.cat([prev[None], rows[:-1]])
        logp = torch.log_softmax(before.float(), -1)
        targets = torch.as_tensor(piece[1:] if prev is None else piece, device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        tops = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k > 0 else None
        for j, (t, lp) in enumerate(zip(targets.tolist(), chosen)):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else None
            self._scored.append(SampledToken(token=t, logprob=lp, top=top))
        self._prev_row = rows[-1]

    def _begin_output(self, logits: torch.Tensor) -> None:
        req = self.request
        self.prefill_s = time.perf_counter() - self._t0
        self.emit(Started(len(req.prompt_ids), self.cached, self._scored))
        self.sampler = Sampler(req.sampling, logits.shape[-1], logits.device, req.prompt_ids)
        self.constraint = req.constraint.start(logits.device, req.stop_token_ids) if req.constraint is not None else None
        self.detok = self.tokenizer.detokenizer()
        self.stopper = StopMatcher(req.stop)
        self.fed = list(req.prompt_ids)
        self.n_out = self.steps = 0
        self.decode_s = 0.0
        self.stop_hit = False
        self._pending: list[SampledToken] = []
        if req.max_tokens <= 0:  # the prompt only (scoring it, with prompt_logprobs)
            self._finish("length")
            return
        self.status = Status.DECODE
        self._take(logits)

    # -- decode ----------------------------------------------------------------------------------
    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the raw logits (a batch can pick it for all such rows at once)."""
        return self.sampler.plain_greedy and self.picks_on_device

    @property
    def picks_on_device(self) -> bool:
        """Its next token is the device's pick from the raw logits (the argmax, or a draw: `row_sampling`), so
        a batch picks it with the others' in one launch, and a step may be queued on it before it is read."""
        return (self.sampler.picks_on_device and self.constraint is None
                and not (self.n_out < self.request.min_tokens and self.request.stop_token_ids))

    def row_sampling(self, ahead: int = 0):
        """Its next pick for the device (lily.kernels.sample.RowSampling); ahead: tokens picked but not yet read."""
        return self.sampler.row_sampling(ahead)

    def prepare_mask(self) -> None:
        """With a grammar: compute the next token's mask now (the driver calls this after launching the
        decode step and before reading its result, so the CPU work overlaps the device's)."""
        if self.status is Status.DECODE and self.constraint is not None:
            self.constraint.prepare()

    def decoded(self, logits: torch.Tensor | None, seconds: float, finite: bool | None = None,
                picked: int | None = None) -> None:
        """The logits [V] after feeding next_token (one step of `seconds`); `finite` and `picked` (the device's
        pick, for a sequence that picks_on_device) when the driver computed them for the whole batch at once.
        A step queued ahead (lily.model.greedy_step) gives no logits: finite and picked only."""
        self.decode_s += seconds
        if finite is False:
            raise non_finite(self.request, f"decode step {self.steps + 1}")
        if finite is None:
            check_finite(logits, self.request, f"decode step {self.steps + 1}")
        self.steps += 1
        self.fed.append(self.next_token)
        self._take(logits, picked)

    def _take(self, logits: torch.Tensor, picked: int | None = None) -> None:
        """Choose the next token from `logits` and emit what became final; finish on a stop or the limit."""
        req = self.request
        if req.cancelled.is_set():
            self._finish("cancelled")
            return
        if picked is not None and self.picks_on_device:
            tok = self.sampler.chosen(picked)
        else:
            held = self.n_out < req.min_tokens and bool(req.stop_token_ids)
            if held:
                logits = logits.clone()
                logits[list(req.stop_token_ids)] = float("-inf")
            try:
                tok = self.sampler.sample(logits, self.constraint.allowed() if self.constraint is not None else None,
                                          banned=held)
            except NoTokenLeft:
                raise self._nothing_left(held) from None
        if tok.token in req.stop_token_ids:
            self._finish("stop")
            return
        if self.constraint is not None:  # before its text goes out: a token the grammar engine refuses is not sent
            self.constraint.accept(tok.token)
        self.n_out += 1
        self._pending.append(tok)
        text, hit = self.stopper.push(self.detok.add(tok.token), check=self.n_out >= req.min_tokens)
        if text or hit:
            self._emit_delta(text)
            self._pending = []
        if hit:
            self.stop_hit = True
            self._finish("stop")
            return
        if self.constraint is not None and self.constraint.finished:
            self._finish("stop")  # the grammar is complete: only an end-of-text token could follow
            return
        if self.n_out >= req.max_tokens:
            self._finish("length")
            return
        self.next_token = tok.token

    def _nothing_left(self, held: bool) -> RequestError:
        """The request's own masks left no token to draw: a RequestError naming the field to change."""
        req = self.request
        at = f"at output token {self.n_out + 1}"
        grammar = self.constraint is not None and self.constraint.active
        if req.sampling.allowed_token_ids is not None:
            why = [w for w, on in ((f"the {self.constraint.spec.param} grammar" if grammar else "", grammar),
                                   ("the stop tokens, held back until min_tokens", held),
                                   ("the stop tokens, held back until the answer after the thinking",
                                    self.constraint is not None and not self.constraint.active)) if on]
            return RequestError(f"allowed_token_ids: none of the allowed tokens can be drawn {at}"
                                + (f" (banned there by {' and '.join(why)})" if why else ""), param="allowed_token_ids")
        if held:
            return RequestError(f"min_tokens: {at} only a token that ends the generation can be drawn"
                                + (f" (the {self.constraint.spec.param} grammar is complete)" if grammar else "")
                                + "; lower min_tokens", param="min_tokens")
        param = self.constraint.spec.param if self.constraint is not None else None
        return RequestError(f"{param + ': ' if param else ''}no token can be drawn {at}", param=param)

    # -- the end ---------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Its client left (or the server is stopping): end now with what it has."""
        if self.status is Status.DECODE:
            self._finish("cancelled")
        elif self.status is not Status.DONE:  # nothing was generated
            self.status = Status.DONE
            self.done = Finished("cancelled", len(self.request.prompt_ids), 0, self.cached, 0.0, 0.0, 0)
            self.emit(self.done)

    def _emit_delta(self, text: str) -> None:
        """Stream `text` with the tokens pending since the last Delta (the first text's time noted)."""
        if text and self._first_token_s is None:
            self._first_token_s = time.perf_counter() - self._submitted
        self.emit(Delta(text, self._pending))

    def _finish(self, reason: str) -> None:
        if not self.stop_hit:  # release what was held back: an incomplete character, a partial stop string
            tail, hit = self.stopper.push(self.detok.flush(), check=self.n_out >= self.request.min_tokens)
            if not hit:
                tail += self.stopper.flush()
            if tail or self._pending:
                self._emit_delta(tail)
        if (self.cache is not None and self.request.cache_output and len(self.fed) > len(self.request.prompt_ids)
                and not self.ahead):
            self._snapshot(self.fed)
        self.status = Status.DONE
        self.done = Finished(reason, len(self.request.prompt_ids), self.n_out, self.cached, self.prefill_s,
                             self.decode_s, self.steps, self._t0 - self._submitted, self._first_token_s)
        self.emit(self.done)

    def abort(self) -> None:
        """It failed (NonFiniteLogits or any error): drop the snapshots it added, since a state that went
        bad after a snapshot may already have been bad at it. The caller tells the client."""
        if self.cache is not None:
            for tokens in self._added:
                self.cache.discard(tokens)
        self._added = []
        self.status = Status.DONE

    def release(self, backend) -> None:
        """Hand the state back to the backend (release_state), once."""
        if self.state is None or self._released:
            return
        self._released = True
        if self._in_flight is not None:   # a piece still running on the state: whatever reuses it comes after
            self._in_flight[0].settle()
            self._in_flight = None
        release = getattr(backend, "release_state", None)
        if release is not None:
            release(self.state)

    def _snapshot(self, tokens: list[int], logits: torch.Tensor | None = None) -> None:
        if self.cache is None:
            return
        new = tuple(tokens) not in self.cache
        if self.cache.insert(tokens, self.state, self.request.cache_key, logits) and new:
            self._added.append(tuple(tokens))
