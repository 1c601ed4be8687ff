"""Tiny checkpoints in the layout of Qwen's original releases, for the conversion tests.

    from helpers_original import save_original, fused_copy, fp8_copy
    src = save_original(tmp / "per_expert", config, gen)   # transformers' save_pretrained + an MTP head
    fused = fused_copy(src, tmp / "fused")                 # the same tensors, experts fused (the bf16 release)
    fp8 = fp8_copy(src, tmp / "fp8", NOT_CONVERTED)        # block-wise FP8 (the FP8 release)

transformers 5.x's `Qwen3_5MoeForConditionalGeneration.save_pretrained` writes the real release's names
(`model.language_model.*`, `lm_head.weight`, `model.visual.*`) with the experts one by one; the MTP head,
which transformers does not model, is added in a second shard under the release's `mtp.*` names.
Values are random but well-conditioned, in Hugging Face conventions (zero-centred norms).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lily.config import ModelConfig
from lily.demo_tokenizer import write_tokenizer_files

FP8_MAX = 448.0  # largest float8_e4m3fn value
BLOCK = 128


def hf_value(name: str, shape, gen: torch.Generator, n_layers: int) -> torch.Tensor:
    """A well-conditioned random value for a Hugging Face parameter name (zero-centred shifted norms)."""
    def n(std):
        return torch.randn(shape, generator=gen) * std

    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=gen) * 15 + 1)
    if name.endswith("dt_bias"):
        return n(0.1)
    if name.endswith("conv1d.weight"):
        return n(0.25)
    if name.endswith("linear_attn.norm.weight"):  # a plain gain in both conventions
        return 1 + n(0.1)
    if "norm" in name and name.endswith("weight") and len(shape) == 1:  # HF stores gain - 1
        return n(0.1)
    if len(shape) == 1:  # biases of the vision tower
        return n(0.02)
    if name.endswith("embed_tokens.weight"):
        return n(1.0)
    std = shape[-1] ** -0.5
    if any(k in name for k in ("o_proj", "out_proj", "down_proj")):
        std /= math.sqrt(2 * n_layers)
    if name.endswith("mlp.gate.weight"):
        std *= 3
    if name == "lm_head.weight":
        std *= 4
    return n(std)


def plant_edge_groups(w: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite a few 64-wide groups of the first rows with the cases affine quantisation treats
    specially: all zero, constant (positive, negative), one non-zero value (either sign), one-sided
    ranges, an outlier, values near the smallest normal, and a tie at the edge."""
    rows = w.reshape(-1, w.shape[-1])
    std = rows[:, :64].std().item()
    ramp = torch.linspace(0.5, 1.0, 64) * std
    cases = [torch.zeros(64), torch.full((64,), 0.37 * std), torch.full((64,), -2.5 * std),
             torch.zeros(64).index_fill(0, torch.tensor([5]), std), torch.zeros(64).index_fill(0, torch.tensor([9]), -std),
             ramp, -ramp, torch.randn(64, generator=gen) * std * 0.01 + torch.zeros(64).index_fill(0, torch.tensor([3]), 40 * std),
             torch.randn(64, generator=gen) * 1e-37, torch.where(torch.arange(64) % 2 == 0, std, -std)]
    for r, case in enumerate(cases[:rows.shape[0]]):
        rows[r, :64] = case


def mtp_tensors(config: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The MTP head as the original release names it (shared/MODEL.md section 6), experts one by one."""
    c = config
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    shapes = {"mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
              "mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,)}
    for j in range(c.mtp_num_hidden_layers):
        L = f"mtp.layers.{j}."
        shapes.update({L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,),
                       L + "self_attn.q_proj.weight": (c.attn_q_dim, H), L + "self_attn.k_proj.weight": (c.attn_kv_dim, H),
                       L + "self_attn.v_proj.weight": (c.attn_kv_dim, H),
                       L + "self_attn.o_proj.weight": (H, c.num_attention_heads * c.head_dim),
                       L + "self_attn.q_norm.weight": (c.head_dim,), L + "self_attn.k_norm.weight": (c.head_dim,),
                       L + "mlp.gate.weight": (E, H), L + "mlp.shared_expert_gate.weight": (1, H),
                       L + "mlp.shared_expert.gate_proj.weight": (Is, H), L + "mlp.shared_expert.up_proj.weight": (Is, H),
                       L + "mlp.shared_expert.down_proj.weight": (H, Is)})
        for e in range(E):
            shapes.update({L + f"mlp.experts.{e}.gate_proj.weight": (I, H), L + f"mlp.experts.{e}.up_proj.weight": (I, H),
                           L + f"mlp.experts.{e}.down_proj.weight": (H, I)})
    return {k: hf_value(k, s, gen, c.num_hidden_layers).to(torch.bfloat16) for k, s in shapes.items()}


def read_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def write_dir(d: Path, tensors: dict[str, torch.Tensor], config_json: dict, shards: int = 2) -> Path:
    """Tensors in `shards` files with model.safetensors.index.json, config.json and the demo tokenizer."""
    d = Path(d)
    d.mkdir(parents=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(config_json))
    write_tokenizer_files(d)
    return d


_TEXT_PREFIX = re.compile(r"^model\.(language_model\.)?")


def save_original(d: Path, config: ModelConfig, gen: torch.Generator, causal_lm: bool = False) -> Path:
    """transformers' save_pretrained of a random Qwen3.5-MoE (ConditionalGeneration with a tiny vision tower;
    with causal_lm the text model alone, names `model.*`) in bf16, plus the MTP head in its own shard."""
    from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig)

    mtp = mtp_tensors(config, gen) if config.mtp_num_hidden_layers else {}
    edge_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    text = {k: v for k, v in config.text_config_dict().items() if k != "model_type"}
    if causal_lm:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=config.hidden_size,
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    # values drawn in the order of the text model's own names, then the vision tower's: the same generator
    # gives the same text weights whether the model has a vision tower or not
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params, key=lambda n: (n.startswith("model.visual."), _TEXT_PREFIX.sub("", n))):
            params[name].copy_(hf_value(name, tuple(params[name].shape), gen, config.num_hidden_layers))
        for name in ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight",
                     "model.language_model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.weight",
                     "model.language_model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj"):
            if name in params:
                plant_edge_groups(params[name].data, edge_gen)
    model.to(torch.bfloat16).save_pretrained(str(d))
    write_tokenizer_files(d)
    if mtp:
        files = sorted(Path(d).glob("*.safetensors"))
        weight_map = {}
        for f in files:
            with safe_open(str(f), "pt") as s:
                weight_map.update({k: f.name for k in s.keys()})
        save_file(mtp, str(Path(d) / "mtp.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: "mtp.safetensors" for k in mtp})
        (Path(d) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        cfg = json.loads((Path(d) / "config.json").read_text())
        (cfg if causal_lm else cfg["text_config"])["mtp_num_hidden_layers"] = config.mtp_num_hidden_layers
        (Path(d) / "config.json").write_text(json.dumps(cfg))
    return Path(d)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_copy(src: Path, d: Path, a_log_dtype: torch.dtype | None = None) -> Path:
    """The same tensors with every layer's experts fused as the bf16 release stores them:
    experts.gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and experts.down_proj."""
    tensors, per = {}, {}
    for k, t in read_dir(src).items():
        m = _EXPERT.match(k)
        if m:
            per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            tensors[k] = t.to(a_log_dtype) if a_log_dtype is not None and k.endswith("A_log") else t
    for base, projs in per.items():
        E = len(projs["gate_proj"])
        stack = {p: torch.stack([projs[p][e] for e in range(E)]) for p in projs}
        tensors[base + ".gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        tensors[base + ".down_proj"] = stack["down_proj"]
    return write_dir(d, tensors, json.loads((Path(src) / "config.json").read_text()))


def not_converted(name: str, patterns: tuple[str, ...]) -> bool:
    module = name[:-len(".weight")]
    return any(module == p or module.startswith(p + ".") or module.endswith("." + p) for p in patterns)


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as the format describes it: per 128x128 block (partial at the edges) scale_inv =
    amax|w| / 448 (1 for an all-zero block), weight = float8_e4m3fn(w / scale_inv)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    w = w.float()
    scale_inv = torch.ones(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = blk.abs().max().item()
            s = amax / FP8_MAX if amax > 0 else 1.0
            scale_inv[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return q, scale_inv


def fp8_copy(src: Path, d: Path, patterns: tuple[str, ...], a_log_dtype: torch.dtype | None = None) -> Path:
    """The FP8 release of `src`: every Linear weight outside `patterns` (modules_to_not_convert) block-wise
    FP8 with its weight_scale_inv; everything else as it was. The vision tower stays bf16 too."""
    tensors = {}
    for k, t in read_dir(src).items():
        if a_log_dtype is not None and k.endswith("A_log"):
            t = t.to(a_log_dtype)
        if k.endswith(".weight") and t.dim() == 2 and not k.startswith("model.visual.") \
                and not not_converted(k, patterns):
            tensors[k], tensors[k[:-len(".weight")] + ".weight_scale_inv"] = fp8_quantize(t)
        else:
            tensors[k] = t
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(patterns)}
    return write_dir(d, tensors, cfg, shards=3)


def replace_tensors(src: Path, d: Path, fn) -> Path:
    """A copy of `src` with its tensors passed through fn(dict) (mutate in place); same config."""
    tensors = read_dir(src)
    fn(tensors)
    shutil.rmtree(d, ignore_errors=True)
    return write_dir(d, tensors, json.loads((Path(src) / "config.json").read_text()))
