"""lily.kernels.l2_prefetch: which bytes each decode kernel requests into L2 for the next stage.

The prefetch itself is a hint (PTX, GPU only); what can be wrong is which lines are requested. So the
kernels run in the test mode (PF_MODE 2: each requested line's first int32 gets +1) on stand-in ranges:
every line of every range requested exactly once, nothing outside them touched, and the kernels' own results
the same bits as without a prefetch. Under TRITON_INTERPRET=1 on the CPU, fresh random sizes and contents
each run (the seed is printed on failure).
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import triton
import triton.language as tl

from lily.config import TINY
from lily.kernels import gdn_decode as GD
from lily.kernels import l2_prefetch as PF
from lily.kernels import moe_decode as MD
from lily.kernels import quant_gemv as QG
from lily.quant import quantize

EPS = 1e-6


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


@pytest.fixture
def count_lines(monkeypatch):
    monkeypatch.setattr(PF, "COUNT_LINES", True)


def ranges(gen, n: int, empty_ok: bool = True):
    """n stand-in ranges: int32 tensors of fresh random contents, random sizes (bytes: any multiple of 4,
    lines partly filled, some empty), and the byte counts to request of each (all of it)."""
    out = []
    for _ in range(n):
        words = int(torch.randint(0 if empty_ok else 1, 200, (1,), generator=gen))
        t = torch.randint(-2**30, 2**30, (words,), generator=gen, dtype=torch.int32)
        out.append((t, words * 4))
    return out


def expected_counts(t: torch.Tensor, nbytes: int, times: int = 1, start_word: int = 0) -> torch.Tensor:
    """What the test mode leaves in t after requesting nbytes from start_word on, `times` times: +times at the
    first int32 of each 128-byte line."""
    want = t.clone()
    want[start_word:start_word + nbytes // 4:PF.LINE // 4] += times
    return want


@triton.jit
def _ranges_kernel(pf0, pfn0, pf1, pfn1, pf2, pfn2, pf3, pfn3, pf4, pfn4, pf5, pfn5, PF_MODE: tl.constexpr):
    PF.request_ranges(tl.program_id(0), tl.num_programs(0), pf0, pfn0, pf1, pfn1, pf2, pfn2, pf3, pfn3, pf4, pfn4,
                      pf5, pfn5, PF_MODE)


@pytest.mark.parametrize("n_ranges,programs", [(1, 1), (3, 2), (6, 3), (6, 1)])
def test_every_line_of_every_range_is_requested_once(gen, count_lines, n_ranges, programs):
    rs = ranges(gen, n_ranges)
    rs[0] = (rs[0][0], rs[0][1]) if rs[0][1] else ranges(gen, 1, empty_ok=False)[0]
    before = [t.clone() for t, _ in rs]
    like = torch.empty(1)
    args = PF.kernel_args(rs, like, "gdn_in")
    assert args["PF_MODE"] == 2
    _ranges_kernel[(programs,)](**args)
    for (t, n), b in zip(rs, before):
        assert torch.equal(t, expected_counts(b, n)), f"seed {gen.initial_seed()}: {n} bytes"


def test_a_range_of_many_blocks_is_dealt_to_all_programs(gen, count_lines):
    """More lines than the programs take in one round (256 lines each): the loop goes round, nothing twice."""
    t = torch.randint(-2**30, 2**30, (PF.LINE // 4 * (2 * 256 * 3 + 17),), generator=gen, dtype=torch.int32)
    want = expected_counts(t, t.numel() * 4)
    _ranges_kernel[(2,)](**PF.kernel_args(PF.regions_of(t), torch.empty(1), "down"))
    assert torch.equal(t, want)


def test_kernel_args_off_unless_asked_and_on_a_gpu(gen):
    rs = ranges(gen, 2, empty_ok=False)
    like = torch.empty(1)
    args = PF.kernel_args(rs, like, "gdn_in")
    assert args["PF_MODE"] == 0                                     # the CPU: no PTX prefetch
    assert all(args[f"pfn{i}"] == 0 for i in range(PF.MAX_REGIONS))
    assert PF.kernel_args(None, like)["PF_MODE"] == 0
    with pytest.raises(ValueError, match="at most 6"):
        PF.kernel_args(rs * 4, like, "gdn_in")
    with pytest.raises(ValueError, match="contiguous"):
        PF.regions_of(torch.empty(4, 4).t())


def test_the_spellings_of_lily_prefetch():
    assert PF.parse("1") == PF.parse("all") == frozenset(PF.FAMILIES)
    assert PF.parse("0") == PF.parse("") == PF.parse("none") == frozenset()
    assert PF.parse(" down, gate_up ") == frozenset({"down", "gate_up"})
    assert PF.describe(PF.parse("down,gate_up")) == "gate_up,down"
    assert PF.parse(PF.DEFAULT) <= frozenset(PF.FAMILIES)
    with pytest.raises(ValueError, match="unknown kernel families.*'lm_head'"):
        PF.parse("down,lm_head")
    old = PF.set_mode("router")
    try:
        assert PF.MODE == frozenset({"router"}) and PF.active("router") and not PF.active("down")
    finally:
        PF.set_mode(PF.describe(old))


def qt(gen, *shape, bits=4, std=None):
    x = torch.randn(*shape, generator=gen) * (std or shape[-1] ** -0.5)
    return quantize(x.to(torch.bfloat16), bits=bits)


def test_gemv_requests_its_ranges_and_computes_the_same(gen, monkeypatch):
    lin = QG.PackedLinear(qt(gen, 40, 256))
    x, gain = torch.randn(256, generator=gen), torch.rand(256, generator=gen) + 0.5
    plain = QG.gemv(lin, x, torch.full((40,), float("nan")), norm_gain=gain, eps=EPS, block=(8, 2))
    rs = ranges(gen, 5)
    before = [t.clone() for t, _ in rs]
    monkeypatch.setattr(PF, "COUNT_LINES", True)
    out = QG.gemv(lin, x, torch.full((40,), float("nan")), norm_gain=gain, eps=EPS, block=(8, 2),
                  pdl_family="gdn_in", prefetch=rs)
    assert torch.equal(out, plain)
    for (t, n), b in zip(rs, before):
        assert torch.equal(t, expected_counts(b, n)), f"seed {gen.initial_seed()}"


def test_gdn_decode_requests_its_ranges_and_computes_the_same(gen, monkeypatch):
    hk, hv, dk, dv = 2, 4, 32, 64
    proj = torch.randn(2 * hk * dk + 2 * hv * dv + 2 * hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    a_log, dt_bias = torch.rand(hv, generator=gen) + 0.5, torch.randn(hv, generator=gen) * 0.1
    gain = torch.rand(dv, generator=gen) + 0.5
    outs = []
    rs = ranges(gen, 3, empty_ok=False)
    before = [t.clone() for t, _ in rs]
    for count in (False, True):
        monkeypatch.setattr(PF, "COUNT_LINES", count)
        st, out = state.clone(), torch.full((hv * dv,), float("nan"))
        GD.gdn_decode(proj, st, a_log, dt_bias, gain, EPS, GD.GDNScratch(hv, dv, "cpu"), out, hk,
                      prefetch=rs if count else None)
        outs.append((st, out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for (t, n), b in zip(rs, before):
        assert torch.equal(t, expected_counts(b, n)), f"seed {gen.initial_seed()}"


def test_moe_requests_the_routed_experts_down_rows_and_its_ranges(gen, monkeypatch):
    """gate_up in the test mode: down's words, scales and biases of exactly the experts it routed to and the
    shared one (stand-ins with expert blocks of any size, counted), its own ranges; down its ranges; the MoE's
    result the same bits as without."""
    E, I, H, top_k = 8, 64, 128, 3
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    ex = MD.PackedExperts(*w)
    router = QG.PackedLinear(qt(gen, E + 1, H, bits=8, std=0.3 * H ** -0.5))
    h, gain = torch.randn(H, generator=gen), torch.rand(H, generator=gen) + 0.5
    p = QG.perm64_index(H)
    words = int(torch.randint(33, 200, (1,), generator=gen))    # an expert's block: not a whole number of lines
    sb_words = int(torch.randint(1, 70, (1,), generator=gen))
    fake = types.SimpleNamespace(
        w=torch.randint(-2**30, 2**30, (E + 1, words), generator=gen, dtype=torch.int32),
        s=torch.randint(-2**30, 2**30, (E + 1, sb_words), generator=gen, dtype=torch.int32),
        b=torch.randint(-2**30, 2**30, (E + 1, sb_words), generator=gen, dtype=torch.int32))
    before = types.SimpleNamespace(w=fake.w.clone(), s=fake.s.clone(), b=fake.b.clone())
    gu_rs, dn_rs = ranges(gen, 6), ranges(gen, 2, empty_ok=False)
    gu_before, dn_before = [t.clone() for t, _ in gu_rs], [t.clone() for t, _ in dn_rs]
    results = []
    for count in (False, True):
        monkeypatch.setattr(PF, "COUNT_LINES", count)
        sc = MD.MoEScratch(E, top_k, I)
        out, out_p = h.clone(), h[p].clone()
        MD.moe_route(router, out, gain, EPS, sc)
        MD.moe_gate_up(ex, out_p, gain[p], EPS, sc, prefetch=gu_rs if count else None,
                       prefetch_down=fake if count else None)
        MD.moe_down(ex, out, out_p, sc, prefetch=dn_rs if count else None)
        results.append((out, out_p, sc.route_e.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    chosen = set(results[1][2].tolist())
    assert len(chosen) == top_k + 1 and E in chosen
    for e in range(E + 1):
        times = int(e in chosen)
        for name in ("w", "s", "b"):
            t, b = getattr(fake, name)[e], getattr(before, name)[e]
            assert torch.equal(t, expected_counts(b, b.numel() * 4, times)), \
                f"seed {gen.initial_seed()}: expert {e} {name} (chosen: {sorted(chosen)})"
    for (t, n), b in zip(gu_rs + dn_rs, gu_before + dn_before):
        assert torch.equal(t, expected_counts(b, n)), f"seed {gen.initial_seed()}"


def test_the_step_requests_each_next_stages_static_reads():
    """FastModel's plan: each stage requests what the next one reads whatever the step computes (attention
    passing its turn on), gate_up nothing static (down's rows come with its routing), the last stages nothing."""
    from lily.model.fast import FastModel
    from lily.synthetic import random_weights
    fast = FastModel(TINY, random_weights(TINY, seed=3, device="cpu"), device="cpu")
    st = fast.new_state(max_seq=8)
    plan = fast.prefetch_plan(st)
    assert [n for n, _ in plan] == [n for n, *_ in fast.step_plan(st)]
    ptrs = [[t.data_ptr() for t, _ in pf] for _, pf in plan]
    names = [n for n, _ in plan]

    def lin(x):
        return [x.w.data_ptr(), x.s.data_ptr(), x.b.data_ptr()]
    gi = ai = 0
    i = 1
    for li, (kind, mix, moe, *_) in enumerate(fast.layers):
        ex = moe.experts
        E = ex.n_experts
        if kind == "full_attention":
            assert names[i:i + 3] == ["attn_qkv", "attn_core", "attn_o"]
            assert ptrs[i] == lin(mix.o_proj) and ptrs[i + 1] == []
            assert ptrs[i + 2] == lin(moe.router)
            i += 3
            ai += 1
        else:
            assert names[i:i + 3] == ["gdn_in", "gdn_core", "gdn_out"]
            assert ptrs[i] == [st.rec_state[gi].data_ptr()]
            assert plan[i][1][0][1] == st.rec_state[gi].numel() * 4
            assert ptrs[i + 1] == lin(mix.out_proj)
            assert ptrs[i + 2] == lin(moe.router)
            i += 3
            gi += 1
        assert names[i:i + 3] == ["moe_router", "moe_gate_up", "moe_down"]
        assert ptrs[i] == [ex.gate.w[E].data_ptr(), ex.gate.s[E].data_ptr(), ex.gate.b[E].data_ptr(),
                           ex.up.w[E].data_ptr(), ex.up.s[E].data_ptr(), ex.up.b[E].data_ptr()]
        assert plan[i][1][0][1] == ex.gate.w[E].numel() * 4
        assert ptrs[i + 1] == []
        if li + 1 < len(fast.layers):
            nxt_kind, nxt_mix = fast.layers[li + 1][:2]
            assert ptrs[i + 2] == lin(nxt_mix.qkv if nxt_kind == "full_attention" else nxt_mix.in_proj)
        else:
            assert ptrs[i + 2] == []
        i += 3
    assert names[i:] == ["lm_head", "greedy"] and ptrs[i:] == [[], []] and ptrs[0] == []
