"""The engine worker: one thread owns the model and runs a step loop over the sequences in flight.

Each step (lily.engine.scheduler) decodes every running sequence together, one batched call
(`backend.decode_batch`, or one `decode` a row for backends without it), and adds at most one prefill
piece. A new request joins between steps; one that finishes, fails or is cancelled leaves at the step
that notices it and hands its state back, so the next waiting request can take its slot.

While others decode, a prompt piece is launched beside them (the backend's launch_prefill: on the GPU a
stream of its own) instead of between two of their steps: the running streams keep stepping while it runs,
and the loop takes its logits at the first step after it has run. A sequence that comes out of its prompt while
the others' step was queued ahead waits for their next step and joins its launch, rather than stepping alone.

A lone plain-greedy stream runs ahead: the step after token n (its input is token n still on the device)
is queued before token n is read back, so the GPU always has the next step waiting (it does not idle while
the host wakes from the read and launches) and token n's host work (and the HTTP side's, which shares the
interpreter) overlaps it. No step runs ahead past the length limit (known before the token); one may run
past a stop token (not known until it is read): when the stream ends on a stop token or string, or is
cancelled, the step ahead is dropped with its state, and that state, one token past the output, is not
cached (a stream with stop strings whose end state would be cached does not run ahead). Plain-greedy
streams decoding together run ahead the same way, one batched step (lily.model.greedy_step.BatchGreedyStep:
each row's pick stays on the device as its input to the next), except at a step whose prefill may bring a
new row: the next step then starts from the host's tokens, all rows together.

The model (and its GPU stream) is touched only from this thread. The HTTP side submits a request (one
generation, or several: an HTTP request's n choices or batch of prompts take one place in the queue)
with an `emit` callback for each (thread-safe, e.g. loop.call_soon_threadsafe onto an asyncio.Queue)
and sets the request's `cancelled` event when its client goes away. `--max-queue` counts requests none
of whose generations has started; more get QueueFullError (429).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from lily.engine.generation import Failed, Finished, GenerationRequest
from lily.engine.prefix_cache import PrefixCache
from lily.engine.request_error import RequestError
from lily.engine.scheduler import Scheduler
from lily.engine.sequence import Sequence, Status
from lily.model.greedy_step import pick_tokens

log = logging.getLogger("lily.engine")

DEFAULT_MAX_BATCH = 16
# A step's token budget while others decode (the decodes plus one prefill piece). H200, 4K-token prompts through
# lily serve (scripts/serve_bench.py): 2048 -> 8192 took 8 streams from 706 to 863 tok/s in all and 32 from 789
# to 1,044, TTFT p99 1.8 -> 1.0 s and 7.4 -> 4.5 s: a 4K prompt then prefills in one piece (~82 ms, held from
# the running streams once) instead of two or three smaller, slower ones with a decode step between.
DEFAULT_STEP_TOKENS = 8192


class QueueFullError(RuntimeError):
    pass


class ShuttingDownError(RuntimeError):
    """The worker is stopping: it takes no new request (the server answers 503)."""


@dataclass
class _BatchAhead:
    """A batched greedy step queued ahead: its rows' sequences, in row order, and the step."""
    seqs: list[Sequence]
    step: object   # lily.model.greedy_step.BatchGreedyStep


class _Submission:
    """One HTTP request's generations; it holds a place in the queue until the first of them starts."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.queued = True


class EngineWorker:
    def __init__(self, backend, tokenizer, max_queue: int = 64, prefix_cache: PrefixCache | None = None,
                 on_finished=None, max_batch: int = DEFAULT_MAX_BATCH, step_tokens: int = DEFAULT_STEP_TOKENS,
                 run_ahead: bool = True, overlap_prefill: bool = True):
        self.backend = backend
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.on_finished = on_finished  # callback(Finished), for metrics
        self.max_queue = max(1, max_queue)
        # as many sequences at once as the backend has states for (the fast backend's slots)
        self.max_batch = max(1, min(max_batch, getattr(backend, "max_batch", max_batch) or max_batch))
        self.scheduler = Scheduler(self.max_batch, step_tokens)
        self._cv = threading.Condition()
        self._inbox: deque[_Submission] = deque()
        self._queued = 0          # submissions not started yet (under _cv)
        self._queue: list[_Submission] = []  # those submissions, in arrival order (under _cv)
        self._held: set = set()   # every sequence handed to this worker and not yet ended (under _cv)
        self._stopping = False
        # a lone greedy stream's next step, already queued: (sequence, GreedyStep) or None
        self.run_ahead = run_ahead and getattr(backend, "launch_greedy", None) is not None
        self._ahead = None
        # greedy streams decoding together run ahead too: their next batched step, already queued, or None
        self.batch_run_ahead = run_ahead and getattr(backend, "launch_batch_greedy", None) is not None
        # sampled streams too, where a launched step's pick may be a draw (else plain-greedy ones only)
        self.samples_on_device = bool(getattr(backend, "samples_on_device", False))
        self._batch_ahead: _BatchAhead | None = None
        self._read_at = 0.0       # when a step run ahead was last read
        # a prompt piece runs beside the decodes (the backend's launch_prefill), not between their steps
        self.overlap_prefill = overlap_prefill and getattr(backend, "launch_prefill", None) is not None
        self._thread = threading.Thread(target=self._loop, name="lily-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return sum(1 for s in self.scheduler.running if s.status is not Status.DONE)

    def submit(self, request: GenerationRequest, emit) -> None:
        """Queue a request; QueueFullError when it would wait for a slot behind --max-queue others that do."""
        self.submit_all([(request, emit)])

    def submit_all(self, items: list[tuple[GenerationRequest, object]]) -> None:
        """Queue generations (they run at once when slots allow), in one place of the queue."""
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            waiting, seats = self._waiting_for_slots()
            if len(items) > seats and waiting >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting)")
            sub = _Submission([Sequence(req, emit, self.tokenizer, self.prefix_cache) for req, emit in items])
            for seq in sub.seqs:
                seq.submission = sub
            self._held.update(sub.seqs)
            self._inbox.append(sub)
            self._queue.append(sub)
            self._queued += 1
            self._cv.notify()

    def _waiting_for_slots(self) -> tuple[int, int]:
        """(Under _cv.) (the queued submissions that, in arrival order, find every slot taken, the slots left
        after the queue). One that finds its slots free only waits for the prefills before its own (one runs at
        a time): it does not count against --max-queue."""
        seats = self.max_batch - (len(self._held) - sum(len(sub.seqs) for sub in self._queue))
        waiting = 0
        for sub in self._queue:
            if len(sub.seqs) > seats:
                waiting += 1
            seats = max(0, seats - len(sub.seqs))
        return waiting, seats

    @property
    def stopping(self) -> bool:
        """Whether shutdown() has begun: a request it cancelled was not cancelled by its client."""
        return self._stopping

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel everything: what waits ends now, what runs ends at its next step (its stream still gets
        its final event); then wait for the loop to exit."""
        with self._cv:
            self._stopping = True
            pending = list(self._inbox)
            self._inbox.clear()
            for seq in self._held:
                if seq.status is not Status.DONE:  # (one that just ended is not cancelled after the fact)
                    seq.request.cancelled.set()
            self._cv.notify()
        for sub in pending:  # never seen by the loop
            for seq in sub.seqs:
                seq.cancel()
                self._ended(seq)
        self._thread.join(timeout)

    # -- the step loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not self._inbox and not sched.has_work and not self._stopping:
                    self._cv.wait()
                arrived = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for sub in arrived:
                for seq in sub.seqs:
                    sched.add(seq)
            if stopping:  # shutdown may have begun after it drained the inbox: cancel all we hold
                for seq in list(sched.waiting) + sched.running:
                    if seq.status is not Status.DONE:
                        seq.request.cancelled.set()
            self._drop_cancelled()
            if stopping and not sched.has_work:
                return
            self._poll_prefill()
            step = sched.schedule()
            pre = step.prefill
            running = pre is not None and pre.prefill_in_flight   # its piece still on the GPU
            beside = pre is not None and not running and self.overlap_prefill and bool(step.decode)
            if step.decode:
                # (a prefill run this step may bring a new row to the next one: no batched step ahead then; a
                # piece launched beside the decodes joins whenever it is done, the rows ahead read first)
                self._decode(step.decode, joining=pre is not None and not running and not beside)
            if running:
                if not step.decode:   # nothing else to run: wait for it
                    self._prefill_finish(pre)
            elif pre is not None:
                self._prefill(pre, step.prefill_limit, overlap=beside)

    def _drop_cancelled(self) -> None:
        sched = self.scheduler
        for seq in [s for s in sched.waiting if s.request.cancelled.is_set()]:
            sched.drop_waiting(seq)
            seq.cancel()
            self._ended(seq)
        for seq in sched.running:
            if seq.status is not Status.DONE and seq.request.cancelled.is_set():
                seq.cancel()
                self._ended(seq)
        sched.running = [s for s in sched.running if s.status is not Status.DONE]

    def _decode(self, seqs: list[Sequence], joining: bool = False) -> None:
        """One decode step for all of them; a fault in one row (non-finite logits) ends only that row.
        joining: a sequence may join the decodes at the next step (no batched step is queued ahead)."""
        alone = len(seqs) == 1
        ahead, self._ahead = self._ahead, None
        read_ahead = False
        if ahead is not None and ahead[0] in seqs:   # its step was queued last time: that is its step now
            seqs = [s for s in seqs if s is not ahead[0]]
            self._greedy_result(ahead[0], ahead[1], alone)
            read_ahead = True
        # (a stream that ended meanwhile, cancelled, leaves its step ahead unread: its state is released)
        batch_ahead, self._batch_ahead = self._batch_ahead, None
        if batch_ahead is not None:   # the rows it holds were queued last time: that is their step now
            seqs = self._batch_result(batch_ahead, seqs, go_on=not joining)
            read_ahead = True
        if not seqs or read_ahead:
            # (rows no step ahead held: sequences whose prompt just ended. They take their first step with the
            # others at the next step, in one launch, rather than a step of their own now)
            return
        if len(seqs) > 1 and not joining and self.batch_run_ahead and all(self._runs_ahead(s) for s in seqs):
            try:
                step = self._launch_batch(seqs, tokens=[s.next_token for s in seqs])
            except Exception:
                for seq in seqs:
                    self._fail(seq)
                return
            self._batch_result(_BatchAhead(seqs, step), seqs, go_on=True)
            return
        if alone and self._runs_ahead(seqs[0]):
            seq = seqs[0]
            try:
                step = self._launch(seq, token=seq.next_token)
            except Exception:
                self._fail(seq)
                return
            self._greedy_result(seq, step, alone=True)
            return
        batch = getattr(self.backend, "decode_batch", None)
        t0 = time.perf_counter()
        if batch is None:  # a backend without batching: one decode a row
            rows = {}
            for seq in seqs:
                try:
                    rows[seq] = self.backend.decode(seq.next_token, seq.state)
                except Exception:
                    self._fail(seq)
            seqs = [s for s in seqs if s in rows]
            if not seqs:
                return
            logits = torch.stack([rows[s] for s in seqs])
        else:
            try:
                logits = batch([s.next_token for s in seqs], [s.state for s in seqs])
            except Exception:
                for seq in seqs:
                    self._fail(seq)
                return
        # the rows the device picks for (argmax or draw) in one launch, and one read for the whole batch, not a
        # sync per row
        device = [s.picks_on_device for s in seqs]
        if any(device):
            tokens = pick_tokens(logits, [s.row_sampling() if d else None for s, d in zip(seqs, device)])
        for seq in seqs:  # grammar masks on the CPU while the device still runs the step
            seq.prepare_mask()
        if any(device):
            finite, picked = torch.stack([torch.isfinite(logits).all(-1).long(), tokens.long()]).tolist()
            picked = [t if d else None for t, d in zip(picked, device)]
        else:
            finite, picked = torch.isfinite(logits).all(-1).tolist(), [None] * len(seqs)
        seconds = time.perf_counter() - t0
        for i, seq in enumerate(seqs):
            try:
                seq.decoded(logits[i], seconds, bool(finite[i]), picked[i])
            except Exception:
                self._fail(seq)
                continue
            if seq.status is Status.DONE:
                self._ended(seq)

    def _runs_ahead(self, seq: Sequence) -> bool:
        """Whether a stream may run a step ahead: the device's pick is its token (plain greedy, or a plain draw
        where the backend draws on the device), and its end state, if cached, cannot come from a stop string
        (a step ahead would be in it)."""
        on_device = seq.picks_on_device if self.samples_on_device else seq.plain_greedy
        return (self.run_ahead and on_device
                and not (seq.cache is not None and seq.request.cache_output and seq.request.stop))

    def _launch(self, seq: Sequence, token: int | None = None, after=None):
        """Queue a lone stream's step on `token` or after a step of it not read yet (its pick the next draw)."""
        if not self.samples_on_device:
            return self.backend.launch_greedy(seq.state, token, after=after)
        return self.backend.launch_greedy(seq.state, token, after=after,
                                          pick=seq.row_sampling(ahead=0 if after is None else 1))

    def _launch_batch(self, seqs: list[Sequence], tokens: list[int] | None = None, after=None):
        """Queue a batched step of seqs on their tokens, or after = (a batched step not read yet, their rows)."""
        states = [s.state for s in seqs]
        if not self.samples_on_device:
            return self.backend.launch_batch_greedy(states, tokens, after=after)
        ahead = 0 if after is None else 1
        return self.backend.launch_batch_greedy(states, tokens, after=after,
                                                picks=[s.row_sampling(ahead) for s in seqs])

    def _greedy_result(self, seq: Sequence, step, alone: bool) -> None:
        """Read a greedy step's token, a lone stream's next step queued first if the stream may go on (by
        what is known before the token); then the token's host work."""
        seq.ahead = False
        req = seq.request
        nxt = None
        if alone and seq.n_out + 1 < req.max_tokens and not req.cancelled.is_set() and self._runs_ahead(seq):
            try:
                nxt = self._launch(seq, after=step)
            except Exception:   # (e.g. the state is full: the next step, not run ahead, reports it)
                nxt = None
        try:
            token, finite = step.result()
        except Exception:
            self._fail(seq)
            return
        now = time.perf_counter()
        # (a step queued ahead counts from when the step before it was read)
        seconds = now - max(step.launched_at, self._read_at)
        self._read_at = now
        if nxt is not None:
            seq.ahead = True   # the state is a token further than the output (until that step is read)
            if finite and token not in req.stop_token_ids:
                self._ahead = (seq, nxt)
        try:
            seq.decoded(None, seconds, finite, token)
        except Exception:
            self._ahead = None
            self._fail(seq)
            return
        if seq.status is Status.DONE:
            self._ahead = None   # (a stop: the step ahead is dropped with the state)
            self._ended(seq)

    def _batch_result(self, ahead: "_BatchAhead", seqs: list[Sequence], go_on: bool) -> list[Sequence]:
        """Read a batched greedy step's tokens for the rows of `seqs` it holds, their next step queued first
        (go_on, every row of seqs in it and at least two of them going on: input its picks on the device);
        then those tokens' host work. Returns the sequences of seqs it does not hold (still to step)."""
        index = {id(s): i for i, s in enumerate(ahead.seqs)}
        held = [s for s in seqs if id(s) in index]
        rest = [s for s in seqs if id(s) not in index]
        nxt = None
        if go_on and not rest:
            # (by what is known before the tokens: a row at its last token, or cancelled, goes no further)
            more = [s for s in held if s.n_out + 1 < s.request.max_tokens and not s.request.cancelled.is_set()
                    and self._runs_ahead(s)]
            if len(more) > 1:
                try:
                    nxt = _BatchAhead(more, self._launch_batch(more, after=(ahead.step, [index[id(s)] for s in more])))
                except Exception:   # (e.g. a state is full: the next step, not run ahead, reports it)
                    nxt = None
        try:
            tokens, finite = ahead.step.result()
        except Exception:
            for seq in held:
                self._fail(seq)
            return rest
        now = time.perf_counter()
        seconds = now - max(ahead.step.launched_at, self._read_at)
        self._read_at = now
        for seq in held:
            seq.ahead = False
        if nxt is not None:
            for seq in nxt.seqs:
                seq.ahead = True   # its state is a token further than its output (until that step is read)
            self._batch_ahead = nxt
        for seq in held:
            i = index[id(seq)]
            try:
                seq.decoded(None, seconds, finite[i], tokens[i])
            except Exception:
                self._fail(seq)
                continue
            if seq.status is Status.DONE:
                self._ended(seq)
        return rest

    def _prefill(self, seq: Sequence, limit: int | None, overlap: bool = False) -> None:
        """The sequence's next prompt piece (started first if it waits); overlap: launched beside the decodes
        (_poll_prefill takes it once it has run), else run and taken now."""
        try:
            if seq.status is Status.WAITING:
                self._started(seq)
                seq.start(self.backend)
            seq.prefill_launch(self.backend, limit, overlap=overlap)
        except Exception:
            self._fail(seq)
            return
        if overlap and not self._piece_ran(seq):
            return
        self._prefill_finish(seq)

    def _poll_prefill(self) -> None:
        """A prompt piece launched beside the decodes that has run: its sequence takes its logits (its first
        token joins the next step's decodes)."""
        for seq in self.scheduler.running:
            if seq.prefill_in_flight and self._piece_ran(seq):
                self._prefill_finish(seq)

    @staticmethod
    def _piece_ran(seq: Sequence) -> bool:
        try:
            return seq.prefill_ready()
        except Exception:   # (the device failed it: taking the piece reports the fault, for that sequence)
            return True

    def _prefill_finish(self, seq: Sequence) -> None:
        try:
            seq.prefill_finish()
        except Exception:
            self._fail(seq)
            return
        if seq.status is Status.DONE:
            self._ended(seq)

    # -- bookkeeping -------------------------------------------------------------------------------
    def _started(self, seq: Sequence) -> None:
        sub = getattr(seq, "submission", None)
        with self._cv:
            if sub is not None and sub.queued:
                sub.queued = False
                self._queued -= 1
                self._queue.remove(sub)

    def _fail(self, seq: Sequence) -> None:
        """(Called while handling the error.) The request's own doing (RequestError: its schema too complex for
        the grammar engine, its masks leaving no token): tell the client why; a real fault: log it, tell the
        client generically. Either way only this request ends, and the server keeps serving."""
        exc = sys.exc_info()[1]
        if isinstance(exc, RequestError):
            log.info("request %s failed: %s", seq.request.request_id, exc.message)
            failed = Failed(exc.message, 400, exc.param)
        else:
            log.exception("generation failed for request %s", seq.request.request_id)
            failed = Failed("internal error during generation")
        seq.abort()
        seq.emit(failed)
        self._ended(seq, report=False)

    def _ended(self, seq: Sequence, report: bool = True) -> None:
        self._started(seq)  # (a cancelled one that never started leaves the queue too)
        try:
            seq.release(self.backend)
        except Exception:
            log.exception("releasing the state of request %s failed", seq.request.request_id)
        with self._cv:
            self._held.discard(seq)
        if report and seq.done is not None:
            self._report(seq.done)

    def _report(self, done: Finished) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(done)
            except Exception:
                log.exception("metrics callback failed")
