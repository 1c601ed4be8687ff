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

from helpers_tensors import DEV, gdn_inputs, new_generator, randn, rel  # noqa: E402,F401


@pytest.fixture
def gen():
    return new_generator()  # the seed is gen.initial_seed()




@pytest.mark.parametrize("T", [150, 64, 5])
def test_prep_intermediates_match_reference(gen, T):
    """W, U, c and the decayed causal QK, written over NaN, against the fp64 triangular solve."""
    Hk, Hv, dk, dv = 2, 4, 32, 16
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    bufs = (torch.full((T, Hv, dk), float("nan"), device=DEV), torch.full((T, Hv, dv), float("nan"), device=DEV),
            torch.full((T, Hv), float("nan"), device=DEV), torch.full((T, Hv, GC.CHUNK), float("nan"), device=DEV))
    w, u, gc, qk = GC.gdn_prep(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv, out=bufs)
    rw, ru, rgc, rqk = GC.gdn_prep_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    seed = f"seed {gen.initial_seed()}"
    assert rel(w, rw) < 1e-4 and rel(u, ru) < 1e-4, seed
    assert rel(gc, rgc) < 1e-5, seed
    assert rel(qk, rqk) < 1e-4, seed
    # QK is causal within the chunk: nothing above the diagonal, nothing past the chunk's last row
    col = torch.arange(GC.CHUNK, device=DEV)
    above = col[None, :] > (torch.arange(T, device=DEV) % GC.CHUNK)[:, None]
    assert torch.all(qk[above.unsqueeze(1).expand_as(qk)] == 0), seed


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
    assert rel(o, ro) < 2e-3, f"seed {gen.initial_seed()}"
    assert rel(state, rs) < 2e-3, f"seed {gen.initial_seed()}"


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
    assert rel(outs[True][0], outs[False][0]) < 1e-5, f"seed {gen.initial_seed()}"
    assert rel(outs[True][1], outs[False][1]) < 1e-5, f"seed {gen.initial_seed()}"


def test_unknown_precision_is_refused(gen, monkeypatch):
    monkeypatch.setattr(GC, "PREP_PRECISION", "fp16")
    y, b, a, A_log, dt_bias = gdn_inputs(gen, 8, 1, 2, 32, 32)
    with pytest.raises(ValueError, match="PREP_PRECISION"):
        GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, torch.zeros(2, 32, 32, device=DEV), 1)


def test_fp32_conv_output_takes_the_fp32_route(gen):
    """y may also come in fp32 (the k k^T / q k^T dots then run in fp32, not as bf16 MMAs)."""
    T, Hk, Hv, dk, dv = 90, 1, 2, 32, 32
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    y = y.float() + 0.01 * randn(gen, *y.shape)  # values a bf16 tile could not hold
    s0 = randn(gen, Hv, dk, dv, scale=0.3)
    state = s0.clone()
    o = GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, state, Hk)
    ro, rs = gated_delta_recurrent(*GC.gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv), s0)
    assert rel(o, ro) < 2e-3 and rel(state, rs) < 2e-3, f"seed {gen.initial_seed()}"
