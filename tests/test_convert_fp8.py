"""Qwen's block-wise FP8 release: dequantisation against two independent implementations (numpy from the
format description, and transformers' fine-grained FP8 dequantisation), then the bf16 path: lily's
conversion of a tiny FP8 checkpoint equals mlx_lm.convert of its dequantised bf16 weights, bit for bit,
and quantise-at-load gives exactly the converted weights.

The FP8 checkpoint is built here to the published format: 128x128 blocks (partial at the edges),
weight float8_e4m3fn, weight_scale_inv float32 [ceil(out/128), ceil(in/128)], experts one by one,
the router gates, in_proj_a/b, embeddings, lm_head and mtp.fc left bf16 by modules_to_not_convert.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from helpers_ckpt import random_prompt, same_weight
from helpers_original import fp8_copy, fused_copy, read_dir, save_original, write_dir
from lily.checkpoint import convert_checkpoint, load_checkpoint
from lily.checkpoint.fp8 import dequantize_fp8_blocks, dequantize_fp8_rows
from lily.config import TINY

CONFIG = dataclasses.replace(TINY, mtp_num_hidden_layers=1)
NOT_CONVERTED = ("lm_head", "model.language_model.embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                 "mlp.gate", "mlp.shared_expert_gate", "mtp.fc")


def fresh_gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def numpy_dequant(w: torch.Tensor, scale_inv: torch.Tensor, bm: int, bn: int) -> np.ndarray:
    """From the format description: element (r, c) times the scale of its block (r // bm, c // bn), in
    float32, rounded to bfloat16 (returned as the bf16 values in float32)."""
    q = w.float().numpy()
    s = scale_inv.float().numpy()
    out = np.empty_like(q)
    for r in range(q.shape[0]):
        for c0 in range(0, q.shape[1], bn):
            out[r, c0:c0 + bn] = q[r, c0:c0 + bn] * s[r // bm, c0 // bn]
    return torch.from_numpy(out).to(torch.bfloat16).float().numpy()


def random_fp8(gen, rows, cols, bm, bn):
    w = torch.randn(rows, cols, generator=gen).mul(torch.rand(rows, 1, generator=gen) * 8)
    q = (w * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-rows // bm), -(-cols // bn), generator=gen) * 1e-2 + 1e-4
    return q, s


@pytest.mark.parametrize("rows, cols, block", [(200, 300, (128, 128)), (64, 128, (128, 128)), (96, 80, (32, 16))])
def test_dequant_matches_numpy_from_the_format(rows, cols, block):
    q, s = random_fp8(fresh_gen(), rows, cols, *block)
    ours = dequantize_fp8_blocks(q, s, block)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, cols)
    assert np.array_equal(ours.float().numpy(), numpy_dequant(q, s, *block))
    # by slabs of rows (what conversion does to bound memory): the same bits
    assert torch.equal(dequantize_fp8_rows(q, s, block, max_elements=3 * cols), ours)


def test_dequant_of_stacked_experts():
    gen = fresh_gen()
    parts = [random_fp8(gen, 72, 136, 128, 128) for _ in range(3)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    ours = dequantize_fp8_rows(q, s, (128, 128))
    for e, (qe, se) in enumerate(parts):
        assert np.array_equal(ours[e].float().numpy(), numpy_dequant(qe, se, 128, 128))
    with pytest.raises(ValueError, match="does not cover"):
        dequantize_fp8_blocks(q[0], s[0][:, :1], (128, 128))


def transformers_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' fine-grained FP8 dequantisation (what from_pretrained(..., dequantize=True) applies)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """An FP8 release (A_log float32, as Qwen stores it), the bf16 weights transformers dequantises it to, and
    mlx_lm.convert of those (fused, which mlx-lm reads)."""
    from mlx_lm.convert import convert
    base = tmp_path_factory.mktemp("fp8")
    src = save_original(base / "bf16", CONFIG, fresh_gen())
    fp8 = fp8_copy(src, base / "fp8", NOT_CONVERTED, a_log_dtype=torch.float32)
    tensors = read_dir(fp8)
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name[:-len("_scale_inv")]
        tensors[weight] = transformers_dequant(tensors[weight], tensors.pop(name))
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    dequantized = write_dir(base / "dequantized", tensors, cfg)
    fused = fused_copy(dequantized, base / "dequantized_fused")
    convert(str(fused), str(base / "mlx"), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    return {"fp8": fp8, "dequantized": dequantized, "mlx": base / "mlx", "base": base}


def test_fp8_release_format(release):
    t = read_dir(release["fp8"])
    w = t["model.language_model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (64, 128)
    assert t["model.language_model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv"].shape == (1, 1)
    assert t["model.language_model.layers.3.self_attn.q_proj.weight_scale_inv"].shape == (4, 1)
    assert t["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert t["mtp.fc.weight"].dtype == torch.bfloat16 and t["mtp.layers.0.self_attn.o_proj.weight"].dtype == \
        torch.float8_e4m3fn
    assert t["model.language_model.layers.1.linear_attn.A_log"].dtype == torch.float32


def test_lily_dequant_matches_transformers(release):
    """Every FP8 weight of the release: lily's dequantisation, transformers' and numpy's give the same bits."""
    t = read_dir(release["fp8"])
    n = 0
    for name in [k for k in t if k.endswith(".weight_scale_inv")]:
        q, s = t[name[:-len("_scale_inv")]], t[name]
        ours = dequantize_fp8_rows(q, s, (128, 128))
        assert torch.equal(ours, transformers_dequant(q, s)), name
        half = s.to(torch.bfloat16)  # some of Qwen's FP8 releases store the scales in bf16
        assert torch.equal(dequantize_fp8_rows(q, half, (128, 128)), transformers_dequant(q, half)), name
        n += 1
    assert n > 100
    assert np.array_equal(ours.float().numpy(), numpy_dequant(q, s, 128, 128))


def test_fp8_convert_equals_mlx_lm_of_the_dequantized_weights(release):
    ours = read_dir(convert_checkpoint(release["fp8"], release["base"] / "lily", device="cpu"))
    theirs = read_dir(release["mlx"])
    assert set(ours) - {k for k in ours if k.startswith("mtp.")} == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert ours["language_model.model.layers.0.linear_attn.A_log"].dtype == torch.float32  # kept, as mlx-lm does
    # quantise-at-load of the FP8 release holds exactly the converted weights, and the dequantized bf16
    # release quantises to them as well
    converted = load_checkpoint(release["base"] / "lily").weights
    for src in (release["fp8"], release["dequantized"]):
        at_load = load_checkpoint(src, quantize_device="cpu").weights
        assert list(at_load) == list(converted)
        for key, w in converted.items():
            assert same_weight(at_load[key], w), key


def test_fp8_logits_match_mlx_lm(release):
    """The path above to its end: mlx-lm (float32) on the conversion of the dequantized weights vs lily's
    reference model on quantise-at-load of the FP8 release."""
    from helpers_mlx import lily_logprobs_fp32, mlx_logprobs_fp32

    ids = random_prompt(20, CONFIG.vocab_size, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    theirs = mlx_logprobs_fp32(release["mlx"], ids)
    ours = lily_logprobs_fp32(load_checkpoint(release["fp8"], quantize_device="cpu"), ids)
    assert (theirs[1:] - theirs[:-1]).abs().max() > 0.5
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-3, f"max |d logprob| = {err:.2e}"



def test_scales_stored_in_bf16_are_read_exactly(release, tmp_path):
    """Some of Qwen's FP8 releases store weight_scale_inv in bf16: read as the float32 of the same values."""
    from helpers_original import replace_tensors

    def scales_to(dtype):
        def fn(t):
            for k in [k for k in t if k.endswith("weight_scale_inv")]:
                t[k] = t[k].to(torch.bfloat16).to(dtype)
        return fn

    half = replace_tensors(release["fp8"], tmp_path / "bf16_scales", scales_to(torch.bfloat16))
    full = replace_tensors(release["fp8"], tmp_path / "f32_scales", scales_to(torch.float32))
    assert read_dir(half)["model.language_model.layers.3.self_attn.o_proj.weight_scale_inv"].dtype == torch.bfloat16
    a = load_checkpoint(half, quantize_device="cpu").weights
    b = load_checkpoint(full, quantize_device="cpu").weights
    assert all(same_weight(a[k], b[k]) for k in b)
