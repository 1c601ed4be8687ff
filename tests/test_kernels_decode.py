"""Decode kernels against their plain-torch references (TRITON_INTERPRET=1 on the CPU, tiny shapes).

Every check draws fresh random inputs (the seed is printed on failure) and poisons the outputs first,
so an unwritten element or a wrong index shows up as NaN or a large error.
"""

from __future__ import annotations

import random

import pytest
import torch

from lily.config import FULL
from lily.engine.constraints import apply_token_bitmask
from lily.kernels import attention_decode as AD
from lily.kernels import gdn_decode as GD
from lily.kernels import moe_decode as MD
from lily.kernels import quant_gemv as QG
from lily.kernels.embedding import embed, embed_reference
from lily.kernels.greedy import greedy_finish
from lily.quant import quantize

from helpers_tensors import assert_rows_within

EPS = 1e-6

# Bounds on the worst row (a head's D values; an element, over the vector's RMS, for a GEMV's output),
# each ~3x the worst measured over 27 seeds (LILY_MEASURE_FILE, tests/helpers_tensors.py) under the
# interpreter; one wrong element or head is off by far more.
GEMV = 1e-5      # fp32 dot products of dequantized weights, each element: 3.6e-6 worst (the MoE's output;
                 # 2.6e-6 for a plain GEMV at K=4096), medians 1-1.7e-6
CONV = 9e-6      # the conv step on the fused GEMV: 2.9e-6 worst, 1.3e-6 median
GDN = 1e-5       # the decode gated delta step, fp32: per head of the output over its typical head (the norm
                 # passes on S^T q's relative error, large where S^T q is near zero: over itself a head had a
                 # tail), per key row of the state: 2.5e-6 and 7.2e-7 worst over 45 seeds (medians 2.1e-7 and
                 # 2.2e-7: a long tail); 2.0e-6 in test_kernels_batch
HALF_GEMV = 6e-3   # the 4-bit codes' dot in fp16 pairs (lily.kernels.half_dot: x and each product rounded to fp16,
                   # an FMA rounds twice under the interpreter): 2.4e-3 worst over 12 seeds, medians 1-2e-3;
                   # a wrong word, group or scale is off by O(1)
HALF_CONV = 6e-3  # the conv step on such a GEMV's rows: 1.8e-3 worst
HALF_MOE = 1.2e-2  # the MoE's output with gate_up and down on the fp16-pair dot (two roundings in a row, act in
                   # fp16): 4.4e-3 worst over 18 seeds, medians 2.5-3e-3; a wrong word, group, scale or slot
                   # weight is off by O(1)
ATTN = 3e-6      # decode attention over a bf16 cache (fp32 dots here), per head: 1.0e-6 worst, 4e-7 median
KV_ROW = 8e-3    # a K/V cache row per head: the fp32 head truncated to bf16, each element by under 2^-7 of
                 # itself, so a row by under 7.8e-3: 4.3e-3 worst here, 5.9e-3 in test_kernels_batch


@pytest.fixture(params=[False, True], ids=["fp32-dot", "half-dot"])
def half_dot(request, monkeypatch):
    """Both codes dots of the 4-bit GEMV and the MoE decode kernels (quant_gemv.HALF_DOT)."""
    monkeypatch.setattr(QG, "HALF_DOT", request.param)
    return request.param


def gemv_bound(half: bool, bits: int = 4) -> float:
    return HALF_GEMV if half and bits == 4 else GEMV


@pytest.fixture
def gen():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    return g


def rn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def qt(gen, *shape, bits=4, std=None):
    return quantize((rn(gen, *shape) * (std or shape[-1] ** -0.5)).to(torch.bfloat16), bits=bits)


def nan(*shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("bits,n,k", [(4, 40, 128), (8, 9, 192), (4, 24, 4096)])
def test_gemv_plain_norm_residual(gen, half_dot, bits, n, k):
    w = qt(gen, n, k, bits=bits)
    lin = QG.PackedLinear(w)
    x, gain, res = rn(gen, k), rn(gen, k).abs() + 0.5, rn(gen, n)
    out = nan(n)
    QG.gemv(lin, x, out)
    bound = gemv_bound(half_dot, bits)
    assert_rows_within(out, QG.gemv_reference(w, x), bound, f"seed {gen.initial_seed()}: plain gemv", row_dims=0)
    for block in (None, (8, 2)):   # (8, 2): programs of several blocks, each block's residual read a block ahead
        out = res.clone()
        QG.gemv(lin, x, out, norm_gain=gain, eps=EPS, residual=out, block=block)
        assert_rows_within(out - res, QG.gemv_reference(w, QG.rmsnorm_reference(x, gain, EPS)), bound,
                           f"seed {gen.initial_seed()}: gemv norm residual, block {block}", row_dims=0)


@pytest.mark.parametrize("n,k", [(40, 256), (37, 320), (24, 2048)])
def test_gemv_prologue_sums_from_the_codes_and_unmasked_tiles(gen, monkeypatch, n, k):
    """quant_gemv.SUMS_FROM_CODES (the pair-dot prologue's group sums, sum of squares and largest |x| from the dot's
    own loads of x) and EVEN_TILES (whole blocks of rows, whole rows of groups: tiles loaded without masks): each
    setting within the pair dot's bound of the reference, with and without the RMSNorm prologue; the masked and
    unmasked tiles bit for bit the same; the two prologues within float rounding of each other. (40, 256): whole
    blocks of 8 rows; 37 rows: a partial last block; K = 320: 5 groups, padded to 8 with masks."""
    monkeypatch.setattr(QG, "HALF_DOT", True)
    w = qt(gen, n, k)
    lin = QG.PackedLinear(w)
    p = QG.perm64_index(k)
    x, gain = rn(gen, k), rn(gen, k).abs() + 0.5
    seed = f"seed {gen.initial_seed()}"
    for norm in (None, gain):
        ref = QG.gemv_reference(w, x if norm is None else QG.rmsnorm_reference(x, gain, EPS))
        outs = {}
        for sums in (False, True):
            for even in (False, True):
                monkeypatch.setattr(QG, "SUMS_FROM_CODES", sums)
                monkeypatch.setattr(QG, "EVEN_TILES", even)
                outs[(sums, even)] = QG.gemv(lin, x[p], nan(n), norm_gain=None if norm is None else gain[p], eps=EPS,
                                             perm_x=True, block=(8, 2))
                assert_rows_within(outs[(sums, even)], ref, HALF_GEMV,
                                   f"{seed}: sums {sums}, even {even}, norm {norm is not None}", row_dims=0)
        for sums in (False, True):
            assert torch.equal(outs[(sums, False)], outs[(sums, True)]), seed
        torch.testing.assert_close(outs[(True, True)], outs[(False, True)], rtol=1e-5,
                                   atol=1e-5 * float(ref.abs().max()), msg=seed)


def test_half_dot_off_keeps_a_call_site_on_the_fp32_dot(gen, monkeypatch):
    """quant_gemv.HALF_DOT_OFF (LILY_HALF_DOT_OFF): a call site named there takes the fp32 dot (the same bits as
    HALF_DOT off), the others keep the fp16-pair dot (a different rounding)."""
    w = qt(gen, 192, 256)
    lin = QG.PackedLinear(w)
    x, gain = rn(gen, 256), rn(gen, 256).abs() + 0.5
    outs = {}
    for half, off, site in [(False, frozenset(), "gdn_out"), (True, frozenset({"gdn_out"}), "gdn_out"),
                            (True, frozenset({"gdn_out"}), "gdn_in")]:
        monkeypatch.setattr(QG, "HALF_DOT", half)
        monkeypatch.setattr(QG, "HALF_DOT_OFF", off)
        outs[(half, site)] = QG.gemv(lin, x, nan(192), norm_gain=gain, eps=EPS, pdl_family=site)
    assert torch.equal(outs[(True, "gdn_out")], outs[(False, "gdn_out")])
    assert not torch.equal(outs[(True, "gdn_in")], outs[(False, "gdn_out")])
    ref = QG.gemv_reference(w, QG.rmsnorm_reference(x, gain, EPS))
    assert_rows_within(outs[(True, "gdn_in")], ref, HALF_GEMV, f"seed {gen.initial_seed()}: half dot", row_dims=0)


def test_half_dot_off_keeps_the_lm_heads_argmax_blocks_on_fp32(gen, monkeypatch):
    """LILY_HALF_DOT_OFF=lm_head: the lm_head's argmax blocks keep the fp32 dot (the same bits as HALF_DOT off);
    unset, no call site does."""
    assert QG.parse_half_dot_off(None) == frozenset()
    assert QG.parse_half_dot_off("") == frozenset()
    assert QG.parse_half_dot_off(" gate_up, lm_head ") == frozenset({"gate_up", "lm_head"})
    monkeypatch.setattr(QG, "HALF_DOT_OFF", QG.parse_half_dot_off("lm_head"))
    w = qt(gen, 192, 256)
    lin = QG.PackedLinear(w)
    x, gain = rn(gen, 256), rn(gen, 256).abs() + 0.5
    outs = {}
    for half in (False, True):
        monkeypatch.setattr(QG, "HALF_DOT", half)
        npart = QG.gemv_programs(lin, (16, 2))
        outs[half] = QG.gemv(lin, x, nan(192), norm_gain=gain, eps=EPS, block=(16, 2), pdl_family="lm_head",
                             argmax=(nan(npart), torch.full((npart,), -1, dtype=torch.int32)))
    assert torch.equal(outs[True], outs[False])


def test_gemv_blocks_cover_all_rows(gen, half_dot):
    """Several programs, partial last block, groups tiled over two chunks: still every row right."""
    w = qt(gen, 37, 4096)
    lin = QG.PackedLinear(w)
    x = rn(gen, 4096)
    out = nan(37)
    QG.gemv(lin, x, out, block=(8, 32))
    assert_rows_within(out, QG.gemv_reference(w, x), gemv_bound(half_dot), f"seed {gen.initial_seed()}: blocks",
                       row_dims=0)


def gpu_choice(monkeypatch, module, fn, *args):
    """What `fn` picks on a GPU (its launch choices differ under the interpreter): called with the
    module's INTERPRET flag off."""
    with monkeypatch.context() as m:
        m.setattr(module, "INTERPRET", False)
        return fn(*args)


# (rows, columns) of the full model's decode GEMVs that pick differently on the GPU
FULL_GEMVS = {"projection": (FULL.linear_conv_dim + FULL.linear_value_dim + 2 * FULL.linear_num_value_heads,
                             FULL.hidden_size),
              "out_proj": (FULL.hidden_size, FULL.linear_value_dim), "lm_head": (FULL.vocab_size, FULL.hidden_size)}


@pytest.mark.parametrize("matrix", FULL_GEMVS)
def test_gemv_with_the_gpus_block_choice(gen, half_dot, monkeypatch, matrix):
    """The rows per block, programs per SM and warps the GPU picks for each kind of the full model's
    GEMVs, passed explicitly on a small matrix (many blocks a program, a partial last one)."""
    bn, per_sm, warps = gpu_choice(monkeypatch, QG, QG.pick_block, *FULL_GEMVS[matrix], 4)
    w = qt(gen, 203, 512)
    lin = QG.PackedLinear(w)
    x, gain, res = rn(gen, 512), rn(gen, 512).abs() + 0.5, rn(gen, 203)
    out = res.clone()
    QG.gemv(lin, x, out, norm_gain=gain, eps=EPS, residual=out, block=(bn, per_sm), num_warps=warps)
    ref = QG.gemv_reference(w, QG.rmsnorm_reference(x, gain, EPS))
    assert_rows_within(out - res, ref, gemv_bound(half_dot),
                       f"seed {gen.initial_seed()}, block {(bn, per_sm, warps)}: gpu blocks", row_dims=0)


@pytest.mark.parametrize("block", [None, (8, 2)], ids=["one-block", "blocks-of-8"])
def test_gemv_stacked_conv_epilogue(gen, half_dot, block):
    """GDN in-proj: stacked q|k|v|z|b|a rows, RMSNorm prologue, conv step + SiLU and the state shift; blocks of 8:
    two programs of several blocks each, a block's conv state read while the one before it writes its own."""
    conv_dim, z_dim, hv, k, K = 96, 64, 4, 128, 4
    parts = [qt(gen, conv_dim, k), qt(gen, z_dim, k), qt(gen, hv, k), qt(gen, hv, k)]
    lin = QG.prepare_concat(parts)
    h, gain = rn(gen, k), rn(gen, k).abs() + 0.5
    conv_w = rn(gen, conv_dim, K) * 0.5
    state = rn(gen, K - 1, conv_dim).to(torch.bfloat16)
    new_state = state.clone()
    out = nan(lin.n)
    QG.gemv(lin, h, out, norm_gain=gain, eps=EPS, conv=(conv_w, new_state), block=block)
    m = torch.cat([QG.gemv_reference(p, QG.rmsnorm_reference(h, gain, EPS)) for p in parts])
    y, ref_state = QG.conv_step_reference(m[:conv_dim], conv_w, state)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(out[conv_dim:], m[conv_dim:], gemv_bound(half_dot), f"{seed}: stacked z|b|a", row_dims=0)
    # (the newest row rounds to bf16 in the state)
    assert_rows_within(out[:conv_dim], y, HALF_CONV if half_dot else CONV, f"{seed}: conv", row_dims=0)
    assert torch.equal(new_state[:-1], state[1:])                   # shifted exactly
    # the newest state row: each element m rounded to bf16 (truncated here), within one bf16 step of m
    rms = float(m[:conv_dim].pow(2).mean().sqrt())
    assert torch.allclose(new_state[-1].float(), m[:conv_dim], rtol=2 ** -7, atol=gemv_bound(half_dot) * rms), seed


def test_gemv_gated_norm_prologue(gen, half_dot):
    hv, dv, n = 4, 32, 64
    w = qt(gen, n, hv * dv)
    lin = QG.PackedLinear(w)
    o, z, gain = rn(gen, hv * dv), rn(gen, hv * dv), rn(gen, dv).abs() + 0.5
    ss = (o.reshape(hv, 2, dv // 2) ** 2).sum(-1)                    # two partial sums per head
    out = nan(n)
    QG.gemv(lin, o, out, gated_norm=(z, ss, gain, dv), eps=EPS)
    ref = QG.gemv_reference(w, QG.gated_rmsnorm_reference(o, z, gain, dv, EPS))
    assert_rows_within(out, ref, gemv_bound(half_dot), f"seed {gen.initial_seed()}: gated norm", row_dims=0)


def test_lm_head_argmax_and_greedy_finish(gen, half_dot, monkeypatch):
    """The lm_head's (max, argmax) partials and the greedy pick, on either codes dot."""
    monkeypatch.setattr(QG, "HALF_DOT_OFF", frozenset())
    v, k = 700, 128
    w = qt(gen, v, k, std=1.0)
    lin = QG.PackedLinear(w)
    h, gain = rn(gen, k), rn(gen, k).abs() + 0.5
    npart = QG.gemv_programs(lin, (16, 2))
    pmax, pidx = nan(npart), torch.full((npart,), -1, dtype=torch.int32)
    logits = nan(v)
    QG.gemv(lin, h, logits, norm_gain=gain, eps=EPS, argmax=(pmax, pidx), block=(16, 2), pdl_family="lm_head")
    assert_rows_within(logits, QG.gemv_reference(w, QG.rmsnorm_reference(h, gain, EPS)), gemv_bound(half_dot),
                       f"seed {gen.initial_seed()}: lm_head", row_dims=0)
    nxt, log = torch.full((1,), -1, dtype=torch.int32), torch.full((4,), -1, dtype=torch.int32)
    step, pos = torch.tensor([5], dtype=torch.int32), torch.tensor([11], dtype=torch.int32)
    greedy_finish(pmax, pidx, v, nxt, log, step, pos)
    assert int(nxt) == int(torch.argmax(logits)) == int(log[5 % 4])
    assert int(step) == 6 and int(pos) == 12
    # a grammar's token mask (lily.engine.constraints' layout) over many blocks: the pick is the best allowed row
    words = (v + 31) // 32
    tmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), generator=gen, dtype=torch.int64).to(torch.int32)
    best = int(torch.argmax(logits))
    tmask[best // 32] &= ~(1 << (best % 32))          # the unconstrained pick is banned, so the mask must matter
    pmax, pidx = nan(npart), torch.full((npart,), -1, dtype=torch.int32)
    masked = nan(v)
    QG.gemv(lin, h, masked, norm_gain=gain, eps=EPS, argmax=(pmax, pidx), block=(16, 2), pdl_family="lm_head",
            token_mask=tmask)
    assert torch.equal(masked, logits)                                  # the logits themselves are all there
    greedy_finish(pmax, pidx, v, nxt, log, step, pos)
    assert int(nxt) == int(apply_token_bitmask(logits, tmask).argmax())


def test_embed_row(gen):
    table = qt(gen, 300, 192, std=1.0)
    tok = int(torch.randint(0, 300, (1,), generator=gen))
    out, out_p = nan(192), nan(192)
    embed(QG.PackedLinear(table), torch.tensor([tok], dtype=torch.int32), out, out_p)
    ref = embed_reference(table, tok)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    assert torch.equal(out_p, out[QG.perm64_index(192)])


def test_gemv_perm64_input_and_output(gen, half_dot):
    """The PERM64 input layout (x, gain, z permuted) gives the same result as natural order, and OUT2
    writes the chosen rows permuted."""
    n, k = 192, 256
    w = qt(gen, n, k)
    lin = QG.PackedLinear(w)
    p = QG.perm64_index(k)
    x, gain = rn(gen, k), rn(gen, k).abs() + 0.5
    ref = QG.gemv_reference(w, QG.rmsnorm_reference(x, gain, EPS))
    out, out2 = nan(n), nan(128)
    QG.gemv(lin, x[p], out, norm_gain=gain[p], eps=EPS, perm_x=True, out2=out2, out2_rows=(64, 192))
    assert_rows_within(out, ref, gemv_bound(half_dot), f"seed {gen.initial_seed()}: perm64", row_dims=0)
    assert torch.equal(out2, out[64:192][QG.perm64_index(128)])
    # gated per-head norm with head_dim 32 (< 64: heads split a group)
    hv, dv = 8, 32
    o, z, g2 = rn(gen, k), rn(gen, k), rn(gen, dv).abs() + 0.5
    ss = (o.reshape(hv, 1, dv) ** 2).sum(-1)
    out = nan(n)
    QG.gemv(lin, o[p], out, gated_norm=(z[p], ss, g2, dv), eps=EPS, perm_x=True)
    assert_rows_within(out, QG.gemv_reference(w, QG.gated_rmsnorm_reference(o, z, g2, dv, EPS)),
                       gemv_bound(half_dot), f"seed {gen.initial_seed()}: perm64 gated norm", row_dims=0)


@pytest.mark.parametrize("top_k,norm_topk,blocks", [(2, True, "interpreter"), (3, False, "interpreter"),
                                                     (2, True, "gpu")])
def test_moe_decode(gen, monkeypatch, half_dot, top_k, norm_topk, blocks):
    """blocks "gpu": the three launches with the rows per block and programs per SM the GPU picks; half-dot:
    gate_up and down dot their codes in fp16 pairs (the router is 8-bit: always fp32)."""
    if blocks == "gpu":
        monkeypatch.setattr(MD, "INTERPRET", False)
    E, I, H = 8, 64, 128
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    ex = MD.PackedExperts(*w)
    # logits of order 0.3 (std=0.3/sqrt(H) on a normed x): the top-k weights sum well below 1 (order 1 gave
    # a top-3 of 8 summing to 0.955 on seed 3914130259, which failed the check below)
    router_q = qt(gen, E + 1, H, bits=8, std=0.3 * H ** -0.5)
    router = QG.PackedLinear(router_q)
    h, gain = rn(gen, H), rn(gen, H).abs() + 0.5
    sc = MD.MoEScratch(E, top_k, I)
    sc.act.fill_(float("nan"))
    sc.logits.fill_(float("nan"))
    sc.route_e.fill_(-1)
    sc.route_w.fill_(float("nan"))
    p = QG.perm64_index(H)
    out, out_p = h.clone(), h[p].clone()
    MD.moe_decode(ex, router, out, out_p, gain, gain[p], EPS, sc, norm_topk=norm_topk)
    x = QG.rmsnorm_reference(h, gain, EPS)
    logits = QG.gemv_reference(router_q, x)
    assert_rows_within(sc.logits, logits, GEMV, f"seed {gen.initial_seed()}: router", row_dims=0)
    # routing from the kernel's own logits (a near-tie must not turn into a spurious failure)
    ref = h + MD.moe_reference(x, sc.logits[:E], sc.logits[E], *w, top_k=top_k, norm_topk=norm_topk)
    assert_rows_within(out - h, ref - h, HALF_MOE if half_dot else GEMV, f"seed {gen.initial_seed()}: moe",
                       row_dims=0)
    assert torch.equal(out_p, out[p])
    assert sc.route_e[:top_k].tolist() == torch.topk(sc.logits[:E], top_k).indices.tolist()
    assert int(sc.route_e[top_k]) == E
    probs = torch.softmax(sc.logits[:E], -1)[sc.route_e[:top_k].long()]
    assert probs.sum() < 0.95, "degenerate routing: renormalising would change nothing"
    want = probs / probs.sum() if norm_topk else probs
    assert torch.allclose(sc.route_w[:top_k], want, rtol=1e-5, atol=1e-7)
    assert torch.allclose(sc.route_w[top_k], torch.sigmoid(sc.logits[E]), rtol=1e-6)
    # a second call (the next layer) gives the same result; down routing from the logits itself (as when it
    # is launched programmatically) does not use the routing gate_up wrote, poisoned between the two launches
    out2, out2_p = h.clone(), h[p].clone()
    MD.moe_route(router, out2, gain, EPS, sc, norm_topk)
    MD.moe_gate_up(ex, out2_p, gain[p], EPS, sc, norm_topk=norm_topk)
    sc.route_e.fill_(0)
    sc.route_w.fill_(float("nan"))
    MD.moe_down(ex, out2, out2_p, sc, norm_topk=norm_topk, route_self=True)
    assert torch.equal(out2, out)
    assert torch.equal(out2_p, out_p)


def small_moe(gen):
    """A small MoE layer on fresh random inputs: (E, I, H, its six quantized weights, PackedExperts, the 8-bit
    router stack, h, gain, PERM64 index of H); the router's logits of order 0.3, as test_moe_decode's."""
    E, I, H = 8, 64, 128
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    router = QG.PackedLinear(qt(gen, E + 1, H, bits=8, std=0.3 * H ** -0.5))
    return E, I, H, w, MD.PackedExperts(*w), router, rn(gen, H), rn(gen, H).abs() + 0.5, QG.perm64_index(H)


@pytest.mark.parametrize("block", [(8, 3), (32, 5), (16, 2)])
def test_gate_up_shared_expert_first_gives_the_same_act(gen, monkeypatch, block):
    """moe_decode.GATE_UP_SHARED_FIRST: the shared expert's units first, a program whose first unit is one of
    them computing it before its wait. Each unit's arithmetic is the same whatever the order, so act, the
    routing and down's output are bit for bit those of the slot order; blocks: (8, 3) every program starts on a
    shared unit, (32, 5) two of five do, (16, 2) programs of many units. (The route below is the one both
    orders compute: gate_up routes from the same logits.)"""
    monkeypatch.setattr(QG, "HALF_DOT", True)
    top_k = 3
    E, I, H, w, ex, router, h, gain, p = small_moe(gen)
    got = {}
    for first in (False, True):
        monkeypatch.setattr(MD, "GATE_UP_SHARED_FIRST", first)
        sc = MD.MoEScratch(E, top_k, I)
        sc.act.fill_(float("nan"))
        sc.route_e.fill_(-1)
        MD.moe_route(router, h, gain, EPS, sc)
        MD.moe_gate_up(ex, h[p].clone(), gain[p], EPS, sc, block=block)
        out = h.clone()
        MD.moe_down(ex, out, h[p].clone(), sc)
        got[first] = (sc.act.clone(), sc.route_e.clone(), sc.route_w.clone(), out)
    assert torch.isfinite(got[True][0]).all(), "a unit left unwritten"
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b), f"seed {gen.initial_seed()}"
    x = QG.rmsnorm_reference(h, gain, EPS)
    ref = h + MD.moe_reference(x, sc.logits[:E], sc.logits[E], *w, top_k=top_k)
    assert_rows_within(got[True][3] - h, ref - h, HALF_MOE, f"seed {gen.initial_seed()}: moe", row_dims=0)


@pytest.mark.parametrize("E,top_k,norm_topk", [(8, 2, True), (6, 3, False), (40, 8, True), (40, 7, True)])
def test_topk_on_int32_keys_routes_as_int64_keys(gen, monkeypatch, E, top_k, norm_topk):
    """route_topk's KEY32 (the index in the int32 image's low bits), a key a round or two (PAIRS), picks the
    experts, in the same slot order, and the weights, bit for bit, that the int64 keys pick, exact ties going to
    the lower expert index (ties drawn on purpose; E = 6 and 40: padding past E; top-3 and 7: an odd last round
    of pairs); in gate_up's routing and in down's own (route_self)."""
    I, H = 64, 128
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    ex = MD.PackedExperts(*w)
    p = QG.perm64_index(H)
    h, gain = rn(gen, H), rn(gen, H).abs() + 0.5
    logits = rn(gen, E + 1)
    dup = torch.randperm(E, generator=gen)[:4]
    logits[dup[1]] = logits[dup[0]]                      # exact ties
    logits[dup[3]] = logits[dup[2]]
    got = {}
    for key32, pairs in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(MD, "TOPK_KEY32", key32)
        monkeypatch.setattr(MD, "TOPK_PAIRS", pairs)
        sc = MD.MoEScratch(E, top_k, I)
        sc.logits.copy_(logits)
        sc.route_e.fill_(-1)
        sc.route_w.fill_(float("nan"))
        MD.moe_gate_up(ex, h[p].clone(), gain[p], EPS, sc, norm_topk=norm_topk)
        out, out_p = h.clone(), h[p].clone()
        routed = sc.route_e.clone(), sc.route_w.clone()
        sc.route_e.fill_(0)
        sc.route_w.fill_(float("nan"))
        MD.moe_down(ex, out, out_p, sc, norm_topk=norm_topk, route_self=True)
        got[key32, pairs] = routed, out
    seed = f"seed {gen.initial_seed()}"
    (e0, w0), out0 = got[False, False]
    assert e0[:top_k].tolist() == sorted(range(E), key=lambda i: (-float(logits[i]), i))[:top_k], seed
    for mode in ((True, False), (True, True)):
        (e1, w1), out1 = got[mode]
        assert e1.tolist() == e0.tolist(), f"{seed}: {mode}"
        assert torch.equal(w1, w0), f"{seed}: {mode}"
        assert torch.equal(out1, out0), f"{seed}: {mode}"


def test_moe_half_dot_off_keeps_its_kernels_on_the_fp32_dot(gen, monkeypatch):
    """The MoE kernels read the half dot's switch at each launch: "gate_up" / "down" in HALF_DOT_OFF keep that
    kernel on the fp32 dot (the same bits as HALF_DOT off), each one on its own."""
    top_k = 2
    E, I, H, w, ex, router, h, gain, p = small_moe(gen)
    outs = {}
    for half, off in [(False, ""), (True, "gate_up,down"), (True, "gate_up"), (True, "down"), (True, "")]:
        monkeypatch.setattr(QG, "HALF_DOT", half)
        monkeypatch.setattr(QG, "HALF_DOT_OFF", QG.parse_half_dot_off(off))
        sc = MD.MoEScratch(E, top_k, I)
        sc.act.fill_(float("nan"))
        out = h.clone()
        MD.moe_decode(ex, router, out, h[p].clone(), gain, gain[p], EPS, sc)
        outs[(half, off)] = out, sc.act.clone()
    assert torch.equal(outs[(True, "gate_up,down")][0], outs[(False, "")][0])
    # gate_up on fp32 alone: its act is the fp32 path's, down's output is not; down on fp32 alone: the reverse
    assert torch.equal(outs[(True, "gate_up")][1], outs[(False, "")][1])
    assert not torch.equal(outs[(True, "gate_up")][0], outs[(False, "")][0])
    assert torch.equal(outs[(True, "down")][1], outs[(True, "")][1])
    assert not torch.equal(outs[(True, "down")][1], outs[(False, "")][1])
    assert not torch.equal(outs[(True, "down")][0], outs[(True, "")][0])


@pytest.mark.parametrize("top_k,norm_topk,ahead,blocks,by_expert,block_major", [
    (2, True, 1, None, False, False), (3, False, 1, None, False, False), (3, True, 2, None, False, False),
    (3, True, 1, ((8, 2), (8, 2)), False, False), (2, True, 1, ((8, 4), (8, 2)), False, False),
    (3, True, 1, None, True, False), (3, False, 1, ((8, 4), (8, 2)), True, False),
    (3, True, 1, ((8, 4), (8, 2)), True, True), (2, True, 2, ((8, 2), (8, 2)), True, True)])
def test_moe_rows(gen, monkeypatch, half_dot, top_k, norm_topk, ahead, blocks, by_expert, block_major):
    """The row-batched MoE: each valid row of the batch against the plain-torch MoE of that row (routing from
    its own logits), rows past n_valid (a graph's padding) untouched; ahead 2: gate_up requesting two units
    ahead (here one program a row walks all 4 units); blocks ((8, 2), (8, 2)): the GPU's at 2 rows
    (moe_decode.ROWS_BLOCKS), ((8, 4), (8, 2)) its default at more (ROWS_*_BLOCK): one program a row walking
    8-row units and 8-row down blocks; by_expert: the routed slots in ascending expert order
    (moe_decode.ROWS_BY_EXPERT from ROWS_ORDER_MIN_ROWS rows; otherwise a batch one row short of it), each
    with its own weight; block_major: gate_up's units block by block (ROWS_BLOCK_MAJOR), every unit still once;
    then down routing itself (route_self), bit for bit the same."""
    E, I, H, B, n_valid = 8, 64, 128, 4, 3
    monkeypatch.setattr(MD, "ROWS_BY_EXPERT", True)
    monkeypatch.setattr(MD, "ROWS_BLOCK_MAJOR", block_major)
    monkeypatch.setattr(MD, "ROWS_ORDER_MIN_ROWS", B if by_expert else B + 1)
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    ex = MD.PackedExperts(*w)
    h, gain = rn(gen, B, H), rn(gen, H).abs() + 0.5
    logits = rn(gen, B, E + 1) * 0.3   # order 0.3: the top-k weights sum well below 1 (see test_moe_decode)
    sc = MD.MoERowsScratch(E, top_k, I, B)
    sc.act.fill_(float("nan"))
    sc.route_w.fill_(float("nan"))
    sc.route_e.fill_(-1)
    out = h.clone()
    MD.moe_rows(ex, out, gain, EPS, logits, torch.tensor([n_valid], dtype=torch.int32), sc, norm_topk=norm_topk,
                ahead=ahead, blocks=blocks)
    for b in range(n_valid):
        x = QG.rmsnorm_reference(h[b], gain, EPS)
        p = torch.softmax(logits[b, :E], -1)
        assert p.topk(top_k).values.sum() < 0.95, "degenerate routing: renormalising would change nothing"
        ref = h[b] + MD.moe_reference(x, logits[b, :E], logits[b, E], *w, top_k=top_k, norm_topk=norm_topk)
        assert_rows_within(out[b] - h[b], ref - h[b], HALF_MOE if half_dot else GEMV,
                           f"seed {gen.initial_seed()}: row {b}", row_dims=0)
        top = torch.topk(logits[b, :E], top_k)
        want_w = torch.softmax(logits[b, :E], -1)[top.indices]
        want_w = want_w / want_w.sum() if norm_topk else want_w
        order = top.indices.sort().indices if by_expert else torch.arange(top_k)
        assert sc.route_e[b, :top_k].tolist() == top.indices[order].tolist()
        assert torch.allclose(sc.route_w[b, :top_k], want_w[order], rtol=1e-5), f"row {b}: weights"
        assert sc.route_e[b, top_k] == E and torch.allclose(sc.route_w[b, top_k], torch.sigmoid(logits[b, E]))
    assert torch.equal(out[n_valid:], h[n_valid:])
    assert torch.isnan(sc.act[n_valid:]).all()
    # down routing from the logits itself (its launch programmatic, lily.kernels.pdl rows_down) in gate_up's slot
    # order: the same sums in the same order, so the same bits
    again = h.clone()
    MD.moe_rows(ex, again, gain, EPS, logits, torch.tensor([n_valid], dtype=torch.int32), sc, norm_topk=norm_topk,
                ahead=ahead, blocks=blocks, route_self=True)
    assert torch.equal(again, out)


# tile: gdn_decode.TILE (value columns a program, warps); (64, 4): a whole head a program (its counter still used)
@pytest.mark.parametrize("tile", [None, (64, 4), (16, 2)])
def test_gdn_decode(gen, monkeypatch, tile):
    monkeypatch.setattr(GD, "TILE", tile)
    hk, hv, dk, dv = 2, 4, 32, 64
    conv_dim, vd = 2 * hk * dk + hv * dv, hv * dv
    proj = rn(gen, conv_dim + vd + 2 * hv)
    state = rn(gen, hv, dk, dv) * 0.1
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen) * 15 + 1), rn(gen, hv) * 0.1
    gain = rn(gen, dv).abs() + 0.5
    st = state.clone()
    scratch = GD.GDNScratch(hv, dv, "cpu")
    out = nan(vd)
    GD.gdn_decode(proj, st, a_log, dt_bias, gain, EPS, scratch, out, hk)
    out = out[QG.perm64_index(vd)]                                  # written in PERM64 order
    z = proj[conv_dim:conv_dim + vd]
    b, a = proj[conv_dim + vd:conv_dim + vd + hv], proj[conv_dim + vd + hv:]
    ref_o, ref_s = GD.gdn_decode_reference(proj[:conv_dim], z, b, a, state, a_log, dt_bias, hk, gain, EPS)
    assert_rows_within(st, ref_s, GDN, f"seed {gen.initial_seed()}: state")             # each head's key rows
    assert_rows_within(out.reshape(hv, dv), ref_o.reshape(hv, dv), GDN, f"seed {gen.initial_seed()}: output", typical=True)
    assert int(scratch.count.abs().sum()) == 0                      # the head counters are reset for the next step
    if tile is not None:   # a tile that does not divide the head, or more programs a head than the scratch holds
        for bad in ((48, 4), (4, 4)):
            monkeypatch.setattr(GD, "TILE", bad)
            with pytest.raises(ValueError, match="value columns a program"):
                GD.gdn_decode(proj, st, a_log, dt_bias, gain, EPS, scratch, out, hk)


# the decode step's split count on a GPU for 2 KV heads (FastModel: 128 // KV heads), with its default
# block_t: at 70 positions most splits are empty, which the combine must skip; 3 splits of 32, 32 and 6
# positions: the last split holds keys (this token's among them), which the combine must not leave out
# (splits: attention_decode.SPLITS set over the scratch's n_split, as gpu_decode_check's --const-ab sets it;
#  tile: attention_decode.SPLIT_TILE, split-K's (keys a block, warps) over the caller's; long: LONG_SPAN, splits of
#  at least that many keys in the longer blocks: with 3 splits of 24 keys (70 -> blocks of 8) they take blocks of
#  16 (24 >= 24), the last split's 22 keys a partial block; (32, 16) leaves every split on block_t)
@pytest.mark.parametrize("n_split,length,block_t,splits,tile,long", [
    (1, 5, 16, None, None, None), (4, 70, 16, None, None, None), (3, 70, 16, None, None, None),
    (128 // 2, 70, 32, None, None, (256, 64)), (4, 70, 16, 7, None, None), (3, 70, 16, None, (32, 8), None),
    (3, 70, 8, None, None, (24, 16)), (3, 70, 8, None, None, (32, 16))])
def test_attention_decode(gen, monkeypatch, n_split, length, block_t, splits, tile, long):
    monkeypatch.setattr(AD, "SPLITS", splits)
    monkeypatch.setattr(AD, "SPLIT_TILE", tile)
    monkeypatch.setattr(AD, "LONG_SPAN", long)
    hq, hkv, D, rot = 4, 2, 64, 16
    max_seq = 80
    pos = length - 1
    kc, vc = rn(gen, max_seq, hkv, D).to(torch.bfloat16), rn(gen, max_seq, hkv, D).to(torch.bfloat16)
    kc[pos:], vc[pos:] = float("nan"), float("nan")        # the row at pos must be written, later rows unread
    proj = rn(gen, hq * 2 * D + 2 * hkv * D)
    qn, kn = rn(gen, D).abs() + 0.5, rn(gen, D).abs() + 0.5
    inv = AD.rope_inv_freq(rot, 1e7)
    scratch = AD.AttentionScratch(hq, D, n_split, "cpu")
    out = nan(hq * D)
    AD.attention_decode(proj, kc, vc, torch.tensor([pos], dtype=torch.int32), qn, kn, inv, EPS, hq, scratch, out,
                        block_t=block_t)
    qg = proj[:hq * 2 * D].reshape(hq, 2 * D)
    k_new = AD.rmsnorm_rope_reference(proj[hq * 2 * D:hq * 2 * D + hkv * D].reshape(hkv, D), kn, pos, inv, EPS)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(kc[pos].float(), k_new, KV_ROW, f"{seed}: K row")           # each KV head
    assert_rows_within(vc[pos].float(), proj[hq * 2 * D + hkv * D:].reshape(hkv, D), KV_ROW, f"{seed}: V row")
    q = AD.rmsnorm_rope_reference(qg[:, :D], qn, pos, inv, EPS)
    ref = AD.attention_decode_reference(q, qg[:, D:], kc[:pos + 1], vc[:pos + 1])
    assert_rows_within(out[QG.perm64_index(hq * D)].reshape(hq, D), ref.reshape(hq, D), ATTN,
                       f"{seed}: output")   # each query head; written in PERM64 order
    if splits:
        monkeypatch.setattr(AD, "SPLITS", AD.SPLITS_MAX + 1)
        with pytest.raises(ValueError, match="the scratch holds"):
            AD.attention_decode(proj, kc, vc, torch.tensor([pos], dtype=torch.int32), qn, kn, inv, EPS, hq, scratch,
                                out, block_t=block_t)

