"""Comparing a bf16 engine with the fp32 reference through the MoE router's near-ties.

Where the reference's k-th and (k+1)-th router logits are closer than the engine's own router-logit
error, any bf16 engine may honestly pick the other expert, and the flip then spreads to later positions
(through attention and the GDN state) and layers. So the engine is made to follow the reference's
routing: before each MoE layer routes, the engine's router logits are compared with the reference's
for the same rows, and at a row where the two pick different experts (each such row must be a near-tie:
the reference's margin below twice the engine's largest router-logit error in that row; anything else is
a routing bug and fails) the engine's logits of the swapped experts are exchanged, so its own routing
kernel picks the reference's experts with weights within its error. Then no position needs an excuse:
every row of logits, caches and state must match closely.

    with reference_router(ref) as ref_calls:
        want = ref.forward(ids, state)                    # the reference first: its routing is followed
    with fast_prefill_routing(monkeypatch, ref_calls, config) as routing:
        got = prefill_forward(...)                        # (fast_decode_routing for the decode step)
    assert_logits_close(got, want, PREFILL_LIMIT, "...")

The engine's router logits are taken where it computes them: lily.model.fast_prefill's moe_topk
(prefill) and lily.model.fast's moe_route (the decode step).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from helpers_tensors import row_rel

# An engine's relative error per row (a position's logits, a cache or state row) against the fp32
# reference, its routing following the reference's, at the tiny config: through the decode step (bf16 KV
# and conv state) <= 7e-3 over 90 weight seeds; through the prefill kernels ~1e-2 median and 1.4e-2 to
# 2.4e-2 worst over 20 seeds under the interpreter's truncating bf16 casts (less on a GPU), but one position
# of test_state_pool's 7-token prompt reached 4.3e-2 (LILY_TEST_SEED=3787114057, routing followed; the same at
# 67dd917, before any kernel change of that day), and one row of test_kernels_prefill's 29-token prompt 5.6e-2
# (LILY_TEST_SEED=3126911885, the same at 976e23c: the router input of layer 2 at one position 9.3 % off where
# layer 1's was 0.7 %; 52 other seeds of that test <= 2.8e-2 worst). Wrong math is off by O(1); a missed key or
# expert in one row by 5-20 % in that row (the kernel tests catch those at far tighter bounds,
# scripts/mutation_check.py; its routing mutations are caught here too).
DECODE_LIMIT = 2e-2
PREFILL_LIMIT = 8e-2
# The median position of a prompt's logits through the prefill kernels: 0.9-1.1e-2 (10 seeds of
# test_kernels_prefill's, the one above among them); the prefill's routing without the top-k renormalisation
# puts it at 4-6e-2.
PREFILL_MEDIAN_LIMIT = 3e-2


@contextmanager
def reference_router(model):
    """Records the router logits [T, E] of each MoE layer a ReferenceModel runs, in call order."""
    calls: list[torch.Tensor] = []
    linear = model._linear

    def recording(x, name):
        y = linear(x, name)
        if name.endswith("mlp.gate"):
            calls.append(y.detach().float().cpu().clone())
        return y

    model._linear = recording
    try:
        yield calls
    finally:
        model._linear = linear


class FollowReference:
    """The reference's routing, layer by layer, for the engine to follow (see the module's docstring).
    `flips`: (layer, position, reference margin, engine error) of each row where the engine's own choice
    differed and was a near-tie; `not_ties`: the same where it was not (a bug)."""

    def __init__(self, ref_calls: list[torch.Tensor], config):
        L = config.num_hidden_layers
        assert ref_calls and len(ref_calls) % L == 0, f"{len(ref_calls)} reference router calls for {L} layers"
        self.layers = [torch.cat(ref_calls[i::L]) for i in range(L)]  # [T, E] per layer, every pass
        self.k = config.num_experts_per_tok
        self.done = [0] * L       # rows of each layer followed so far
        self.calls = 0
        self.flips: list[tuple] = []
        self.not_ties: list[tuple] = []

    def follow(self, logits: torch.Tensor) -> torch.Tensor:
        """The engine's router logits [T, E] of its next MoE call -> the logits to route with."""
        layer = self.calls % len(self.layers)
        self.calls += 1
        start = self.done[layer]
        ref = self.layers[layer][start:start + logits.shape[0]]
        self.done[layer] += logits.shape[0]
        eng = logits.detach().float().cpu()
        assert ref.shape == eng.shape, f"layer {layer}: engine router logits {tuple(eng.shape)}, reference {tuple(ref.shape)}"
        k = self.k
        top = ref.topk(k + 1, dim=-1)
        margin = top.values[:, k - 1] - top.values[:, k]
        err = (eng - ref).abs().amax(-1)
        mine = eng.topk(k, dim=-1).indices
        out = logits
        for t in range(eng.shape[0]):
            want, got = set(top.indices[t, :k].tolist()), set(mine[t].tolist())
            if want == got:
                continue
            row = (layer, start + t, float(margin[t]), float(err[t]))
            (self.flips if margin[t] < 2 * err[t] else self.not_ties).append(row)
            if out is logits:
                out = logits.clone()
            for e_in, e_out in zip(sorted(want - got), sorted(got - want)):
                out[t, e_in], out[t, e_out] = logits[t, e_out], logits[t, e_in]
        return out

    def check(self) -> None:
        """Every reference row was followed, and the engine's own routing differed only at near-ties."""
        assert self.done == [x.shape[0] for x in self.layers], f"rows followed {self.done}, reference {self.layers[0].shape[0]}"
        assert not self.not_ties, ("the engine routed differently where the reference's top-k margin exceeds its "
                                   f"router-logit error (layer, position, margin, error): {self.not_ties}")


@contextmanager
def fast_prefill_routing(monkeypatch, ref_calls, config):
    """lily.model.fast_prefill's MoE layers follow the reference's routing (its moe_topk kernel still does
    the routing, on the followed logits); yields the FollowReference, checked on a clean exit."""
    import lily.model.fast_prefill as fast_prefill
    from lily.kernels.moe_routing import summed_partials

    routing = FollowReference(ref_calls, config)
    topk = fast_prefill.moe_topk

    def following(logits, k, renormalize=True, shared=False):
        logits = summed_partials(logits)   # (the router's K-split partials, summed as moe_topk does)
        # with the shared expert's gate as the last column, the routed columns are followed, the gate kept
        routed = logits[:, :-1] if shared else logits
        followed = routing.follow(routed)
        if shared:
            followed = logits if followed is routed else torch.cat([followed, logits[:, -1:]], 1)
        return topk(followed, k, renormalize, shared=shared)

    with monkeypatch.context() as m:
        m.setattr(fast_prefill, "moe_topk", following)
        yield routing
    routing.check()


@contextmanager
def fast_decode_routing(monkeypatch, ref_calls, config):
    """lily.model.fast's decode step follows the reference's routing: after its router GEMV writes the
    logits (the last row is the shared expert's gate), the followed ones replace them for the routing
    kernel; yields the FollowReference, checked on a clean exit."""
    import lily.model.fast as fast

    routing = FollowReference(ref_calls, config)
    route = fast.moe_route

    def following(router, h, gain, eps, sc, *args, **kwargs):
        route(router, h, gain, eps, sc, *args, **kwargs)
        experts = sc.logits[:-1]
        experts.copy_(routing.follow(experts[None])[0])

    with monkeypatch.context() as m:
        m.setattr(fast, "moe_route", following)
        yield routing
    routing.check()


def assert_logits_close(engine: torch.Tensor, reference: torch.Tensor, limit: float, what: str,
                        median_limit: float | None = None) -> None:
    """Logits [T, V]: every position's relative error within `limit` (and their median within median_limit:
    an error in every position, as a wrong routing weight makes, fails even where no one row is far off),
    and the greedy token equal wherever the reference's top-2 margin exceeds twice that position's largest
    logit error."""
    err = row_rel(engine, reference)
    msg = f"{what}: relative error per position {[f'{e:.1e}' for e in err.tolist()]}"
    assert float(err.max()) < limit, f"{msg}: over {limit:.1e}"
    if median_limit is not None:
        assert float(err.median()) < median_limit, f"{msg}: median over {median_limit:.1e}"
    top2 = reference.topk(2, dim=-1).values
    decisive = ((top2[:, 0] - top2[:, 1]) > 2 * (engine - reference).abs().amax(-1)).cpu()
    assert torch.equal(engine.argmax(-1).cpu()[decisive], reference.argmax(-1).cpu()[decisive]), f"{msg}: greedy token"


def assert_fast_follows_reference(monkeypatch, backend, reference, what: str, steps: int = 3):
    """A random prompt through the fast backend's prefill kernels, then `steps` decode steps, against the
    reference model on the same weights (routing following its at near-ties): every position's logits within
    the paths' limits (the decode steps run on the state the prefill kernels left, whose error they carry; their
    own step's is DECODE_LIMIT's). Returns (the reference's state, the fast state, the tokens fed)."""
    import random

    c = reference.config
    ids = [random.randrange(c.vocab_size) for _ in range(random.randint(6, 12))]
    fed = [random.randrange(c.vocab_size) for _ in range(steps)]
    rs, fs = reference.new_state(), backend.new_state()
    with reference_router(reference) as calls:
        want = reference.forward(ids, rs, logits_for="all")
        want_steps = torch.stack([reference.forward([t], rs)[0] for t in fed])
    with fast_prefill_routing(monkeypatch, calls[:len(c.layer_types)], c):
        got = backend.prefill_logits(ids, fs)
    with fast_decode_routing(monkeypatch, calls[len(c.layer_types):], c):
        got_steps = torch.stack([backend.decode(t, fs) for t in fed])
    assert_logits_close(got, want, PREFILL_LIMIT, f"{what} prefill", PREFILL_MEDIAN_LIMIT)
    assert_logits_close(got_steps, want_steps, PREFILL_LIMIT, f"{what} decode steps")
    return rs, fs, ids + fed
