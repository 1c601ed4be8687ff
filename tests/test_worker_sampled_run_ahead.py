"""Sampled streams run ahead in the engine worker (lily/engine/worker.py) where the backend draws on the device
(`samples_on_device`: lily.kernels.sample's race, keyed by the request's seed and the token's index): a lone
stream and a batch of them queue their next step before reading the current one, as greedy streams do. On the
reference backend (CPU); the oracle is each request run alone (`generate`, which never runs ahead and draws on
the host through lily.engine.sampling), token for token with the same seed. The order of the worker's calls is
recorded, never timed.
"""

from __future__ import annotations

import random

import pytest
from helpers_batching import Engine, solo
from test_worker_batch_run_ahead import BatchAheadRecorder, held_start
from test_worker_run_ahead import AheadEngine, greedy

from lily.config import TINY
from lily.engine.reference_backend import ReferenceBackend
from lily.engine.sampling import SamplingParams
from lily.synthetic import random_weights


@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(100_000)), "cpu")


class SampledAheadRecorder(BatchAheadRecorder):
    """The BatchAheadRecorder over a backend whose launched steps draw: each launch's picks are logged too."""
    samples_on_device = True

    def __init__(self, inner):
        super().__init__(inner)
        self.picks: list = []

    def launch_greedy(self, state, token=None, after=None, pick=None):
        self.picks.append([pick])
        self._gate()
        self.launches += 1
        step = self.inner.launch_greedy(state, token, after, pick=pick)
        self.calls.append(("launch", 1))
        self.log.append(("launch", self.launches, "after" if after is not None else "token"))
        return self._launched(step, ("read", self.launches))

    def launch_batch_greedy(self, states, tokens=None, after=None, picks=None):
        self.picks.append(picks)
        self._gate()
        self.batch_launches += 1
        n = self.batch_launches
        step = self.inner.launch_batch_greedy(states, tokens, after, picks=picks)
        self.calls.append(("decode", len(states)))
        self.log.append(("batch", n, len(states), "after" if after is not None else "tokens"))
        return self._launched(step, ("batch_read", n))


class SampledEngine(AheadEngine):
    """An Engine over a SampledAheadRecorder (its log also takes each stream's events)."""

    def __init__(self, backend, **kw):
        Engine.__init__(self, backend, recorder=SampledAheadRecorder, **kw)


def sampled(n_prompt: int, max_tokens: int, seed: int | None = None, **knobs) -> object:
    knobs.setdefault("temperature", random.choice([0.7, 1.0, 1.3]))
    return greedy(n_prompt, max_tokens, sampling=SamplingParams(
        seed=random.randrange(2**63) if seed is None else seed, **knobs))


def test_a_lone_sampled_stream_runs_ahead_with_its_solo_tokens(backend):
    """A seeded stream with top-k / top-p / min-p: every decode step after the first is queued on the previous
    step's draw still on the device, before that draw is read; its tokens are the solo run's (host draws), and
    the same without running ahead."""
    req = sampled(random.randrange(3, 9), random.randrange(8, 14), top_k=random.choice([0, 5, 40]),
                  top_p=random.choice([1.0, 0.9]), min_p=random.choice([0.0, 0.05]))
    want = solo(backend, req)
    for ahead in (True, False):
        with SampledEngine(backend, run_ahead=ahead) as eng:
            run = eng.submit(req).wait()
            log = eng.rec.log
        assert run.tokens == want.tokens and run.finished.finish_reason == "length"
        launches = [e for e in log if e[0] == "launch"]
        if not ahead:
            assert not launches
            continue
        n = req.max_tokens
        assert [e[1:] for e in launches] == [(1, "token")] + [(i, "after") for i in range(2, n)]
        for c in range(2, n):
            assert log.index(("launch", c, "after")) < log.index(("read", c - 1)), (c, log)


def test_sampled_and_greedy_streams_run_ahead_together(backend):
    """Three seeded sampled streams (different knobs) and a greedy one decode together: batched steps run ahead
    on the rows' draws, each row's pick its own; every stream gets its solo tokens."""
    reqs = [sampled(random.randrange(3, 9), 12), sampled(random.randrange(3, 9), 10, top_k=7),
            sampled(random.randrange(3, 9), 12, top_p=0.8, min_p=0.02), greedy(random.randrange(3, 9), 9)]
    with SampledEngine(backend) as eng:
        runs = held_start(eng, reqs)
        log = eng.rec.log
    for run, req in zip(runs, reqs):
        assert run.tokens == solo(backend, req).tokens
    ahead = [e for e in log if e[0] == "batch" and e[3] == "after"]
    assert any(e[2] == 4 for e in ahead), log
    for e in ahead:
        assert log.index(e) < log.index(("batch_read", e[1] - 1)), (e, log)


def test_host_drawn_rows_step_from_the_host_with_the_same_tokens(backend):
    """A row the device cannot draw for (log-probabilities, a penalty) keeps the batch stepping from the host's
    tokens; the other rows' draws still come from one pick over the batch, and all get their solo tokens."""
    reqs = [sampled(random.randrange(3, 9), 8), sampled(random.randrange(3, 9), 8, logprobs=True, top_logprobs=2),
            sampled(random.randrange(3, 9), 8, presence_penalty=0.7)]
    with SampledEngine(backend) as eng:
        runs = held_start(eng, reqs)
    assert eng.rec.batch_launches == 0 and 3 in eng.rec.decode_sizes()
    for run, req in zip(runs, reqs):
        want = solo(backend, req)
        assert run.tokens == want.tokens and run.logprobs == want.logprobs


def test_unseeded_streams_differ_and_a_stop_string_ends_one(backend):
    """Two unseeded streams of one prompt draw differently (each its own random seed); a seeded one that ends on
    a stop string (its step ahead dropped) has the solo run's text and hands its state back once."""
    prompt = [random.randrange(TINY.vocab_size) for _ in range(6)]
    a, b = greedy(0, 24, sampling=SamplingParams(temperature=1.5)), greedy(0, 24, sampling=SamplingParams(temperature=1.5))
    a.prompt_ids, b.prompt_ids = list(prompt), list(prompt)
    with SampledEngine(backend) as eng:
        ra, rb = held_start(eng, [a, b])
    assert ra.tokens != rb.tokens and len(ra.tokens) == len(rb.tokens) == 24
    c = sampled(0, 24, temperature=1.5)
    c.prompt_ids = list(prompt)
    text = solo(backend, c).text
    at = random.randrange(2, len(text) - 3)
    c.stop = [text[at:at + 2]]
    with SampledEngine(backend) as eng:
        (rc,) = held_start(eng, [c])
        releases = sum(1 for k in eng.rec.calls if k[0] == "release")
        launched = eng.rec.launches
    want = solo(backend, c)
    assert want.finished.finish_reason == "stop" == rc.finished.finish_reason
    assert rc.text == want.text and rc.tokens == want.tokens and releases == 1
    assert launched > want.finished.decode_steps   # a step past the stop was queued (and dropped)
