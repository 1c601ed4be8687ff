"""The fast backend's slot pool: a request's state is a slot, and the slot (with the decode graph captured
against it) is reused by the next request, reset to the empty sequence; a lone request gets the lowest free
slot, so it keeps slot 0 and its graph; a prefix-cache hit is copied into a slot; however a request ends, its
slot comes back. Tiny FastModel under TRITON_INTERPRET=1 on the CPU, with graph capture simulated by a
recorder that replays eagerly (and counts captures).
"""

from __future__ import annotations

import random

import pytest
import torch

from lily.config import TINY
from lily.engine.fast_backend import FastBackend, copy_state_into
from lily.engine.generation import Finished, GenerationRequest, Started, generate
from lily.engine.prefix_cache import PrefixCache
from lily.engine.sampling import SamplingParams
from lily.model.reference import ReferenceModel
from lily.synthetic import random_weights

from helpers_routing import (PREFILL_LIMIT, PREFILL_MEDIAN_LIMIT, assert_logits_close, fast_decode_routing,
                             fast_prefill_routing, reference_router)

MAX_SEQ = 64


from helpers_detok import ByteTok  # noqa: E402,F401


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=random.randrange(10_000))


def graphed_backend(weights, max_batch=2) -> FastBackend:
    """The graph path on the CPU: `_record` returns a replayer of the step and counts the captures."""
    b = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, use_graph=True, max_batch=max_batch)
    b.captures = 0

    def record(step):
        b.captures += 1
        return type("Replay", (), {"replay": staticmethod(step)})()
    b.model._record = record
    return b


def rand_ids(n):
    return [random.randrange(TINY.vocab_size) for _ in range(n)]


def run(backend, prompt, n, cache=None, **kw):
    """Greedy generation through the engine: its tokens, each step's log-probabilities of the whole
    vocabulary (its logits, up to a constant) [n, V], and the Finished event."""
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=TINY.vocab_size)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=sampling, **kw)
    events = []
    done = generate(backend, ByteTok(), req, events.append, cache)
    picked = [t for e in events if hasattr(e, "tokens") for t in e.tokens]
    logprobs = torch.empty(len(picked), TINY.vocab_size)
    for i, t in enumerate(picked):
        ids, values = zip(*t.top)
        logprobs[i, list(ids)] = torch.tensor(values)
    return [t.token for t in picked], logprobs, done


_eager: dict[int, FastBackend] = {}


def check_against_reference(weights, prompt, fed_before=()) -> None:
    """The prompt's logits, every position, are the fp32 ReferenceModel's fed the same tokens (after the
    same prefix), within the prefill kernels' limit: the kernels' state is right, not only the engine's
    bookkeeping of it. On an eager backend of the same weights, its routing following the reference's at
    near-ties (helpers_routing), so the graph capture's extra steps do not shift what it follows."""
    if id(weights) not in _eager:
        _eager[id(weights)] = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, use_graph=False)
    be = _eager[id(weights)]
    ref = ReferenceModel(TINY, weights)
    st, rs = be.model.new_state(MAX_SEQ), ref.new_state()
    with pytest.MonkeyPatch.context() as mp:
        def feed(ids, following, step):  # the reference, then the backend following its routing
            with reference_router(ref) as ref_calls:
                ref.forward(ids, rs)
            with following(mp, ref_calls, TINY):
                step()
        if fed_before:
            earlier, decoded = fed_before
            feed(earlier, fast_prefill_routing, lambda: be.prefill(earlier, st))
            for t in decoded:
                feed([t], fast_decode_routing, lambda t=t: be.decode(t, st))
        with reference_router(ref) as ref_calls:
            want = ref.forward(prompt, rs, logits_for="all")
        with fast_prefill_routing(mp, ref_calls, TINY):
            rows = be.prefill_logits(prompt, st)
    assert_logits_close(rows, want, PREFILL_LIMIT, "the prompt's logits against the reference", PREFILL_MEDIAN_LIMIT)


def fresh_greedy(backend, weights, prompt, n, fed_before=()):
    """The oracle: greedy tokens from a newly allocated state (never pooled), argmax on the host, and each
    step's log-probabilities [n, V]. With fed_before (prompt, decoded tokens), the state first takes the
    same steps a cached prefix took, so the arithmetic is the same one the engine ran and the tokens must
    be equal (the logits too), not merely close. And the prompt's logits are checked against the
    reference model (check_against_reference): a wrong prefill fails even where engine and oracle agree."""
    check_against_reference(weights, prompt, fed_before)
    st = backend.model.new_state(MAX_SEQ)
    if fed_before:
        earlier, decoded = fed_before
        backend.prefill(earlier, st)
        for t in decoded:
            backend.decode(t, st)
    logits = [backend.prefill(prompt, st)]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits.append(backend.decode(out[-1], st))
        out.append(int(logits[-1].argmax()))
    return out, torch.log_softmax(torch.stack(logits).float(), -1)


def same_run(engine, oracle) -> bool:
    """The engine's tokens and log-probabilities (every token's) are the oracle's."""
    (tokens, logprobs, _), (want_tokens, want_logprobs) = engine, oracle
    return tokens == want_tokens and torch.allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)


def test_back_to_back_requests_reuse_one_state_and_graph_and_match_fresh_states(weights):
    b = graphed_backend(weights)
    cache = PrefixCache(8, 1 << 30, b.clone_state, b.state_nbytes)   # (room for every snapshot below)
    first_prompt = rand_ids(6)
    first, _, done = run(b, first_prompt, 2, cache)
    assert done.finish_reason == "length" and len(first) == 2 and b.captures == 1
    assert b.pool.free == b.pool.n_slots
    pooled = b.pool.states[0]
    assert pooled.graph is not None and pooled.pos == 0 and int(pooled.pos_dev) == 0
    assert not pooled.rec_state.any() and not pooled.conv_state.any()
    # rows past pos are never read: poison them all (the reset leaves the KV cache as it was)
    pooled.k_cache.fill_(float("nan"))
    pooled.v_cache.fill_(float("nan"))

    # a new prompt on the recycled state: same tokens as a fresh state, no second capture
    second_prompt = rand_ids(5)
    second = run(b, second_prompt, 2, cache)
    assert second[2].cached_tokens == 0
    assert b.captures == 1 and b.pool.free == b.pool.n_slots
    assert same_run(second, fresh_greedy(b, weights, second_prompt, 2))   # (the oracle's own state captures its graph)

    # a follow-up that extends the first request (prompt + output): a prefix-cache hit, copied into the
    # pooled state; the cache's entry is not touched; same tokens as a fresh state
    follow = first_prompt + first[:1] + rand_ids(2)
    entry = cache._entries[tuple(first_prompt + first[:1])].state
    assert entry.k_cache.shape[1] == entry.pos == len(first_prompt) + 1   # compact: only the rows in use
    before = {n: getattr(entry, n).clone() for n in ("k_cache", "v_cache", "conv_state", "rec_state")}
    captures = b.captures
    third = run(b, follow, 2, cache)
    assert third[2].cached_tokens == len(first_prompt) + 1
    assert b.captures == captures and b.pool.free == b.pool.n_slots
    assert all(torch.equal(getattr(entry, n), t) for n, t in before.items())
    # (prefill of 6, a decode step, then prefill of 2 differs from one prefill of 9 in its rounding)
    assert same_run(third, fresh_greedy(b, weights, follow[len(first_prompt) + 1:], 2, (first_prompt, first[:1])))

    # the second prompt sent again: its snapshot kept the logits after it, so no prompt token runs (the whole
    # prompt cached) and the tokens and log-probabilities are the fresh state's
    captures = b.captures
    again = run(b, second_prompt, 2, cache)
    assert again[2].cached_tokens == len(second_prompt) and b.captures == captures
    assert b.pool.free == b.pool.n_slots
    assert same_run(again, fresh_greedy(b, weights, second_prompt, 2))


def test_a_failed_or_cancelled_request_returns_its_state(weights):
    b = graphed_backend(weights)
    st = b.new_state()
    b.release_state(st)
    real_prefill = b.prefill

    def broken_prefill(ids, state):
        state.rec_state.fill_(float("nan"))   # half-way through: the state is dirty when it fails
        state.pos = 3
        raise RuntimeError("device fault")
    b.prefill = broken_prefill
    with pytest.raises(RuntimeError, match="device fault"):
        run(b, rand_ids(4), 3)
    assert b.pool.free == b.pool.n_slots and b.new_state() is st   # back, and handed out first again
    b.release_state(st)
    assert st.pos == 0 and not st.rec_state.isnan().any() and not st.rec_state.any()

    # cancelled as soon as it started: ends "cancelled", the state is back
    b.prefill = real_prefill
    req = GenerationRequest(prompt_ids=rand_ids(3), max_tokens=4, sampling=SamplingParams(temperature=0.0))
    events = []

    def emit(e):
        events.append(e)
        if isinstance(e, Started):
            req.cancelled.set()
    done = generate(b, ByteTok(), req, emit)
    assert isinstance(events[-1], Finished) and done.finish_reason == "cancelled"
    assert b.pool.free == b.pool.n_slots and st.pos == 0


def test_slots_go_lowest_first_and_only_slots_come_back(weights):
    b = graphed_backend(weights, max_batch=3)
    states = [b.new_state() for _ in range(3)]
    assert [s.slot for s in states] == [0, 1, 2] and b.pool.free == 0
    extra = b.new_state()                                 # every slot taken: a state of its own
    assert not b.pool.owns(extra) and extra.max_seq == MAX_SEQ
    for s in states:
        s.pos = 5
        s.pos_dev.fill_(5)
        s.rec_state.normal_()
    b.release_state(states[2])
    b.release_state(states[0])
    b.release_state(states[0])                            # twice: still once in the free list
    b.release_state(extra)                                # not a slot: dropped
    assert b.pool.free == 2
    assert all(s.pos == 0 and int(s.pos_dev) == 0 and not s.rec_state.any() for s in (states[0], states[2]))
    assert states[1].pos == 5 and int(states[1].pos_dev) == 5    # a slot in use is left alone
    assert b.new_state() is states[0] and b.new_state() is states[2] and b.new_state() is not states[1]
    assert b.new_state(max_seq=8).max_seq == 8            # other sizes are always new
    # a slot's tensors are views of the pool's: the batched step and the slot's own graph see the same state
    assert states[1].rec_state.data_ptr() == b.pool.rec_state[:, 1].data_ptr()
    assert states[1].pos_dev.data_ptr() == b.pool.pos[1:].data_ptr()


def test_copy_into_a_state_copies_what_is_in_use(weights):
    b = graphed_backend(weights)
    src, dst = b.model.new_state(MAX_SEQ), b.model.new_state(MAX_SEQ)
    for s in (src, dst):
        for t in (s.k_cache, s.v_cache, s.conv_state, s.rec_state):
            t.normal_()
    src.pos = 9
    src.pos_dev.fill_(9)
    dst.graph = graph = object()
    copy_state_into(dst, src)
    assert dst.pos == 9 and int(dst.pos_dev) == 9 and dst.graph is graph
    assert torch.equal(dst.k_cache[:, :9], src.k_cache[:, :9]) and torch.equal(dst.v_cache[:, :9], src.v_cache[:, :9])
    assert torch.equal(dst.conv_state, src.conv_state) and torch.equal(dst.rec_state, src.rec_state)
    small = b.model.new_state(4)
    with pytest.raises(ValueError, match="max_seq=4"):
        copy_state_into(small, src)
    # the prefix cache's snapshot: only the rows in use, no graph; restored into a full-size pooled state
    snap = b.clone_state(src)
    assert snap.k_cache.shape[1] == snap.max_seq == 9 and snap.graph is None
    assert b.state_nbytes(snap) < b.state_nbytes(src)
    snap.rec_state.add_(1.0)                          # the snapshot is its own memory
    assert not torch.equal(snap.rec_state, src.rec_state)
    run_on = b.restore_state(snap)
    assert b.pool.owns(run_on) and not hasattr(snap, "slot")
    assert run_on.max_seq == MAX_SEQ and run_on.pos == 9 and torch.equal(run_on.rec_state, snap.rec_state)
    assert torch.equal(run_on.k_cache[:, :9], src.k_cache[:, :9])


def test_bench_rounds_reuse_an_emptied_state_with_its_graph_and_repeat_the_tokens(weights):
    """lily bench's engine: a round of the same size empties the previous round's state in place (its
    captured graph stays) and produces the fresh state's tokens; another size allocates anew."""
    from lily.bench.lily_engine import BackendEngine

    b = graphed_backend(weights)
    eng = BackendEngine(b)
    prompt = rand_ids(7)
    want, _ = fresh_greedy(b, weights, prompt, 5)
    b.captures = 0
    eng.reset(20)
    first_state = eng.state
    toks = [eng.prefill(prompt)]
    toks += eng.decode_greedy(toks[0], 4)
    assert b.captures == 1 and toks == want
    eng.reset(20)
    assert eng.state is first_state and eng.state.pos == 0 and b.captures == 1
    again = [eng.prefill(prompt)]
    again += eng.decode_greedy(again[0], 4)
    assert again == toks and b.captures == 1
    eng.reset(24)
    assert eng.state is not first_state and b.captures == 2


def test_capture_launches_the_new_graph_once_and_leaves_the_state_as_it_was(weights):
    """The first launch at capture runs a whole step on the state and undoes it: decoding after a capture
    made mid-sequence (after a prefill) matches the graph-free path exactly, logits included."""
    graphed = graphed_backend(weights)
    eager = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, use_graph=False)
    prompt = rand_ids(9)
    sg, se = graphed.model.new_state(MAX_SEQ), eager.model.new_state(MAX_SEQ)
    tg, te = int(graphed.prefill(prompt, sg).argmax()), int(eager.prefill(prompt, se).argmax())
    assert tg == te and sg.graph is None
    for _ in range(4):
        lg, le = graphed.decode(tg, sg), eager.decode(te, se)       # the first decode captures
        assert torch.equal(lg, le) and sg.pos == se.pos and int(sg.pos_dev) == int(se.pos_dev)
        tg, te = int(lg.argmax()), int(le.argmax())
    assert graphed.captures == 1
    assert torch.equal(sg.rec_state, se.rec_state) and torch.equal(sg.conv_state, se.conv_state)


def test_slots_are_sized_by_the_memory_budget(weights, monkeypatch):
    """A byte budget bounds the slot count (max_batch is the most); too small for one slot is one clear error.
    With --gpu-memory-fraction the budget is what the fraction leaves after what the GPU holds, the measured
    scratch peak of a prefill chunk (a quarter more), the batched step's logits and the reserve (CUDA faked)."""
    from lily.model.fast import FastState
    from lily.engine.sequence import PROMPT_SCORING_PIECE
    from lily.model.fast_prefill import DEFAULT_CHUNK
    from lily.model.slots import slot_nbytes

    per = slot_nbytes(TINY, MAX_SEQ)
    b = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, max_batch=16, state_bytes=3 * per + per // 2)
    assert b.max_batch == b.pool.n_slots == 3 and b.pool.nbytes() == 3 * per
    with pytest.raises(ValueError, match="lower --max-seq"):
        FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, state_bytes=per - 1)

    gib, mib = 2 ** 30, 2 ** 20
    scratch_state = FastState(TINY, DEFAULT_CHUNK, "cpu").nbytes()
    fake = {"mem_get_info": lambda *a: (6 * gib, 10 * gib), "memory_allocated": lambda *a: gib,
            "max_memory_allocated": lambda *a: gib + scratch_state + 100 * mib,
            "synchronize": lambda *a: None, "reset_peak_memory_stats": lambda *a: None, "empty_cache": lambda: None}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    measured = []   # the scratch a request can make, as the budget runs it (its peak is the faked one above)

    def prefill(ids, state, logits="last"):
        measured.append((len(ids), logits))
        return torch.randn(len(ids) if logits == "all" else 1, TINY.vocab_size)
    monkeypatch.setattr(b.model, "prefill", prefill)
    budget = b._state_budget(0.5, reserve=256 * mib, max_batch=5)
    assert measured == [(min(DEFAULT_CHUNK, MAX_SEQ), "last"), (min(PROMPT_SCORING_PIECE, MAX_SEQ), "all")]
    # where the prefill kernels do not fit the GPU (prompts through the decode step), no chunk is measured
    b.model._prefill_fits, measured[:] = False, []
    b._state_budget(0.5, reserve=256 * mib, max_batch=5)
    assert measured == [(min(PROMPT_SCORING_PIECE, MAX_SEQ), "all")]
    b.model._prefill_fits = True
    step = 2 * 8 * TINY.vocab_size * 4                     # 5 rows: the 8-row bucket's logits, and a copy
    left = 5 * gib - 4 * gib - int(1.25 * 100 * mib) - step
    assert budget == left - 256 * mib and b.prefix_cache_bytes == 256 * mib
    # a prefix cache budget that would leave no room for one sequence gives way to it
    assert b._state_budget(0.5, reserve=left, max_batch=5) == per and b.prefix_cache_bytes == left - per
    assert b._state_budget(0.3, reserve=0, max_batch=5) == 0          # less than nothing left: zero


def test_a_prefill_chunk_whose_scratch_leaves_no_slot_gives_way(weights, monkeypatch):
    """Where a full prefill chunk's scratch leaves no room for one sequence (a 24 GB card with its 19 GB of
    weights), the budget measures the next smaller chunk and keeps the largest that leaves room; the model's
    prefill then runs in chunks of that size. Where none leaves room, the smallest, and the pool's clear error.
    (CUDA faked: the scratch's peak grows with the chunk's tokens.)"""
    from lily.engine import fast_backend
    from lily.model import fast_prefill
    from lily.model.slots import slot_nbytes

    full = fast_prefill.DEFAULT_CHUNK
    assert full // 2 in fast_backend.PREFILL_CHUNKS and full // 4 in fast_backend.PREFILL_CHUNKS
    b = FastBackend(TINY, weights, device="cpu", max_seq=full, max_batch=4)
    assert b.model.prefill_chunk == full
    gib, mib = 2 ** 30, 2 ** 20
    per_token = random.randint(56, 64) * 1024           # a 16K chunk's scratch ~0.9-1 GiB, an 8K one's half
    made, measured = [], []
    fake = {"mem_get_info": lambda *a: (6 * gib, 10 * gib), "memory_allocated": lambda *a: gib,
            "max_memory_allocated": lambda *a: gib + made[-1].nbytes() + per_token * max(
                n for n, lg in measured[-2:] if lg == "last"),
            "synchronize": lambda *a: None, "reset_peak_memory_stats": lambda *a: None, "empty_cache": lambda: None}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    real_new_state = b.model.new_state

    def new_state(max_seq):
        made.append(real_new_state(max_seq))
        return made[-1]

    def prefill(ids, state, logits="last"):
        measured.append((len(ids), logits))
        return torch.randn(len(ids) if logits == "all" else 1, TINY.vocab_size)
    monkeypatch.setattr(b.model, "new_state", new_state)
    monkeypatch.setattr(b.model, "prefill", prefill)
    budget = b._state_budget(0.5, reserve=0, max_batch=4)
    lasts = [n for n, lg in measured if lg == "last"]
    assert lasts == [full, full // 2], measured       # 16K left no room; 8K did, so no smaller one was tried
    assert b.model.prefill_chunk == full // 2
    step = 2 * 4 * TINY.vocab_size * 4
    assert budget == gib - int(1.25 * per_token * (full // 2)) - step >= slot_nbytes(TINY, full)
    # no chunk leaves room (a smaller fraction): the smallest is kept, and too small a budget is the pool's error
    b.model.prefill_chunk, measured[:] = full, []
    assert b._state_budget(0.4, reserve=0, max_batch=4) == 0
    assert [n for n, lg in measured if lg == "last"] == [full, *fast_backend.PREFILL_CHUNKS]
    assert b.model.prefill_chunk == fast_backend.PREFILL_CHUNKS[-1]


def test_the_model_prefills_in_chunks_of_its_prefill_chunk(weights, monkeypatch):
    """FastModel.prefill hands its prefill_chunk to the prefill's forward, so a prompt longer than it runs in
    pieces of that many tokens (prefill_forward's chunking itself is tests/test_kernels_prefill.py's)."""
    from lily.model import fast_prefill

    b = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, use_graph=False)
    seen = []
    real = fast_prefill.prefill_forward

    def forward(*args, chunk_tokens, **kw):
        seen.append(chunk_tokens)
        return real(*args, chunk_tokens=chunk_tokens, **kw)
    monkeypatch.setattr(fast_prefill, "prefill_forward", forward)
    prompt = rand_ids(40)
    b.model.prefill(prompt, b.model.new_state(MAX_SEQ))
    b.model.prefill_chunk = random.randint(7, 19)
    st = b.model.new_state(MAX_SEQ)
    logits = b.model.prefill(prompt, st)
    assert seen == [fast_prefill.DEFAULT_CHUNK, b.model.prefill_chunk]
    assert st.pos == len(prompt) and logits.shape == (TINY.vocab_size,) and torch.isfinite(logits).all()


def test_bench_fidelity_gives_its_slots_back(weights):
    """lily.bench.fidelity's states come from the pool and go back to it (a kept slot would leave the pool's
    one slot taken for the bench's own state). Its rows stay what they were computed as after the release
    resets the state: the same path run by hand gives them exactly."""
    from lily.bench import fidelity

    b = FastBackend(TINY, weights, device="cpu", max_seq=MAX_SEQ, use_graph=False, max_batch=1)
    ids = [random.randrange(TINY.vocab_size) for _ in range(3)]
    tf = fidelity.teacher_forced_logits(b, ids)
    last = fidelity.prefill_last_logits(b, ids)
    assert b.pool.free == b.pool.n_slots == 1
    st = b.new_state()
    want = [b.prefill(ids[:1], st).reshape(-1).float().clone()]
    want += [b.decode(t, st).reshape(-1).float().clone() for t in ids[1:]]
    b.release_state(st)
    st = b.new_state()
    want_last = b.prefill(ids, st).reshape(1, -1).float().clone()
    b.release_state(st)
    assert torch.equal(tf, torch.stack(want)) and torch.equal(last, want_last)
