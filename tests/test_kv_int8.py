"""The int8 KV cache (lily.kernels.kv_int8): the kernels that write it and read it against plain-torch
references, then the fast backend on it against the reference model that stores its rows the same way.

Caches start from fresh random rows packed by the reference; rows the kernels must not read are poisoned
with 0xFF bytes (codes 255 and a NaN scale), so a row read past the sequence shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch
from helpers_tensors import (DEV, INTERPRET, assert_rows_close, assert_rows_within, new_generator, row_rel, to_bf16,
                             typical_row_err)
from test_kernels_prefill import attention_bf16

from lily.kernels import attention_decode as AD
from lily.kernels import attention_decode_batch as AB
from lily.kernels import quant_gemv as QG
from lily.kernels.flash_attention import attention_reference, flash_attention_prefill, norm_rope_reference, \
    rope_inv_freq as rope_inv_freq64, write_kv_prefill
from lily.kernels.kv_int8 import KV8_PAD, kv8_pack_reference, kv8_quantize_reference, kv8_roundtrip_reference, \
    kv_cache_zeros, kv_head_dim, kv_row_bytes, kv_rows_reference

EPS = 1e-6
I32 = torch.int32
# attention over an int8 cache against the reference over the same cache dequantized, per head: fp32 dots under
# the interpreter (the codes and scales are exact there); on the GPU q and the probabilities are rounded to
# fp16 (2^-11 relative each) before the tensor-core dots
ATTN8 = 5e-6 if INTERPRET else 4e-3


@pytest.fixture
def gen():
    return new_generator()


def rn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


def poisoned(cache: torch.Tensor, *index) -> None:
    """Rows at index hold 0xFF bytes: codes 255 and a NaN scale (a row read by mistake is NaN)."""
    cache[index] = 0xFF


def assert_row_quantized(row: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A written cache row (uint8 [..., D + KV8_PAD]) holds want (fp32 [..., D]) quantized: each value within
    half a step of its scale (a little more: the kernel's want differs from the reference's in the last bits),
    the scale max|want| / 127."""
    d = want.shape[-1]
    got = kv_rows_reference(row)
    codes, scales = kv8_quantize_reference(want)
    got_scale = row[..., d:d + 4].contiguous().view(torch.float32)[..., 0]
    assert torch.allclose(got_scale.cpu(), scales.cpu(), rtol=1e-5, atol=0), f"{what}: scales"
    step_err = ((got - want.float()).abs() / scales[..., None]).max()
    assert step_err <= 0.51, f"{what}: a value {float(step_err):.3f} steps from its row's quantized value"
    assert int((row[..., :d].int() - codes.int()).abs().max()) <= 1, f"{what}: codes"


def test_reference_quantization_round_trip(gen):
    x = rn(gen, 5, 3, 64) * torch.rand(5, 3, 1, generator=gen).to(DEV) * 10
    x[1, 2] = 0.0                                          # an all-zero row: scale 0, codes 128, back to zeros
    codes, scales = kv8_quantize_reference(x)
    assert codes.dtype == torch.uint8 and int(codes.min()) >= 1 and int(codes.max()) <= 255
    back = kv8_roundtrip_reference(x)
    assert ((back - x).abs() <= scales[..., None] * 0.5 + 1e-7).all()
    assert torch.equal(back[1, 2], torch.zeros(64, device=DEV))
    assert (codes.int() - 128).abs().amax(-1)[scales > 0].eq(127).all()     # each row's largest value: +-127
    packed = kv8_pack_reference(x)
    assert packed.shape == (5, 3, 64 + KV8_PAD)
    assert torch.equal(kv_rows_reference(packed), back)
    x[0, 0, 5] = float("nan")                              # a non-finite row stays non-finite
    assert kv_rows_reference(kv8_pack_reference(x))[0, 0].isnan().all()


def test_layout_helpers():
    c = kv_cache_zeros((2, 7), 2, 256, "int8", "cpu")
    assert c.shape == (2, 7, 2, 256 + KV8_PAD) and c.dtype == torch.uint8 and kv_head_dim(c) == 256
    assert kv_row_bytes(256, "int8") == 272 and kv_row_bytes(256, "bf16") == 512
    assert kv_head_dim(kv_cache_zeros((3,), 2, 64, "bf16", "cpu")) == 64
    with pytest.raises(ValueError, match="KV cache dtype 'fp8'"):
        kv_cache_zeros((3,), 2, 64, "fp8", "cpu")


# a split count that leaves splits empty, one whose last split is partial, and the long-span blocks
# (factor: attention_decode.KV8_SPLIT_FACTOR, the int8 cache's splits over the scratch's n_split; 4 x 4 splits at
#  70 positions leaves most of them empty)
@pytest.mark.parametrize("n_split,length,block_t,long,factor", [
    (1, 5, 16, None, 1), (4, 70, 16, None, 4), (3, 70, 16, (24, 32), 2), (3, 70, 16, None, 1)])
def test_attention_decode_int8(gen, monkeypatch, n_split, length, block_t, long, factor):
    monkeypatch.setattr(AD, "LONG_SPAN", long)
    monkeypatch.setattr(AD, "KV8_SPLIT_FACTOR", factor)
    hq, hkv, D, rot, max_seq = 4, 2, 64, 16, 80
    pos = length - 1
    # rows of different magnitudes, so a scale applied to the wrong row shows
    kc = kv8_pack_reference(rn(gen, max_seq, hkv, D) * torch.rand(max_seq, hkv, 1, generator=gen).to(DEV) * 4)
    vc = kv8_pack_reference(rn(gen, max_seq, hkv, D) * torch.rand(max_seq, hkv, 1, generator=gen).to(DEV) * 4)
    poisoned(kc, slice(pos, None))
    poisoned(vc, slice(pos, None))                        # the row at pos must be written, later rows unread
    proj = rn(gen, hq * 2 * D + 2 * hkv * D)
    qn, kn = rn(gen, D).abs() + 0.5, rn(gen, D).abs() + 0.5
    inv = AD.rope_inv_freq(rot, 1e7, DEV)
    out = torch.full((hq * D,), float("nan"), device=DEV)
    AD.attention_decode(proj, kc, vc, torch.tensor([pos], dtype=I32, device=DEV), qn, kn, inv, EPS, hq,
                        AD.AttentionScratch(hq, D, n_split, DEV), out, block_t=block_t)
    seed = f"seed {gen.initial_seed()}"
    qg = proj[:hq * 2 * D].reshape(hq, 2 * D)
    k_new = AD.rmsnorm_rope_reference(proj[hq * 2 * D:hq * 2 * D + hkv * D].reshape(hkv, D), kn, pos, inv, EPS)
    assert_row_quantized(kc[pos], k_new, f"{seed}: K row")
    assert_row_quantized(vc[pos], proj[hq * 2 * D + hkv * D:].reshape(hkv, D), f"{seed}: V row")
    assert (kc[pos + 1:] == 0xFF).all() and (vc[pos + 1:] == 0xFF).all()
    q = AD.rmsnorm_rope_reference(qg[:, :D], qn, pos, inv, EPS)
    ref = AD.attention_decode_reference(q, qg[:, D:], kv_rows_reference(kc[:pos + 1]), kv_rows_reference(vc[:pos + 1]))
    assert_rows_within(out[QG.perm64_index(hq * D, DEV)].reshape(hq, D), ref.reshape(hq, D), ATTN8, f"{seed}: output")


def test_attention_decode_rows_int8(gen):
    n_slots, max_seq, hq, hkv, D, rot = 4, 48, 4, 2, 64, 16
    lengths = [1, 9, 40]
    slots = torch.randperm(n_slots, generator=gen)[:len(lengths) + 1].to(DEV, I32)   # one pad row past n_valid
    nv = torch.tensor([len(lengths)], dtype=I32, device=DEV)
    kc = kv8_pack_reference(rn(gen, n_slots, max_seq, hkv, D))
    vc = kv8_pack_reference(rn(gen, n_slots, max_seq, hkv, D) * 3)
    pos = torch.zeros(n_slots, dtype=I32, device=DEV)
    for s, n in zip(slots.tolist(), lengths):
        pos[s] = n - 1
        poisoned(kc, s, slice(n - 1, None))
        poisoned(vc, s, slice(n - 1, None))
    before = kc.clone()
    proj = rn(gen, len(lengths) + 1, hq * 2 * D + 2 * hkv * D)
    qn, kn = rn(gen, D).abs() + 0.5, rn(gen, D).abs() + 0.5
    inv = AD.rope_inv_freq(rot, 1e7, DEV)
    out = AB.attention_decode_rows(proj, kc, vc, pos, slots, nv, qn, kn, inv, EPS, hq, n_split=3, block_t=16)
    live = slots[:len(lengths)].tolist()
    want, k_new, v_new = AB.attention_decode_rows_reference(
        proj[:len(lengths)], [kv_rows_reference(kc[s]) for s in live], [kv_rows_reference(vc[s]) for s in live],
        [n - 1 for n in lengths], qn, kn, inv, EPS, hq)
    seed = f"seed {gen.initial_seed()}"
    assert_rows_within(out[:len(lengths)].reshape(-1, hq, D), want.reshape(-1, hq, D), ATTN8, f"{seed}: output")
    for b, (s, n) in enumerate(zip(live, lengths)):
        assert_row_quantized(kc[s, n - 1], k_new[b].reshape(hkv, D), f"{seed}, row {b}: K row")
        assert_row_quantized(vc[s, n - 1], v_new[b].reshape(hkv, D), f"{seed}, row {b}: V row")
        assert (kc[s, n:] == 0xFF).all()
    for s in set(range(n_slots)) - set(live):
        assert torch.equal(kc[s], before[s])


# pos_on "device": the position as a captured prefill graph passes it, with the decoded rows' buffers a state
# keeps for its graphs (fast_prefill._kv_decode_buffers; poisoned: each chunk must write what it reads)
@pytest.mark.parametrize("tiles,pos_on", [((64, 64, 4, 2, False), "host"), ((32, 64, 4, 2, True), "device"),
                                          ((128, 64, 8, 2, True), "host")])
def test_flash_attention_int8_after_cached_prefix(gen, tiles, pos_on, monkeypatch):
    """write_kv_prefill quantizes each new row as the reference does, and the prefill attention over the int8
    cache (its own chunk's rows included, decoded to bf16 first: kv8_dequantize_rows) matches the fp32 reference
    over the cache dequantized."""
    from lily.kernels import flash_attention
    monkeypatch.setattr(flash_attention, "TILES", tiles)
    Hq, Hkv, D, rot = 4, 2, 64, 16
    inv = rope_inv_freq64(rot, 1e7, DEV)
    kc = kv_cache_zeros((128,), Hkv, D, "int8", DEV)
    poisoned(kc, slice(None))
    vc = kc.clone()
    kn = (1 + 0.1 * rn(gen, D)).to(torch.bfloat16)
    qn = (1 + 0.1 * rn(gen, D)).to(torch.bfloat16)
    pos = 0
    decoded = None
    if pos_on == "device":
        decoded = tuple(torch.full((128, Hkv, D), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2))
    for T in (37, 70):  # a prefix, then a chunk continuing after it (two query blocks)
        k, v = rn(gen, T, Hkv * D, dtype=torch.bfloat16), (rn(gen, T, Hkv * D) * 3).to(torch.bfloat16)
        qg = rn(gen, T, Hq * 2 * D, dtype=torch.bfloat16)
        at = pos if pos_on == "host" else torch.tensor([pos], dtype=I32, device=DEV)   # (a prefill graph's)
        write_kv_prefill(k, v, kn, inv, kc, vc, at)
        o = flash_attention_prefill(qg, qn, inv, kc, vc, at, Hq, decoded=decoded)
        msg = f"seed {gen.initial_seed()}, positions {pos}..{pos + T - 1}"
        keys = norm_rope_reference(k.reshape(T, Hkv, D), kn, torch.arange(pos, pos + T, device=DEV), inv)
        assert_row_quantized(kc[pos:pos + T], keys, f"{msg}: K rows")
        assert_row_quantized(vc[pos:pos + T], v.float().reshape(T, Hkv, D), f"{msg}: V rows")
        rows = kv_rows_reference(kc[:pos + T]), kv_rows_reference(vc[:pos + T])
        ref = attention_reference(qg, qn, inv, *rows, pos, Hq).reshape(T, Hq, D)
        # the decoded rows go through the bf16 kernel: within 3x the bf16 level of attention on them
        level = float(row_rel(attention_bf16(qg, qn, inv, to_bf16(rows[0]), to_bf16(rows[1]), pos, Hq), ref).max())
        assert_rows_close(o.reshape(T, Hq, D), ref, f"{msg}: output", level=level)
        pos += T
    assert (kc[pos:] == 0xFF).all(), "rows past the prompt must stay untouched"


# -- the fast backend on an int8 cache ----------------------------------------------------------------------

def test_fast_backend_int8_cache_follows_the_reference_that_stores_rows_alike(monkeypatch):
    """A prompt through the prefill kernels, then decode steps, on an int8 cache: every position's logits within
    the paths' limits of the fp32 reference whose K/V rows are quantized the same way (routing following its
    at near-ties), the caches' rows within those limits of its rows; the state's bytes are the int8 layout's."""
    import random

    from helpers_routing import PREFILL_LIMIT, PREFILL_MEDIAN_LIMIT, assert_fast_follows_reference

    from lily.config import TINY
    from lily.engine.fast_backend import FastBackend
    from lily.model.reference import ReferenceModel
    from lily.model.slots import slot_nbytes
    from lily.synthetic import random_weights

    weights = random_weights(TINY, seed=random.randrange(10_000))
    be = FastBackend(TINY, weights, device="cpu", max_seq=48, prefill_mode="kernels", kv_dtype="int8")
    ref = ReferenceModel(TINY, weights, kv_dtype="int8")
    rs, fs, fed = assert_fast_follows_reference(monkeypatch, be, ref, "int8")
    assert fs.k_cache.dtype == torch.uint8 and fs.k_cache.shape[-1] == TINY.head_dim + KV8_PAD
    assert fs.nbytes() == slot_nbytes(TINY, 48, "int8") < slot_nbytes(TINY, 48, "bf16")
    n = len(fed)
    for j, i in enumerate(TINY.full_attention_layers):
        for cache, rows in ((fs.k_cache, rs.keys), (fs.v_cache, rs.values)):
            # each row over the typical row's norm; the last layer's rows carry the whole stack's error before
            # any norm averages it (0.10 worst at LILY_TEST_SEED=4199142634, the median row ~1e-2): a missed or
            # misplaced row, or a wrong scale, is off by O(1)
            got_rows = kv_rows_reference(cache[j, :n])
            assert_rows_within(got_rows, rows[i], 2 * PREFILL_LIMIT, f"layer {i} cache", typical=True)
            assert float(typical_row_err(got_rows, rows[i]).median()) < PREFILL_MEDIAN_LIMIT, f"layer {i} cache"
    # a snapshot of the int8 state (the prefix cache's) restored into a slot decodes exactly as the original
    snap = be.clone_state(fs)
    restored = be.restore_state(snap)
    assert torch.equal(restored.k_cache[:, :n], fs.k_cache[:, :n])
    assert torch.equal(be.decode(fed[-1], restored), be.decode(fed[-1], fs))


# -- the option, end to end ---------------------------------------------------------------------------------

def test_bench_runs_lily_on_the_int8_cache(tmp_path):
    """`lily bench --kv-cache-dtype int8` (the reference backend, tiny): the run says which cache it used, and its
    greedy tokens are an independent reference model's on an int8 cache (they differ from the bf16 cache's run
    only where a near-tie lets them)."""
    import json
    import random

    from lily.bench import contract
    from lily.cli import main
    from lily.config import TINY
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    seed = random.randrange(1 << 20)
    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic", "tiny", "--seed", str(seed), "--device", "cpu", "--backend", "reference",
                 "--kv-cache-dtype", "int8", "--contexts", "24", "--decode-steps", "4", "--retries", "0",
                 "--no-plot", "--out", str(out)]) == 0
    lily = json.loads(out.read_text())["engines"]["lily"]
    assert lily["info"]["kv_cache_dtype"] == "int8"
    row = lily["rows"][0]
    model = ReferenceModel(TINY, random_weights(TINY, seed=seed), kv_dtype="int8")
    state = model.new_state()
    logits = [model.forward(contract.synthetic_prompt(24, TINY.vocab_size), state, logits_for="last")[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(4):
        logits.append(model.forward([tokens[-1]], state)[-1])
        tokens.append(int(logits[-1].argmax()))
    decisive = next((i + 1 for i, l in enumerate(logits) if float(l.topk(2).values.diff().abs()) < 1e-3),
                    len(logits))
    assert row["tokens"][:decisive] == tokens[:decisive]


def test_load_backend_passes_the_kv_cache_dtype(tmp_path):
    """`lily serve --kv-cache-dtype` reaches the backend through load_backend (here the reference on a tiny
    checkpoint written to disk), and a wrong value is refused."""
    from lily.engine import load_backend
    from lily.synthetic import make_synthetic

    make_synthetic("tiny", tmp_path)
    assert load_backend(tmp_path, "cpu", "reference", kv_dtype="int8").model.kv_dtype == "int8"
    assert load_backend(tmp_path, "cpu", "reference").model.kv_dtype == "bf16"
    with pytest.raises(ValueError, match="KV cache dtype 'fp8'"):
        load_backend(tmp_path, "cpu", "reference", kv_dtype="fp8")


def test_batched_step_on_int8_slots_matches_the_batch1_step(monkeypatch):
    """The batched decode step over int8 slots (rows in slots out of batch order, ragged histories) against the
    batch-1 step on int8 states of the same histories, its routing following theirs at near-ties: logits within
    the decode path's limit, the K and V rows each step appends within a code step of each other's."""
    import random

    from helpers_routing import DECODE_LIMIT
    from test_fast_batch import ragged_slots_against_batch1

    from lily.config import TINY
    from lily.engine.fast_backend import FastBackend
    from lily.synthetic import random_weights

    b = FastBackend(TINY, random_weights(TINY, seed=random.randrange(10_000)), device="cpu", max_seq=32,
                    max_batch=4, kv_dtype="int8")
    states, alone = ragged_slots_against_batch1(monkeypatch, b, DECODE_LIMIT)
    assert all(s.k_cache.dtype == torch.uint8 for s in states + alone)
    for st, a in zip(states, alone):
        n = st.pos
        assert n == a.pos
        for cache, other in ((st.k_cache, a.k_cache), (st.v_cache, a.v_cache)):
            assert torch.equal(cache[:, :n - 2], other[:, :n - 2])      # the prefill's rows: the same kernels
            got_rows, want_rows = kv_rows_reference(cache[:, n - 2:n]), kv_rows_reference(other[:, n - 2:n])
            scale = want_rows.abs().amax(-1, keepdim=True) / 127
            assert ((got_rows - want_rows).abs() <= 1.5 * scale + 0.02 * want_rows.abs()).all()
