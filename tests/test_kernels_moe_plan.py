"""The grouped MoE's routing plan (lily/kernels/moe_plan.py) against its plain-torch reference, and the
grouped GEMMs over plans of several block sizes against the per-expert loop."""

from __future__ import annotations

import pytest
import torch

from lily.kernels.moe_grouped_gemm import moe_grouped, moe_grouped_reference
from lily.kernels.moe_plan import PLAN_TILE, block_classes, moe_plan, moe_plan_reference
from helpers_tensors import DEV, assert_rows_close, new_generator, randn
from test_kernels_prefill import moe_bf16_level, qt


@pytest.fixture
def gen():
    return new_generator()  # the seed is gen.initial_seed()


def _ids(gen, T, k, E, skew):
    """[T, k] distinct experts a row; skew > 0 piles most rows onto a few experts (a trained router's
    uneven load: some experts span several blocks and tiles, others get none)."""
    logits = torch.randn(T, E, generator=gen)
    if skew:
        logits += skew * torch.linspace(1, 0, E)[torch.randperm(E, generator=gen)]
    return logits.topk(k).indices.to(torch.int32).to(DEV)


def _covered_rows(plan, ids):
    """Each sorted row's block count, checking each block stays inside one expert's run."""
    E = plan.num_experts
    flat = ids.reshape(-1).long()[plan.slots.long()]
    seen = torch.zeros(flat.numel(), dtype=torch.long)
    for bm, be, bs, bt in plan.block_groups():
        for e, s, t in zip(be.tolist(), bs.tolist(), bt.tolist()):
            if e == E:
                continue
            rows = slice(s, min(t, s + bm))
            assert s < t and (flat[rows] == e).all(), f"block ({e}, {s}, {t}) of {bm} rows leaves its expert"
            seen[rows] += 1
    return seen


@pytest.mark.parametrize("T,k,E,block_m,skew", [
    (37, 2, 8, None, 0.0),              # one size (a short prompt)
    (700, 2, 8, None, 0.0),             # sizes 128, 64, 32, 16 (an average of 175 rows an expert)
    (2500, 4, 12, (64, 32, 16), 6.0),   # E not a power of two, skewed, 10000 pairs: many tiles
    (5, 3, 32, (128, 16), 0.0),         # fewer pairs than experts
    (600, 8, 300, None, 2.0),           # 600 16-row blocks: five programs of block indices, E past 256
])
def test_plan_matches_reference(gen, T, k, E, block_m, skew):
    ids = _ids(gen, T, k, E, skew)
    got, ref = moe_plan(ids, E, block_m, kernels=True), moe_plan_reference(ids, E, block_m)
    seed = f"seed {gen.initial_seed()}"
    assert 32 * PLAN_TILE < 10000, "the skewed case must span more tiles than the scan reads at once"
    assert torch.equal(got.slots.cpu(), ref.slots.cpu()), f"{seed}: slots differ from a stable sort"
    assert [g[0] for g in got.block_groups()] == [g[0] for g in ref.block_groups()]
    for (bm, ge, gs, gt), (_, re_, rs, rt) in zip(got.block_groups(), ref.block_groups()):
        ge, re_ = ge.cpu(), re_.cpu()
        assert torch.equal(ge, re_), f"{seed}: experts of the {bm}-row blocks differ"
        real = re_ < E
        assert torch.equal(gs.cpu()[real], rs.cpu()[real]) and torch.equal(gt.cpu()[real], rt.cpu()[real]), seed
    assert (_covered_rows(got, ids) == 1).all(), f"{seed}: a sorted row not covered exactly once"


def test_tail_blocks_take_the_remainders(gen):
    """An expert's rows beyond its full blocks go to one block of the smallest size that holds them."""
    E, bm = 4, (64, 32, 16)
    counts = [64 + 20, 64 + 40, 10, 128]  # tails of 20 (a 32-block), 40 (a 64-block), 10 (a 16-block), none
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].to(torch.int32).reshape(-1, 1).to(DEV)
    plan = moe_plan(ids, E, bm, kernels=True)
    real = {size: sorted(e for e in be.tolist() if e < E) for size, be, _, _ in plan.block_groups()}
    assert real == {64: [0, 1, 1, 3, 3], 32: [0], 16: [2]}
    assert (_covered_rows(plan, ids) == 1).all()


def test_block_classes():
    assert block_classes(256 * 8, 256) == (16,)            # 8 rows an expert: one small size
    assert block_classes(4096 * 8, 256) == (128, 64, 32, 16)
    assert block_classes(1024 * 8, 256) == (32,)
    with pytest.raises(ValueError, match="descending"):
        moe_plan(torch.zeros(4, 2, dtype=torch.int32, device=DEV), 8, (16, 32), kernels=True)


@pytest.mark.parametrize("block_m", [(64, 32, 16), (32, 16)])
def test_moe_grouped_over_several_block_sizes(gen, block_m):
    E, k, H, I, T = 6, 2, 128, 64, 150
    gate, up, down = qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I)
    x = randn(gen, T, H, dtype=torch.bfloat16)
    top, idx = randn(gen, T, E).softmax(-1).topk(k)
    top = top / top.sum(-1, keepdim=True)
    plan = moe_plan(idx, E, block_m, kernels=True)
    assert len(plan.block_groups()) == len(block_m)
    base = randn(gen, T, H)
    out = base.clone()
    moe_grouped(x, plan, top.reshape(-1).contiguous(), gate, up, down, out)
    ref = moe_grouped_reference(x, idx, top, gate, up, down)
    assert_rows_close(out - base, ref, f"seed {gen.initial_seed()}",
                      level=moe_bf16_level(x, idx, top, gate, up, down, ref))
