"""The GDN recurrent state stored in bf16 (`--recurrent-state-dtype bf16`): each kernel that carries it between
calls reads it into fp32, updates it there and stores it rounded once; the reference model rounds its stored
state the same way, and the fast backend follows that reference. Kernels under TRITON_INTERPRET=1 on fresh
random inputs, against the plain-torch references on the same bf16 state (upcast exactly)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_tensors import assert_rows_within, gdn_inputs, new_generator, randn

import lily.kernels.gdn_chunked as GC
from lily.kernels import gdn_decode as GD
from lily.kernels import gdn_decode_batch as GB
from lily.kernels import quant_gemv as QG
from lily.kernels.gated_delta import gated_delta_recurrent

EPS = 1e-6
BF16 = torch.bfloat16
GDN = 1e-5   # the fp32 update's own bound (tests/test_kernels_decode.py): the output is computed before rounding


@pytest.fixture
def gen():
    return new_generator()


def rn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def assert_stored_rounded(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got (bf16) is the fp32 want rounded once: each element within one bf16 step of it (the interpreter's
    cast truncates, the GPU's rounds to nearest), plus the fp32 update's noise on elements near zero."""
    assert got.dtype == BF16, f"{what}: stored as {got.dtype}"
    noise = GDN * want.abs().amax(-1, keepdim=True)
    bad = (got.float() - want).abs() > 2 ** -7 * want.abs() + noise
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than one bf16 step"


def test_gdn_decode_on_a_bf16_state(gen):
    hk, hv, dk, dv = 2, 4, 32, 64
    conv_dim, vd = 2 * hk * dk + hv * dv, hv * dv
    proj = rn(gen, conv_dim + vd + 2 * hv)
    state = (rn(gen, hv, dk, dv) * 0.1).to(BF16)
    before = state.clone()
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen) * 15 + 1), rn(gen, hv) * 0.1
    gain = rn(gen, dv).abs() + 0.5
    out = torch.full((vd,), float("nan"))
    GD.gdn_decode(proj, state, a_log, dt_bias, gain, EPS, GD.GDNScratch(hv, dv, "cpu"), out, hk)
    out = out[QG.perm64_index(vd)]
    z = proj[conv_dim:conv_dim + vd]
    b, a = proj[conv_dim + vd:conv_dim + vd + hv], proj[conv_dim + vd + hv:]
    ref_o, ref_s = GD.gdn_decode_reference(proj[:conv_dim], z, b, a, before.float(), a_log, dt_bias, hk, gain, EPS)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(out.reshape(hv, dv), ref_o.reshape(hv, dv), GDN, f"{seed}: output", typical=True)
    assert_stored_rounded(state, ref_s, f"{seed}: state")
    assert not torch.equal(state, before)


def test_gdn_step_rows_on_bf16_slots(gen):
    """The batched step on a bf16 slot pool: the valid rows' slots updated and rounded, the output from the fp32
    update, the pad row and the other slots untouched; then the same with the gated norm in the launch."""
    n_slots, hk, hv, dk, dv, n_valid, pad = 4, 2, 4, 32, 64, 3, 1
    perm = torch.randperm(n_slots, generator=gen)[:n_valid]
    slots = torch.cat([perm, torch.zeros(pad, dtype=perm.dtype)]).to(torch.int32)
    nv = torch.tensor([n_valid], dtype=torch.int32)
    conv_dim, vd = 2 * hk * dk + hv * dv, hv * dv
    state = (rn(gen, n_slots, hv, dk, dv) * 0.1).to(BF16)
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen) * 15 + 1), rn(gen, hv) * 0.1
    gain = rn(gen, dv).abs() + 0.5
    seed = f"seed {gen.initial_seed()}"
    for fused in (False, True):
        proj = rn(gen, n_valid + pad, conv_dim + vd + 2 * hv)
        before = state.clone()
        if fused:
            scratch = GB.StepNormScratch(n_valid + pad, hv, dv, "cpu", block_v=32)
            scratch.o.fill_(float("nan"))
            GB.gdn_step_norm_rows(proj, state, a_log, dt_bias, slots, nv, hk, gain, EPS, scratch)
            out = scratch.o
        else:
            out = torch.full((n_valid + pad, hv, dv), float("nan"))
            GB.gdn_step_rows(proj, state, a_log, dt_bias, slots, nv, hk, out=out, block_v=32)
        b_, a_ = proj[:n_valid, conv_dim + vd:conv_dim + vd + hv], proj[:n_valid, conv_dim + vd + hv:]
        want_o, want_s = GB.gdn_step_rows_reference(proj[:n_valid, :conv_dim], b_, a_,
                                                    [before[s].float() for s in slots[:n_valid].tolist()],
                                                    a_log, dt_bias, hk)
        assert_rows_within(out[:n_valid], want_o.reshape(n_valid, hv, dv), GDN, f"{seed}: output", typical=True)
        assert out[n_valid:].isnan().all()
        for b, s in enumerate(slots[:n_valid].tolist()):
            assert_stored_rounded(state[s], want_s[b], f"{seed}, fused {fused}, row {b}: state")
        unused = sorted(set(range(n_slots)) - set(slots[:n_valid].tolist()))
        assert torch.equal(state[unused], before[unused])


@pytest.mark.parametrize("split", [False, True])
def test_chunked_prefill_on_a_bf16_state(gen, monkeypatch, split):
    """A prompt's chunked walk starts from the bf16 state (exactly upcast) and stores its end rounded once."""
    monkeypatch.setattr(GC, "SCAN_SPLIT", split)
    Hk, Hv, dk, dv, T = 2, 4, 32, 32, 90
    y, b, a, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, dk, dv)
    state = randn(gen, Hv, dk, dv, scale=0.3).to(BF16)
    s0 = state.float()
    o = GC.gdn_chunked_prefill(y, b, a, A_log, dt_bias, state, Hk)
    q, k, v, g, beta = GC.gdn_inputs_reference(y, b, a, A_log, dt_bias, Hk, Hv, dk, dv)
    ro, rs = gated_delta_recurrent(q, k, v, g, beta, s0)
    seed = f"seed {gen.initial_seed()}"
    # the walk's own bound (tests/test_gdn_chunked.py's RECURRENCE)
    assert_rows_within(o, ro, 2e-4, f"{seed}: output", typical=True)
    assert state.dtype == BF16
    assert_rows_within(state.float(), rs, 2e-4 + 2 ** -7, f"{seed}: state")


def test_reference_rounds_its_stored_state():
    """The reference's bf16 option: each GDN layer's stored state is its own bf16 rounding after a prompt and
    after a step, and not the fp32 run's state (so the option does something)."""
    from lily.config import TINY
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    weights = random_weights(TINY, seed=random.randrange(10_000))
    ids = [random.randrange(TINY.vocab_size) for _ in range(9)]
    runs = {}
    for dtype in ("fp32", "bf16"):
        model = ReferenceModel(TINY, weights, rec_dtype=dtype)
        st = model.new_state()
        model.forward(ids, st)
        after_prompt = {i: s.clone() for i, s in st.recurrent.items()}
        model.forward([ids[0]], st)
        runs[dtype] = (after_prompt, st.recurrent)
    for i in TINY.linear_attention_layers:
        for s in (runs["bf16"][0][i], runs["bf16"][1][i]):
            assert s.dtype == torch.float32 and torch.equal(s, s.to(BF16).float()), i
        assert not torch.equal(runs["bf16"][1][i], runs["fp32"][1][i]), i
    with pytest.raises(ValueError, match="recurrent state dtype 'fp16'"):
        ReferenceModel(TINY, weights, rec_dtype="fp16")


def test_fast_backend_follows_the_reference_that_rounds_its_state_alike(monkeypatch):
    """A prompt through the prefill kernels, then decode steps, on a bf16 recurrent state: every position's logits
    within the paths' limits of the fp32 reference whose stored state is rounded the same way (routing following
    its at near-ties), each layer's state within a rounding of its; the state's bytes shrink by the state's half;
    a snapshot restored into a slot decodes exactly as the original."""
    from helpers_routing import PREFILL_LIMIT, assert_fast_follows_reference

    from lily.config import TINY
    from lily.engine.fast_backend import FastBackend
    from lily.model.reference import ReferenceModel
    from lily.model.slots import slot_nbytes
    from lily.synthetic import random_weights

    c = TINY
    weights = random_weights(c, seed=random.randrange(10_000))
    be = FastBackend(c, weights, device="cpu", max_seq=48, prefill_mode="kernels", rec_dtype="bf16")
    ref = ReferenceModel(c, weights, rec_dtype="bf16")
    rs, fs, fed = assert_fast_follows_reference(monkeypatch, be, ref, "bf16-state")
    assert fs.rec_state.dtype == BF16
    half = len(c.linear_attention_layers) * c.linear_num_value_heads * c.linear_key_head_dim \
        * c.linear_value_head_dim * 2
    assert fs.nbytes() == slot_nbytes(c, 48, "bf16", "bf16") == slot_nbytes(c, 48, "bf16", "fp32") - half
    for j, i in enumerate(c.linear_attention_layers):
        # the paths' error carried into the state, plus the roundings on either side
        assert_rows_within(fs.rec_state[j].float(), rs.recurrent[i], 2 * PREFILL_LIMIT, f"layer {i} state",
                           typical=True)
    snap = be.clone_state(fs)
    restored = be.restore_state(snap)
    assert restored.rec_state.dtype == BF16 and torch.equal(restored.rec_state, fs.rec_state)
    assert torch.equal(be.decode(fed[-1], restored), be.decode(fed[-1], fs))


def test_batched_step_on_bf16_slots_matches_the_batch1_step(monkeypatch):
    """The batched decode step over bf16-state slots (rows in slots out of batch order, ragged histories) against
    the batch-1 step on bf16 states of the same histories, its routing following theirs at near-ties: logits
    within the decode path's limit, the states within a rounding of each other's."""
    from helpers_routing import DECODE_LIMIT
    from test_fast_batch import ragged_slots_against_batch1

    from lily.config import TINY
    from lily.engine.fast_backend import FastBackend
    from lily.synthetic import random_weights

    b = FastBackend(TINY, random_weights(TINY, seed=random.randrange(10_000)), device="cpu", max_seq=32,
                    max_batch=4, rec_dtype="bf16")
    states, alone = ragged_slots_against_batch1(monkeypatch, b, DECODE_LIMIT)
    for st, a in zip(states, alone):
        assert st.rec_state.dtype == a.rec_state.dtype == BF16
        # (3x: the two paths round a bf16 state apart; a CI seed's worst row 4.01e-2, median 7e-4; wrong math is O(1))
        assert_rows_within(st.rec_state.float(), a.rec_state.float(), 3 * DECODE_LIMIT, "state", typical=True)


def test_the_option_reaches_the_backends(tmp_path):
    """`--recurrent-state-dtype` reaches either backend through load_backend and is refused when wrong; `lily
    serve` and `lily bench` take it (bench says in its JSON which it used)."""
    import json

    from lily.cli import main, make_parser
    from lily.engine import load_backend
    from lily.engine.fast_backend import FastBackend
    from lily.server.main import add_arguments
    from lily.synthetic import make_synthetic

    make_synthetic("tiny", tmp_path / "m")
    assert load_backend(tmp_path / "m", "cpu", "reference", rec_dtype="bf16").model.rec_dtype == "bf16"
    assert load_backend(tmp_path / "m", "cpu", "reference").model.rec_dtype == "fp32"
    fast = FastBackend.from_dir(tmp_path / "m", "cpu", max_seq=16, rec_dtype="bf16")   # (load_backend: CUDA only)
    assert fast.model.rec_dtype == "bf16" and fast.new_state().rec_state.dtype == BF16
    with pytest.raises(ValueError, match="recurrent state dtype 'fp16'"):
        load_backend(tmp_path / "m", "cpu", "reference", rec_dtype="fp16")
    parser = make_parser("lily serve", "")
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "m"), "--recurrent-state-dtype", "bf16"])
    assert args.recurrent_state_dtype == "bf16"
    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "--backend", "reference",
                 "--recurrent-state-dtype", "bf16", "--contexts", "16", "--decode-steps", "2", "--retries", "0",
                 "--no-plot", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["engines"]["lily"]["info"]["recurrent_state_dtype"] == "bf16"


def test_bench_builds_lily_with_both_state_dtypes():
    """`lily bench --synthetic` builds the fast backend with the KV cache and recurrent state it was asked for
    (FastBackend takes them through its **kwargs: a check by parameter name alone dropped both, so a synthetic
    --kv-cache-dtype int8 run measured the bf16 cache)."""
    from lily.bench.main import backend_from_weights
    from lily.config import TINY
    from lily.synthetic import random_weights

    weights = random_weights(TINY, seed=random.randrange(10_000))
    for kv, rec in (("int8", "bf16"), ("bf16", "fp32")):
        fast = backend_from_weights("fast", TINY, weights, "cpu", 32, kv, rec)
        assert (fast.model.kv_dtype, fast.model.rec_dtype, fast.max_batch) == (kv, rec, 1)
        ref = backend_from_weights("reference", TINY, weights, "cpu", 32, kv, rec)
        assert (ref.model.kv_dtype, ref.model.rec_dtype) == (kv, rec)
