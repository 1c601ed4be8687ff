"""The gated delta rule (Gated DeltaNet's recurrence), in plain torch and fp32: the oracle for the kernels.

Per value head, with a state S [dk, dv] carried across tokens:

    S = exp(g_t) * S                      # decay
    u = v_t - S^T k_t                     # what the state fails to predict
    S = S + beta_t * k_t u^T              # delta-rule write
    o_t = S^T q_t

Conventions shared by both functions (and expected of every kernel that claims to compute this):
- q, k: [T, Hk, dk] exactly as they enter the recurrence: already L2-normalised per head, and q already
  multiplied by dk**-0.5. (The model does both before calling; keeping them out of here keeps this
  function the bare recurrence.)
- v: [T, Hv, dv]; g (log-decay, <= 0) and beta (in (0, 1)): [T, Hv].
- Hv must be a multiple of Hk; value head j reads key head j // (Hv // Hk) (interleave, not tile).
- state: [Hv, dk, dv] or None (zeros). It is not modified.
- Returns (o [T, Hv, dv], new_state [Hv, dk, dv]), both fp32. All math is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch


def _prepare(q, k, v, g, beta, state):
    T, Hk, dk = q.shape
    Tv, Hv, dv = v.shape
    if k.shape != q.shape or Tv != T or g.shape != (T, Hv) or beta.shape != (T, Hv) or Hv % Hk:
        raise ValueError(f"gated delta: inconsistent shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)} g{tuple(g.shape)} beta{tuple(beta.shape)}")
    rep = Hv // Hk
    f32 = torch.float32
    # [Hv, T, d]: key head j // rep serves value head j
    q = q.to(f32).repeat_interleave(rep, dim=1).transpose(0, 1)
    k = k.to(f32).repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.to(f32).transpose(0, 1)
    g = g.to(f32).transpose(0, 1)
    beta = beta.to(f32).transpose(0, 1)
    if state is None:
        state = torch.zeros(Hv, dk, dv, dtype=f32, device=v.device)
    elif state.shape != (Hv, dk, dv):
        raise ValueError(f"gated delta: state is {tuple(state.shape)}, expected {(Hv, dk, dv)}")
    return q, k, v, g, beta, state.to(f32).clone()


def gated_delta_recurrent(q, k, v, g, beta, state=None):
    """Token by token, exactly the recurrence above (the decode step; T may be any length)."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, state)
    T = q.shape[1]
    out = torch.empty_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[:, None, None]
        u = v[:, t] - torch.einsum("hkv,hk->hv", S, k[:, t])
        S = S + beta[:, t, None, None] * k[:, t, :, None] * u[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", S, q[:, t])
    return out.transpose(0, 1).contiguous(), S


def gated_delta_chunked(q, k, v, g, beta, state=None, chunk: int = 64):
    """The same function computed a chunk at a time (the WY / UT-transform form used for prefill).

    Inside a chunk, with c_i the cumulative log-decay from the chunk start to position i and S0 the state
    at the chunk start, the writes w_i (= beta_i * u_i) solve the unit lower-triangular system
        w_i + beta_i * sum_{j<i} exp(c_i - c_j) (k_i . k_j) w_j = beta_i (v_i - exp(c_i) S0^T k_i),
    after which  o_t = exp(c_t) S0^T q_t + sum_{i<=t} exp(c_t - c_i) (q_t . k_i) w_i  and
    the state leaving the chunk is  exp(c_C) S0 + sum_i exp(c_C - c_i) k_i w_i^T.
    The last chunk may be shorter; no padding is needed.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, state)
    Hv, T, _ = q.shape
    out = torch.empty_like(v)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        c = g[:, s:e].cumsum(-1)                                   # [Hv, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(c_i - c_j) for j <= i; masked before exp so the upper triangle cannot overflow
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        strict = ((kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]).tril(-1)
        system = strict + torch.eye(n, dtype=torch.float32, device=q.device)
        rhs_v = bc[:, :, None] * vc                                # beta_i v_i
        rhs_k = (bc * c.exp())[:, :, None] * kc                    # beta_i exp(c_i) k_i (reads S0)
        w_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        w_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
        w = w_v - w_k @ S                                          # [Hv, n, dv]
        attn = (qc @ kc.transpose(1, 2)) * decay                   # [Hv, n, n], causal
        out[:, s:e] = (c.exp()[:, :, None] * qc) @ S + attn @ w
        tail = (c[:, -1:] - c).exp()                               # exp(c_C - c_i)
        S = c[:, -1].exp()[:, None, None] * S + (tail[:, :, None] * kc).transpose(1, 2) @ w
    return out.transpose(0, 1).contiguous(), S
