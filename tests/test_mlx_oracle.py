"""mlx-lm as the oracle for the checkpoint format and the logits.

Two tiny checkpoints:
  * converted: a random transformers Qwen3.5-MoE text model saved in the original Hugging Face layout
    (`model.language_model.*`, fused experts, zero-centred norms, conv1d [C, 1, K], plus MTP and vision
    weights that conversion drops) and turned into MLX 4-bit by `mlx_lm.convert` itself;
  * synthetic: `lily make-synthetic --preset tiny`.
For both: lily loads it, every weight dequantizes bit-identically to mx.dequantize of the model mlx-lm
loads, and lily's ReferenceModel logits match mlx-lm's run in float32 (max |d logprob| <= 1e-3).
"""

import json

import mlx.core as mx
import mlx_lm.utils as mlx_utils
import pytest
import torch
from mlx.utils import tree_flatten
from safetensors.torch import save_file

from helpers_ckpt import random_prompt
from helpers_mlx import lily_logprobs_fp32, mlx_logprobs_fp32, to_torch
from helpers_original import hf_value
from lily.checkpoint import load_checkpoint, mlx_name
from lily.cli import main as lily_main
from lily.config import TINY
from lily.demo_tokenizer import write_tokenizer_files
from lily.quant import QuantTensor


PROMPT_LEN = 40


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An MLX checkpoint written by mlx_lm.convert from a random original-layout HF checkpoint."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from mlx_lm.convert import convert
    base = tmp_path_factory.mktemp("convert")
    hf_dir, mlx_dir = base / "hf", base / "mlx"
    text = {k: v for k, v in TINY.text_config_dict().items() if k != "model_type"}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    sd = {}
    for name, p in model.named_parameters():  # transformers' own (fused-expert) parameter layout
        key = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        sd[key] = hf_value(name, tuple(p.shape), gen, TINY.num_hidden_layers).contiguous()
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in sd
    assert sd["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1  # HF [C, 1, K]
    # weights of the original checkpoint that lily (and mlx-lm) do not run
    sd["mtp.fc.weight"] = torch.randn(TINY.hidden_size, 2 * TINY.hidden_size, generator=gen)
    sd["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
    hf_dir.mkdir()
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    text = model.config.to_dict()
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text, "tie_word_embeddings": False, "eos_token_id": list(TINY.eos_token_ids),
              "torch_dtype": "bfloat16"}
    (hf_dir / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(hf_dir)
    convert(str(hf_dir), str(mlx_dir), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    return mlx_dir


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic") / "tiny"
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    assert lily_main(["make-synthetic", "--preset", "tiny", "--seed", str(seed), str(out)]) == 0
    return out


@pytest.fixture(params=["converted", "synthetic"])
def ckpt_dir(request):
    return request.getfixturevalue(request.param)


def test_converted_checkpoint_is_mlx_lms_own_output(converted):
    """Guard: the fixture really went through mlx_lm.convert (its quantization block, no HF names)."""
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    assert cfg["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    names = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight" in names
    assert not any("mtp." in k or "visual" in k or "experts." in k for k in names)


def test_weights_bit_identical_to_mlx_lm(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir)
    model, _ = mlx_utils.load_model(ckpt_dir)
    params = dict(tree_flatten(model.parameters()))
    assert ckpt.config.router_bits == 8 and ckpt.tokenizer_dir == ckpt_dir
    n_quant = 0
    for key, w in ckpt.weights.items():
        name = mlx_name(key)
        if isinstance(w, QuantTensor):
            qw, s, b = params[name + ".weight"], params[name + ".scales"], params[name + ".biases"]
            bits = 8 if key.endswith(("mlp.gate", "shared_expert_gate")) else 4
            assert w.bits == bits, key
            theirs = mx.dequantize(qw, s, b, group_size=64, bits=bits)  # bf16, MLX's own arithmetic
            assert theirs.dtype == mx.bfloat16
            assert torch.equal(w.dequantize(torch.bfloat16), to_torch(theirs)), key
            assert torch.equal(w.dequantize(torch.float32),
                               to_torch(mx.dequantize(qw, s.astype(mx.float32), b.astype(mx.float32),
                                                      group_size=64, bits=bits))), key
            n_quant += 1
        else:
            theirs = to_torch(params[name])
            if key.endswith("conv1d.weight"):
                theirs = theirs.squeeze(-1)  # MLX [C, K, 1] -> lily [C, K]
            if key.endswith(("A_log", "dt_bias")):  # held in float32 (docs/internals.md): an exact upcast
                assert w.dtype == torch.float32 and torch.equal(w, theirs.float()), key
            else:
                assert w.dtype == theirs.dtype and torch.equal(w, theirs), key
    assert n_quant == sum(1 for k in params if k.endswith(".scales"))
    assert len(params) == sum(3 if isinstance(w, QuantTensor) else 1 for w in ckpt.weights.values())


def test_reference_logits_match_mlx_lm(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir)
    ids = random_prompt(PROMPT_LEN, ckpt.config.vocab_size, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    theirs = mlx_logprobs_fp32(ckpt_dir, ids)
    ours = lily_logprobs_fp32(ckpt, ids)
    assert ours.shape == theirs.shape == (PROMPT_LEN, ckpt.config.vocab_size)
    assert torch.isfinite(ours).all()
    # the prompt must make a difference to the logits, or the comparison would prove little
    assert (theirs[1:] - theirs[:-1]).abs().max() > 0.5
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-3, f"max |d logprob| = {err:.2e}"


def test_synthetic_tokenizer_loads_in_mlx_lm(synthetic):
    from lily.demo_tokenizer import build_tokenizer

    _, tok = mlx_utils.load(str(synthetic))
    text = "The robot paints the sea. Ünïcödé 😀"
    assert tok.encode(text, add_special_tokens=False) == build_tokenizer().encode(text).ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert set(tok.eos_token_ids) >= {500}
