"""Qwen's original releases in, lily's MLX 4-bit weights out: `lily convert` and quantise-at-load.

Oracles: transformers writes the source (`save_pretrained` of a random tiny Qwen3.5-MoE: the release's
names, experts one by one, the vision tower; the MTP head added under its release names), the fused
layout is built from the same tensors, and `mlx_lm.convert -q --q-bits 4 --q-group-size 64` (mlx[cpu])
converts the fused copy. lily's output must equal mlx-lm's tensor for tensor, bit for bit, from either
layout (plus the MTP head, which mlx-lm drops); mlx-lm must load lily's output and its float32 logits must
match lily's within 1e-3 in log-probability; quantise-at-load must give exactly the converted weights.
"""

import dataclasses
import json
import os
import random
import stat

import httpx
import mlx_lm.utils as mlx_utils
import pytest
import torch
from mlx.utils import tree_flatten

from helpers_ckpt import random_prompt, same_weight
from helpers_mlx import lily_logprobs_fp32, mlx_logprobs_fp32
from helpers_original import fused_copy, read_dir, save_original
from helpers_serve import serving
from lily.checkpoint import convert_checkpoint, load_checkpoint, read_safetensors_header
from lily.cli import main as lily_main
from lily.config import TINY
from lily.quant import QuantTensor


CONFIG = dataclasses.replace(TINY, mtp_num_hidden_layers=1)
PROMPT_LEN = 24


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The per-expert source (transformers' own save), its fused copy, and mlx_lm.convert of the fused copy."""
    from mlx_lm.convert import convert
    base = tmp_path_factory.mktemp("original")
    seed = fresh_seed()
    print(f"seed {seed}")
    per_expert = save_original(base / "per_expert", CONFIG, torch.Generator().manual_seed(seed))
    fused = fused_copy(per_expert, base / "fused")
    convert(str(fused), str(base / "mlx"), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    return {"per_expert": per_expert, "fused": fused, "mlx": base / "mlx", "base": base, "seed": seed}


@pytest.fixture(scope="module")
def converted(sources):
    """lily convert of the per-expert source, in small shards (the CLI, as a user runs it, is tested below)."""
    return convert_checkpoint(sources["per_expert"], sources["base"] / "lily", device="cpu", shard_bytes=150_000)


def test_sources_have_the_release_layouts(sources):
    names = set(read_dir(sources["per_expert"]))
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names  # transformers' own layout
    assert "model.language_model.layers.0.linear_attn.conv1d.weight" in names and "lm_head.weight" in names
    assert any(n.startswith("model.visual.") for n in names) and "mtp.layers.0.mlp.experts.0.up_proj.weight" in names
    fused = read_dir(sources["fused"])
    assert fused["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert fused["model.language_model.layers.0.linear_attn.conv1d.weight"].shape == (256, 1, 4)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_convert_equals_mlx_lm_bit_for_bit(sources, converted, layout, tmp_path):
    theirs = read_dir(sources["mlx"])
    ours = read_dir(converted if layout == "per_expert" else
                    convert_checkpoint(sources["fused"], tmp_path / "lily", device="cpu"))
    assert len(theirs) == 182
    mtp = {k for k in ours if k.startswith("mtp.")}
    assert set(ours) - mtp == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name], t), name
    # the MTP head: 4-bit, its router gates 8-bit, its norms the effective gain (HF's zero-centred + 1)
    assert ours["mtp.fc.weight"].shape == (CONFIG.hidden_size, 2 * CONFIG.hidden_size // 8)
    assert ours["mtp.layers.0.mlp.gate.weight"].shape == (CONFIG.num_experts, CONFIG.hidden_size // 4)
    assert ours["mtp.layers.0.mlp.switch_mlp.down_proj.scales"].shape == (CONFIG.num_experts, CONFIG.hidden_size,
                                                                          CONFIG.moe_intermediate_size // 64)
    src = read_dir(sources["per_expert"])
    assert torch.equal(ours["mtp.norm.weight"], src["mtp.norm.weight"] + 1.0)


def test_converted_directory(sources, converted):
    shards = sorted(converted.glob("*.safetensors"))
    assert len(shards) > 3 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # shards of at most the limit (a tensor larger than it gets a shard of its own)
        tensors = read_safetensors_header(s)
        assert sum(t.nbytes for t in tensors.values()) <= 150_000 or len(tensors) == 1
    cfg = json.loads((converted / "config.json").read_text())
    theirs = json.loads((sources["mlx"] / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"]
    assert {k: v for k, v in cfg["quantization"].items() if not k.startswith("mtp.")} == theirs["quantization"]
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (converted / name).read_bytes() == (sources["per_expert"] / name).read_bytes(), name
    assert not list(converted.parent.glob(".*lily-convert*"))  # nothing left beside it


def test_quantize_at_load_gives_the_converted_weights(sources, converted):
    """From either layout, quantise-at-load holds exactly what loading lily's converted checkpoint holds
    (the MTP head included), and that is what the MLX files hold."""
    ref = load_checkpoint(converted)
    assert ref.config == CONFIG
    assert [k for k in ref.weights if k.startswith("mtp.")][:3] == ["mtp.pre_fc_norm_embedding.weight",
                                                                    "mtp.pre_fc_norm_hidden.weight", "mtp.fc"]
    for layout in ("per_expert", "fused"):
        ckpt = load_checkpoint(sources[layout], device="cpu", quantize_device="cpu")
        assert ckpt.config == CONFIG and ckpt.tokenizer_dir == sources[layout]
        assert list(ckpt.weights) == list(ref.weights)
        for key, w in ref.weights.items():
            assert same_weight(ckpt.weights[key], w), (layout, key)
    assert ref.weights["layers.0.linear_attn.A_log"].dtype == torch.float32  # stored bf16 (as the source)


def test_mlx_lm_loads_lilys_output_and_the_logits_agree(sources, converted):
    """mlx-lm (float32) on lily's converted checkpoint vs lily's reference model, from the converted
    checkpoint and from quantise-at-load: those two identical, both within 1e-3 of mlx-lm."""
    ids = random_prompt(PROMPT_LEN, CONFIG.vocab_size, seed=fresh_seed())
    model, _ = mlx_utils.load_model(converted)  # lily's MTP tensors (`mtp.*`) are dropped by mlx-lm's sanitize
    assert dict(tree_flatten(model.parameters()))["language_model.model.layers.0.mlp.gate.scales"].shape == \
        (CONFIG.num_experts, 2)
    theirs = mlx_logprobs_fp32(converted, ids)
    assert (theirs[1:] - theirs[:-1]).abs().max() > 0.5  # the prompt moves the logits: the check means something
    from_converted = lily_logprobs_fp32(load_checkpoint(converted), ids)
    at_load = lily_logprobs_fp32(load_checkpoint(sources["fused"], quantize_device="cpu"), ids)
    assert torch.equal(from_converted, at_load)
    err = (from_converted - theirs).abs().max().item()
    assert err <= 1e-3, f"max |d logprob| = {err:.2e}"


def test_text_only_save_reads_the_same(sources, tmp_path):
    """transformers' Qwen3_5MoeForCausalLM.save_pretrained (names `model.*`, a text config at the top) with
    the same values converts to the same weights."""
    a = sources["per_expert"]
    b = save_original(tmp_path / "text", CONFIG, torch.Generator().manual_seed(sources["seed"]), causal_lm=True)
    assert json.loads((b / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert "model.layers.0.linear_attn.A_log" in read_dir(b)
    wa = load_checkpoint(a, quantize_device="cpu").weights
    wb = load_checkpoint(b, quantize_device="cpu").weights
    assert list(wa) == list(wb)
    for key, w in wa.items():
        assert same_weight(wb[key], w), key


def test_convert_command(sources, tmp_path, capsys):
    out = tmp_path / "out"
    assert lily_main(["convert", str(sources["fused"]), str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    assert set(read_dir(out)) == set(read_dir(sources["mlx"])) | {k for k in read_dir(out) if k.startswith("mtp.")}
    # refused: an output that is not empty, a source that is already MLX, a missing source
    assert lily_main(["convert", str(sources["fused"]), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert lily_main(["convert", str(out), str(tmp_path / "again")]) == 2
    assert "already" in capsys.readouterr().err
    assert lily_main(["convert", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "again").exists()


def test_converted_weights_get_the_umask_like_the_other_files(sources, tmp_path):
    # safetensors' save_file makes its file 0600: another user or a container uid could not read the weights
    mask = random.choice((0o022, 0o002, 0o027, 0o007))
    old = os.umask(mask)
    try:
        out = tmp_path / "out"
        assert lily_main(["convert", str(sources["fused"]), str(out), "--device", "cpu"]) == 0
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, {k: oct(v) for k, v in modes.items()}
    assert "model.safetensors" in modes or "model-00001-of-00002.safetensors" in modes


def test_quantized_weights_are_quant_tensors(converted):
    w = load_checkpoint(converted).weights
    assert isinstance(w["mtp.layers.0.mlp.switch_mlp.gate_proj"], QuantTensor)
    assert w["mtp.layers.0.mlp.shared_expert_gate"].bits == 8 and w["mtp.fc"].bits == 4


def test_generate_bench_and_serve_take_the_original_directory(sources, converted, tmp_path, capsys):
    """`lily generate|bench|serve --model SRC` on an original release (quantised at load) behave as on its
    conversion: the same greedy tokens and log-probabilities."""
    ids = ",".join(map(str, random_prompt(12, CONFIG.vocab_size, seed=fresh_seed())))

    def generate(model, *extra):
        assert lily_main(["generate", "--model", str(model), "--max-tokens", "6", "--ignore-eos", "--json",
                          "--device", "cpu", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    want = generate(converted, "--prompt-ids", ids, "--top-logprobs", "3")
    assert generate(sources["fused"], "--prompt-ids", ids, "--top-logprobs", "3") == want
    assert len(want["tokens"]) == 6

    out = tmp_path / "bench.json"
    assert lily_main(["bench", "--model", str(sources["per_expert"]), "--device", "cpu", "--backend", "reference",
                      "--contexts", "16", "--decode-steps", "2", "--retries", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    lily_doc = json.loads(out.read_text())["engines"]["lily"]
    assert lily_doc["ok"] and lily_doc["rows"][0]["context"] == 16
    # the peers read MLX checkpoints: with an original release they are refused, in one line
    assert lily_main(["bench", "--model", str(sources["fused"]), "--device", "cpu", "--peers", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lily convert" in err

    # the server's text leaves out the tokenizer's hidden special tokens (<|im_start|> ...), which `lily
    # generate --json` prints: compare against the generated ids decoded the server's way
    from lily.tokenizer import Tokenizer
    text = Tokenizer.from_dir(converted).decode(generate(converted, "--prompt", "The robot paints")["tokens"])
    with serving(["--model", str(sources["fused"]), "--device", "cpu"]) as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "fused", "prompt": "The robot paints", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text


def test_check_describes_an_original_release(sources, capsys):
    assert lily_main(["check", str(sources["per_expert"])]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "original release (quantised to MLX 4-bit at load), with the MTP head" in out


def test_transformers_peer_reads_a_converted_checkpoint(converted):
    """The benchmark's transformers peer reads lily's output (its MTP head left out) into the HF model."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from lily.bench.peers.hf_peer import hf_state_dict

    sd = dict(hf_state_dict(converted, "cpu", torch.float32))
    assert not any("mtp" in k for k in sd)
    text = {k: v for k, v in CONFIG.text_config_dict().items() if k != "model_type"}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    model.load_state_dict(sd, strict=True)
