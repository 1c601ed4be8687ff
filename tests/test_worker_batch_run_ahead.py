"""Plain-greedy streams decoding together run ahead in the engine worker (lily/engine/worker.py): the next
batched step, its inputs the rows' picks still on the device, is queued before the current one is read back
and its tokens' host work done. On the reference backend (CPU); the oracle is each request run alone
(`generate`, which never runs ahead); the order of the worker's calls against the streams' events is recorded,
never timed.
"""

from __future__ import annotations

import random

import pytest
from helpers_batching import Run, solo
from test_worker_run_ahead import AheadEngine, AheadRecorder, greedy

from lily.config import TINY
from lily.engine.generation import Failed
from lily.engine.prefix_cache import PrefixCache
from lily.engine.reference_backend import ReferenceBackend
from lily.engine.sampling import SamplingParams
from lily.synthetic import random_weights


@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(100_000)), "cpu")


class BatchAheadRecorder(AheadRecorder):
    """The AheadRecorder with launch_batch_greedy: each batched launch is logged as ("batch", n, rows, "after" or
    "tokens"), each read of its tokens as ("batch_read", n); it counts as a decode of its rows (calls, steps and
    hooks as decode_batch). nan_rows = {launch n: row}: that launch reports that row's logits non-finite."""

    def __init__(self, inner, nan_rows: dict | None = None):
        super().__init__(inner)
        self.batch_launches = 0
        self.nan_rows = nan_rows or {}

    def launch_batch_greedy(self, states, tokens=None, after=None):
        self._gate()
        self.batch_launches += 1
        n = self.batch_launches
        step = self.inner.launch_batch_greedy(states, tokens, after)
        if n in self.nan_rows:
            step._host[step.rows + self.nan_rows[n]] = 0
        self.calls.append(("decode", len(states)))
        self.log.append(("batch", n, len(states), "after" if after is not None else "tokens"))
        return self._launched(step, ("batch_read", n))


class BatchAheadEngine(AheadEngine):
    def __init__(self, backend, nan_rows: dict | None = None, **kw):
        super(AheadEngine, self).__init__(backend, recorder=lambda b: BatchAheadRecorder(b, nan_rows), **kw)


def held_start(eng, reqs):
    """Submit reqs while the worker is held, so they prefill one a step and then decode together."""
    eng.rec.hold()
    runs = [eng.submit(r) for r in reqs]
    eng.rec.release()
    return [r.wait() for r in runs]


def test_batched_streams_queue_their_next_step_before_reading(backend):
    """Three greedy streams of different lengths: once all decode, each batched step is queued (its inputs the
    previous step's picks) before the previous one is read, and rows leave at their length limit without a
    step past it. Every stream gets its solo tokens; each state goes back once."""
    reqs = [greedy(random.randrange(3, 10), n) for n in random.sample(range(6, 14), 3)]
    with BatchAheadEngine(backend) as eng:
        runs = held_start(eng, reqs)
        log = eng.rec.log
        releases = sum(1 for c in eng.rec.calls if c[0] == "release")
    for run, req in zip(runs, reqs):
        want = solo(backend, req)
        assert run.tokens == want.tokens and run.finished.finish_reason == "length"
        assert run.finished.decode_steps == want.finished.decode_steps and run.finished.decode_s > 0
    launches = [e for e in log if e[0] == "batch"]
    ahead = [e for e in launches if e[3] == "after"]
    assert ahead, log
    for e in ahead:   # queued before the step it follows was read
        assert log.index(e) < log.index(("batch_read", e[1] - 1)), (e, log)
    # no row is stepped past its limit: the rows of every step the backend ran add up to the solo runs' steps
    stepped = sum(n for kind, n in eng.rec.calls if kind in ("decode", "launch"))
    assert stepped == sum(r.max_tokens - 1 for r in reqs), eng.rec.calls
    assert releases == 3


def test_a_stop_and_a_non_finite_row_leave_the_others_running_ahead(backend):
    """In a batch running ahead, one row ends on a stop string (its step ahead dropped, its state handed back
    once, its output the solo run's) and a row's logits come back non-finite at the 4th batched launch (that
    request fails with what it had; the other rows go on): the rest get their solo tokens."""
    base = greedy(random.randrange(3, 9), 20)
    full = solo(backend, base)
    stop_at = random.randrange(2, len(full.text) - 3)
    stopper = greedy(0, 20, stop=[full.text[stop_at:stop_at + 2]])
    stopper.prompt_ids = list(base.prompt_ids)
    reqs = [stopper, greedy(random.randrange(3, 9), 16), greedy(random.randrange(3, 9), 16)]
    with BatchAheadEngine(backend, nan_rows={4: 1}) as eng:
        runs = held_start(eng, reqs)
        releases = sum(1 for c in eng.rec.calls if c[0] == "release")
        launches = eng.rec.batch_launches
    want = [solo(backend, r) for r in reqs]
    assert want[0].finished.finish_reason == "stop"
    failed = [i for i, run in enumerate(runs) if isinstance(run.events[-1], Failed)]
    assert len(failed) == 1 and launches >= 4 and releases == 3
    for i, (run, w) in enumerate(zip(runs, want)):
        if i in failed:
            assert run.finished is None and len(run.tokens) < len(w.tokens)
            assert run.tokens == w.tokens[:len(run.tokens)]
        else:
            assert run.tokens == w.tokens and run.text == w.text
            assert run.finished.finish_reason == w.finished.finish_reason


def test_cancel_while_a_batched_step_is_ahead(backend):
    """A row is cancelled from its own stream after 8 tokens (the batch runs ahead by then: its next batched step
    is in flight): it ends cancelled with those tokens and, a token past its output, is not cached; the other
    row goes on and gets its solo tokens."""
    a, b = greedy(random.randrange(3, 9), 20, cache_output=True), greedy(random.randrange(3, 9), 16)
    cache = PrefixCache(16, 1 << 30, backend.clone_state, backend.state_nbytes)

    def cancel_at_three(run, ev):
        if len(run.tokens) == 8:
            run.request.cancelled.set()
    with BatchAheadEngine(backend, cache=cache) as eng:
        eng.rec.hold()
        run_a = Run(a)
        run_a.on_event = cancel_at_three
        eng.worker.submit(a, run_a.emit)
        run_b = eng.submit(b)
        eng.rec.release()
        run_a.wait()
        run_b.wait()
        releases = sum(1 for k in eng.rec.calls if k[0] == "release")
    assert run_a.finished.finish_reason == "cancelled" and run_a.tokens == solo(backend, a).tokens[:8]
    assert run_b.tokens == solo(backend, b).tokens
    n = len(a.prompt_ids)
    assert not any(len(key) > n and list(key[:n]) == a.prompt_ids for key in cache._entries)
    assert eng.rec.batch_launches >= 2 and releases == 2


def test_a_request_joining_a_batch_that_runs_ahead(backend):
    """C arrives while A and B run ahead together: the step of C's prefill queues nothing ahead, the next starts
    all three from the host's tokens, and the batch runs ahead again; every stream gets its solo tokens."""
    a, b, c = greedy(random.randrange(3, 9), 16), greedy(random.randrange(3, 9), 16), greedy(random.randrange(3, 9), 6)
    with BatchAheadEngine(backend) as eng:
        late = {}
        eng.rec.on_step(5, lambda: late.__setitem__("c", eng.submit(c)))
        run_a, run_b = held_start(eng, [a, b])
        run_c = late["c"].wait()
        launches = [e for e in eng.rec.log if e[0] == "batch"]
    for run, req in ((run_a, a), (run_b, b), (run_c, c)):
        assert run.tokens == solo(backend, req).tokens
    three = [e for e in launches if e[2] == 3]
    assert three and three[0][3] == "tokens" and any(e[3] == "after" for e in three), launches


def test_a_sampled_row_keeps_the_batch_stepping_from_the_host(backend):
    """A sampled stream beside a greedy one: no batched step runs ahead while they decode together (the sampled
    row's token is chosen on the host); both get their solo tokens."""
    reqs = [greedy(5, 8), greedy(5, 8, sampling=SamplingParams(temperature=0.8, seed=random.randrange(1000)))]
    with BatchAheadEngine(backend) as eng:
        runs = held_start(eng, reqs)
    assert eng.rec.batch_launches == 0 and 2 in eng.rec.decode_sizes()
    for run, req in zip(runs, reqs):
        assert run.tokens == solo(backend, req).tokens
