"""ModelConfig parsing: the real Qwen3.6-35B-A3B config shape, the presets, and refusals."""

import copy
import re

import pytest

from lily.config import FULL, TINY, ConfigError, ModelConfig


def _real_like_config() -> dict:
    """A config.json shaped like the MLX conversion of Qwen3.6-35B-A3B (values from docs/model.md)."""
    return FULL.mlx_config_json()


def test_full_roundtrip_and_derived_dims():
    conf = ModelConfig.from_config_json(_real_like_config())
    assert conf == FULL
    assert conf.full_attention_layers == list(range(3, 40, 4))
    assert len(conf.linear_attention_layers) == 30
    assert conf.rotary_dim == 64
    assert conf.linear_conv_dim == 8192
    assert conf.attn_q_dim == 8192 and conf.attn_kv_dim == 512
    assert conf.router_bits == 8


def test_tiny_roundtrip():
    assert ModelConfig.from_config_json(TINY.mlx_config_json()) == TINY


def test_layer_types_default_from_interval():
    cfg = _real_like_config()
    del cfg["text_config"]["layer_types"]
    assert ModelConfig.from_config_json(cfg).layer_types == FULL.layer_types


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.pop("quantization") and c.pop("quantization_config"), "quantization"),
    (lambda c: c["quantization"].update(bits=8) or c.pop("quantization_config"), "bits"),
    (lambda c: c["quantization"].update(group_size=32) or c.pop("quantization_config"), "group_size"),
    (lambda c: c["quantization"].update(mode="mxfp4") or c.pop("quantization_config"), "mode"),
    (lambda c: c["text_config"].pop("hidden_size"), "hidden_size"),
    (lambda c: c["text_config"].update(hidden_size="2048"), "hidden_size"),
    (lambda c: c["text_config"].update(num_hidden_layers=39), "layer_types"),
    (lambda c: c["text_config"].update(head_dim=96), "head_dim"),
    (lambda c: c["text_config"].update(num_experts_per_tok=300), "num_experts_per_tok"),
])
def test_refusals_name_the_field(mutate, needle):
    cfg = copy.deepcopy(_real_like_config())
    mutate(cfg)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_config_json(cfg, source="ckpt/config.json")


def test_null_eos_falls_back_as_absent_does():
    # transformers 5 saves a Qwen3_5MoeConfig with text_config.eos_token_id null and none at the top
    cfg = _real_like_config()
    cfg.pop("eos_token_id", None)
    cfg["text_config"]["eos_token_id"] = None
    assert ModelConfig.from_config_json(cfg).eos_token_ids == FULL.eos_token_ids
    cfg["eos_token_id"] = None  # a null at the top defers to text_config's ids
    ids = list(range(1000, 1000 + 3))
    cfg["text_config"]["eos_token_id"] = ids
    assert ModelConfig.from_config_json(cfg).eos_token_ids == tuple(ids)
    cfg["eos_token_id"] = ids[0]  # and a top-level id wins over them
    assert ModelConfig.from_config_json(cfg).eos_token_ids == (ids[0],)


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c.update(eos_token_id="248046"), "eos_token_id is '248046'"),
    (lambda c: c.update(eos_token_id=[248046, 1.5]), "eos_token_id is [248046, 1.5]"),
    (lambda c: (c.pop("eos_token_id", None), c["text_config"].update(eos_token_id=True)),
     "text_config.eos_token_id is True"),
    (lambda c: c["text_config"].update(rope_parameters="default"), "text_config.rope_parameters is 'default'"),
    (lambda c: c["text_config"].update(rope_parameters=[1]), "text_config.rope_parameters is [1]"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_theta="1e7"), "rope_parameters.rope_theta is '1e7'"),
])
def test_wrong_types_are_one_line_naming_the_field(mutate, needle):
    cfg = copy.deepcopy(_real_like_config())
    assert isinstance(cfg["text_config"].get("rope_parameters"), dict)  # the rope cases edit a real block
    mutate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ModelConfig.from_config_json(cfg, source="ckpt/config.json")
