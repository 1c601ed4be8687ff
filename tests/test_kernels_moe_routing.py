"""lily/kernels/moe_routing.py (prefill routing) against the model's torch routing (softmax, top-k,
renormalise), and the grouped MoE's fixed-order slot combine, at tiny shapes on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from lily.kernels.moe_routing import moe_topk, moe_topk_reference

from helpers_tensors import DEV, new_generator, randn  # noqa: E402


@pytest.mark.parametrize("T,E,k", [(37, 256, 8), (5, 8, 2), (19, 60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_topk_matches_softmax_topk(T, E, k, renormalize):
    gen = new_generator()
    logits = randn(gen, T, E, scale=3.0)
    w = torch.full((T, k), float("nan"), device=DEV)
    w, ids = moe_topk(logits, k, renormalize)
    ref_w, ref_ids = moe_topk_reference(logits, k, renormalize)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu()), f"seed {gen.initial_seed()}"
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-7), f"seed {gen.initial_seed()}"


def test_moe_topk_ties_pick_the_lower_index_and_nan_stays_in_range():
    logits = torch.zeros(3, 16, device=DEV)
    logits[0, [3, 9]] = 2.0           # a tie for the first place
    logits[1] = float("nan")          # a poisoned row must not index outside the experts
    logits[2] = torch.arange(16, device=DEV, dtype=torch.float32)
    w, ids = moe_topk(logits, 3)
    assert ids[0].tolist()[:2] == [3, 9]
    assert ids[1].min() >= 0 and ids[1].max() < 16 and torch.isnan(w[1]).all()
    assert ids[2].tolist() == [15, 14, 13]
