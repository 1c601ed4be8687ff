"""The batched decode kernels against their plain-torch references (TRITON_INTERPRET=1 on the CPU, tiny
shapes): B rows, each on its own slot of a pool at its own position (ragged lengths), rows in an order
that is not the slots' order, and padding rows past n_valid that must touch nothing. Fresh random inputs
each run (the seed is in the failure message); outputs are poisoned first, and so are the slots no row
owns, so a stray read or write shows up.
"""

from __future__ import annotations

import pytest
import torch
from helpers_tensors import assert_rows_close, assert_rows_within, new_generator
from test_kernels_prefill import moe_bf16_level

from lily.kernels import attention_decode_batch as AB
from lily.kernels import gdn_decode_batch as GB
from lily.kernels.attention_decode import rope_inv_freq
from lily.kernels.embedding import embed_reference, embed_rows
from lily.kernels.moe_grouped_gemm import moe_grouped, moe_grouped_reference
from lily.kernels.moe_route_batch import moe_route_rows, moe_route_rows_reference
from lily.kernels.quant_gemv import PackedLinear
from lily.quant import quantize

EPS = 1e-6
I32 = torch.int32

# Bounds on the worst row (a batch row's one head, or the row itself; a conv output's element over the
# RMS), each ~3x the worst measured over 27 seeds or more (LILY_MEASURE_FILE, tests/helpers_tensors.py)
# under the interpreter; one wrong row, head or element is off by far more.
CONV = 2.5e-6    # the conv step, fp32: worst element 8.6e-7, median 4e-7
GDN = 1e-5       # the gated delta step, fp32: output per head over its typical head (over itself a head had a
                 # tail to 9.8e-6, S^T q can be near zero), state per key row: 2.0e-6 worst over 57 seeds,
                 # medians 2.5e-7 (output) and 2.3e-7 (state); 2.5e-6 in test_kernels_decode
ATTN = 3e-6      # attention over the bf16 caches, fp32 dots here, per head: 7.2e-7 worst (1.0e-6 batch-1)
KV_ROW = 8e-3    # a written K/V row per head: the fp32 head truncated to bf16, each element by under 2^-7 of
                 # itself, so a row by under 7.8e-3: 5.9e-3 worst, 3.5e-3 median (a wrong element shows)
ROUTE = 5e-7     # the routing weights, fp32 softmax, per row: 1.8e-7 worst, 9e-8 median
# the grouped experts through the plan: 3x the bf16 level (moe_bf16_level: the same math with the kernel's
# bf16 casts), as the prefill's grouped MoE test; per row ~9e-3 there against a level of ~3-6e-3


@pytest.fixture
def gen():
    return new_generator()


def rn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def rows_of(gen, n_slots: int, n_valid: int, pad: int):
    """(slots int32 [n_valid + pad], n_valid int32 [1]): distinct slots in a shuffled order, pads on slot 0."""
    perm = torch.randperm(n_slots, generator=gen)[:n_valid]
    return torch.cat([perm, torch.zeros(pad, dtype=perm.dtype)]).to(I32), torch.tensor([n_valid], dtype=I32)


def test_embed_rows(gen):
    table = quantize((rn(gen, 300, 256) * 0.1).to(torch.bfloat16), bits=4)
    tokens = torch.randint(0, 300, (5,), generator=gen, dtype=I32)
    out = embed_rows(PackedLinear(table), tokens)
    for b, t in enumerate(tokens.tolist()):
        assert torch.equal(out[b], embed_reference(table, t)), gen.initial_seed()


def test_conv_step_rows(gen):
    n_slots, C, K, n_valid, pad = 5, 320, 4, 3, 2
    slots, nv = rows_of(gen, n_slots, n_valid, pad)
    state = rn(gen, n_slots, K - 1, C).to(torch.bfloat16)
    before = state.clone()
    conv_w = rn(gen, C, K) * 0.5
    proj = rn(gen, n_valid + pad, C + 7)
    m = proj.clone()
    GB.conv_step_rows(proj, conv_w, state, slots, nv, block=128)
    want_y, want_states = GB.conv_step_rows_reference(m[:n_valid, :C], conv_w,
                                                      [before[s].float() for s in slots[:n_valid].tolist()])
    assert_rows_within(proj[:n_valid, :C], want_y, CONV, f"seed {gen.initial_seed()}: conv rows", row_dims=0)
    assert torch.equal(proj[:, C:], m[:, C:]) and torch.equal(proj[n_valid:], m[n_valid:])  # pads untouched
    for b, s in enumerate(slots[:n_valid].tolist()):
        # (the interpreter's fp32 -> bf16 cast truncates: one bf16 step apart at most)
        assert torch.allclose(state[s].float(), want_states[b], rtol=2 ** -7, atol=0), gen.initial_seed()
    unused = sorted(set(range(n_slots)) - set(slots[:n_valid].tolist()))
    assert torch.equal(state[unused], before[unused])


def test_gdn_step_rows(gen):
    n_slots, hk, hv, dk, dv, n_valid, pad = 4, 2, 4, 32, 64, 3, 1
    slots, nv = rows_of(gen, n_slots, n_valid, pad)
    conv_dim, vd = 2 * hk * dk + hv * dv, hv * dv
    proj = rn(gen, n_valid + pad, conv_dim + vd + 2 * hv)
    state = rn(gen, n_slots, hv, dk, dv) * 0.1
    before = state.clone()
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen) * 15 + 1), rn(gen, hv) * 0.1
    out = torch.full((n_valid + pad, hv, dv), float("nan"))
    GB.gdn_step_rows(proj, state, a_log, dt_bias, slots, nv, hk, out=out, block_v=32)
    b_, a_ = proj[:n_valid, conv_dim + vd:conv_dim + vd + hv], proj[:n_valid, conv_dim + vd + hv:]
    want_o, want_s = GB.gdn_step_rows_reference(proj[:n_valid, :conv_dim], b_, a_,
                                                [before[s] for s in slots[:n_valid].tolist()], a_log, dt_bias, hk)
    assert_rows_within(out[:n_valid], want_o.reshape(n_valid, hv, dv), GDN, f"seed {gen.initial_seed()}: output", typical=True)
    assert out[n_valid:].isnan().all()                                  # the pad row wrote nothing
    for b, s in enumerate(slots[:n_valid].tolist()):
        assert_rows_within(state[s], want_s[b], GDN, f"seed {gen.initial_seed()}, row {b}: state")
    unused = sorted(set(range(n_slots)) - set(slots[:n_valid].tolist()))
    assert torch.equal(state[unused], before[unused])


def test_gdn_step_norm_rows(gen):
    """The state update and the gated RMSNorm in one launch (the last of a head's programs normalises it): the
    step's state and the normed bf16 rows against the references, twice (the counters back at zero between
    calls, as a CUDA graph's next replay needs), the pad row and the other slots untouched."""
    from lily.kernels.gdn_chunked import gated_rmsnorm_reference
    n_slots, hk, hv, dk, dv, n_valid, pad, eps = 4, 2, 4, 32, 64, 3, 1, 1e-6
    slots, nv = rows_of(gen, n_slots, n_valid, pad)
    conv_dim, vd = 2 * hk * dk + hv * dv, hv * dv
    state = rn(gen, n_slots, hv, dk, dv) * 0.1
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen) * 15 + 1), rn(gen, hv) * 0.1
    gain = rn(gen, dv).abs() + 0.5
    scratch = GB.StepNormScratch(n_valid + pad + 2, hv, dv, "cpu", block_v=16)   # 4 programs a head
    seed = f"seed {gen.initial_seed()}"
    for call in range(2):
        proj = rn(gen, n_valid + pad, conv_dim + vd + 2 * hv)
        before = state.clone()
        scratch.o.fill_(float("nan"))
        x = GB.gdn_step_norm_rows(proj, state, a_log, dt_bias, slots, nv, hk, gain, eps, scratch)
        b_, a_ = proj[:n_valid, conv_dim + vd:conv_dim + vd + hv], proj[:n_valid, conv_dim + vd + hv:]
        want_o, want_s = GB.gdn_step_rows_reference(proj[:n_valid, :conv_dim], b_, a_,
                                                    [before[s] for s in slots[:n_valid].tolist()], a_log, dt_bias, hk)
        want_x = gated_rmsnorm_reference(want_o.reshape(n_valid, hv, dv), proj[:n_valid, conv_dim:conv_dim + vd],
                                         gain, eps)
        assert x.dtype == torch.bfloat16 and x.shape == (n_valid + pad, vd)
        # bf16 rows: each element rounded once (KV_ROW's bound)
        assert_rows_within(x[:n_valid].float().reshape(n_valid, hv, dv), want_x.reshape(n_valid, hv, dv), KV_ROW,
                           f"{seed}, call {call}: normed output")
        for b, s in enumerate(slots[:n_valid].tolist()):
            assert_rows_within(state[s], want_s[b], GDN, f"{seed}, call {call}, row {b}: state")
        unused = sorted(set(range(n_slots)) - set(slots[:n_valid].tolist()))
        assert torch.equal(state[unused], before[unused])
        assert scratch.o[n_valid:].isnan().all()                        # the pad row wrote nothing
        assert not scratch.count.any()                                  # every head's counter set back
    with pytest.raises(ValueError, match="scratch"):
        GB.gdn_step_norm_rows(proj, state, a_log, dt_bias, slots, nv, hk, gain, eps,
                              GB.StepNormScratch(1, hv, dv, "cpu"))


@pytest.mark.parametrize("n_split", [1, 3])
def test_attention_decode_rows_ragged(gen, n_split):
    n_slots, max_seq, hq, hkv, D, rot = 4, 48, 4, 2, 64, 16
    lengths = [1, 9, 40]                                   # each row's position: 0, 8, 39 (ragged)
    n_valid, pad = len(lengths), 1
    slots, nv = rows_of(gen, n_slots, n_valid, pad)
    kc = rn(gen, n_slots, max_seq, hkv, D).to(torch.bfloat16)
    vc = rn(gen, n_slots, max_seq, hkv, D).to(torch.bfloat16)
    pos = torch.randint(0, max_seq, (n_slots,), generator=gen, dtype=I32)
    for s, n in zip(slots.tolist(), lengths):
        pos[s] = n - 1
        kc[s, n - 1:], vc[s, n - 1:] = float("nan"), float("nan")   # the row at pos is written, later rows unread
    untouched = [(s, kc[s].clone()) for s in range(n_slots) if s not in slots[:n_valid].tolist()]
    proj = rn(gen, n_valid + pad, hq * 2 * D + 2 * hkv * D)
    qn, kn = rn(gen, D).abs() + 0.5, rn(gen, D).abs() + 0.5
    inv = rope_inv_freq(rot, 1e7)
    out = AB.attention_decode_rows(proj, kc, vc, pos, slots, nv, qn, kn, inv, EPS, hq, n_split=n_split, block_t=16)
    live = slots[:n_valid].tolist()   # the reference reads the caches as the kernel left them (this token's row in)
    want, k_new, v_new = AB.attention_decode_rows_reference(proj[:n_valid], [kc[s] for s in live], [vc[s] for s in live],
                                                            [n - 1 for n in lengths], qn, kn, inv, EPS, hq)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(out[:n_valid].reshape(n_valid, hq, D), want.reshape(n_valid, hq, D), ATTN, f"{seed}: output")
    for b, (s, n) in enumerate(zip(slots.tolist(), lengths)):
        assert_rows_within(kc[s, n - 1].float(), k_new[b].reshape(hkv, D), KV_ROW, f"{seed}, row {b}: K row")
        assert_rows_within(vc[s, n - 1].float(), v_new[b].reshape(hkv, D), KV_ROW, f"{seed}, row {b}: V row")
        assert kc[s, n:].isnan().all()                     # nothing past the position
    for s, k in untouched:
        assert torch.equal(kc[s].view(torch.int16), k.view(torch.int16))


def stacked_experts(gen, E, I, H):
    """gate, up [E+1, I, H], down [E+1, H, I]: E routed experts and the shared one last, as the decode path
    stacks them."""
    def q(*shape):
        return quantize((rn(gen, *shape) * shape[-1] ** -0.5).to(torch.bfloat16), bits=4)
    return q(E + 1, I, H), q(E + 1, I, H), q(E + 1, H, I)


@pytest.mark.parametrize("top_k,norm_topk,block_m,rows_at_once", [(2, True, 16, 8), (3, False, 2, 2)])
def test_moe_route_rows_plan_and_grouped_experts(gen, monkeypatch, top_k, norm_topk, block_m, rows_at_once):
    from lily.kernels import moe_route_batch
    monkeypatch.setattr(moe_route_batch, "ROWS_AT_ONCE", rows_at_once)   # 2: several passes, counts carried
    E, I, H, n_valid, pad = 8, 64, 128, 5, 2
    logits = rn(gen, n_valid + pad, E + 1) * 2
    nv = torch.tensor([n_valid], dtype=I32)
    plan, w = moe_route_rows(logits, nv, top_k, norm_topk, block_m=block_m)
    ids, want_w = moe_route_rows_reference(logits[:n_valid], top_k, norm_topk)
    k1 = top_k + 1
    got_w = w.view(-1, k1)[:n_valid]
    assert_rows_within(got_w, want_w, ROUTE, f"seed {gen.initial_seed()}: routing weights")
    # the plan: each valid pair exactly once, in blocks of one expert, pads nowhere
    seen = []
    for e, s, t in zip(plan.block_expert.tolist(), plan.block_start.tolist(), plan.block_end.tolist()):
        if e >= plan.num_experts:
            continue
        rows = plan.slots[s:min(s + block_m, t)].tolist()
        assert rows and all(int(ids.view(-1)[p]) == e for p in rows), (e, rows)
        seen += rows
    assert sorted(seen) == list(range(n_valid * k1)), gen.initial_seed()
    # the prefill's grouped expert GEMMs run the batch through the plan
    gate, up, down = stacked_experts(gen, E, I, H)
    x = rn(gen, n_valid + pad, H).to(torch.bfloat16)
    out = torch.zeros(n_valid + pad, H)
    moe_grouped(x, plan, w, gate, up, down, out=out)
    want = moe_grouped_reference(x[:n_valid], ids, want_w, gate, up, down)
    assert_rows_close(out[:n_valid], want, f"seed {gen.initial_seed()}: experts",   # bf16 activations between the GEMMs
                      level=moe_bf16_level(x[:n_valid], ids, want_w, gate, up, down, want))


def test_moe_route_rows_all_pads(gen):
    """n_valid 0 (the warm-up of a graph bucket): no block is live."""
    plan, _ = moe_route_rows(rn(gen, 4, 9), torch.tensor([0], dtype=I32), 2)
    assert all(e >= plan.num_experts for e in plan.block_expert.tolist())

