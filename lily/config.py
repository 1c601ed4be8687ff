"""The model's configuration: every dimension the engine needs, read from a checkpoint's config.json.

lily implements one architecture (docs/model.md). The full Qwen3.6-35B-A3B shape is the target;
smaller configs of the same architecture (tests, the demo) are accepted as long as they keep the
constraints the kernels rely on, which `validate` checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A config.json that lily cannot run: the message names the file and field."""


# what to do with an MLX checkpoint quantized otherwise than lily runs it (8-bit, group 32, mixed, mxfp4...)
MLX_REMEDY = ("lily runs the 4-bit group-64 checkpoint: mlx_lm.convert -q --q-bits 4 --q-group-size 64, "
              "or `lily convert` the original release")
# fields that say a qwen3_5_moe config.json holds its text model at the top level (no text_config)
FLAT_FIELDS = ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's context extension from config.json's rope_parameters (or rope_scaling): "linear" (positions
    divided by factor) or "yarn" (Qwen's setting past 262,144 tokens: the low frequencies interpolated by factor,
    the high ones kept, a ramp between, and cos / sin scaled by an attention factor). The fields are transformers'
    and vLLM's; lily.model.rope turns them into frequencies as transformers does."""
    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None     # yarn: the pretrained context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None                   # yarn: None = from factor, mscale and mscale_all_dim
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def to_json(self) -> dict:
        """The rope_parameters entries (besides rope_theta and the rotary fraction) that describe it."""
        out: dict = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        return out


# rope types that describe plain RoPE for a text-only model ("mrope": Qwen2-VL's name for its sections)
PLAIN_ROPE_TYPES = (None, "default", "mrope")
SCALED_ROPE_TYPES = ("linear", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 262_144
    norm_topk_prob: bool = True
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    # quantization (MLX affine)
    group_size: int = 64
    bits: int = 4
    router_bits: int = 8
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0  # layers of the multi-token-prediction head (the original release has 1)

    # -- derived -----------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def linear_key_dim(self) -> int:  # q and k width of the GDN projection
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:  # channels of the depthwise conv: q, k, v
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attn_q_dim(self) -> int:  # q_proj output: per head [query | gate]
        return self.num_attention_heads * self.head_dim * 2

    @property
    def attn_kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def validate(self, source: str = "config.json") -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{source}: {msg}")

        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers={self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            need(t in ("full_attention", "linear_attention"),
                 f"layer_types[{i}] is {t!r}, expected 'full_attention' or 'linear_attention'")
        need(self.hidden_size % self.group_size == 0,
             f"hidden_size={self.hidden_size} must be a multiple of the quantization group size {self.group_size}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            need(getattr(self, name) % self.group_size == 0,
                 f"{name}={getattr(self, name)} must be a multiple of the group size {self.group_size}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             "linear_num_value_heads must be a multiple of linear_num_key_heads")
        need((self.num_attention_heads * self.head_dim) % self.group_size == 0,
             "num_attention_heads * head_dim must be a multiple of the group size (o_proj input)")
        need(self.linear_value_dim % self.group_size == 0,
             "linear_num_value_heads * linear_value_head_dim must be a multiple of the group size (out_proj input)")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"partial_rotary_factor={self.partial_rotary_factor} gives an unusable rotary dim {self.rotary_dim}")
        need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok must be in 1..num_experts")
        need(self.vocab_size > 0, "vocab_size must be positive")
        need(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim must be >= 1")
        for d in ("head_dim", "linear_key_head_dim", "linear_value_head_dim"):
            v = getattr(self, d)
            need(v >= 16 and (v & (v - 1)) == 0, f"{d}={v} must be a power of two >= 16 (kernel tile)")
        need(self.bits == 4, f"quantization bits={self.bits}: lily runs 4-bit checkpoints only")
        need(self.group_size == 64, f"quantization group_size={self.group_size}: lily runs group 64 only")

    # -- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_config_json(cls, cfg: dict, source: str = "config.json", mlx_quantized: bool = True) -> "ModelConfig":
        """Parse a Qwen3.5/3.6 MoE config.json (top-level `qwen3_5_moe` with `text_config`, or the text
        config itself) including MLX's `quantization` block. With mlx_quantized=False (an original bf16 or
        FP8 release, quantized at load) any quantization block is ignored and the result describes the
        MLX 4-bit model lily makes of it (group 64, 8-bit router gates)."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = cfg.get("model_type")
        if model_type == "qwen3_5_moe":
            text = cfg.get("text_config")
            if text is None and all(k in cfg for k in FLAT_FIELDS):
                text = cfg  # the text model's fields at the top level, as transformers reads them too
            elif not isinstance(text, dict):
                missing = ", ".join(k for k in FLAT_FIELDS if k not in cfg)
                raise ConfigError(f"{source}: model_type qwen3_5_moe needs a 'text_config' object, or the text "
                                  f"model's fields at the top level (missing: {missing})")
        elif model_type == "qwen3_5_moe_text":
            text = cfg
        else:
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r}; lily runs Qwen3.6-35B-A3B "
                "(model_type 'qwen3_5_moe')")

        def get(name, typ, default=dataclasses.MISSING):
            if name in text:
                v = text[name]
            elif name in cfg and cfg is not text:
                v = cfg[name]
            elif default is not dataclasses.MISSING:
                return default
            else:
                raise ConfigError(f"{source}: text_config.{name} is missing")
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
                raise ConfigError(f"{source}: text_config.{name} is {v!r}, expected {typ.__name__}")
            if typ is int and v <= 0:
                raise ConfigError(f"{source}: text_config.{name} is {v}, expected a positive integer")
            return v

        n_layers = get("num_hidden_layers", int)
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", int, 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        if not isinstance(layer_types, list):
            raise ConfigError(f"{source}: text_config.layer_types must be a list")

        rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = text.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: text_config.{rope_key} is {rope!r}, expected an object")

        def number(name, default):
            # rope's own value first, then text_config's (older configs keep them at that level)
            where, v = (rope_key, rope[name]) if rope.get(name) is not None else ("", text.get(name))
            if v is None:
                return default
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"{source}: text_config.{where + '.' if where else ''}{name} is {v!r}, expected a number")
            return float(v)

        rope_theta = number("rope_theta", 10_000_000.0)
        prf = number("partial_rotary_factor", 0.25)
        rope_scaling = _rope_scaling(rope, rope_key, number, get("max_position_embeddings", int, 262_144), source)
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError(f"{source}: attn_output_gate must be true for this architecture")

        mtp_layers = text.get("mtp_num_hidden_layers", 0)
        if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
            raise ConfigError(f"{source}: text_config.mtp_num_hidden_layers is {mtp_layers!r}, expected an integer >= 0")

        # null counts as absent (transformers 5 saves a Qwen3_5MoeConfig with text_config.eos_token_id null
        # and none at the top): the model's own end-of-text ids then
        eos_key = "eos_token_id" if cfg.get("eos_token_id") is not None else "text_config.eos_token_id"
        eos = cfg.get("eos_token_id") if cfg.get("eos_token_id") is not None else text.get("eos_token_id")
        if eos is None:
            eos = [248046, 248044]
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise ConfigError(f"{source}: {eos_key} is {eos!r}, expected a token id or a list of token ids")

        q = cfg.get("quantization") or cfg.get("quantization_config")  # an empty block counts as none
        if not mlx_quantized:
            q = {"group_size": 64, "bits": 4, "mode": "affine"}
        if not isinstance(q, dict) or not q:
            raise ConfigError(f"{source}: no 'quantization' block: lily loads MLX affine 4-bit checkpoints "
                              "(made by mlx_lm.convert -q)")
        mode = q.get("mode", "affine")
        if mode != "affine":
            raise ConfigError(f"{source}: quantization mode {mode!r} is unsupported; {MLX_REMEDY}")
        bits, group = q.get("bits"), q.get("group_size")
        if bits != 4:
            raise ConfigError(f"{source}: quantization bits={bits!r} is unsupported; {MLX_REMEDY}")
        if group != 64:
            raise ConfigError(f"{source}: quantization group_size={group!r} is unsupported; {MLX_REMEDY}")
        router_bits = 8
        for key, val in q.items():
            if isinstance(val, dict) and key.endswith((".mlp.gate", ".mlp.shared_expert_gate")):
                if val.get("bits") not in (4, 8) or val.get("group_size", 64) != 64:
                    raise ConfigError(f"{source}: quantization.{key} is {val}: a mixed-precision recipe (router gates "
                                      f"at 8 or 4 bits, group 64, expected); {MLX_REMEDY}")
                router_bits = val["bits"]

        conf = cls(
            hidden_size=get("hidden_size", int),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=get("num_attention_heads", int),
            num_key_value_heads=get("num_key_value_heads", int),
            head_dim=get("head_dim", int),
            linear_num_key_heads=get("linear_num_key_heads", int),
            linear_num_value_heads=get("linear_num_value_heads", int),
            linear_key_head_dim=get("linear_key_head_dim", int),
            linear_value_head_dim=get("linear_value_head_dim", int),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", int),
            num_experts=get("num_experts", int),
            num_experts_per_tok=get("num_experts_per_tok", int),
            moe_intermediate_size=get("moe_intermediate_size", int),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", int),
            vocab_size=get("vocab_size", int),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("max_position_embeddings", int, 262_144),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            eos_token_ids=tuple(ids),
            group_size=group,
            bits=bits,
            router_bits=router_bits,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=mtp_layers,
        )
        if conf.tie_word_embeddings:
            raise ConfigError(f"{source}: tie_word_embeddings=true is not this architecture (expected false)")
        conf.validate(source)
        return conf

    def text_config_dict(self) -> dict:
        """The HF `text_config` (for writing checkpoints and building oracle models)."""
        return {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "full_attention_interval": 4,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attn_output_gate": True,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "norm_topk_prob": self.norm_topk_prob,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
                **(self.rope_scaling.to_json() if self.rope_scaling else {}),
            },
            "eos_token_id": list(self.eos_token_ids),
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
        }

    def mlx_config_json(self, with_mtp: bool = False) -> dict:
        """A config.json as mlx_lm.convert writes for this model (quantization block included); with_mtp
        also lists the MTP head's 8-bit router gates (lily keeps the head, mlx_lm.convert drops it)."""
        text = self.text_config_dict()
        quant: dict = {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        layers = [f"language_model.model.layers.{i}" for i in range(self.num_hidden_layers)]
        if with_mtp:
            layers += [f"mtp.layers.{j}" for j in range(self.mtp_num_hidden_layers)]
        for layer in layers:
            for m in ("mlp.gate", "mlp.shared_expert_gate"):
                quant[f"{layer}.{m}"] = {"group_size": 64, "bits": self.router_bits}
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": False,
            "eos_token_id": list(self.eos_token_ids),
            "quantization": quant,
            "quantization_config": quant,
        }


def _rope_scaling(rope: dict, rope_key: str, number, max_positions: int, source: str) -> RopeScaling | None:
    """The RopeScaling a rope_parameters / rope_scaling block asks for (None: plain RoPE). number(name, default)
    reads a numeric entry; types lily cannot run exactly are refused rather than run as plain RoPE."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in PLAIN_ROPE_TYPES:
        return None
    where = f"{source}: text_config.{rope_key}"
    if kind not in SCALED_ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type is {kind!r}: lily runs RoPE as 'default', 'linear' or 'yarn' "
                          "(Qwen's setting for long contexts); remove the entry or use yarn")
    factor = number("factor", None)
    if kind == "linear":
        if factor is None or factor < 1:
            raise ConfigError(f"{where}.factor is {rope.get('factor')!r}: linear scaling needs a factor >= 1")
        return RopeScaling("linear", factor)
    original = rope.get("original_max_position_embeddings", max_positions)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ConfigError(f"{where}.original_max_position_embeddings is {original!r}, expected a positive integer")
    if factor is None:       # (transformers: the ratio of the context to the pretrained one)
        factor = max_positions / original
    if factor <= 0:
        raise ConfigError(f"{where}.factor is {factor!r}, expected a positive number")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}.truncate is {truncate!r}, expected true or false")
    # beta_fast / beta_slow: 0 or null take the defaults, as in transformers
    return RopeScaling("yarn", factor, original, beta_fast=number("beta_fast", None) or 32.0,
                       beta_slow=number("beta_slow", None) or 1.0, attention_factor=number("attention_factor", None),
                       mscale=number("mscale", None), mscale_all_dim=number("mscale_all_dim", None),
                       truncate=truncate)


def _layer_types(n: int) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


FULL = ModelConfig(
    hidden_size=2048, num_hidden_layers=40, layer_types=_layer_types(40),
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320, mtp_num_hidden_layers=1,
)

# Small enough for CI on two cores, same structure: GQA 4/2 (2 query heads per KV head), GDN 2 key /
# 4 value heads (value head j reads key head j // 2), 4 layers with the full-attention one last.
TINY = ModelConfig(
    hidden_size=128, num_hidden_layers=4, layer_types=_layer_types(4),
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, vocab_size=512,
    eos_token_ids=(500, 499),
)

PRESETS = {"tiny": TINY, "full": FULL}

# what the fast backend's KV cache may be stored as (lily.kernels.kv_int8); the reference emulates int8
KV_CACHE_DTYPES = ("bf16", "int8")
# what the fast backend's GDN recurrent state may be stored as between steps (the arithmetic stays fp32); bf16
# halves its bytes, as peers offer for hybrid models (SGLang --mamba-ssm-dtype, vLLM --mamba-ssm-cache-dtype);
# the reference emulates it
RECURRENT_STATE_DTYPES = ("fp32", "bf16")


def check_rec_dtype(rec_dtype: str) -> str:
    if rec_dtype not in RECURRENT_STATE_DTYPES:
        raise ValueError(f"recurrent state dtype {rec_dtype!r}: expected one of {', '.join(RECURRENT_STATE_DTYPES)}")
    return rec_dtype


def with_layers(conf: ModelConfig, n: int) -> ModelConfig:
    """The same widths with n layers (the full-attention layer pattern kept)."""
    return dataclasses.replace(conf, num_hidden_layers=n, layer_types=_layer_types(n))
