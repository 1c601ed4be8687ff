"""RoPE scaled for long contexts (config.json's rope_parameters "yarn" / "linear", lily.model.rope): the
frequencies and YaRN's attention factor against transformers' own functions, the config's parsing and
refusals, the reference model against transformers' Qwen3_5MoeForCausalLM with YaRN on, and the fast backend's
prefill kernels and decode step (the factor folded into the q / k norm gains) against the reference, under
TRITON_INTERPRET=1. Fresh random parameters each run."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lily.config import FULL, TINY, ConfigError, ModelConfig, RopeScaling, with_layers
from lily.model import rope


def _gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def _config_json(c: ModelConfig, **rope_entries) -> dict:
    text = c.text_config_dict()
    text["rope_parameters"].update(rope_entries)
    return {"model_type": "qwen3_5_moe", "text_config": text}


def _random_yarn(rng: random.Random) -> dict:
    entries = {"rope_type": "yarn", "factor": rng.uniform(1.5, 16.0),
               "original_max_position_embeddings": rng.choice([4096, 32768, 262144]),
               "beta_fast": rng.choice([32, 16, 48]), "beta_slow": rng.choice([1, 2]),
               "truncate": rng.random() < 0.7}
    pick = rng.randrange(3)
    if pick == 1:
        entries["attention_factor"] = rng.uniform(0.8, 1.5)
    elif pick == 2:
        entries.update(mscale=rng.uniform(0.5, 1.5), mscale_all_dim=rng.uniform(0.5, 1.5))
    return entries


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_frequencies_and_factor_are_transformers(kind):
    """lily.model.rope against transformers' ROPE_INIT_FUNCTIONS on the same config.json, full-size shapes."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = random.Random(random.randrange(2**31))
    for _ in range(6):
        entries = _random_yarn(rng) if kind == "yarn" else {"rope_type": "linear", "factor": rng.uniform(1.0, 8.0)}
        theta = rng.choice([1e4, 1e6, 1e7])
        cfg = _config_json(dataclasses.replace(FULL, rope_theta=theta), **entries)
        c = ModelConfig.from_config_json(cfg, mlx_quantized=False)
        assert c.rope_scaling is not None and c.rope_scaling.rope_type == kind
        hf = Qwen3_5MoeTextConfig(**cfg["text_config"])
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        got = rope.inv_freq(c)
        assert got.shape == want.shape == (c.rotary_dim // 2,)
        # (transformers computes in fp32)
        assert torch.allclose(got, want.double(), rtol=1e-6, atol=0), (entries, theta)
        assert rope.attention_factor(c) == pytest.approx(want_factor, rel=1e-12), entries
        if kind == "yarn":   # the ramp leaves the highest frequency alone
            plain = rope.inv_freq(dataclasses.replace(c, rope_scaling=None))
            assert float(got[0]) == pytest.approx(float(plain[0]), rel=1e-12)


def test_plain_rope_keeps_each_paths_frequencies():
    """No scaling: the values each path took before (float64 for the reference and the prefill kernels, the
    Hugging Face float32 formula for the decode kernels), and no factor."""
    from lily.kernels import attention_decode, flash_attention

    c = FULL
    assert torch.equal(rope.inv_freq(c), flash_attention.rope_inv_freq(c.rotary_dim, c.rope_theta, None))
    assert torch.equal(rope.inv_freq(c, dtype=torch.float32),
                       attention_decode.rope_inv_freq(c.rotary_dim, c.rope_theta))
    assert rope.attention_factor(c) == 1.0
    gain = torch.rand(c.head_dim, generator=_gen()).to(torch.bfloat16) + 0.5
    assert torch.equal(rope.qk_norm_gain(c, gain), gain.float())


def test_config_reads_every_spelling_and_writes_it_back():
    rng = random.Random(random.randrange(2**31))
    entries = _random_yarn(rng)
    c = ModelConfig.from_config_json(_config_json(TINY, **entries), mlx_quantized=False)
    s = c.rope_scaling
    assert s.factor == pytest.approx(entries["factor"]) and s.original_max_position_embeddings == entries[
        "original_max_position_embeddings"] and s.truncate == entries["truncate"]
    # what lily writes (convert, make-synthetic) keeps it: MLX config and HF text config alike
    assert ModelConfig.from_config_json(c.mlx_config_json()).rope_scaling == s
    assert ModelConfig.from_config_json({"model_type": "qwen3_5_moe", "text_config": c.text_config_dict()},
                                        mlx_quantized=False).rope_scaling == s
    # Qwen2.5's spelling: a rope_scaling block with "type"
    text = TINY.text_config_dict()
    del text["rope_parameters"]
    text["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    legacy = ModelConfig.from_config_json({"model_type": "qwen3_5_moe", "text_config": text}, mlx_quantized=False)
    assert legacy.rope_scaling == RopeScaling("yarn", 4.0, 32768)
    # no factor: transformers takes the context over the pretrained one
    cfg = _config_json(TINY, rope_type="yarn", original_max_position_embeddings=8192)
    cfg["text_config"]["max_position_embeddings"] = 8192 * 3
    assert ModelConfig.from_config_json(cfg, mlx_quantized=False).rope_scaling.factor == 3.0
    for plain in ("default", "mrope", None):
        assert ModelConfig.from_config_json(_config_json(TINY, rope_type=plain),
                                            mlx_quantized=False).rope_scaling is None


@pytest.mark.parametrize("entries,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type is 'dynamic'.*'yarn'"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type is 'longrope'"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_type is 'llama3'"),
    ({"rope_type": "linear"}, "linear scaling needs a factor"),
    ({"rope_type": "yarn", "factor": "4"}, "factor is '4', expected a number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings is 0"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, "truncate is 'yes'"),
])
def test_config_refuses_what_it_cannot_run_exactly(entries, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_config_json(_config_json(TINY, **entries), mlx_quantized=False)


def test_folded_gain_scales_only_the_rotary_dims():
    c = dataclasses.replace(TINY, rope_scaling=RopeScaling("yarn", 8.0, 64))
    gain = torch.rand(c.head_dim, generator=_gen()) + 0.5
    folded = rope.qk_norm_gain(c, gain)
    f = rope.attention_factor(c)
    assert f > 1.1
    assert torch.allclose(folded[:c.rotary_dim], gain[:c.rotary_dim] * f)
    assert torch.equal(folded[c.rotary_dim:], gain[c.rotary_dim:])


# A small theta and pretrained context, so the few positions a CPU test runs cross YaRN's ramp: the frequencies
# matter there as well as the attention factor.
def _yarn_config(base: ModelConfig, attention_factor: float | None = None) -> ModelConfig:
    rng = random.Random(random.randrange(2**31))
    return dataclasses.replace(base, rope_theta=rng.uniform(20.0, 200.0),
                               rope_scaling=RopeScaling("yarn", rng.uniform(6.0, 16.0), rng.choice([8, 16]),
                                                        attention_factor=attention_factor))


def test_reference_matches_transformers_with_yarn():
    """The reference model (cos and sin times the factor) against transformers in float64 with the same YaRN
    config.json; the same model without the scaling is far off, so the comparison sees it."""
    from test_reference_hf import _max_dlogprob, hf_model, tiny_weights
    from lily.model.reference import ReferenceModel

    c = _yarn_config(with_layers(TINY, 4))
    weights = tiny_weights(c, _gen())
    ids = torch.randint(0, c.vocab_size, (70,), generator=_gen())
    with torch.no_grad():
        want = hf_model(c, weights, torch.float64)(ids[None]).logits[0]
    got = ReferenceModel(c, weights).forward(ids, ReferenceModel(c, weights).new_state())
    assert _max_dlogprob(got.double(), want) <= 2e-4
    plain = dataclasses.replace(c, rope_scaling=None)
    unscaled = ReferenceModel(plain, weights)
    assert _max_dlogprob(unscaled.forward(ids, unscaled.new_state()).double(), want) > 1e-2


def test_fast_backend_follows_the_reference_with_yarn(monkeypatch):
    """The prefill kernels and the decode step with YaRN (frequencies in inv_freq, the factor in the q / k norm
    gains) against the reference on the same weights. The attention factor is set high (a config may give its
    own), so that the reference without the scaling differs from it by more than the paths' limit: a backend
    that ignored YaRN would fail."""
    from helpers_routing import PREFILL_LIMIT, assert_fast_follows_reference, row_rel
    from lily.engine.fast_backend import FastBackend
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    c = _yarn_config(TINY, attention_factor=random.uniform(4.0, 6.0))
    weights = random_weights(c, seed=random.randrange(10_000))
    ref = ReferenceModel(c, weights)
    be = FastBackend(c, weights, device="cpu", max_seq=64, prefill_mode="kernels")
    assert_fast_follows_reference(monkeypatch, be, ref, "yarn")
    ids = [random.randrange(c.vocab_size) for _ in range(12)]
    plain = ReferenceModel(dataclasses.replace(c, rope_scaling=None), weights)
    far = row_rel(plain.forward(ids, plain.new_state(), logits_for="all"),
                  ref.forward(ids, ref.new_state(), logits_for="all"))
    assert float(far.max()) > 1.5 * PREFILL_LIMIT, far


def test_a_yarn_checkpoint_end_to_end(tmp_path, capsys):
    """A checkpoint whose config.json asks for YaRN: `lily check` says so, and `lily generate` (reference
    backend) gives the YaRN model's greedy tokens and log-probabilities, not plain RoPE's."""
    import json

    from helpers_ckpt import write_tiny_checkpoint
    from lily.cli import main
    from lily.model.reference import ReferenceModel

    c = _yarn_config(TINY, attention_factor=random.uniform(4.0, 6.0))
    path, weights = write_tiny_checkpoint(tmp_path / "yarn", c, seed=random.randrange(10_000), tokenizer=True)
    assert main(["check", str(path)]) == 0
    assert f"(RoPE yarn x{c.rope_scaling.factor:g} from {c.rope_scaling.original_max_position_embeddings:,})" in \
        capsys.readouterr().out
    prompt = [random.randrange(c.vocab_size) for _ in range(12)]
    assert main(["generate", "--model", str(path), "--backend", "reference", "--device", "cpu", "--ignore-eos",
                 "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "4", "--top-logprobs", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for config, same in ((c, True), (dataclasses.replace(c, rope_scaling=None), False)):
        model = ReferenceModel(config, weights)
        st = model.new_state()
        logits = model.forward(prompt, st)[-1]
        picked = []
        for _ in range(4):
            picked.append((int(logits.argmax()), float(logits.log_softmax(-1).max())))
            logits = model.forward([picked[-1][0]], st)[0]
        got = [(t, top[0][1]) for t, top in zip(out["tokens"], out["top_logprobs"])]
        close = [t == u and abs(a - b) < 1e-4 for (t, a), (u, b) in zip(got, picked)]
        assert all(close) if same else not all(close), (config.rope_scaling, got, picked)
