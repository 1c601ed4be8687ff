"""A lone greedy stream runs ahead in the engine worker (lily/engine/worker.py): the next step is queued
before the current one is read back and its token's host work done, on the reference backend (CPU). The
oracle is the same request run alone (`generate`, which never runs ahead); the order of the worker's calls
against the stream's events is recorded, never timed.
"""

from __future__ import annotations

import random

import pytest
from helpers_batching import Engine, Recorder, Run, solo

from lily.config import TINY
from lily.engine.generation import Delta, Failed, GenerationRequest
from lily.engine.prefix_cache import PrefixCache
from lily.engine.reference_backend import ReferenceBackend
from lily.engine.sampling import SamplingParams
from lily.synthetic import random_weights


@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(100_000)), "cpu")


def greedy(n_prompt: int, max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[random.randrange(TINY.vocab_size) for _ in range(n_prompt)],
                             max_tokens=max_tokens, sampling=kw.pop("sampling", SamplingParams(temperature=0.0)),
                             **kw)


class AheadRecorder(Recorder):
    """The Recorder with launch_greedy: each launch is logged as ("launch", n) (n counts launches from 1,
    "after" when its input is the previous step's pick on the device), each read of a launched step's token
    as ("read", n), and decode hooks run after launch n. `log` also takes the streams' events (Run.on_event)
    in the order they happen."""

    def __init__(self, inner, nan_at: int | None = None):
        super().__init__(inner)
        self.log: list[tuple] = []
        self.launches = 0
        self.nan_at = nan_at

    def launch_greedy(self, state, token=None, after=None):
        self._gate()
        self.launches += 1
        step = self.inner.launch_greedy(state, token, after)
        if self.launches == self.nan_at:
            step._host[1] = 0    # this step's logits reported non-finite
        self.calls.append(("launch", 1))
        self.log.append(("launch", self.launches, "after" if after is not None else "token"))
        return self._launched(step, ("read", self.launches))

    def _launched(self, step, read: tuple):
        """A launched step: its reads logged as `read`; it counts as a decode step (hooks run after it)."""
        result = step.result
        step.result = lambda: self.log.append(read) or result()
        self.steps += 1
        for fn in self.after_decode.pop(self.steps, []):
            fn()
        return step


class AheadEngine(Engine):
    """An Engine over an AheadRecorder, whose log also takes each submitted stream's events."""

    def __init__(self, backend, nan_at: int | None = None, **kw):
        super().__init__(backend, recorder=lambda b: AheadRecorder(b, nan_at), **kw)

    def submit(self, request: GenerationRequest) -> Run:
        run = Run(request)
        run.on_event = lambda r, ev: self.rec.log.append(("event", type(ev).__name__, len(r.tokens)))
        self.worker.submit(request, run.emit)
        return run


def test_next_step_is_queued_before_the_token_is_streamed(backend):
    """With run_ahead, decode step n + 1 (input: step n's pick on the device) is launched before the text of
    step n's token reaches the stream; without, after it. Same tokens either way, the solo run's."""
    n = random.randrange(6, 12)
    req = greedy(random.randrange(3, 12), n)
    want = solo(backend, req)
    for ahead in (True, False):
        with AheadEngine(backend, run_ahead=ahead) as eng:
            run = eng.submit(req).wait()
            log = eng.rec.log
        assert run.tokens == want.tokens and run.finished.finish_reason == "length"
        assert run.finished.decode_steps == want.finished.decode_steps == n - 1 and run.finished.decode_s > 0
        if not ahead:
            assert eng.rec.launches == 0 and eng.rec.decode_sizes() == [1] * (n - 1)
            continue
        # token 1 comes from the prompt; decode step i yields token i + 1; the last token needs no step after it
        launches = [e for e in log if e[0] == "launch"]
        assert [e[1:] for e in launches] == [(1, "token")] + [(i, "after") for i in range(2, n)]
        for c in range(2, n):   # the event that streams token c comes after step c was launched
            emitted = next(i for i, e in enumerate(log) if e[:2] == ("event", "Delta") and e[2] >= c)
            assert log.index(("launch", c, "after")) < emitted, (c, log)
            # and step c was queued before step c - 1 was read: the GPU always has the next step waiting
            assert log.index(("launch", c, "after")) < log.index(("read", c - 1)), (c, log)


def test_stop_string_drops_the_step_ahead_and_the_next_request_is_unharmed(backend):
    """A stream that ends on a stop string had one step launched past it (dropped with its state): its
    output is the solo run's, and requests after it on the same engine too."""
    base = greedy(random.randrange(3, 9), 24)
    full = solo(backend, base)
    stop_at = random.randrange(2, len(full.text) - 3)
    req = greedy(0, 24, stop=[full.text[stop_at:stop_at + 2]])
    req.prompt_ids = list(base.prompt_ids)
    later = [greedy(random.randrange(3, 9), random.randrange(4, 9)) for _ in range(2)]
    with AheadEngine(backend) as eng:
        run = eng.submit(req).wait()
        runs = [eng.submit(r).wait() for r in later]
        releases = sum(1 for c in eng.rec.calls if c[0] == "release")
    want = solo(backend, req)
    assert run.finished.finish_reason == "stop" == want.finished.finish_reason
    assert run.text == want.text and run.tokens == want.tokens
    assert eng.rec.launches > want.finished.decode_steps   # a step past the stop was launched
    for r, q in zip(runs, later):
        assert r.tokens == solo(backend, q).tokens
    assert releases == 3   # every state handed back once


def test_a_request_joining_a_stream_that_runs_ahead(backend):
    """B arrives while A runs ahead alone: A's step ahead is taken as its step, then both decode together
    (no step ahead while two run); both get their solo tokens."""
    a, b = greedy(random.randrange(3, 9), 14), greedy(random.randrange(3, 9), 5)
    with AheadEngine(backend) as eng:
        runs = {}
        eng.rec.on_step(3, lambda: runs.__setitem__("b", eng.submit(b)))
        run_a = eng.submit(a).wait()
        run_b = runs["b"].wait()
        sizes = eng.rec.decode_sizes()
    assert run_a.tokens == solo(backend, a).tokens and run_b.tokens == solo(backend, b).tokens
    assert 2 in sizes   # they decoded together through decode_batch
    assert eng.rec.launches > 3   # A ran ahead before B came and after B left


def test_cancel_while_a_step_is_ahead(backend):
    """A is cancelled from its own stream after 3 tokens (a step is then in flight): it ends cancelled with
    those tokens, its state goes back once and, being a token past its output, is not cached; the next
    request gets its solo tokens."""
    a, c = greedy(random.randrange(3, 9), 20, cache_output=True), greedy(random.randrange(3, 9), 6)

    def cancel_at_three(run, ev):
        if len(run.tokens) == 3:
            run.request.cancelled.set()
    cache = PrefixCache(16, 1 << 30, backend.clone_state, backend.state_nbytes)
    with AheadEngine(backend, cache=cache) as eng:
        run_a = Run(a)
        run_a.on_event = cancel_at_three
        eng.worker.submit(a, run_a.emit)
        run_a.wait()
        run_c = eng.submit(c).wait()
        releases = sum(1 for k in eng.rec.calls if k[0] == "release")
    assert run_a.finished.finish_reason == "cancelled" and run_a.tokens == solo(backend, a).tokens[:3]
    n = len(a.prompt_ids)
    assert eng.rec.launches >= 3
    assert not any(len(key) > n and list(key[:n]) == a.prompt_ids for key in cache._entries)
    assert run_c.tokens == solo(backend, c).tokens and releases == 2


def test_what_does_not_run_ahead(backend):
    """Sampling, log-probabilities, and a stream with stop strings whose end state is cached (cache_output
    with a prefix cache) decode step by step: no launch_greedy; their output is the solo run's. Without stop
    strings such a stream runs ahead, never past its last token, and its cached end state continues a
    longer prompt exactly as a fresh prefill does."""
    reqs = [greedy(5, 6, sampling=SamplingParams(temperature=0.8, seed=random.randrange(1000))),
            greedy(5, 6, sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2))]
    with AheadEngine(backend) as eng:
        runs = [eng.submit(r).wait() for r in reqs]
    assert eng.rec.launches == 0
    for run, req in zip(runs, reqs):
        assert run.tokens == solo(backend, req).tokens
    new_cache = lambda: PrefixCache(16, 1 << 30, backend.clone_state, backend.state_nbytes)  # noqa: E731
    with_stop = greedy(5, 6, cache_output=True, stop=["@@"])
    with AheadEngine(backend, cache=new_cache()) as eng:
        run = eng.submit(with_stop).wait()
    assert eng.rec.launches == 0 and run.tokens == solo(backend, with_stop).tokens
    plain = greedy(5, 6, cache_output=True)
    cache = new_cache()
    with AheadEngine(backend, cache=cache) as eng:
        run = eng.submit(plain).wait()
        assert eng.rec.launches == 5 and run.tokens == solo(backend, plain).tokens
        assert tuple(plain.prompt_ids + run.tokens[:-1]) in cache   # its end state, as fed
        follow = greedy(0, 5)
        follow.prompt_ids = plain.prompt_ids + run.tokens + [random.randrange(TINY.vocab_size)]
        again = eng.submit(follow).wait()
    assert again.started.cached_tokens == len(plain.prompt_ids) + 5
    assert again.tokens == solo(backend, follow).tokens


def test_non_finite_step_ahead_fails_only_that_request(backend):
    """A step whose logits come back non-finite (the 3rd launch) ends that request with an error; the step
    queued after it before it was read (the 4th) is dropped, and none follows; the engine serves the next
    request normally."""
    a, b = greedy(random.randrange(3, 9), 10), greedy(random.randrange(3, 9), 5)
    with AheadEngine(backend, nan_at=3) as eng:
        run_a = eng.submit(a).wait()
        launches_a = eng.rec.launches
        run_b = eng.submit(b).wait()
    assert isinstance(run_a.events[-1], Failed) and run_a.finished is None
    assert run_a.tokens == solo(backend, a).tokens[:3]   # the prompt's token and steps 1, 2
    assert launches_a == 4
    assert run_b.tokens == solo(backend, b).tokens and any(isinstance(e, Delta) for e in run_b.events)


def test_stop_token_drops_the_step_queued_past_it(backend):
    """A stream that ends on a stop token id had the step after it queued before the token was read: that
    step is dropped with the state (handed back once), the output is the solo run's, and the next request
    on the engine gets its solo tokens."""
    for _ in range(20):   # a token met first after a decode step, before the last two (greedy may repeat one)
        base = greedy(random.randrange(3, 9), 16)
        full = solo(backend, base)
        firsts = [t for i, t in enumerate(full.tokens[1:-2], 1) if full.tokens.index(t) == i]
        if firsts:
            break
    assert firsts, "20 prompts, each greedy output one repeated token"
    stop_id = random.choice(firsts)
    req = greedy(0, 16, stop_token_ids=frozenset({stop_id}))
    req.prompt_ids = list(base.prompt_ids)
    later = greedy(random.randrange(3, 9), random.randrange(4, 9))
    with AheadEngine(backend) as eng:
        run = eng.submit(req).wait()
        launches = eng.rec.launches
        run_later = eng.submit(later).wait()
        releases = sum(1 for c in eng.rec.calls if c[0] == "release")
    want = solo(backend, req)
    assert run.finished.finish_reason == "stop" == want.finished.finish_reason
    assert run.tokens == want.tokens == full.tokens[:full.tokens.index(stop_id)]
    assert launches == want.finished.decode_steps + 1   # the step past the stop token, queued and dropped
    assert run_later.tokens == solo(backend, later).tokens and releases == 2
