"""The fast backend (FastModel's decode step, all kernels) against the fp32 ReferenceModel on a tiny
random checkpoint, under TRITON_INTERPRET=1 on the CPU (no CUDA graph there; the GPU script covers it).
"""

from __future__ import annotations

import random

import pytest
import torch

from lily.config import TINY
from lily.engine.fast_backend import FastBackend
from lily.model.reference import ReferenceModel
from lily.synthetic import random_weights

from helpers_routing import (DECODE_LIMIT, PREFILL_LIMIT, PREFILL_MEDIAN_LIMIT, assert_logits_close,
                             fast_decode_routing, fast_prefill_routing, reference_router)
from helpers_tensors import assert_rows_close


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=random.randrange(10_000))


@pytest.fixture(scope="module")
def backend(weights):
    return FastBackend(TINY, weights, device="cpu", max_seq=64, prefill_mode="decode")


def test_decode_steps_match_reference(weights, backend, monkeypatch):
    """Token by token through the fused kernels, its routing following the reference's at near-ties
    (helpers_routing): every step's logits within DECODE_LIMIT of the fp32 reference, the same greedy
    token wherever it is decisive; the state advances like the reference's, row by row (every attention
    layer's K and V cache, every GDN layer's conv state and recurrent state, value head by value head)."""
    ref = ReferenceModel(TINY, weights)
    rs, fs = ref.new_state(), backend.new_state()
    ids = [random.randrange(TINY.vocab_size) for _ in range(4)]
    with reference_router(ref) as ref_calls:
        want = torch.stack([ref.forward([t], rs)[0] for t in ids])
    with fast_decode_routing(monkeypatch, ref_calls, TINY) as routing:
        got = torch.stack([backend.decode(t, fs) for t in ids])
    msg = f"near-tie expert flips followed (layer, step, margin, error): {routing.flips}"
    assert_logits_close(got, want, DECODE_LIMIT, f"decode steps, {msg}")
    assert fs.pos == rs.pos == len(ids)
    # (the caches hold bf16 rows: K after norm + RoPE, as the reference's; the recurrent state is fp32 with
    # a mean magnitude of ~0.02, so each value head's is compared, not its elements against an atol)
    for j, i in enumerate(TINY.full_attention_layers):
        assert_rows_close(fs.k_cache[j, :len(ids)], rs.keys[i], f"{msg}: K cache layer {i}", limit=DECODE_LIMIT)
        assert_rows_close(fs.v_cache[j, :len(ids)], rs.values[i], f"{msg}: V cache layer {i}", limit=DECODE_LIMIT)
    for j, i in enumerate(TINY.linear_attention_layers):
        assert_rows_close(fs.conv_state[j], rs.conv[i], f"{msg}: conv state layer {i}", limit=DECODE_LIMIT)
        assert_rows_close(fs.rec_state[j], rs.recurrent[i], f"{msg}: recurrent state layer {i}", row_dims=2,
                          limit=DECODE_LIMIT)


def test_greedy_loop_equals_stepwise_and_clone_is_independent(backend):
    """decode_greedy (token chosen on the device, fed back without the host) == argmax stepping, tokens
    and the last step's logits, from clones of one state; the clones do not share buffers."""
    st = backend.new_state()
    logits = backend.prefill([3, 250], st)
    first = int(logits.argmax())
    a, b = (backend.restore_state(backend.clone_state(st)) for _ in range(2))  # (a snapshot is restored to run on)
    assert a.k_cache.data_ptr() != b.k_cache.data_ptr()
    greedy = backend.decode_greedy(first, a, 2)
    greedy_logits = backend.model.logits.clone()   # the loop's last step's logits
    stepped, t = [], first
    for _ in range(2):
        stepped_logits = backend.decode(t, b)
        t = int(stepped_logits.argmax())
        stepped.append(t)
    assert greedy == stepped
    assert torch.allclose(greedy_logits, stepped_logits, atol=1e-5, rtol=1e-5)
    assert a.pos == b.pos == st.pos + 2
    assert torch.equal(a.rec_state, b.rec_state) and not torch.equal(a.rec_state, st.rec_state)
    assert backend.state_nbytes(st) == sum(t.numel() * t.element_size() for t in
                                           (st.k_cache, st.v_cache, st.conv_state, st.rec_state, st.pos_dev))


def test_launched_greedy_steps_chain_on_the_device(backend):
    """launch_greedy: the first step fed the host's token, each later one the previous step's pick read on
    the device (`after`), even with another state's step in between (the pick is the step's own copy); the
    tokens are decode_greedy's, each step reports its logits finite, and a NaN in the state is reported."""
    st = backend.new_state()
    first = int(backend.prefill([random.randrange(TINY.vocab_size) for _ in range(3)], st).argmax())
    a, b = (backend.restore_state(backend.clone_state(st)) for _ in range(2))
    want = backend.decode_greedy(first, a, 3)
    other = backend.restore_state(backend.clone_state(st))
    got, step = [], None
    for i in range(3):
        step = backend.launch_greedy(b, first) if step is None else backend.launch_greedy(b, after=step)
        backend.decode(random.randrange(TINY.vocab_size), other)   # (another state's step in between)
        token, finite = step.result()
        got.append(token)
        assert finite
    assert got == want and b.pos == a.pos
    b.rec_state[0].fill_(float("nan"))
    assert backend.launch_greedy(b, after=step).result()[1] is False


def test_graph_path_feeds_the_callers_token(weights, backend):
    """The first step after a (first) capture runs the caller's token, not the compile warm-up's pick: the
    graph path, with a recorder that replays eagerly, gives the eager path's logits."""
    graphed = FastBackend(TINY, weights, device="cpu", max_seq=64, prefill_mode="decode", use_graph=True)
    graphed.model._record = lambda step: type("Replay", (), {"replay": staticmethod(step)})()
    a, b = graphed.new_state(), backend.new_state()
    for t in (7, 301):
        la, lb = graphed.decode(t, a), backend.decode(t, b)
        assert torch.allclose(la, lb, atol=1e-5, rtol=1e-5)
    assert a.graph is not None and a.pos == b.pos == 2


@pytest.mark.parametrize("graph", [False, True])
def test_greedy_pick_in_the_step_honours_the_token_mask(weights, backend, graph):
    """A grammar's bitmask in the buffer the step reads: the device's greedy pick is the best allowed token
    (oracle: the reference masking on the unmasked logits), the logits themselves stay unmasked, and with
    the mask reset the pick is the plain argmax again. The graph path reads the same buffer (recorder
    replaying eagerly, as above)."""
    from lily.engine.constraints import apply_token_bitmask

    fb = backend
    if graph:
        fb = FastBackend(TINY, weights, device="cpu", max_seq=64, prefill_mode="decode", use_graph=True)
        fb.model._record = lambda step: type("Replay", (), {"replay": staticmethod(step)})()
    seed = random.randrange(2 ** 31)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    st = fb.new_state()
    fb.prefill([random.randrange(TINY.vocab_size) for _ in range(3)], st)
    for _ in range(3):
        snap = fb.clone_state(st)
        plain_state = fb.restore_state(snap)
        token = random.randrange(TINY.vocab_size)
        plain = fb.decode(token, plain_state)  # the unmasked logits of this step
        words = (TINY.vocab_size + 31) // 32
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), generator=g, dtype=torch.int64).to(torch.int32)
        mask &= torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), generator=g, dtype=torch.int64).to(torch.int32)
        best = int(plain.argmax())
        mask[best // 32] &= ~(1 << (best % 32))  # the unconstrained pick is banned, so the mask must matter
        fb.set_token_mask(mask)
        fb.model.next_tok.fill_(-7)  # poisoned: the step must write its pick
        picked = fb.decode_greedy(token, st, 1)[0]
        assert picked == int(apply_token_bitmask(plain, mask).argmax()) != best
        assert torch.allclose(fb.model.logits, plain, atol=1e-5, rtol=1e-5)
        fb.set_token_mask(None)
        fb.release_state(plain_state)
    again = fb.restore_state(fb.clone_state(st))
    assert fb.decode_greedy(5, again, 1)[0] == int(fb.decode(5, st).argmax())


def test_user_errors_are_one_clear_line(backend):
    st = backend.new_state(max_seq=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.decode(TINY.vocab_size, st)
    with pytest.raises(ValueError, match="max_seq=2"):
        backend.prefill([1, 2, 3], st)
    with pytest.raises(ValueError, match="prefill needs at least one token"):
        backend.prefill([], st)
    with pytest.raises(ValueError, match="prefill_mode"):
        FastBackend(TINY, {}, device="cpu", prefill_mode="fast")


@pytest.mark.parametrize("mode", ["decode", "kernels"])
def test_prefill_logits_are_every_positions_logits(weights, mode, monkeypatch):
    """prefill_logits (prompt scoring) gives each position's logits: the last row is what prefill gives,
    every row is the reference's for that position (within the limit of the path, the decode step or the
    prefill kernels, its routing following the reference's at near-ties), and the state ends where
    prefill's does."""
    be = FastBackend(TINY, weights, device="cpu", max_seq=64, prefill_mode=mode)
    ids = [random.randrange(TINY.vocab_size) for _ in range(random.randint(5, 9))]
    ref = ReferenceModel(TINY, weights)
    with reference_router(ref) as ref_calls:
        want = ref.forward(ids, ref.new_state(), logits_for="all")
    st, st_last = be.new_state(), be.new_state()
    following = fast_prefill_routing if mode == "kernels" else fast_decode_routing
    with following(monkeypatch, ref_calls, TINY):
        rows = be.prefill_logits(ids, st)
    with following(monkeypatch, ref_calls, TINY):
        last = be.prefill(ids, st_last)
    assert rows.shape == (len(ids), TINY.vocab_size) and torch.isfinite(rows).all()
    assert torch.allclose(rows[-1], last, atol=1e-4, rtol=1e-4)
    assert st.pos == st_last.pos == len(ids)
    assert_logits_close(rows, want, PREFILL_LIMIT if mode == "kernels" else DECODE_LIMIT, f"{mode} prefill",
                        PREFILL_MEDIAN_LIMIT if mode == "kernels" else None)
    # every row nearest to its own position's reference row (rows in the wrong order or repeated are not)
    nearest = torch.cdist(rows.double(), want.double()).argmin(1)
    assert nearest.tolist() == list(range(len(ids)))
    assert torch.equal(be.decode(ids[-1], st), be.decode(ids[-1], st_last))


def test_prefill_falls_back_to_the_decode_step_where_the_kernels_do_not_fit(weights, backend, monkeypatch, caplog):
    """On a GPU with less shared memory than the prefill kernels ask, Triton refuses them as they load
    (OutOfResources, before anything runs): the model finds that once, on a scratch state, says so in the
    log, and runs prompts through the decode step: the same logits and state as prefill_mode="decode"."""
    from triton.runtime.errors import OutOfResources
    from lily.model import fast_prefill
    from lily.model.fast import PREFILL_PROBE_TOKENS
    probes = []

    def refused(config, weights, state, ids, logits="last", **kw):
        probes.append((state.max_seq, logits))
        raise OutOfResources(114688, 101376, "shared memory")

    monkeypatch.setattr(fast_prefill, "prefill_forward", refused)
    be = FastBackend(TINY, weights, device="cpu", max_seq=64)   # prefill_mode "auto"
    be.model._prefill_fits = None   # (probed on CUDA devices only: as if this were one)
    ids = [random.randrange(TINY.vocab_size) for _ in range(random.randint(3, 6))]
    st, want_st = be.new_state(), backend.new_state()
    with caplog.at_level("WARNING", logger="lily.model"):
        got = [be.prefill(ids, st), be.prefill(ids[:2], st)]
    want = [backend.prefill(ids, want_st), backend.prefill(ids[:2], want_st)]
    assert probes == [(PREFILL_PROBE_TOKENS, "none")]   # one probe, on its own scratch state
    assert sum("decode step" in r.getMessage() for r in caplog.records) == 1
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert st.pos == want_st.pos == len(ids) + 2
    assert torch.equal(st.rec_state, want_st.rec_state) and torch.equal(st.k_cache, want_st.k_cache)


def test_prefill_kernels_used_where_they_fit(weights, monkeypatch):
    """The probe passes: prompts go to the prefill kernels (probed once)."""
    from lily.model import fast_prefill
    calls = []
    real = fast_prefill.prefill_forward
    monkeypatch.setattr(fast_prefill, "prefill_forward",
                        lambda *a, **kw: calls.append(kw.get("logits")) or real(*a, **kw))
    be = FastBackend(TINY, weights, device="cpu", max_seq=64)
    be.model._prefill_fits = None
    be.prefill([1, 2, 3], be.new_state())
    be.prefill([4, 5], be.new_state())
    assert calls == ["none", "last", "last"]


@pytest.mark.parametrize("mode", ["decode", "kernels"])
def test_launched_prefill_is_the_prefill(weights, mode):
    """launch_prefill (the engine's prompt beside the decodes) gives what prefill gives: the same logits,
    the same state after it; off CUDA it has run when it returns."""
    be = FastBackend(TINY, weights, device="cpu", max_seq=64, prefill_mode=mode)
    ids = [random.randrange(TINY.vocab_size) for _ in range(random.randint(4, 9))]
    st, want_st = be.new_state(), be.new_state()
    pending = be.launch_prefill(ids, st)
    assert pending.ready()
    got, want = pending.result(), be.prefill(ids, want_st)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    assert st.pos == want_st.pos == len(ids)
    assert torch.equal(st.rec_state, want_st.rec_state) and torch.equal(st.conv_state, want_st.conv_state)
    assert torch.equal(st.k_cache, want_st.k_cache)
