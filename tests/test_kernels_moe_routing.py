"""lily/kernels/moe_routing.py (prefill routing) against the model's torch routing (softmax, top-k,
renormalise), and the grouped MoE's fixed-order slot combine, at tiny shapes on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from lily.kernels.moe_routing import moe_topk, moe_topk_reference

from helpers_tensors import DEV, new_generator, randn  # noqa: E402


@pytest.mark.parametrize("T,E,k", [(37, 256, 8), (5, 8, 2), (19, 60, 4), (21, 16, 7)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_topk_matches_softmax_topk(T, E, k, renormalize, shared, monkeypatch):
    import lily.kernels.moe_routing as R
    gen = new_generator()
    logits = randn(gen, T, E + int(shared), scale=3.0)
    monkeypatch.setattr(R, "TOPK_ROWS", 4)   # several programs, the last one partly past T
    w, ids = moe_topk(logits, k, renormalize, shared=shared)
    ref_w, ref_ids = moe_topk_reference(logits, k, renormalize, shared=shared)
    assert ids.shape == w.shape == (T, k + int(shared))
    assert torch.equal(ids.long().cpu(), ref_ids.cpu()), f"seed {gen.initial_seed()}"
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-7), f"seed {gen.initial_seed()}"
    if shared:   # the independent statement of the shared slot: expert E, weight sigmoid(gate)
        assert (ids[:, k] == E).all()
        assert torch.allclose(w[:, k], 1 / (1 + torch.exp(-logits[:, E].double())).float(), rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_topk_sums_the_routers_split_partials(shared):
    """The router GEMM's K-split partials (q_gemm_parts) routed directly: the same experts and weights as
    routing q_gemm's summed logits, bit for bit (the same sum in the same order)."""
    from lily.kernels.q4_gemm import q_gemm, q_gemm_parts
    from helpers_tensors import qt
    gen = new_generator()
    T, E, K, k = 23, 40, 1024, 6
    x = randn(gen, T, K, dtype=torch.bfloat16)
    w = qt(gen, E + int(shared), K, bits=8)
    parts = q_gemm_parts(x, w)
    assert parts is not None and parts.shape[0] > 1, "the shape must split K"
    want_w, want_ids = moe_topk(q_gemm(x, w, out_dtype=torch.float32), k, shared=shared)
    got_w, got_ids = moe_topk(parts, k, shared=shared)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w), f"seed {gen.initial_seed()}"
    ref_w, ref_ids = moe_topk_reference(parts, k, shared=shared)
    assert torch.equal(got_ids.long().cpu(), ref_ids.cpu())
    assert torch.allclose(got_w, ref_w, rtol=1e-5, atol=1e-7)


def test_moe_topk_ties_pick_the_lower_index_and_nan_stays_in_range():
    logits = torch.zeros(3, 16, device=DEV)
    logits[0, [3, 9]] = 2.0           # a tie for the first place
    logits[1] = float("nan")          # a poisoned row must not index outside the experts
    logits[2] = torch.arange(16, device=DEV, dtype=torch.float32)
    w, ids = moe_topk(logits, 3)
    assert ids[0].tolist()[:2] == [3, 9]
    assert ids[1].min() >= 0 and ids[1].max() < 16 and torch.isnan(w[1]).all()
    assert ids[2].tolist() == [15, 14, 13]
