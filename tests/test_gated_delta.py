"""The torch gated delta rule: chunked (WY/UT) == recurrent == an independent per-head loop == HF's torch
fallback, from a non-zero state, with T not a multiple of the chunk and value heads > key heads."""

import random

import pytest
import torch
import torch.nn.functional as F

from lily.kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent


def _inputs(T, Hk, Hv, dk, dv, gen):
    q = F.normalize(torch.randn(T, Hk, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(T, Hk, dk, generator=gen), dim=-1)
    v = torch.randn(T, Hv, dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 1.5  # decays exp(g) in (0.22, 1]
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(Hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _naive(q, k, v, g, beta, state):
    """One head at a time with explicit matrices: S <- a S (I - b k k^T)^T form written out directly."""
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    out = torch.empty(T, Hv, v.shape[2], dtype=torch.float64)
    S_all = state.double().clone()
    for h in range(Hv):
        kh = h // (Hv // Hk)
        S = S_all[h]
        for t in range(T):
            kt, qt, vt = k[t, kh].double(), q[t, kh].double(), v[t, h].double()
            S = torch.exp(g[t, h].double()) * S
            S = (torch.eye(dk, dtype=torch.float64) - beta[t, h] * torch.outer(kt, kt)) @ S \
                + beta[t, h].double() * torch.outer(kt, vt)
            out[t, h] = S.T @ qt
        S_all[h] = S
    return out, S_all


@pytest.mark.parametrize("T,chunk", [(1, 64), (77, 16), (150, 64)])
def test_chunked_matches_recurrent_from_nonzero_state(T, chunk):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, g, beta, state = _inputs(T, 2, 6, 16, 24, gen)
    state_before = state.clone()
    o_r, s_r = gated_delta_recurrent(q, k, v, g, beta, state)
    o_c, s_c = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    assert torch.equal(state, state_before), "the input state must not be modified"
    assert o_r.dtype == s_r.dtype == o_c.dtype == s_c.dtype == torch.float32
    assert o_r.shape == o_c.shape == (T, 6, 24) and s_c.shape == (6, 16, 24)
    o_n, s_n = _naive(q, k, v, g, beta, state)
    assert o_n.abs().max() > 0.05  # the state and the writes both matter
    torch.testing.assert_close(o_r.double(), o_n, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_r.double(), s_n, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=2e-5, rtol=1e-5)


def test_split_sequence_continues_from_state():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, g, beta, state = _inputs(100, 4, 8, 32, 16, gen)
    o_all, s_all = gated_delta_chunked(q, k, v, g, beta, state, chunk=32)
    o1, s1 = gated_delta_chunked(q[:45], k[:45], v[:45], g[:45], beta[:45], state, chunk=32)
    o2, s2 = gated_delta_recurrent(q[45:50], k[45:50], v[45:50], g[45:50], beta[45:50], s1)
    o3, s3 = gated_delta_chunked(q[50:], k[50:], v[50:], g[50:], beta[50:], s2, chunk=32)
    torch.testing.assert_close(torch.cat([o1, o2, o3]), o_all, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s3, s_all, atol=2e-5, rtol=1e-5)


def test_matches_transformers_torch_fallback():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    dk = 32
    q, k, v, g, beta, state = _inputs(70, 2, 4, dk, 32, gen)
    # HF scales q by dk**-0.5 itself; ours takes q already scaled
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(q[None] * dk ** 0.5, k[None], v[None], g[None], beta[None],
                                                  chunk_size=16, initial_state=state[None],
                                                  output_final_state=True)
    o, s = gated_delta_chunked(q, k, v, g, beta, state, chunk=32)
    torch.testing.assert_close(o, o_hf[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_hf[0], atol=2e-5, rtol=1e-5)


def test_bf16_inputs_give_fp32_results():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, g, beta, state = _inputs(20, 2, 4, 16, 16, gen)
    args = [x.bfloat16() for x in (q, k, v, g, beta)]
    o, s = gated_delta_chunked(*args, state, chunk=8)
    o_ref, s_ref = gated_delta_recurrent(*[x.float() for x in args], state)
    assert o.dtype == s.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta, state = _inputs(5, 3, 4, 16, 16, gen)  # 4 value heads over 3 key heads
    with pytest.raises(ValueError, match="inconsistent shapes"):
        gated_delta_recurrent(q, k, v, g, beta, None)
    q, k, v, g, beta, state = _inputs(5, 2, 4, 16, 16, gen)
    with pytest.raises(ValueError, match="state is"):
        gated_delta_chunked(q, k, v, g, beta, state[:, :8])
