"""Continuous batching in the engine worker, on the reference backend (CPU): many requests decode together
and each gets exactly the tokens it gets alone; requests join and leave between steps; a cancelled one
frees its slot at the next step; a prompt over the step's token budget prefills in pieces between the
running decodes; the queue answers full; a NaN in one sequence ends only that sequence and nothing of it
stays cached. The oracle is the same request run alone (`generate`), with the same prefill pieces where
the batch split a prompt. Everything concurrent is arranged by events (a gate in the backend, hooks
after given decode steps), never by timing.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers_batching import Engine, Run, solo

from lily.config import TINY
from lily.engine.generation import Failed, GenerationRequest
from lily.engine.prefix_cache import PrefixCache
from lily.engine.reference_backend import ReferenceBackend
from lily.engine.sampling import SamplingParams
from lily.engine.worker import QueueFullError
from lily.synthetic import random_weights



@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(100_000)), "cpu")


def prompt(n: int) -> list[int]:
    return [random.randrange(TINY.vocab_size) for _ in range(n)]


def greedy(n_prompt: int, max_tokens: int, scored: bool = False, **kw) -> GenerationRequest:
    """A greedy request; scored: it reports every token's log-probabilities of the whole vocabulary (each
    step's logits, up to a constant), so a batch's arithmetic is compared, not only its argmax."""
    scores = dict(logprobs=True, top_logprobs=TINY.vocab_size) if scored else {}
    return GenerationRequest(prompt_ids=prompt(n_prompt), max_tokens=max_tokens,
                             sampling=kw.pop("sampling", SamplingParams(temperature=0.0, **scores)), **kw)


def same_as(run: Run, want: Run, n: int | None = None) -> bool:
    """The run's first n (all) tokens and their log-probabilities are the solo run's."""
    return run.tokens[:n] == want.tokens[:n] and run.logprobs[:n] == want.logprobs[:n]


def submit_together(eng: Engine, requests: list[GenerationRequest]) -> list[Run]:
    """Submit all while the worker is held inside the first one's prefill, so none has finished before the
    last arrives."""
    eng.rec.hold()
    runs = [eng.submit(requests[0])]
    eng.rec.wait_held()
    runs += [eng.submit(r) for r in requests[1:]]
    eng.rec.release()
    return [r.wait() for r in runs]


def test_concurrent_requests_get_their_solo_tokens(backend):
    requests = [greedy(random.randrange(3, 20), random.randrange(9, 14)) for _ in range(4)]
    requests.append(greedy(7, 10, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=random.randrange(1000))))
    requests.append(greedy(5, 10, sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)))
    requests.append(greedy(6, 10, sampling=SamplingParams(temperature=0.0, presence_penalty=1.5), min_tokens=3,
                           stop_token_ids=frozenset({random.randrange(TINY.vocab_size)})))
    requests.append(greedy(8, 10, stop=[chr(65 + random.randrange(26)) + chr(65 + random.randrange(26)), "Q"]))
    requests.append(greedy(9, 0, prompt_logprobs=2))       # prompt scoring (every position's logits), no output
    with Engine(backend, max_batch=16) as eng:
        runs = submit_together(eng, requests)
        sizes = eng.rec.decode_sizes()
    assert max(sizes) >= 6, sizes  # (the scorer decodes nothing; one with a stop string may end early)
    for run, req in zip(runs, requests):
        want = solo(backend, req)
        assert run.tokens == want.tokens and run.text == want.text
        assert run.logprobs == want.logprobs
        assert run.started.prompt_logprobs == want.started.prompt_logprobs
        assert run.finished.finish_reason == want.finished.finish_reason
        assert run.finished.completion_tokens == len(run.tokens)
        assert run.finished.decode_steps == want.finished.decode_steps


def test_requests_join_and_leave_between_steps(backend):
    """A runs; B arrives after A's third step and leaves after two of its own; C arrives as B ends."""
    a, b, c = greedy(9, 14), greedy(4, 3, scored=True), greedy(12, 5)
    run_b, run_c = Run(b), Run(c)
    with Engine(backend) as eng:
        def b_ended(run, ev):
            if run.finished is not None:
                eng.worker.submit(c, run_c.emit)   # from B's own last event, on the worker thread
        run_b.on_event = b_ended
        eng.rec.on_step(3, lambda: eng.worker.submit(b, run_b.emit))
        run_a = eng.submit(a)
        for r in (run_a, run_b, run_c):
            r.wait()
        sizes = eng.rec.decode_sizes()
    # A alone, then with B (B's 2 decodes), alone for the step C prefills, then with C, then alone
    assert sizes == [1] * 4 + [2] * 2 + [1] + [2] * 4 + [1] * 2, sizes
    for run, req in ((run_a, a), (run_b, b), (run_c, c)):
        assert same_as(run, solo(backend, req))


def test_cancel_mid_batch_frees_the_slot_at_the_next_step(backend):
    a, b, c = greedy(5, 12, scored=True), greedy(6, 12, scored=True), greedy(7, 6)
    with Engine(backend, max_batch=2) as eng:
        def cancel_after_two(run, ev):
            if len(run.tokens) == 2:
                run.request.cancelled.set()
        eng.rec.hold()
        run_a = eng.submit(a)
        eng.rec.wait_held()
        run_b, run_c = Run(b), Run(c)
        run_b.on_event = cancel_after_two
        eng.worker.submit(b, run_b.emit)
        eng.worker.submit(c, run_c.emit)
        assert eng.worker.queue_depth == 2  # two slots: A holds one, B and C have not started
        eng.rec.release()
        for r in (run_a, run_b, run_c):
            r.wait()
        calls = eng.rec.calls
    assert run_b.finished.finish_reason == "cancelled" and run_b.finished.completion_tokens == 2
    assert len(run_b.tokens) == 2 and same_as(run_b, solo(backend, b), 2)
    # B's state went back before C's prefill (C waited for the slot), and C ran to completion
    releases = [i for i, (kind, _) in enumerate(calls) if kind == "release"]
    prefills = [i for i, (kind, _) in enumerate(calls) if kind == "prefill"]
    assert len(prefills) == 3 and releases[0] < prefills[2]
    for run, req in ((run_a, a), (run_c, c)):
        assert same_as(run, solo(backend, req)) and run.finished.finish_reason == "length"


def test_a_prompt_over_the_step_budget_prefills_in_pieces_between_decodes(backend):
    a, b = greedy(6, 16), greedy(30, 4, scored=True)
    with Engine(backend, step_tokens=8) as eng:
        runs = {}
        eng.rec.on_step(2, lambda: runs.__setitem__("b", eng.submit(b)))
        run_a = eng.submit(a).wait()
        runs["b"].wait()
        calls = [c for c in eng.rec.calls if c[0] != "release"]
    first_b = calls.index(("prefill", 7))
    b_prefill = [c for c in calls[first_b:] if c[0] == "prefill"]
    assert [n for _, n in b_prefill] == [7, 7, 7, 7, 2]  # 8 tokens a step, A's decode is one of them
    # A decoded between every two pieces of B: B held it back by one piece a step, never the whole prompt
    span = calls[first_b:calls.index(("prefill", 2), first_b) + 1]
    assert [c[0] for c in span] == ["prefill", "decode"] * 4 + ["prefill"]
    assert same_as(run_a, solo(backend, a))
    assert same_as(runs["b"], solo(backend, b, pieces=[7, 7, 7, 7, 2]))


def test_queue_full_while_the_slots_are_busy(backend):
    a, b, c = greedy(4, 3), greedy(4, 3, scored=True), greedy(4, 3)
    with Engine(backend, max_batch=1, max_queue=1) as eng:
        eng.rec.hold()
        run_a = eng.submit(a)
        eng.rec.wait_held()
        run_b = eng.submit(b)              # waits: the one slot is A's
        assert eng.worker.queue_depth == 1
        with pytest.raises(QueueFullError, match="queue is full"):
            eng.submit(c)
        eng.rec.release()
        run_a.wait()
        run_b.wait()
        assert eng.worker.queue_depth == 0
        assert same_as(eng.submit(c).wait(), solo(backend, c))
    assert max(eng.rec.decode_sizes()) == 1
    assert same_as(run_b, solo(backend, b))


def test_a_request_that_finds_a_free_slot_is_never_refused_by_the_queue_limit(backend):
    """--max-queue bounds the requests that wait for a slot: ones that find their slot free (they wait only for
    the prefills before them, one at a time) are always taken; it refused them once max_queue requests had not yet
    started, whatever slots were free (QA: 8 requests at once on an idle --max-batch 16 --max-queue 2 server,
    five 429s)."""
    k = random.randint(2, 4)
    reqs = [greedy(random.randint(3, 6), 3) for _ in range(k + 3)]
    with Engine(backend, max_batch=k + 1, max_queue=1) as eng:
        eng.rec.hold()
        runs = [eng.submit(reqs[0])]
        eng.rec.wait_held()                    # the first holds a slot, its prefill held
        runs += [eng.submit(r) for r in reqs[1:k + 1]]  # k more: a free slot each, none started
        assert eng.worker.queue_depth == k
        runs.append(eng.submit(reqs[k + 1]))   # every slot taken: it waits, the one request the queue holds
        with pytest.raises(QueueFullError, match="queue is full"):
            eng.submit(reqs[k + 2])
        eng.rec.release()
        for run, req in zip(runs, reqs):
            assert same_as(run.wait(), solo(backend, req))
        assert eng.worker.queue_depth == 0


def poison(state) -> None:
    """NaN into one GDN layer's recurrent state (reference or fast backend state)."""
    if hasattr(state, "rec_state"):
        state.rec_state[0].fill_(float("nan"))
    else:
        next(iter(state.recurrent.values())).fill_(float("nan"))


def cached_states_are_finite(cache: PrefixCache) -> bool:
    for entry in cache._entries.values():
        st = entry.state
        tensors = ([st.k_cache, st.v_cache, st.conv_state, st.rec_state] if hasattr(st, "rec_state") else
                   [t for d in (st.keys, st.values, st.conv, st.recurrent) for t in d.values()])
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return False
    return True


def nan_isolation(backend, max_tokens: int = 8, poison_after: int = 4, solo_equal: bool = True,
                  exact: bool = True) -> None:
    """Three requests decode together; after step `poison_after` (3 or later: all three decode in step 3) the
    middle one's state turns NaN. It fails; the others
    get exactly the tokens they get when the same three run clean (and, with solo_equal, when each runs
    alone); none of its snapshots stays in the cache and every cached state is finite."""
    requests = [greedy(5, max_tokens, scored=True), greedy(6, max_tokens), greedy(7, max_tokens)]

    def together(poisoned: bool):
        cache = PrefixCache(16, 1 << 30, backend.clone_state, backend.state_nbytes)
        with Engine(backend, cache=cache) as eng:
            runs = []

            def poison_b():
                seq = next(s for s in eng.worker.scheduler.running if s.request is runs[1].request)
                poison(seq.state)
            if poisoned:  # steps: A + B's prefill, A+B + C's prefill, then A+B+C
                eng.rec.on_step(poison_after, poison_b)
            eng.rec.hold()
            runs.append(eng.submit(requests[0]))
            eng.rec.wait_held()
            runs += [eng.submit(r) for r in requests[1:]]
            eng.rec.release()
            for r in runs:
                r.wait()
        return runs, cache

    clean, _ = together(False)
    runs, cache = together(True)
    bad = runs[1]
    assert isinstance(bad.events[-1], Failed) and bad.finished is None
    assert clean[1].finished.finish_reason == "length"
    for i in (0, 2):
        if exact:
            assert same_as(runs[i], clean[i]) and runs[i].finished.finish_reason == "length", (i, runs[i].events)
        else:  # the others still run to their length, their first token (the prefill's) the clean run's
            assert runs[i].finished.finish_reason == "length" and len(runs[i].tokens) == max_tokens, runs[i].events
            assert runs[i].tokens[0] == clean[i].tokens[0], (i, runs[i].events)
        if solo_equal:
            assert same_as(runs[i], solo(backend, requests[i]))
    assert len(cache) > 0 and cached_states_are_finite(cache)
    bad_prompt = tuple(requests[1].prompt_ids)
    assert not any(tokens[:len(bad_prompt)] == bad_prompt for tokens in cache._entries)


def test_nan_in_one_sequence_is_isolated(backend):
    nan_isolation(backend)
