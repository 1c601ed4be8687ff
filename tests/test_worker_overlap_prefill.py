"""A prompt piece runs beside the running decodes (lily/engine/worker.py, the backend's launch_prefill): the
worker launches it, keeps stepping the running streams while it is in flight, and takes its logits at the
first step after it has run. On the reference backend (CPU) behind a recorder whose launched pieces report
themselves run only after a given number of further decode steps (a count of the worker's own calls, never a
time); the oracle is each request run alone, with the same prefill pieces.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers_batching import Engine, Recorder, solo
from test_worker_batch_run_ahead import BatchAheadRecorder

from lily.config import TINY
from lily.engine.generation import Failed, GenerationRequest
from lily.engine.reference_backend import ReferenceBackend
from lily.engine.sampling import SamplingParams
from lily.synthetic import random_weights


@pytest.fixture(scope="module")
def backend():
    return ReferenceBackend(TINY, random_weights(TINY, seed=random.randrange(100_000)), "cpu")


def greedy(n_prompt: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[random.randrange(TINY.vocab_size) for _ in range(n_prompt)],
                             max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))


class PieceInFlight:
    """A launched piece: ready() once its recorder has run `steps` more decode steps (or at once with 0);
    settle() / result() are logged as ("settle", state id)."""

    def __init__(self, rec: "OverlapRecorder", out: torch.Tensor, state, steps: int):
        self.rec, self.out, self.state_id = rec, out, id(state)
        self.ready_at = rec.steps + steps

    def ready(self) -> bool:
        if self.rec.fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (a test's fault)")
        return self.rec.steps >= self.ready_at

    def settle(self) -> None:
        self.rec.calls.append(("settle", self.state_id))

    def result(self) -> torch.Tensor:
        self.settle()
        if self.rec.fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (a test's fault)")
        return self.out


class OverlapRecorder(Recorder):
    """The Recorder with launch_prefill, logged as ("launch_prefill", tokens) and, with its state's id, in
    `launched`; each piece is ready `in_flight_steps` decode steps after its launch; poison = True: its logits
    carry a NaN; fault = True: asking whether it has run, or for its logits, raises (the device failed it)."""

    in_flight_steps = 4

    def __init__(self, inner):
        super().__init__(inner)
        self.launched: list[tuple[int, int]] = []
        self.poison = self.fault = False

    def launch_prefill(self, ids, state):
        self._gate()
        out = self.inner.prefill(ids, state)
        if self.poison:
            out = out.clone()
            out[random.randrange(out.numel())] = float("nan")
        self.calls.append(("launch_prefill", len(ids)))
        self.launched.append((len(ids), id(state)))
        return PieceInFlight(self, out, state, self.in_flight_steps)


def between(calls: list, first, last) -> list:
    """The calls after `first` and before `last` (each the first such call)."""
    i = calls.index(first)
    return calls[i + 1:calls.index(last, i)]


def test_a_new_prompt_prefills_while_the_running_stream_decodes(backend):
    """A second request arrives while the first decodes: its prompt is launched beside the decodes, the first
    stream takes exactly the in-flight steps alone meanwhile, then both decode together. Both get their solo
    tokens; the launched prompt never went through the in-order prefill."""
    a, b = greedy(random.randrange(3, 6), 24), greedy(random.randrange(6, 12), 10)   # (told apart by length)
    with Engine(backend, recorder=OverlapRecorder) as eng:
        runs = {}
        eng.rec.on_step(3, lambda: runs.setdefault("b", eng.submit(b)))
        ra = eng.submit(a).wait()
        rb = runs["b"].wait()
        calls = list(eng.rec.calls)
    assert ra.tokens == solo(backend, a).tokens and rb.tokens == solo(backend, b).tokens
    assert eng.rec.launched and eng.rec.launched[0][0] == len(b.prompt_ids)
    assert ("prefill", len(a.prompt_ids)) in calls and ("prefill", len(b.prompt_ids)) not in calls
    # while b's piece was in flight: a's steps alone, exactly as many as the piece took
    meanwhile = between(calls, ("launch_prefill", len(b.prompt_ids)), ("decode", 2))
    decodes = [c for c in meanwhile if c[0] == "decode"]
    assert decodes and all(c == ("decode", 1) for c in decodes)
    assert len(decodes) == OverlapRecorder.in_flight_steps, calls
    assert rb.started is not None and rb.finished.finish_reason == "length"


def test_a_long_prompt_runs_its_pieces_beside_the_decodes(backend):
    """A prompt over the step budget: each piece is launched beside the running decodes in turn, and the
    request gets the tokens it gets alone with the same pieces."""
    budget = 8
    a = greedy(4, 40)
    b = greedy(random.randrange(17, 23), 6)
    with Engine(backend, recorder=OverlapRecorder, step_tokens=budget) as eng:
        runs = {}
        eng.rec.on_step(2, lambda: runs.setdefault("b", eng.submit(b)))
        ra = eng.submit(a).wait()
        rb = runs["b"].wait()
        pieces = [n for n, _ in eng.rec.launched]
    piece = budget - 1   # the step budget less a's one decode
    n = len(b.prompt_ids)
    assert pieces == [piece] * (n // piece) + ([n % piece] if n % piece else [])
    assert rb.tokens == solo(backend, b, pieces=pieces).tokens
    assert ra.tokens == solo(backend, a).tokens


def test_a_lone_prompt_runs_in_order(backend):
    """Nothing decodes: the prompt runs in place (no launch), as before."""
    a = greedy(random.randrange(3, 9), 5)
    with Engine(backend, recorder=OverlapRecorder) as eng:
        ra = eng.submit(a).wait()
        calls = list(eng.rec.calls)
    assert ra.tokens == solo(backend, a).tokens
    assert not eng.rec.launched and ("prefill", len(a.prompt_ids)) in calls


def test_cancelled_while_its_prompt_runs(backend):
    """The client of the request whose piece is in flight goes away: it ends cancelled without a token, its
    state goes back once and only after the piece is settled (nothing reuses the state under it), and the
    running stream goes on with its solo tokens."""
    a, b = greedy(5, 20), greedy(random.randrange(6, 12), 10)
    with Engine(backend, recorder=OverlapRecorder) as eng:
        runs = {}
        eng.rec.on_step(3, lambda: runs.setdefault("b", eng.submit(b)))
        eng.rec.on_step(5, lambda: runs["b"].request.cancelled.set())
        ra = eng.submit(a).wait()
        rb = runs["b"].wait()
        calls = list(eng.rec.calls)
    assert ra.tokens == solo(backend, a).tokens
    assert rb.finished.finish_reason == "cancelled" and rb.tokens == [] and rb.started is None
    sid = eng.rec.launched[0][1]
    assert calls.count(("release", sid)) == 1
    assert calls.index(("settle", sid)) < calls.index(("release", sid))


def test_overlap_off_runs_every_prompt_in_order(backend):
    """overlap_prefill=False (lily serve --no-overlap-prefill): a prompt arriving while another decodes runs in
    place between its steps, as before."""
    a, b = greedy(5, 16), greedy(random.randrange(6, 12), 8)
    with Engine(backend, recorder=OverlapRecorder, overlap_prefill=False) as eng:
        runs = {}
        eng.rec.on_step(3, lambda: runs.setdefault("b", eng.submit(b)))
        ra = eng.submit(a).wait()
        rb = runs["b"].wait()
        calls = list(eng.rec.calls)
    assert not eng.rec.launched and ("prefill", len(b.prompt_ids)) in calls
    assert ra.tokens == solo(backend, a).tokens and rb.tokens == solo(backend, b).tokens


@pytest.mark.parametrize("flaw", ["poison", "fault"])
def test_a_launched_prompt_that_goes_wrong_ends_that_request_only(backend, flaw):
    """The launched piece's logits hold a NaN (poison), or polling it raises (fault: the device failed it): that
    request fails with the generic message when its piece is taken, its state goes back once, the running
    stream keeps its solo tokens and the worker serves the next request."""
    a, b, c = greedy(5, 20), greedy(random.randrange(6, 12), 10), greedy(4, 6)
    with Engine(backend, recorder=OverlapRecorder) as eng:
        runs = {}

        def submit_flawed():
            setattr(eng.rec, flaw, True)
            runs["b"] = eng.submit(b)
        eng.rec.on_step(2, submit_flawed)   # (b is launched after step 3: by step 4 its piece has the flaw)
        eng.rec.on_step(4, lambda: setattr(eng.rec, flaw, False))
        ra = eng.submit(a).wait()
        rb = runs["b"].wait()
        rc = eng.submit(c).wait()
        calls = list(eng.rec.calls)
    failed = [e for e in rb.events if isinstance(e, Failed)]
    assert failed and "internal error" in failed[0].message and rb.tokens == [] and rb.started is None
    assert calls.count(("release", eng.rec.launched[0][1])) == 1
    assert ra.tokens == solo(backend, a).tokens and rc.tokens == solo(backend, c).tokens


class OverlapAheadRecorder(OverlapRecorder, BatchAheadRecorder):
    """Launched prompts, and greedy steps run ahead alone (("launch", 1) in calls) and batched (("decode", n))."""


@pytest.mark.parametrize("overlap", [True, False])
def test_a_joining_stream_steps_with_the_others(backend, overlap):
    """Greedy streams run ahead, alone or batched; a new one whose prompt has just been taken does not take
    a decode step of its own beside the steps ahead: it joins the others' next launch. Every stream gets its
    solo tokens."""
    a, a2 = greedy(5, 30), greedy(4, 30)
    b = greedy(random.randrange(6, 12), 10)
    with Engine(backend, recorder=OverlapAheadRecorder, overlap_prefill=overlap) as eng:
        runs = {}
        eng.rec.on_step(3, lambda: runs.setdefault("a2", eng.submit(a2)))   # a runs ahead alone, then a2 joins
        eng.rec.on_step(9, lambda: runs.setdefault("b", eng.submit(b)))     # a and a2 run ahead batched
        ra = eng.submit(a).wait()
        ra2, rb = runs["a2"].wait(), runs["b"].wait()
        calls = list(eng.rec.calls)
    assert ra.tokens == solo(backend, a).tokens and ra2.tokens == solo(backend, a2).tokens
    assert rb.tokens == solo(backend, b).tokens
    assert bool(eng.rec.launched) == overlap
    assert ("decode", 1) not in calls, calls   # (nobody stepped alone beside the others)
    assert ("decode", 2) in calls and ("decode", 3) in calls
