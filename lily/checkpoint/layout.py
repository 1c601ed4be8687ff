"""lily's weight names (docs/internals.md) and every tensor a config implies, with its logical shape and
bit width or dtype: the contract between the checkpoint readers, the writer and the model."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from lily.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """One entry of the weights dict: a quantized module (bits set) or a plain tensor (dtype set)."""

    key: str                 # lily name (internals.md)
    shape: tuple[int, ...]   # logical shape (conv1d: [C, K], as lily hands it out)
    bits: int | None = None  # quantized module: expected bit width
    dtype: torch.dtype | None = None  # plain tensor: expected dtype

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def mlx_name(self) -> str:
        return mlx_name(self.key)


def mlx_name(key: str) -> str:
    """lily key -> tensor/module name in the MLX files (MTP weights keep the original release's `mtp.`)."""
    if key.startswith("mtp."):
        return key
    return "language_model.lm_head" if key == "lm_head" else "language_model.model." + key


# RMSNorm gains that Hugging Face stores zero-centred (it computes norm(x) * (1 + w)); MLX files and lily
# hold the effective gain. linear_attn.norm is a plain gain in both.
_ZERO_CENTRED_NORM = re.compile(
    r"^(mtp\.)?(norm|pre_fc_norm_embedding|pre_fc_norm_hidden|layers\.\d+\.(input_layernorm|post_attention_layernorm"
    r"|self_attn\.q_norm|self_attn\.k_norm))\.weight$")


def zero_centred_in_hf(key: str) -> bool:
    """Whether Hugging Face stores this norm's gain as w - 1 (the MLX conversion adds 1.0)."""
    return _ZERO_CENTRED_NORM.match(key) is not None


def memory_dtype(spec: TensorSpec) -> torch.dtype:
    """The dtype a plain tensor has in memory, whatever float dtype the file holds: A_log and dt_bias in
    fp32 (the gates are computed in fp32), norms and conv1d in bf16."""
    return torch.float32 if spec.key.endswith(("A_log", "dt_bias")) else spec.dtype


def expected_tensors(config: ModelConfig, mtp: bool = False) -> dict[str, TensorSpec]:
    """Every weight the config implies, in a stable order (the order files are written in). With `mtp`,
    also the multi-token-prediction head (config.mtp_num_hidden_layers full-attention MoE layers)."""
    c, bf16 = config, torch.bfloat16
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    specs: list[TensorSpec] = [TensorSpec("embed_tokens", (c.vocab_size, H), bits=c.bits)]

    def q(key, *shape, bits=c.bits):
        specs.append(TensorSpec(key, tuple(shape), bits=bits))

    def p(key, *shape, dtype=bf16):
        specs.append(TensorSpec(key, tuple(shape), dtype=dtype))

    def layer(L, kind):
        p(f"{L}.input_layernorm.weight", H)
        p(f"{L}.post_attention_layernorm.weight", H)
        if kind == "full_attention":
            a = f"{L}.self_attn"
            q(f"{a}.q_proj", c.attn_q_dim, H)
            q(f"{a}.k_proj", c.attn_kv_dim, H)
            q(f"{a}.v_proj", c.attn_kv_dim, H)
            q(f"{a}.o_proj", H, c.num_attention_heads * c.head_dim)
            p(f"{a}.q_norm.weight", c.head_dim)
            p(f"{a}.k_norm.weight", c.head_dim)
        else:
            g = f"{L}.linear_attn"
            q(f"{g}.in_proj_qkv", c.linear_conv_dim, H)
            q(f"{g}.in_proj_z", c.linear_value_dim, H)
            q(f"{g}.in_proj_b", c.linear_num_value_heads, H)
            q(f"{g}.in_proj_a", c.linear_num_value_heads, H)
            p(f"{g}.conv1d.weight", c.linear_conv_dim, c.linear_conv_kernel_dim)
            p(f"{g}.A_log", c.linear_num_value_heads, dtype=torch.float32)
            p(f"{g}.dt_bias", c.linear_num_value_heads)
            p(f"{g}.norm.weight", c.linear_value_head_dim)
            q(f"{g}.out_proj", H, c.linear_value_dim)
        m = f"{L}.mlp"
        q(f"{m}.gate", E, H, bits=c.router_bits)
        q(f"{m}.switch_mlp.gate_proj", E, I, H)
        q(f"{m}.switch_mlp.up_proj", E, I, H)
        q(f"{m}.switch_mlp.down_proj", E, H, I)
        q(f"{m}.shared_expert.gate_proj", Is, H)
        q(f"{m}.shared_expert.up_proj", Is, H)
        q(f"{m}.shared_expert.down_proj", H, Is)
        q(f"{m}.shared_expert_gate", 1, H, bits=c.router_bits)

    for i, kind in enumerate(c.layer_types):
        layer(f"layers.{i}", kind)
    p("norm.weight", H)
    q("lm_head", c.vocab_size, H)
    if mtp:  # shared/MODEL.md section 6: fc over [norm(embedding), norm(hidden)], attention MoE layers, norm
        p("mtp.pre_fc_norm_embedding.weight", H)
        p("mtp.pre_fc_norm_hidden.weight", H)
        q("mtp.fc", H, 2 * H)
        for j in range(c.mtp_num_hidden_layers):
            layer(f"mtp.layers.{j}", "full_attention")
        p("mtp.norm.weight", H)
    return {s.key: s for s in specs}


def describe(config: ModelConfig) -> str:
    """A short human summary of a config (used by `lily check`)."""
    c = config
    return (f"{c.num_hidden_layers} layers ({len(c.linear_attention_layers)} gated DeltaNet, "
            f"{len(c.full_attention_layers)} full attention), hidden {c.hidden_size}, vocab {c.vocab_size}, "
            f"{c.num_experts} experts top-{c.num_experts_per_tok} (intermediate {c.moe_intermediate_size}, "
            f"shared {c.shared_expert_intermediate_size}), attention {c.num_attention_heads}q/"
            f"{c.num_key_value_heads}kv x {c.head_dim}, GDN {c.linear_num_key_heads}k/{c.linear_num_value_heads}v "
            f"x {c.linear_key_head_dim}, {c.bits}-bit group {c.group_size} (router {c.router_bits}-bit), "
            f"context {c.max_position_embeddings:,}{_rope_note(c)}")


def _rope_note(c: ModelConfig) -> str:
    s = c.rope_scaling
    if s is None:
        return ""
    if s.rope_type == "linear":
        return f" (RoPE linear x{s.factor:g})"
    return f" (RoPE yarn x{s.factor:g} from {s.original_max_position_embeddings:,})"

