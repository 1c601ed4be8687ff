"""lily.kernels.router_partials: the MoE router's logits accumulated by the out-projection before it (TRITON_INTERPRET=1
on the CPU, tiny shapes, fresh random inputs each run; the seed is printed on failure)."""

from __future__ import annotations

import random

import pytest
import torch

from lily.config import TINY
from lily.kernels import moe_decode as MD
from lily.kernels import quant_gemv as QG
from lily.kernels.router_partials import decode_accumulators, router_logits_reference
from lily.quant import quantize

from helpers_routing import fast_decode_routing, reference_router
from helpers_tensors import assert_rows_within

EPS = 1e-6
LOGITS = 1e-5   # the router's logits, each over their RMS: fp32 sums in another order, the fixed point's 2^-24
                # relative rounding of each block's share (a wrong word, scale or block is off by O(1))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def qt(gen, *shape, bits=4, std=None):
    return quantize((torch.randn(*shape, generator=gen) * (std or shape[-1] ** -0.5)).to(torch.bfloat16), bits=bits)


@pytest.mark.parametrize("block", [None, (8, 2), (16, 3)])
def test_out_projection_accumulates_the_routers_logits(gen, block):
    """An out-projection (residual in place, PERM64 copy) with router_into: h as before, and the accumulators
    hold the router's logits of RMSNorm(h) * gain and sum h^2; they were zeroed by another GEMV's zero=."""
    n, k, E = 128, 256, 11
    lin = QG.PackedLinear(qt(gen, n, k))
    router_q = qt(gen, E + 1, n, bits=8, std=2.0 * n ** -0.5)
    router = QG.PackedLinear(router_q)
    x, h0, gain = torch.randn(k, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen) + 0.5
    racc = torch.randint(-2**40, 2**40, (E + 2,), generator=gen, dtype=torch.int64)        # poisoned
    QG.gemv(lin, x, torch.full((n,), float("nan")), zero=racc)                             # the in-projection's zero=
    assert int(racc.abs().sum()) == 0
    plain = h0.clone()
    QG.gemv(lin, x, plain, residual=plain, block=block)
    h, h_p = h0.clone(), torch.full((n,), float("nan"))
    QG.gemv(lin, x, h, residual=h, out2=h_p, block=block, router_into=(router, gain, racc))
    assert torch.equal(h, plain) and torch.equal(h_p, h[QG.perm64_index(n)])
    ref = router_logits_reference(h, router_q.dequantize(torch.float32), gain, EPS)
    assert_rows_within(decode_accumulators(racc, n, EPS), ref, LOGITS, f"seed {gen.initial_seed()}: logits", row_dims=0)
    assert abs(float(racc[-1]) / 2**20 - float(h.pow(2).sum())) <= 1e-5 * float(h.pow(2).sum())
    if block is not None:
        # the blocks' shares are integers: the same blocks arriving in another order (another number of programs
        # walking them) give the same bits
        again = torch.zeros_like(racc)
        h2 = h0.clone()
        QG.gemv(lin, x, h2, residual=h2, block=(block[0], 5), router_into=(router, gain, again))
        assert torch.equal(again, racc)


def test_router_into_checks_what_it_is_given(gen):
    lin = QG.PackedLinear(qt(gen, 64, 128))
    router4 = QG.PackedLinear(qt(gen, 9, 64))
    router8 = QG.PackedLinear(qt(gen, 9, 64, bits=8))
    out = torch.zeros(64)
    with pytest.raises(ValueError, match="8-bit router"):
        QG.gemv(lin, torch.randn(128), out, residual=out, router_into=(router4, torch.ones(64),
                                                                         torch.zeros(10, dtype=torch.int64)))
    with pytest.raises(ValueError, match="int64 accumulators"):
        QG.gemv(lin, torch.randn(128), out, residual=out, router_into=(router8, torch.ones(64),
                                                                         torch.zeros(10, dtype=torch.float32)))


@pytest.mark.parametrize("top_k,norm_topk", [(2, True), (3, False)])
def test_moe_routes_from_the_accumulators_as_from_the_logits(gen, top_k, norm_topk):
    """gate_up (and down routing itself) from the accumulators: the experts and weights of the router GEMV's
    logits, the MoE's output within the logits' rounding."""
    E, I, H = 8, 64, 128
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    ex = MD.PackedExperts(*w)
    router_q = qt(gen, E + 1, H, bits=8, std=0.3 * H ** -0.5)
    router = QG.PackedLinear(router_q)
    o_lin = QG.PackedLinear(qt(gen, H, 256))
    o, h0, gain = torch.randn(256, generator=gen), torch.randn(H, generator=gen), torch.rand(H, generator=gen) + 0.5
    p = QG.perm64_index(H)
    outs = {}
    for fused in (False, True):
        sc = MD.MoEScratch(E, top_k, I)
        sc.act.fill_(float("nan"))
        racc = torch.zeros(E + 2, dtype=torch.int64)
        h, h_p = h0.clone(), torch.full((H,), float("nan"))
        QG.gemv(o_lin, o, h, residual=h, out2=h_p, block=(16, 2), router_into=(router, gain, racc) if fused else None)
        if not fused:
            MD.moe_route(router, h, gain, EPS, sc, norm_topk)
        MD.moe_gate_up(ex, h_p, gain[p], EPS, sc, norm_topk=norm_topk, racc=racc if fused else None)
        routing = sc.route_e.clone(), sc.route_w.clone()
        sc.route_e.fill_(0)                       # down routing itself must not read gate_up's
        sc.route_w.fill_(float("nan"))
        MD.moe_down(ex, h, h_p, sc, norm_topk=norm_topk, route_self=True, racc=racc if fused else None, eps=EPS)
        outs[fused] = h, routing
    (h_a, (e_a, w_a)), (h_b, (e_b, w_b)) = outs[False], outs[True]
    seed = f"seed {gen.initial_seed()}"
    assert torch.equal(e_a, e_b), seed
    assert torch.allclose(w_a, w_b, rtol=1e-5, atol=1e-7), seed
    assert_rows_within(h_b - h0, h_a - h0, 1e-4, f"{seed}: moe output", row_dims=0)


def test_the_decode_step_with_and_without_the_router_launch(monkeypatch):
    """FastModel (TINY, eager): the fused step drops one launch a layer and decodes what the router GEMV's step
    decodes: its own routing never departs from the reference's but at near-ties (which both then follow:
    helpers_routing; a router row, layer or step mixed up would route elsewhere), its logits within the bf16
    caches' rounding (a 1e-7 change of a K, V or conv-state element can round it to its neighbour: 6e-7 to
    3.6e-5 of the logits measured; on the fp32 dots: the fp16-pair dot's rounding does the same to x)."""
    from lily.model import fast as F
    monkeypatch.setattr(QG, "HALF_DOT", False)
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights
    weights = random_weights(TINY, seed=random.randrange(2**31), device="cpu")
    fast = F.FastModel(TINY, weights, device="cpu")
    ref = ReferenceModel(TINY, weights)
    toks = [int(t) for t in torch.randint(0, TINY.vocab_size, (3,))]
    rs = ref.new_state()
    with reference_router(ref) as ref_calls:
        for t in toks:
            ref.forward([t], rs)
    logits, launches = {}, {}
    for fuse in (False, True):
        monkeypatch.setattr(F, "FUSE_ROUTER", fuse)
        st = fast.new_state(max_seq=8)
        with fast_decode_routing(monkeypatch, ref_calls, TINY) as routing:
            logits[fuse] = torch.stack([fast.decode(t, st).clone() for t in toks])
        assert not routing.not_ties
        launches[fuse] = fast.launches_per_step()
    assert launches[False] - launches[True] == TINY.num_hidden_layers
    rel = float((logits[True] - logits[False]).abs().max() / logits[False].abs().max())
    assert rel < 1e-3, rel
