"""Prefill kernels (lily/kernels/{q4_gemm,moe_grouped_gemm,conv1d_prefill,gdn_chunked,flash_attention}.py)
and the prefill forward (lily/model/fast_prefill.py), at tiny shapes.

Oracles: plain-torch fp32 references (dequantize-then-matmul, the token-by-token gated delta recurrence
of lily/kernels/gated_delta.py, explicit softmax attention) and lily.model.reference.ReferenceModel for
the whole prefill. Fresh random inputs every run (the seed is in the failure message); outputs are
poisoned with NaN before the kernels write them. On a machine without a GPU the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py), whose bf16 conversion truncates: tolerances allow for that.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from lily.config import FULL, TINY
from lily.kernels.conv1d_prefill import conv1d_prefill, conv1d_prefill_reference
from lily.kernels.flash_attention import (attention_reference, flash_attention_prefill, norm_rope_reference,
                                          rope_inv_freq, write_kv_prefill)
from lily.kernels.gated_delta import gated_delta_recurrent
from lily.kernels.gdn_chunked import (gated_rmsnorm, gated_rmsnorm_reference, gdn_chunked_prefill,
                                      gdn_inputs_reference)
from lily.kernels.moe_grouped_gemm import gate_up_splits, identity_plan, moe_grouped, moe_grouped_reference, moe_plan
from lily.kernels import flash_attention, moe_grouped_gemm
from lily.kernels.moe_plan import block_classes
from lily.kernels.q4_gemm import q_gemm, q_gemm_reference, rmsnorm_rows, split_k
from lily.quant import QuantTensor

from helpers_routing import (PREFILL_LIMIT, PREFILL_MEDIAN_LIMIT, assert_logits_close, fast_prefill_routing,
                             reference_router)
from helpers_tensors import (DEV, assert_rows_close, assert_rows_within, gdn_inputs, new_generator, qt,  # noqa: F401
                             randn, rel, row_rel, to_bf16)

# The strongly coupled chunk against the fp64 recurrence, its worst (position, head) row of the output (over
# its typical row) and (head, key dim) row of the state: ~3x the worst measured over 42 seeds under the
# interpreter (output 1.5e-3 worst, 5e-4 median; state 1.1e-3, 3e-4; the whole tensors were held to 5e-3)
COUPLED = 4.5e-3


@pytest.fixture
def gen():
    return new_generator()  # the seed is gen.initial_seed()


def moe_bf16_level(x, ids, w, gate, up, down, ref) -> float:
    """The yardstick of the grouped MoE: moe_grouped_reference's math with the kernel's bf16 casts (the
    dequantized weights and the SwiGLU activation), its worst row against the fp32 reference."""
    x, out = x.float(), torch.zeros(x.shape, device=x.device)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (to_bf16(QuantTensor(m.weight[e], m.scales[e], m.biases[e], m.bits).dequantize()).float()
                      for m in (gate, up, down))
        h = to_bf16(torch.nn.functional.silu(x[t] @ wg.T) * (x[t] @ wu.T)).float()
        out.index_add_(0, t, (h @ wd.T) * w[t, j].float()[:, None])
    return float(row_rel(out, ref).max())


def attention_bf16(qg, q_norm, inv_freq, k_all, v_all, pos0, num_heads, eps=1e-6):
    """attention_reference's math with the kernel's bf16 casts (the scaled query, the probabilities, the
    output): the yardstick of flash attention. [T, Hq, HD]"""
    T = qg.shape[0]
    L, Hkv, HD = k_all.shape
    qg = qg.float().reshape(T, num_heads, 2 * HD)
    q = norm_rope_reference(qg[..., :HD], q_norm, torch.arange(pos0, pos0 + T, device=qg.device), inv_freq, eps)
    q = to_bf16(q / math.sqrt(HD)).float()
    k = to_bf16(k_all.float()).float().repeat_interleave(num_heads // Hkv, 1)
    v = v_all.float().repeat_interleave(num_heads // Hkv, 1)
    s = torch.einsum("thd,shd->hts", q, k)
    s = s.masked_fill(torch.arange(L, device=qg.device)[None, :] > torch.arange(pos0, pos0 + T, device=qg.device)[:, None],
                      float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    o = torch.einsum("hts,shd->thd", to_bf16(p).float(), v) / p.sum(-1).T[..., None]
    return to_bf16(o * torch.sigmoid(qg[..., HD:])).float()


# -- dense quantized GEMM ----------------------------------------------------------------------------

@pytest.mark.parametrize("bits,M,N,K", [(4, 37, 96, 128), (8, 70, 40, 256), (4, 5, 200, 192)])
def test_q_gemm_matches_dequantized_matmul(gen, bits, M, N, K):
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K, bits=bits)
    y = torch.full((M, N), float("nan"), device=DEV)
    q_gemm(x, w, out=y)
    assert_rows_close(y, q_gemm_reference(x, w), f"seed {gen.initial_seed()}")


def test_q_gemm_accumulates_into_residual(gen):
    x = randn(gen, 33, 128, dtype=torch.bfloat16)
    w = qt(gen, 64, 128)
    res = randn(gen, 33, 64)
    out = res.clone()
    q_gemm(x, w, out=out, accumulate=True)
    assert_rows_close(out - res, q_gemm_reference(x, w), f"seed {gen.initial_seed()}")


@pytest.mark.parametrize("bits,M,N,K,splits", [(4, 5, 96, 1024, None), (8, 3, 40, 512, None), (4, 7, 130, 704, 3),
                                               (8, 80, 72, 512, None)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_q_gemm_split_k(gen, bits, M, N, K, splits, accumulate):
    """A GEMM split along K (the batched decode step's rows; a router's few column tiles): the partials summed
    in order, into a bf16 output or added into the fp32 residual; 3 splits of 11 groups leave a shorter last
    split."""
    if splits is None:
        assert split_k(M, N, K, DEV, bits) > 1, "the shape must take the split path by default"
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K, bits=bits)
    ref = q_gemm_reference(x, w)
    if accumulate:
        res = randn(gen, M, N)
        out = res.clone()
        q_gemm(x, w, out=out, accumulate=True, splits=splits)
        assert_rows_close(out - res, ref, f"seed {gen.initial_seed()}")
    else:
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        q_gemm(x, w, out=out, splits=splits)
        assert_rows_close(out.float(), ref, f"seed {gen.initial_seed()}")


@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_summed_by_the_last_split_equals_the_sum_kernel(gen, monkeypatch, accumulate):
    """SPLIT_K_LAST_SUMS: each tile's last split sums the partials (in split order) instead of a kernel after
    them: the same result bit for bit, the arrival counts back at zero after each call, so a second call
    (a graph's next replay) sums again; 3 splits of 11 groups, 3 column tiles, a ragged last one."""
    import lily.kernels.q4_gemm as q4_gemm
    M, N, K = 7, 150, 704
    x = randn(gen, M, K, dtype=torch.bfloat16)
    w = qt(gen, N, K)
    res = randn(gen, M, N)
    got = {}
    for last in (False, True, True):
        monkeypatch.setattr(q4_gemm, "SPLIT_K_LAST_SUMS", last)
        out = res.clone() if accumulate else torch.full((M, N), float("nan"), device=DEV)
        q_gemm(x, w, out=out, accumulate=accumulate, splits=3)
        got.setdefault(last, []).append(out)
    assert torch.equal(got[True][0], got[False][0])
    assert torch.equal(got[True][1], got[False][0])
    assert not q4_gemm._COUNTS[str(x.device)].any()
    monkeypatch.setattr(q4_gemm, "ARRIVAL_COUNTS", 2)          # more tiles than counts: the sum kernel
    out = res.clone() if accumulate else torch.full((M, N), float("nan"), device=DEV)
    q_gemm(x, w, out=out, accumulate=accumulate, splits=3)
    assert torch.equal(out, got[False][0])
    assert_rows_close(got[True][0] - (res if accumulate else 0), q_gemm_reference(x, w), f"seed {gen.initial_seed()}")


@pytest.mark.parametrize("M,tiles_name", [(8, "SKINNY_TILES_8BIT"), (24, "MID_TILES_8BIT")])
def test_8bit_router_takes_its_own_tiles_and_split(gen, monkeypatch, M, tiles_name):
    """An 8-bit weight at a decode batch's rows takes SKINNY_TILES_8BIT / MID_TILES_8BIT and splits K into parts of
    at least SPLIT_K_MIN_GROUPS_8BIT groups, a 4-bit one the shared tiles: set apart, each is still the product
    (bf16 out poisoned first, and the fp32 partials q_gemm_parts hands the router's top-k summing to it)."""
    import lily.kernels.q4_gemm as q4_gemm
    N, K = 72, 1024
    monkeypatch.setattr(q4_gemm, tiles_name, (16, 16, 2, 2))
    monkeypatch.setattr(q4_gemm, "SPLIT_K_MIN_GROUPS_8BIT", 1)
    assert q4_gemm._config(M, N, 8) == (16, 16, 2, 2) and q4_gemm._config(M, N, 4) != (16, 16, 2, 2)
    tiles = -(-M // 16) * -(-N // 16)
    assert split_k(M, N, K, DEV, bits=8) == min(-(-q4_gemm.SPLIT_K_PROGRAMS_PER_SM * q4_gemm.GPU_SMS // tiles), K // 64)
    assert split_k(M, N, K, DEV, bits=4) <= K // 64 // q4_gemm.SPLIT_K_MIN_GROUPS
    for bits in (8, 4):
        x = randn(gen, M, K, dtype=torch.bfloat16)
        w = qt(gen, N, K, bits=bits)
        ref = q_gemm_reference(x, w)
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        q_gemm(x, w, out=out)
        assert_rows_close(out.float(), ref, f"seed {gen.initial_seed()}, {bits}-bit")
        parts = q4_gemm.q_gemm_parts(x, w)
        assert parts is not None and parts.shape[0] == split_k(M, N, K, DEV, bits=bits)
        assert_rows_close(parts.sum(0), ref, f"seed {gen.initial_seed()}, {bits}-bit parts")


def test_split_k_for_skinny_rows_or_few_tiles_only():
    """K splits where the output tiles are few (a decode batch's rows; a short prompt's 257-column router),
    not where a prompt's GEMM already has tiles for every SM."""
    assert split_k(5, 96, 1024, DEV) > 1
    assert split_k(256, 257, 2048, DEV) > 1
    assert split_k(600, 4096, 2048, DEV) == 1
    assert split_k(4096, 257, 2048, DEV) == 1


def test_q_gemm_refuses_mismatched_input(gen):
    with pytest.raises(ValueError, match="expected \\[M, 128\\]"):
        q_gemm(randn(gen, 4, 64, dtype=torch.bfloat16), qt(gen, 32, 128))


def test_rmsnorm_rows(gen):
    h = randn(gen, 21, 128, scale=3.0)
    g = 1 + randn(gen, 128, scale=0.1)
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    assert_rows_close(rmsnorm_rows(h, g, 1e-6), ref, f"seed {gen.initial_seed()}")
    # with the permuted copy: the same bf16 rows, and each 64-group's columns in perm_k_index order
    y, yp = rmsnorm_rows(h, g, 1e-6, permuted_copy=True)
    assert torch.equal(y, rmsnorm_rows(h, g, 1e-6))
    m = torch.arange(128) % 64
    natural_at = torch.arange(128) - m + 16 * ((m // 2) % 4) + 8 * ((m // 8) % 2) + 4 * (m % 2) + m // 16
    assert torch.equal(yp, y[:, natural_at.to(DEV)])


# -- grouped MoE -------------------------------------------------------------------------------------

# the block sizes the GPU uses at a 4K prompt of the full model (its large-prompt tiles, with tail blocks)
GPU_4K_BLOCKS = block_classes(4096 * FULL.num_experts_per_tok, FULL.num_experts)


@pytest.mark.parametrize("T,block_m,skew,splits,paired", [(37, None, False, None, True), (9, 16, False, None, True),
                                                          (150, GPU_4K_BLOCKS, True, None, True),
                                                          (11, 16, False, 2, True), (37, None, False, None, False),
                                                          (11, 16, False, 2, False)],
                         ids=["default", "block16", "gpu-4k-blocks", "block16-split-k", "unpaired",
                              "unpaired-split-k"])
def test_moe_grouped_matches_per_expert_loop(gen, monkeypatch, T, block_m, skew, splits, paired):
    """With skew, every token's first expert is expert 0: its 150 rows fill a full block of the largest
    size and a tail, as a busy expert does in a long prompt. With splits, the gate/up GEMMs' K is split
    (a few decode rows) and the partials summed before the SwiGLU. paired: gate and up rows in one tile
    (PAIRED_GATE_UP, here for blocks of every size) or in two."""
    monkeypatch.setattr(moe_grouped_gemm, "PAIRED_GATE_UP", paired)
    monkeypatch.setattr(moe_grouped_gemm, "PAIRED_MIN_BLOCK", 16)
    E, k, H, I = 8, 2, 128, 64
    gate, up, down = qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I)
    x = randn(gen, T, H, dtype=torch.bfloat16)
    logits = randn(gen, T, E)
    if skew:
        logits[:, 0] += 10
    top, idx = logits.softmax(-1).topk(k)
    top = top / top.sum(-1, keepdim=True)
    plan = moe_plan(idx, E, block_m)
    # the plan covers every (token, slot) exactly once, each block inside one expert's run
    assert sorted(plan.slots.tolist()) == list(range(T * k))
    flat = idx.reshape(-1)[plan.slots.long()]
    for e, s, t in zip(plan.block_expert.tolist(), plan.block_start.tolist(), plan.block_end.tolist()):
        if e < E:
            assert (flat[s:min(t, s + plan.block_m)] == e).all()
    base = randn(gen, T, H)
    out = base.clone()
    if skew:
        assert [g[0] for g in plan.block_groups()] == list(GPU_4K_BLOCKS) and GPU_4K_BLOCKS[0] < 150
    moe_grouped(x, plan, top.reshape(-1).contiguous(), gate, up, down, out, splits=splits)
    ref = moe_grouped_reference(x, idx, top, gate, up, down)
    assert_rows_close(out - base, ref, f"seed {gen.initial_seed()}", level=moe_bf16_level(x, idx, top, gate, up, down, ref))


@pytest.mark.parametrize("top_k", [3, 1])
def test_moe_grouped_next_input_from_the_combine(gen, top_k):
    """next_input: the residual as without it, and the next layer's input bf16 rmsnorm(out) * gain from the
    slot combine (a one-expert group, which has no combine, from rmsnorm_rows)."""
    E, H, I, T = 6, 128, 64, 13
    gate, up, down = qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I)
    x = randn(gen, T, H, dtype=torch.bfloat16)
    top, idx = randn(gen, T, E).softmax(-1).topk(top_k)
    plan = moe_plan(idx, E)
    gain = 1 + randn(gen, H, scale=0.1)
    base = randn(gen, T, H)
    plain = moe_grouped(x, plan, top.reshape(-1).contiguous(), gate, up, down, base.clone())
    out, x_next = moe_grouped(x, plan, top.reshape(-1).contiguous(), gate, up, down, base.clone(),
                              next_input=(gain, 1e-6))
    assert torch.equal(out, plain), f"seed {gen.initial_seed()}"
    want = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
    assert x_next.dtype == torch.bfloat16 and x_next.shape == (T, H)
    assert_rows_close(x_next.float(), want, f"seed {gen.initial_seed()}")
    assert (x_next != rmsnorm_rows(out, gain, 1e-6)).float().mean() < 0.01   # at most an ulp here and there


def test_gate_up_splits_only_for_few_rows():
    """The full model's shapes: a 4-row decode batch splits the gate/up K, a 4K prompt does not."""
    E, k, I, H = FULL.num_experts, FULL.num_experts_per_tok, FULL.moe_intermediate_size, FULL.hidden_size
    few = moe_plan(torch.randint(0, E, (4, k)), E)
    many = moe_plan(torch.randint(0, E, (4096, k)), E)
    assert gate_up_splits(few, I, H, "cpu") > 1 and gate_up_splits(many, I, H, "cpu") == 1


@pytest.mark.parametrize("splits", [None, 2])
def test_shared_expert_as_one_expert_group(gen, splits):
    T, H, I = 19, 128, 64
    g1, u1, d1 = (qt(gen, 1, I, H), qt(gen, 1, I, H), qt(gen, 1, H, I))
    x = randn(gen, T, H, dtype=torch.bfloat16)
    sw = torch.rand(T, generator=gen).to(DEV)
    out = torch.zeros(T, H, device=DEV)
    moe_grouped(x, identity_plan(T, DEV, 16), sw, g1, u1, d1, out, splits=splits)
    ids = torch.zeros(T, 1, dtype=torch.long, device=DEV)
    ref = moe_grouped_reference(x, ids, sw[:, None], g1, u1, d1)
    assert_rows_close(out, ref, f"seed {gen.initial_seed()}", level=moe_bf16_level(x, ids, sw[:, None], g1, u1, d1, ref))


def test_shared_expert_plan_block_rows():
    """The prefill's own shared-expert plan (when it does not run with the routed experts): 64-row blocks
    covering every row once, cached per chunk length."""
    from lily.model import fast_prefill
    for T in (37, 64, 200):
        plan = fast_prefill._identity_plan(T, DEV)
        assert plan.block_m == 64 and plan.slots.tolist() == list(range(T))
        assert plan.block_start.tolist() == list(range(0, T, 64)) and set(plan.block_end.tolist()) == {T}
        assert fast_prefill._identity_plan(T, DEV) is plan


# -- conv1d ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [45, 2])
def test_conv1d_prefill_continues_state(gen, T):
    C, K = 256, 4
    x = randn(gen, T, C, dtype=torch.bfloat16)
    w = randn(gen, C, K, scale=0.5, dtype=torch.bfloat16)
    state = randn(gen, K - 1, C, dtype=torch.bfloat16)
    ry, rs = conv1d_prefill_reference(x, w, state)
    out = torch.full((T, C), float("nan"), device=DEV, dtype=torch.bfloat16)
    conv1d_prefill(x, w, state, out=out)
    assert_rows_close(out, ry, f"seed {gen.initial_seed()}")
    assert torch.equal(state.float(), rs), "conv state must hold the last K-1 pre-conv rows"


@pytest.mark.parametrize("T, n", [(32, 23), (16, 2), (16, 1), (16, 16)])
def test_conv1d_prefill_padded_chunk_keeps_the_prompts_rows(gen, T, n):
    """A padded chunk (a prefill graph's bucket): rows past n are padding; the state takes the last K-1 rows
    of [state; x[:n]] (some from the old state when n < K-1), n read from the device."""
    C, K = 1100, 4   # two column blocks of the state kernel, the second partial
    x = randn(gen, T, C, dtype=torch.bfloat16)
    w = randn(gen, C, K, scale=0.5, dtype=torch.bfloat16)
    state = randn(gen, K - 1, C, dtype=torch.bfloat16)
    ry, rs = conv1d_prefill_reference(x, w, state, n=n)
    out = torch.full((T, C), float("nan"), device=DEV, dtype=torch.bfloat16)
    conv1d_prefill(x, w, state, out=out, n_valid=torch.tensor([n], dtype=torch.int32, device=DEV))
    assert_rows_close(out[:n], ry[:n], f"seed {gen.initial_seed()}")
    assert torch.equal(state.float(), rs), f"n={n}: the state must hold the last K-1 rows of [state; x[:n]]"


# -- chunked gated delta rule ------------------------------------------------------------------------



def test_gdn_chunked_matches_recurrence_from_a_state(gen):
    T, Hk, Hv, dk, dv = 150, 2, 4, 32, 32  # three chunks, the last partial
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    s0 = randn(gen, Hv, dk, dv, scale=0.3)
    state = s0.clone()
    o = gdn_chunked_prefill(y, b, a, A_log, dt_bias, state, Hk)
    q, k, v, g, beta = gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    ro, rs = gated_delta_recurrent(q, k, v, g, beta, s0)
    assert_rows_close(o.reshape(ro.shape), ro, f"seed {gen.initial_seed()}: output")  # [position, head] rows
    assert_rows_close(state, rs, f"seed {gen.initial_seed()}: state")  # [head, key dim] rows


def test_gdn_chunked_near_identical_keys(gen):
    """Strongly coupled chunk (keys almost equal, beta ~ 1, no decay): the triangular inverse is
    ill-conditioned here; compare against the fp64 recurrence."""
    T, Hk, Hv, dk, dv = 64, 1, 2, 32, 32
    y, _, _, _, _ = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    y = y.float()
    y[:, Hk * dk:2 * Hk * dk] = torch.randn(dk, generator=gen).to(DEV) + 0.05 * randn(gen, T, dk)
    y = y.to(torch.bfloat16)
    b, a = torch.full((T, Hv), 6.0, device=DEV), torch.full((T, Hv), -8.0, device=DEV)
    zeros = torch.zeros(Hv, device=DEV)
    state = torch.zeros(Hv, dk, dv, device=DEV)
    o = gdn_chunked_prefill(y, b, a, zeros, zeros, state, Hk)
    q, k, v, g, beta = (t.double() for t in gdn_inputs_reference(y, b, a, zeros, zeros, Hk, Hv, dk, dv))
    ro, rs = gated_delta_recurrent(q, k, v, g, beta)
    assert_rows_within(o, ro, COUPLED, f"seed {gen.initial_seed()}: coupled output", typical=True)
    assert_rows_within(state, rs, COUPLED, f"seed {gen.initial_seed()}: coupled state")


def test_gated_rmsnorm(gen):
    T, Hv, dv = 13, 4, 32
    o = randn(gen, T, Hv, dv)
    z = randn(gen, T, Hv * dv, dtype=torch.bfloat16)
    w = (1 + randn(gen, dv, scale=0.1)).to(torch.bfloat16)
    out = torch.full((T, Hv * dv), float("nan"), device=DEV, dtype=torch.bfloat16)
    gated_rmsnorm(o, z, w, out=out)
    assert_rows_close(out.reshape(T, Hv, dv), gated_rmsnorm_reference(o, z, w).reshape(T, Hv, dv),
                      f"seed {gen.initial_seed()}")


# -- flash attention -----------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, warps, stages, SPLIT_MASK): the default; the causal mask only on the diagonal key blocks,
# with key blocks narrower than the query blocks (several diagonal blocks a query block) and wider ones
# (the full model's head_dim 256 runs flash_attention.TILES_WIDE, (128, 64, 8, 2, True), and on cards with 99 KiB
# of shared memory a program TILES_WIDE_SMALL, (64, 64, 4, 3, True): their block shapes are here)
ATTN_TILES = [(64, 64, 4, 2, False), (64, 32, 4, 2, True), (32, 64, 4, 2, True), (128, 64, 8, 2, True),
              (64, 64, 4, 3, True)]


@pytest.mark.parametrize("tiles", ATTN_TILES)
@pytest.mark.parametrize("inputs, pos_on", [("random", "host"), ("self-attending", "host"), ("random", "device")])
def test_flash_attention_after_cached_prefix(gen, inputs, pos_on, tiles, monkeypatch):
    """Every (position, head) row within 3x the bf16 level (attention_bf16) of the fp32 reference. With
    "self-attending" inputs each key equals its position's query (the heads sharing a KV head share it),
    so each query attends mostly to its own key: a key missed anywhere (the last of a query block, the
    first after the cached prefix) makes its row wrong by O(1). pos_on "device": the position reaches the
    kernels as an int32 device tensor (what a captured prefill graph passes)."""
    monkeypatch.setattr(flash_attention, "TILES", tiles)
    Hq, Hkv, D, rot = 4, 2, 64, 16
    inv = rope_inv_freq(rot, 1e7, DEV)
    kc = torch.full((128, Hkv, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    vc = kc.clone()
    kn = (1 + randn(gen, D, scale=0.1)).to(torch.bfloat16)
    qn = kn.clone() if inputs == "self-attending" else (1 + randn(gen, D, scale=0.1)).to(torch.bfloat16)
    keys, vals, pos = [], [], 0
    for T in (37, 70):  # a prefix, then a chunk continuing after it (two query blocks)
        k, v = randn(gen, T, Hkv * D, dtype=torch.bfloat16), randn(gen, T, Hkv * D, dtype=torch.bfloat16)
        qg = randn(gen, T, Hq * 2 * D, dtype=torch.bfloat16)
        if inputs == "self-attending":
            heads = qg.reshape(T, Hq, 2 * D)
            heads[..., :D] = 3 * k.reshape(T, Hkv, 1, D).expand(T, Hkv, Hq // Hkv, D).reshape(T, Hq, D)
        at = pos if pos_on == "host" else torch.tensor([pos], dtype=torch.int32, device=DEV)
        write_kv_prefill(k, v, kn, inv, kc, vc, at)
        o = flash_attention_prefill(qg, qn, inv, kc, vc, at, Hq)
        keys.append(norm_rope_reference(k.reshape(T, Hkv, D), kn, torch.arange(pos, pos + T, device=DEV), inv))
        vals.append(v.reshape(T, Hkv, D))
        msg = f"seed {gen.initial_seed()}, {inputs}, positions {pos}..{pos + T - 1}"
        assert_rows_close(kc[pos:pos + T], keys[-1], f"{msg}: K cache")  # [position, head] rows
        assert torch.equal(vc[pos:pos + T], vals[-1])
        ref = attention_reference(qg, qn, inv, torch.cat(keys), torch.cat(vals), pos, Hq).reshape(T, Hq, D)
        level = float(row_rel(attention_bf16(qg, qn, inv, torch.cat(keys), torch.cat(vals), pos, Hq), ref).max())
        assert_rows_close(o.reshape(T, Hq, D), ref, f"{msg}: output", level=level)
        pos += T
    assert torch.isnan(kc[pos:].float()).all(), "rows past the prompt must stay untouched"


def test_write_kv_refuses_overflow(gen):
    kc = torch.zeros(8, 2, 64, device=DEV, dtype=torch.bfloat16)
    k = randn(gen, 5, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit the KV cache of 8 positions"):
        write_kv_prefill(k, k, torch.ones(64, device=DEV), rope_inv_freq(16, 1e7, DEV), kc, kc.clone(), 4)


# -- the prefill forward against the reference model ----------------------------------------------------

def _state(c, max_seq):
    n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
    kv = (n_attn, max_seq, c.num_key_value_heads, c.head_dim)
    return types.SimpleNamespace(
        pos=0, k_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=DEV),
        v_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=DEV),
        conv_state=torch.zeros(n_gdn, c.linear_conv_kernel_dim - 1, c.linear_conv_dim, dtype=torch.bfloat16,
                               device=DEV),
        rec_state=torch.zeros(n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                              device=DEV))


@pytest.mark.parametrize("shared_with_routed", [True, False])
def test_prefill_forward_matches_reference_model(gen, monkeypatch, shared_with_routed):
    import lily.kernels.q4_gemm as q4_gemm
    import lily.model.fast_prefill as fast_prefill
    from lily.model.fast_prefill import prefill_forward, with_fused_projections
    monkeypatch.setattr(fast_prefill, "SHARED_WITH_ROUTED", shared_with_routed)
    # the router's K split (on the GPU a short prompt's: the tiny model's K is too short for the default
    # rule) with its partials summed inside the routing kernel
    monkeypatch.setattr(fast_prefill, "ROUTER_PARTS_TO_TOPK", True)
    monkeypatch.setattr(q4_gemm, "SPLIT_K_MIN_GROUPS", 1)
    monkeypatch.setattr(fast_prefill, "NEXT_NORM_IN_COMBINE", True)   # (with the routed experts only)
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    c = TINY
    w = {k: (v.to(DEV) if isinstance(v, (QuantTensor, torch.Tensor)) else v)
         for k, v in random_weights(c, seed=gen.initial_seed() % 1000).items()}
    w = with_fused_projections(c, w)
    ids = torch.randint(0, c.vocab_size, (29,), generator=gen).to(DEV)
    ref = ReferenceModel(c, w, device=DEV)
    rs = ref.new_state()
    with reference_router(ref) as ref_calls:
        r = torch.cat([ref.forward(ids[:20], rs), ref.forward(ids[20:], rs)])
    # a prompt in bounded chunks, then more tokens continuing the cached prefix; the MoE layers follow the
    # reference's routing where it is a near-tie (helpers_routing), so every row must match closely
    st = _state(c, 40)
    with fast_prefill_routing(monkeypatch, ref_calls, c) as routing:
        fast = torch.cat([prefill_forward(c, w, st, ids[:20], logits="all", chunk_tokens=12),
                          prefill_forward(c, w, st, ids[20:], logits="all", chunk_tokens=12)])
    msg = f"seed {gen.initial_seed()}, near-tie expert flips followed (layer, position, margin, error): {routing.flips}"
    assert_logits_close(fast, r, PREFILL_LIMIT, f"{msg}: logits", PREFILL_MEDIAN_LIMIT)
    # The state the decode step reads next, row by row: the conv state's rows, the caches' (position,
    # head) rows and each value head's recurrent state.
    assert st.pos == rs.pos == 29
    for j, i in enumerate(c.linear_attention_layers):
        assert_rows_close(st.conv_state[j], rs.conv[i], f"{msg}: conv state layer {i}", limit=PREFILL_LIMIT)
        assert_rows_close(st.rec_state[j], rs.recurrent[i], f"{msg}: recurrent state layer {i}", row_dims=2,
                          limit=PREFILL_LIMIT)
    for j, i in enumerate(c.full_attention_layers):
        assert_rows_close(st.k_cache[j, :29], rs.keys[i], f"{msg}: K cache layer {i}", limit=PREFILL_LIMIT)
        assert_rows_close(st.v_cache[j, :29], rs.values[i], f"{msg}: V cache layer {i}", limit=PREFILL_LIMIT)
    # the last-position logits (the default) are the last row of the full ones
    with reference_router(ref) as ref_calls:
        ref.forward(ids[:20], ref.new_state())
    with fast_prefill_routing(monkeypatch, ref_calls, c):
        last = prefill_forward(c, w, _state(c, 40), ids[:20], chunk_tokens=12)
    assert last.shape == (c.vocab_size,), msg
    assert rel(last, fast[19]) < 1e-3, msg


def test_prefill_forward_refuses_overlong_prompt(gen):
    from lily.model.fast_prefill import prefill_forward
    st = _state(TINY, 8)
    with pytest.raises(ValueError, match="does not fit max_seq=8"):
        prefill_forward(TINY, {}, st, torch.zeros(9, dtype=torch.long, device=DEV))
