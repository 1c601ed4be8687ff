"""The chunked gated delta rule's launch variants and stored intermediates (lily/kernels/gdn_chunked.py).

The GPU sweep (scripts/gpu_prefill_check.py gdn_sweep) switches the module-level launch choices; each
choice must compute the same function. Under the CPU interpreter every dot is fp32 whatever its
input_precision, so these tests check the plumbing and the math of each variant, not the precision
(the GPU sweep measures that against the fp32 recurrence)."""

from __future__ import annotations


import pytest
import torch

import lily.kernels.gdn_chunked as GC
from lily.kernels.gated_delta import gated_delta_recurrent

from helpers_tensors import (DEV, INTERPRET, assert_rows_within, gdn_inputs, new_generator, randn,  # noqa: E402,F401
                             row_rel)

# Bounds on the worst row (a position's one value head of the output; a value head's key row of the state;
# a position's head of W, U, QK; each element of c over its RMS), ~3x the worst measured over 12-42 seeds
# (LILY_MEASURE_FILE, tests/helpers_tensors.py) under the interpreter, where every dot is fp32: one row
# with a wrong decay or a missed key is off by far more. (On a GPU the tf32 dots are ~1e-3 a product.)
# (W, U, QK and c: over 42 seeds; the first 12 alone gave worsts of 1.4e-5 and 9.5e-6 for W and QK)
PREP = 7e-5        # W, U against the fp64 triangular solve: W 2.3e-5 worst (1e-5 median), U 4.0e-6
                   # (the blocked prep, over 40 seeds: W 2.1e-5 worst, 7.7e-6 median, U 1.9e-6)
PREP_QK = 6e-5     # QK over its typical row (a chunk's first rows hold one or two products; each row over
                   # itself had a tail to 7e-5): 1.9e-5 worst, 5e-6 median
PREP_C = 2.5e-6    # the cumulative log-decay c, each element over c's RMS: 8.6e-7 worst
RECURRENCE = 1e-4   # output (over its typical row: o = S^T q can be near zero; each row over itself had
                    # a tail to 3e-4) and state rows against the fp32 recurrence: 3.2e-5 worst over 42 seeds
                    # (1.5e-5 over the first 12: the tail is long), medians 6e-6 and 2e-6
if not INTERPRET:    # on a GPU (not measured here) the tf32 variant's dots: the former whole-tensor bound
    RECURRENCE = 2e-3
COUPLED_PREP = 1e-4  # W, U of the blocked prep on a strongly coupled chunk (test_blocked_prep_on_a_coupled_chunk):
                     # W 2.8e-5 worst over 40 seeds (1.6e-5 median), U 1.9e-6. The products prep there: 4e-3 to
                     # 1e-2 in fp32 (this interpreter), ~1e3 with its dots at plain tf32 (emulated, the test)
if not INTERPRET:    # the W and U dots are tf32 (not measured here; a CPU emulation of the blocked prep with
    COUPLED_PREP = 5e-2  # tf32x3 merges and tf32 W, U gave 1.5e-2 worst at dk 128)
SAME = 1e-6        # the split walk against the single scan: measured 0 (bitwise equal) under the interpreter


@pytest.fixture
def gen():
    return new_generator()  # the seed is gen.initial_seed()




def _poisoned(T, Hv, dk, dv):
    """gdn_prep's four output buffers full of NaN: an element the kernel does not write fails the checks."""
    nan = dict(fill_value=float("nan"), device=DEV)
    return (torch.full((T, Hv, dk), **nan), torch.full((T, Hv, dv), **nan), torch.full((T, Hv), **nan),
            torch.full((T, Hv, GC.CHUNK), **nan))


@pytest.mark.parametrize("algo", GC.ALGOS)
@pytest.mark.parametrize("T", [150, 64, 5])
def test_prep_intermediates_match_reference(gen, monkeypatch, algo, T):
    """W, U, c and the decayed causal QK, written over NaN, against the fp64 triangular solve."""
    monkeypatch.setattr(GC, "PREP_ALGO", algo)
    Hk, Hv, dk, dv = 2, 4, 32, 16
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    w, u, gc, qk = GC.gdn_prep(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv, out=_poisoned(T, Hv, dk, dv))
    rw, ru, rgc, rqk = GC.gdn_prep_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(w, rw, PREP, f"{seed}: W")                 # [position, head] rows
    assert_rows_within(u, ru, PREP, f"{seed}: U")
    assert_rows_within(gc, rgc, PREP_C, f"{seed}: c", row_dims=0)
    assert_rows_within(qk, rqk, PREP_QK, f"{seed}: QK", typical=True)
    # QK is causal within the chunk: nothing above the diagonal, nothing past the chunk's last row
    col = torch.arange(GC.CHUNK, device=DEV)
    above = col[None, :] > (torch.arange(T, device=DEV) % GC.CHUNK)[:, None]
    assert torch.all(qk[above.unsqueeze(1).expand_as(qk)] == 0), seed


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """What a plain tf32 MMA reads of an fp32 operand: the low 13 mantissa bits dropped."""
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


def _products_inverse_tf32(A: torch.Tensor) -> torch.Tensor:
    """GC._unit_lower_inverse in torch with every dot at plain tf32: (I + A)^-1 for one chunk's A [64, 64]."""
    dot = lambda x, y: _tf32(x) @ _tf32(y)
    rows = torch.arange(GC.CHUNK, device=A.device)
    eye = torch.eye(GC.CHUNK, device=A.device)
    n1 = torch.where((rows[:, None] // 16) == (rows[None, :] // 16), A, 0.0)
    n2 = dot(n1, n1)
    n4 = dot(n2, n2)
    dinv = dot(dot(dot(eye - n1, eye + n2), eye + n4), eye + dot(n4, n4))
    m = dot(dinv, A - n1)
    return dot(eye - dot(m, eye - dot(m, eye - m)), dinv)


def _coupled_inputs(gen, T, Hk, Hv, dk, dv):
    """A strongly coupled prompt (scripts/gpu_prefill_check.py _gdn_case): near-identical keys (a repeated
    token), beta = sigmoid(b + 6) ~ 1, slow decay (A = exp(-6)): I + A is nearly the all-ones lower triangle."""
    y, b, a, _, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    y = y.float()
    y[:, Hk * dk:2 * Hk * dk] = randn(gen, Hk * dk) + 0.05 * randn(gen, T, Hk * dk)
    return y.to(torch.bfloat16), b + 6.0, a, torch.full((Hv,), -6.0, device=DEV), dt_bias


@pytest.mark.parametrize("T", [64, 100])
def test_blocked_prep_on_a_coupled_chunk(gen, monkeypatch, T):
    """The blocked inverse where the nilpotent powers of the products algorithm grow like binomials: W and
    U, written over NaN, within COUPLED_PREP of the fp64 solve, a bound the products algorithm at plain tf32
    fails by far (emulated below on the first chunk). T = 100: the second chunk ends inside its third row
    block, and its fourth lies wholly past T."""
    monkeypatch.setattr(GC, "PREP_ALGO", "blocked")
    Hk, Hv, dk, dv = 1, 2, 64, 32
    args = _coupled_inputs(gen, T, Hk, Hv, dk, dv)
    w, u, gc, qk = GC.gdn_prep(*args, Hk, Hv, dk, dv, out=_poisoned(T, Hv, dk, dv))
    rw, ru, rgc, rqk = GC.gdn_prep_reference(*args, Hk, Hv, dk, dv)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(w, rw, COUPLED_PREP, f"{seed}: coupled W")
    assert_rows_within(u, ru, COUPLED_PREP, f"{seed}: coupled U")
    assert_rows_within(gc, rgc, PREP_C, f"{seed}: coupled c", row_dims=0)
    assert_rows_within(qk, rqk, PREP_QK, f"{seed}: coupled QK", typical=True)

    q, k, v, g, beta = GC.gdn_inputs_reference(*args, Hk, Hv, dk, dv)
    n = GC.CHUNK
    c = g[:n].cumsum(0)  # [n, Hv]
    lower = torch.ones(n, n, dtype=torch.bool, device=DEV).tril(-1)
    worst = 0.0
    for h in range(Hv):
        kc = k[:n, h // (Hv // Hk)]
        A = torch.where(lower, (kc @ kc.T) * (c[:, None, h] - c[None, :, h]).exp() * beta[:n, h, None], 0.0)
        wt = _products_inverse_tf32(A) @ ((beta[:n, h] * c[:, h].exp())[:, None] * kc)
        worst = max(worst, float(row_rel(wt, rw[:n, h]).max()))
    assert worst > 10 * COUPLED_PREP, f"{seed}: the products algorithm at tf32 would pass (W off by {worst:.1e})"


@pytest.mark.parametrize("precision,bv,split,T", [
    ("tf32x3", 32, False, 150),
    ("ieee", 16, False, 150),
    ("tf32x3", 16, True, 150),
    ("tf32", 32, True, 64),
    ("tf32x3", 32, True, 1),
])
def test_variants_match_recurrence_from_a_state(gen, monkeypatch, precision, bv, split, T):
    Hk, Hv, dk, dv = 2, 4, 32, 32
    monkeypatch.setattr(GC, "PREP_PRECISION", precision)
    monkeypatch.setattr(GC, "SCAN_BV", bv)
    monkeypatch.setattr(GC, "SCAN_SPLIT", split)
    monkeypatch.setattr(GC, "OUT_BV", 16)
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    s0 = randn(gen, Hv, dk, dv, scale=0.3)
    state = s0.clone()
    o = GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, state, Hk)
    q, k, v, g, beta = GC.gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    ro, rs = gated_delta_recurrent(q, k, v, g, beta, s0)
    assert_rows_within(o, ro, RECURRENCE, f"seed {gen.initial_seed()}: output", typical=True)     # [position, head] rows
    assert_rows_within(state, rs, RECURRENCE, f"seed {gen.initial_seed()}: state")  # [head, key dim] rows


def test_split_matches_single_scan_over_two_calls(gen, monkeypatch):
    """A prompt in two calls (the state carried between them): the split walk and the single scan agree."""
    Hk, Hv, dk, dv = 1, 2, 32, 32
    y, b, a, A_log, dt_bias = gdn_inputs(gen, 200, Hk, Hv, dk, dv)
    s0 = randn(gen, Hv, dk, dv, scale=0.3)
    outs = {}
    for split in (False, True):
        monkeypatch.setattr(GC, "SCAN_SPLIT", split)
        st = s0.clone()
        o1 = GC.gdn_chunked_prefill(y[:70], b[:70], a[:70], A_log, dt_bias, st, Hk)
        o2 = GC.gdn_chunked_prefill(y[70:], b[70:], a[70:], A_log, dt_bias, st, Hk)
        outs[split] = (torch.cat([o1, o2]), st)
    assert_rows_within(outs[True][0], outs[False][0], SAME, f"seed {gen.initial_seed()}: split output", typical=True)
    assert_rows_within(outs[True][1], outs[False][1], SAME, f"seed {gen.initial_seed()}: split state")


def test_unknown_precision_is_refused(gen, monkeypatch):
    monkeypatch.setattr(GC, "PREP_PRECISION", "fp16")
    y, b, a, A_log, dt_bias = gdn_inputs(gen, 8, 1, 2, 32, 32)
    with pytest.raises(ValueError, match="PREP_PRECISION"):
        GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, torch.zeros(2, 32, 32, device=DEV), 1)


def test_unknown_algorithm_is_refused(gen, monkeypatch):
    monkeypatch.setattr(GC, "PREP_ALGO", "cholesky")
    y, b, a, A_log, dt_bias = gdn_inputs(gen, 8, 1, 2, 32, 32)
    with pytest.raises(ValueError, match="PREP_ALGO"):
        GC.gdn_prep(y, b, a, A_log, dt_bias, 1, 2, 32, 32)


def test_fp32_conv_output_takes_the_fp32_route(gen):
    """y may also come in fp32 (the k k^T / q k^T dots then run in fp32, not as bf16 MMAs)."""
    T, Hk, Hv, dk, dv = 90, 1, 2, 32, 32
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    y = y.float() + 0.01 * randn(gen, *y.shape)  # values a bf16 tile could not hold
    s0 = randn(gen, Hv, dk, dv, scale=0.3)
    state = s0.clone()
    o = GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, state, Hk)
    ro, rs = gated_delta_recurrent(*GC.gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv), s0)
    assert_rows_within(o, ro, RECURRENCE, f"seed {gen.initial_seed()}: fp32 route output", typical=True)
    assert_rows_within(state, rs, RECURRENCE, f"seed {gen.initial_seed()}: fp32 route state")
