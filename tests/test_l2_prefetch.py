"""The decode step's L2 prefetch: the chunk tables, the kernel's addresses (traced under TRITON_INTERPRET=1,
where the bulk prefetch instruction does not exist) against the plain-torch reference, the routed variant's
experts against torch.topk, and the schedule against the step plan of a tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from lily.config import TINY
from lily.kernels.l2_prefetch import chunk_table, l2_prefetch, l2_prefetch_reference
from lily.model import step_prefetch
from lily.model.fast import FastModel
from lily.model.step_prefetch import PrefetchMode, StepPrefetch, kernel_regions
from lily.synthetic import random_weights


def covered(table: torch.Tensor) -> set[int]:
    """The 16-byte units a table's chunks cover."""
    out = set()
    for addr, n, _ in table.tolist():
        assert addr % 16 == 0 and n % 16 == 0
        out.update(range(addr // 16, (addr + n) // 16))
    return out


def test_chunk_table_covers_each_region_once_in_chunks_of_at_most_the_size():
    chunk = 16 * random.randint(1, 40)
    regions = []
    base = 1 << 20
    for _ in range(6):
        n = random.randint(1, 5000)
        regions.append((base + random.randint(0, 15), n, random.randint(0, 1 << 16)))
        base += 1 << 14
    t = chunk_table(regions, chunk)
    assert t.dtype == torch.int64 and t.shape[1] == 3
    assert int(t[:, 1].max()) <= chunk
    want = set()
    for (a, n, _) in regions:
        want.update(range(a // 16, (a + n + 15) // 16))
    assert covered(t) == want
    assert int(t[:, 1].sum()) == len(want) * 16                     # no unit twice
    for addr, n, stride in t.tolist():                              # each chunk inside its region, its stride
        (region,) = [r for r in regions if r[0] & ~15 <= addr and addr + n <= r[0] + r[1] + 15]
        assert stride == region[2]
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_table(regions, 24)


def test_static_prefetch_requests_every_chunk_of_the_table():
    regions = [(16 * random.randint(1, 1 << 20), 16 * random.randint(1, 300), 0) for _ in range(5)]
    table = chunk_table(regions, 16 * random.randint(2, 9))
    trace = torch.full((1, table.shape[0], 2), -7, dtype=torch.int64)     # poisoned
    l2_prefetch(table, trace=trace)
    assert torch.equal(trace, l2_prefetch_reference(table))


@pytest.mark.parametrize("top_k", [2, 4])
def test_routed_prefetch_moves_each_slots_chunks_to_its_expert(top_k):
    n_experts = 16
    logits = torch.randn(n_experts + 1)
    stride = 16 * random.randint(100, 1000)
    regions = [(16 * random.randint(1, 1 << 16), 16 * random.randint(1, 90), stride),
               (16 * random.randint(1 << 17, 1 << 18), 16 * random.randint(1, 90), stride // 2)]
    table = chunk_table(regions, 16 * random.randint(2, 5))
    trace = torch.full((top_k, table.shape[0], 2), -7, dtype=torch.int64)
    l2_prefetch(table, logits, top_k, trace=trace)
    want = l2_prefetch_reference(table, logits, top_k)
    assert torch.equal(trace, want)
    # the slots are the top-k experts: every one of them, each once
    experts = {(int(trace[s, 0, 0]) - int(table[0, 0])) // stride for s in range(top_k)}
    assert experts == set(torch.topk(logits[:-1], top_k).indices.tolist())


def test_the_spellings_of_lily_l2_prefetch():
    assert not step_prefetch.parse("0").on and not step_prefetch.parse("").on
    m = step_prefetch.parse("distance=3, chunk=4096,routed=0,state=0,lm_head=1024")
    assert m == PrefetchMode(distance=3, chunk=4096, routed=False, state=False, lm_head=1024)
    assert step_prefetch.parse("1") == PrefetchMode(distance=2)
    for bad in ("distance=1", "chunk=24", "speed=9", "distance=x"):
        with pytest.raises(ValueError, match="LILY_L2_PREFETCH"):
            step_prefetch.parse(bad)
    old = step_prefetch.set_mode("distance=4")
    try:
        assert step_prefetch.MODE.distance == 4
    finally:
        step_prefetch.MODE = old


@pytest.fixture(scope="module")
def fast():
    return FastModel(TINY, random_weights(TINY, seed=random.randrange(10_000)), device="cpu")


def test_every_region_lies_inside_a_tensor_of_the_model_or_its_state(fast):
    """Each static region (and each routed region, for every expert) is memory of the model's weights or of
    the state: a wrong address here would prefetch garbage."""
    st = fast.new_state(max_seq=8)
    spans = []
    for obj in [fast.lm_head, *(part for layer in fast.layers for part in layer[1:3])]:
        stack = [obj]
        while stack:
            o = stack.pop()
            if isinstance(o, torch.Tensor):
                spans.append((o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()))
            elif hasattr(o, "__dict__"):
                stack.extend(vars(o).values())
    spans.append((st.rec_state.data_ptr(), st.rec_state.data_ptr() + st.rec_state.numel() * 4))
    inside = lambda a, n: any(lo <= a and a + n <= hi for lo, hi in spans)    # noqa: E731
    regions = kernel_regions(fast, st, PrefetchMode(distance=2, lm_head=1 << 12))
    assert [r[0] for r in regions] == [p[0] for p in fast.step_plan(st)]
    n_experts = TINY.num_experts
    for name, static, routed in regions:
        for a, n, _ in static:
            assert n > 0 and inside(a, n), name
        for a, n, stride in routed:
            assert stride > 0 and all(inside(a + e * stride, n) for e in range(n_experts)), name
    names = {r[0] for r in regions if r[1]}
    assert {"attn_qkv", "attn_o", "gdn_in", "gdn_core", "gdn_out", "moe_router", "moe_gate_up", "moe_down",
            "lm_head"} <= names
    assert {r[0] for r in regions if r[2]} == {"moe_gate_up", "moe_down"}


@pytest.mark.parametrize("distance", [2, 3])
def test_schedule_requests_each_kernels_weights_distance_kernels_before_it(fast, distance):
    st = fast.new_state(max_seq=8)
    mode = PrefetchMode(distance=distance, chunk=1 << 12)
    sched = StepPrefetch(fast, st, mode)
    regions = kernel_regions(fast, st, mode)
    for k, (name, static, routed) in enumerate(regions):
        if static:
            launched = set()
            for table, is_routed in sched.after[max(k - distance, -1)]:
                if not is_routed:
                    launched |= covered(table)
            assert covered(chunk_table(static, mode.chunk)) <= launched, name
        if routed:
            router = max(i for i in range(k) if regions[i][0] == "moe_router")
            tables = [t for t, r in sched.after[router] if r]
            assert len(tables) == 1 and covered(chunk_table(routed, mode.chunk)) <= covered(tables[0]), name
    assert not StepPrefetch.wanted(fast)        # the CPU has no bulk prefetch: the step runs without it
