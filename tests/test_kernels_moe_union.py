"""The union MoE of a decode batch (lily/kernels/moe_union.py) under TRITON_INTERPRET=1 on the CPU: every valid
row against the plain-torch MoE of that row (routing from its own logits), with 8 experts so that rows share
experts (each shared expert's tile is dotted with several rows), rows past n_valid untouched, two layers
through one scratch, and the lists the route built against the routing. Fresh random inputs each run (the
seed is in the failure message); act and the lists are poisoned first.
"""

from __future__ import annotations

import pytest
import torch
from helpers_tensors import assert_rows_within, new_generator, qt
from test_kernels_decode import EPS, GEMV, HALF_MOE, half_dot, rn  # noqa: F401 (half_dot: a fixture)

from lily.kernels import moe_decode as MD
from lily.kernels import moe_union as MU
from lily.kernels import quant_gemv as QG
from lily.kernels.moe_route_batch import moe_route_rows_reference
from lily.kernels.q4_gemm import rmsnorm_rows

I32 = torch.int32


@pytest.fixture
def gen():
    return new_generator()


def experts(gen, E, I, H):
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    return w, MD.PackedExperts(*w)


def poisoned_scratch(E, top_k, I, rows, layers):
    sc = MU.UnionScratch(E, top_k, I, rows, layers)
    sc.act.fill_(float("nan"))
    sc.weights.fill_(float("nan"))
    sc.lists.fill_(-1)
    sc.live.fill_(-1)
    sc.reset()
    return sc


def reference_rows(w, h, gain, logits, n_valid, top_k, norm_topk):
    """h[b] + MoE(RMSNorm(h[b]) * gain) for the valid rows, plain torch, fp32."""
    E = logits.shape[1] - 1
    out = []
    for b in range(n_valid):
        x = QG.rmsnorm_reference(h[b], gain, EPS)
        out.append(h[b] + MD.moe_reference(x, logits[b, :E], logits[b, E], *w, top_k=top_k, norm_topk=norm_topk))
    return torch.stack(out)


@pytest.mark.parametrize("top_k,norm_topk,B,n_valid,tiles", [
    (2, True, 7, 5, None),                                # the interpreter's tiles: two blocks a unit
    (3, False, 8, 8, ((16, 32, 1, 4), (32, 64, 1, 4))),   # several units a row's expert, every row valid
    (2, True, 4, 1, ((64, 64, 1, 4), (128, 128, 1, 4))),  # one row (the batch-1 case), one block a unit
])
def test_moe_union_matches_each_rows_moe(gen, half_dot, top_k, norm_topk, B, n_valid, tiles):
    E, I, H = 8, 64, 128
    w, ex = experts(gen, E, I, H)
    h, gain = rn(gen, B, H), rn(gen, H).abs() + 0.5
    logits = rn(gen, B, E + 1) * 0.3   # order 0.3: the top-k weights sum well below 1 (see test_moe_decode)
    y, x_p = rmsnorm_rows(h, gain, EPS, perm64_copy=True)
    p = QG.perm64_index(H)
    x = torch.stack([QG.rmsnorm_reference(r, gain, EPS) for r in h])
    assert_rows_within(x_p[:, p], x, 1e-6, f"seed {gen.initial_seed()}: the fp32 PERM64 copy")
    # the bf16 output: the same rows rounded (by under one bf16 ulp, 2^-7 of the value; 1 % slack for the fp32 sums)
    assert ((y.float() - x).abs() <= x.abs() * 2 ** -7 * 1.01).all(), "the bf16 output is not these rows rounded"
    sc = poisoned_scratch(E, top_k, I, B, 2)
    out = h.clone()
    MU.moe_union(ex, out, x_p, logits, torch.tensor([n_valid], dtype=I32), sc, 1, norm_topk, tiles=tiles)
    ref = reference_rows(w, h, gain, logits, n_valid, top_k, norm_topk)
    for b in range(n_valid):
        assert torch.softmax(logits[b, :E], -1).topk(top_k).values.sum() < 0.95, "degenerate routing"
        assert_rows_within(out[b] - h[b], ref[b] - h[b], HALF_MOE if half_dot else GEMV,
                           f"seed {gen.initial_seed()}: row {b}", row_dims=0)
    assert torch.equal(out[n_valid:], h[n_valid:])
    # the lists: each valid (row, slot) pair once, on its expert's list; the live experts are those chosen
    ids, wts = moe_route_rows_reference(logits[:n_valid], top_k, norm_topk)
    count = sc.counters[1]
    live = sorted(sc.live[:int(count[E + 1])].tolist())
    assert live == sorted(set(ids.flatten().tolist())), (live, ids)
    seen = []
    for e in range(E + 1):
        pairs = sc.lists[e, :int(count[e])].tolist()
        assert all(int(ids.flatten()[q]) == e for q in pairs), (e, pairs)
        seen += pairs
    assert sorted(seen) == list(range(n_valid * (top_k + 1)))
    assert torch.allclose(sc.weights[:n_valid * (top_k + 1)].view(n_valid, -1), wts, rtol=1e-5, atol=1e-7)
    assert sc.counters[0].eq(0).all(), "another layer's counters were touched"
    assert torch.isnan(sc.act[n_valid * (top_k + 1):]).all(), "a padding row's pairs were computed"


def test_moe_union_two_layers_one_scratch(gen):
    """Layer 0 then layer 1 through one scratch (the lists and live experts are shared, the counters are per
    layer), then a reset and layer 0 again: each result as the layer alone gives it."""
    E, I, H, B, top_k = 8, 64, 128, 6, 2
    (w0, ex0), (w1, ex1) = experts(gen, E, I, H), experts(gen, E, I, H)
    h, gain = rn(gen, B, H), rn(gen, H).abs() + 0.5
    l0, l1 = rn(gen, B, E + 1) * 0.3, rn(gen, B, E + 1) * 0.3
    nv = torch.tensor([B], dtype=I32)
    sc = poisoned_scratch(E, top_k, I, B, 2)
    out = h.clone()
    MU.moe_union(ex0, out, rmsnorm_rows(out, gain, EPS, perm64_copy=True)[1], l0, nv, sc, 0)
    mid = out.clone()
    MU.moe_union(ex1, out, rmsnorm_rows(out, gain, EPS, perm64_copy=True)[1], l1, nv, sc, 1)
    want_mid = reference_rows(w0, h, gain, l0, B, top_k, True)
    want = reference_rows(w1, mid, gain, l1, B, top_k, True)
    bound = HALF_MOE if QG.HALF_DOT else GEMV   # (the default dot)
    assert_rows_within(mid - h, want_mid - h, bound, f"seed {gen.initial_seed()}: layer 0", row_dims=0)
    assert_rows_within(out - mid, want - mid, bound, f"seed {gen.initial_seed()}: layer 1", row_dims=0)
    sc.reset()
    again = h.clone()
    MU.moe_union(ex0, again, rmsnorm_rows(again, gain, EPS, perm64_copy=True)[1], l0, nv, sc, 0)
    assert torch.equal(again, mid)     # the interpreter runs programs in order: the same sums bit for bit


def test_moe_union_all_pads_and_bad_shapes(gen):
    """n_valid 0 (a graph bucket's warm-up): nothing is routed or written; wrong shapes are refused."""
    E, I, H, B = 8, 64, 128, 4
    _, ex = experts(gen, E, I, H)
    h = rn(gen, B, H)
    sc = poisoned_scratch(E, 2, I, B, 1)
    out = h.clone()
    MU.moe_union(ex, out, rn(gen, B, H), rn(gen, B, E + 1), torch.tensor([0], dtype=I32), sc, 0)
    assert torch.equal(out, h) and sc.counters.eq(0).all() and torch.isnan(sc.act).all()
    with pytest.raises(ValueError, match="moe_union"):
        MU.moe_union(ex, out, rn(gen, B, H).to(torch.bfloat16), rn(gen, B, E + 1), torch.tensor([1], dtype=I32),
                     sc, 0)
    with pytest.raises(ValueError, match="moe_union"):
        MU.moe_union(ex, out, rn(gen, B, H), rn(gen, B, E + 1), torch.tensor([1], dtype=I32), sc, 1)
