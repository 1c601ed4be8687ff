"""Prefill graphs (lily/model/prefill_graphs.py): a short chunk padded to a bucket and run as a graph.

The CPU has no CUDA graphs, so the recorder is replaced by one that keeps the step and replays it eagerly:
what runs is exactly what a graph would replay (the padded forward reading the position and the prompt's
length from the device), and the captures are counted. The oracle is the unpadded eager forward (itself held
to lily.model.reference.ReferenceModel by tests/test_kernels_prefill.py) on a state of its own: the padded
rows must leave no trace in the logits nor in anything the next token reads (conv and recurrent state, the
KV rows of the prompt).
"""

from __future__ import annotations

import types

import pytest
import torch

from lily.config import TINY
from lily.model.fast_prefill import prefill_forward, with_fused_projections
from lily.model.prefill_graphs import PrefillGraphs
from lily.quant import QuantTensor
from lily.synthetic import random_weights

from helpers_tensors import DEV, assert_rows_close, new_generator, rel


@pytest.fixture
def gen():
    return new_generator()  # the seed is gen.initial_seed()


def _state(c, max_seq):
    n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
    kv = (n_attn, max_seq, c.num_key_value_heads, c.head_dim)
    return types.SimpleNamespace(
        pos=0, max_seq=max_seq, k_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=DEV),
        v_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=DEV),
        conv_state=torch.zeros(n_gdn, c.linear_conv_kernel_dim - 1, c.linear_conv_dim, dtype=torch.bfloat16,
                               device=DEV),
        rec_state=torch.zeros(n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                              device=DEV))


def _weights(gen):
    w = random_weights(TINY, seed=gen.initial_seed() % 1000)
    return with_fused_projections(TINY, {k: (v.to(DEV) if isinstance(v, (QuantTensor, torch.Tensor)) else v)
                                         for k, v in w.items()})


def _eager_graphs(c, w, buckets, gen, staging=None) -> PrefillGraphs:
    g = PrefillGraphs(c, w, DEV, buckets=buckets, staging=staging)
    g._record = lambda step: types.SimpleNamespace(replay=step)
    g.ids.random_(0, c.vocab_size, generator=gen)   # padding rows: leftovers of some earlier prompt
    return g


def _assert_same_state(st, ref, msg):
    n = ref.pos
    assert st.pos == n, msg
    assert torch.equal(st.conv_state, ref.conv_state), f"{msg}: conv state (the last K-1 prompt rows, exactly)"
    assert_rows_close(st.rec_state, ref.rec_state, f"{msg}: recurrent state", row_dims=2, limit=1e-3)
    assert_rows_close(st.k_cache[:, :n], ref.k_cache[:, :n], f"{msg}: K cache", limit=1e-3)
    assert_rows_close(st.v_cache[:, :n], ref.v_cache[:, :n], f"{msg}: V cache", limit=1e-3)


def _assert_replays_prepared(c, w, graphs, st, n: int, gen) -> None:
    """An n-token prompt on state st replays a prepared graph (no capture) and matches the eager prefill on a
    state of its own."""
    captures = graphs.captures
    ref = _state(c, st.k_cache.shape[1])
    ids = torch.randint(0, c.vocab_size, (n,), generator=gen).to(DEV)
    g = prefill_forward(c, w, st, ids, graphs=graphs)
    assert graphs.captures == captures, "the prompt must replay the prepared graph"
    assert rel(g, prefill_forward(c, w, ref, ids)) < 1e-3, f"seed {gen.initial_seed()}"
    _assert_same_state(st, ref, f"seed {gen.initial_seed()}")


def test_padded_graph_chunks_match_the_eager_prefill(gen):
    """A 13-token prompt (bucket 16), a 5-token append (bucket 8, its padding past the cache's end) and a
    3-token append (bucket 8 again: a replay, no capture), each against the unpadded eager forward."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (8, 16), gen)
    ids = torch.randint(0, c.vocab_size, (21,), generator=gen).to(DEV)
    got, want = _state(c, 21), _state(c, 21)
    for s, e, captures in ((0, 13, 1), (13, 18, 2), (18, 21, 2)):
        msg = f"seed {gen.initial_seed()}, tokens {s}..{e - 1}"
        g = prefill_forward(c, w, got, ids[s:e], graphs=graphs)
        r = prefill_forward(c, w, want, ids[s:e])
        assert graphs.captures == captures, msg
        assert g.shape == r.shape == (c.vocab_size,), msg
        assert rel(g, r) < 1e-3, f"{msg}: logits of the last prompt row"
        _assert_same_state(got, want, msg)
    assert set(got.prefill_graphs) == {8, 16}


def test_each_state_keeps_its_own_graphs(gen):
    """A graph bakes in its state's buffers: a second state captures its own, and each serves only its state."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (16,), gen)
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=gen).to(DEV)
    a, b, ra, rb = _state(c, 32), _state(c, 32), _state(c, 32), _state(c, 32)
    for st, ref, row in ((a, ra, 0), (b, rb, 1), (a, ra, 1)):
        g = prefill_forward(c, w, st, ids[row], graphs=graphs)
        assert rel(g, prefill_forward(c, w, ref, ids[row])) < 1e-3, f"seed {gen.initial_seed()}"
    assert graphs.captures == 2
    _assert_same_state(a, ra, f"seed {gen.initial_seed()}: state a")
    _assert_same_state(b, rb, f"seed {gen.initial_seed()}: state b")


def test_states_share_the_staging_states_graphs(gen):
    """With a staging state (16 positions, NaN where nothing was written), chunks that end within it run there
    for any state: a second state's prompt replays the first one's capture, a continuation copies the state's
    KV rows in; a chunk past its 16 positions captures a graph of the state's own. Each state against its own
    unpadded eager prefill, the other state untouched by a run of the first."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (8, 16), gen, staging=_state(c, 16))
    graphs.staging.conv_state.fill_(float("nan"))
    graphs.staging.rec_state.fill_(float("nan"))
    ids = torch.randint(0, c.vocab_size, (2, 24), generator=gen).to(DEV)
    a, b, ra, rb = _state(c, 40), _state(c, 40), _state(c, 40), _state(c, 40)
    # (state, its reference, prompt row, tokens, staging captures after, own captures after)
    runs = ((a, ra, 0, (0, 11), 1, 0), (b, rb, 1, (0, 11), 1, 0), (a, ra, 0, (11, 15), 2, 0),
            (a, ra, 0, (15, 24), 2, 1), (b, rb, 1, (11, 13), 2, 0))
    for st, ref, row, (s, e), shared, own in runs:
        msg = f"seed {gen.initial_seed()}, state {'a' if st is a else 'b'}, tokens {s}..{e - 1}"
        g = prefill_forward(c, w, st, ids[row, s:e], graphs=graphs)
        assert rel(g, prefill_forward(c, w, ref, ids[row, s:e])) < 1e-3, f"{msg}: logits of the last prompt row"
        _assert_same_state(st, ref, msg)
        assert len(graphs.staging.prefill_graphs) == shared and len(getattr(st, "prefill_graphs", {})) == own, msg
        assert graphs.staging.pos == 0, msg
    _assert_same_state(a, ra, f"seed {gen.initial_seed()}: state a at the end")
    assert graphs.captures == 3


def test_prepare_without_a_state_prepares_the_staging_state(gen):
    """prepare() records the staging state's buckets; a state's prompt then replays them without a capture."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (8, 16), gen, staging=_state(c, 16))
    assert graphs.prepare() == [8, 16] and graphs.captures == 2
    _assert_replays_prepared(c, w, graphs, _state(c, 32), 13, gen)
    with pytest.raises(ValueError, match="no staging state"):
        _eager_graphs(c, w, (8,), gen).prepare()


def test_long_chunks_and_all_logits_run_eagerly(gen):
    """A chunk longer than the largest bucket, and logits="all" (every row needed), take the eager path."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (8,), gen)
    ids = torch.randint(0, c.vocab_size, (12,), generator=gen).to(DEV)
    st, ref = _state(c, 16), _state(c, 16)
    out = prefill_forward(c, w, st, ids[:9], graphs=graphs)
    assert graphs.captures == 0 and torch.equal(out, prefill_forward(c, w, ref, ids[:9]))
    rows = prefill_forward(c, w, st, ids[9:], logits="all", graphs=graphs)
    assert graphs.captures == 0 and torch.equal(rows, prefill_forward(c, w, ref, ids[9:], logits="all"))
    assert st.pos == 12


def test_buckets_must_ascend():
    with pytest.raises(ValueError, match="ascending"):
        PrefillGraphs(TINY, {}, DEV, buckets=(16, 8))
    g = PrefillGraphs(TINY, {}, DEV, buckets=(8, 16))
    assert [g.bucket(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, None]


def test_prepare_captures_each_bucket_up_front_and_leaves_the_state_empty(gen):
    """prepare() records every bucket a state can use (a 12-token state: 8 and 16; no prompt it holds needs
    32), leaves the state empty, and a prompt then replays without a capture and matches the eager prefill."""
    c, w = TINY, _weights(gen)
    graphs = _eager_graphs(c, w, (8, 16, 32), gen)
    st = _state(c, 12)
    assert graphs.prepare(st) == [8, 16] and graphs.captures == 2
    assert st.pos == 0 and not st.conv_state.any() and not st.rec_state.any()
    _assert_replays_prepared(c, w, graphs, st, 11, gen)
    with pytest.raises(ValueError, match="empty state"):
        graphs.prepare(st)
