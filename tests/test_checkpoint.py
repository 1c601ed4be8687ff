"""Checkpoint writing and loading: round trips (single file and sharded), skipped weights, progress,
the MLX on-disk details, the synthetic weights' conditioning, and the `lily check` / `make-synthetic`
commands."""

import dataclasses
import json
import os
import random
import shutil
import stat

import mlx.core as mx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers_ckpt import as_loaded, random_prompt, same_weight, write_tiny_checkpoint
from helpers_mlx import to_torch
from lily.checkpoint import (expected_tensors, load_checkpoint, mlx_name, read_safetensors_header,
                             write_checkpoint)
from lily.cli import main as lily_main
from lily.config import TINY, with_layers
from lily.quant import QuantTensor
from lily.synthetic import random_weights


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def test_round_trip_single_file(tmp_path):
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed())
    ckpt = load_checkpoint(path)
    assert ckpt.config == TINY and ckpt.path == path and ckpt.tokenizer_dir is None
    assert list(ckpt.weights) == list(expected_tensors(TINY))  # documented order, nothing extra
    for key, w in as_loaded(weights).items():
        assert same_weight(ckpt.weights[key], w), key
    c = TINY
    assert ckpt.weights["layers.0.linear_attn.conv1d.weight"].shape == (c.linear_conv_dim, c.linear_conv_kernel_dim)
    assert ckpt.weights["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert ckpt.weights["layers.0.linear_attn.dt_bias"].dtype == torch.float32
    assert ckpt.weights["layers.0.mlp.gate"].bits == 8 and ckpt.weights["layers.0.mlp.shared_expert_gate"].bits == 8
    assert ckpt.weights["layers.3.mlp.switch_mlp.down_proj"].shape == (c.num_experts, c.hidden_size,
                                                                         c.moe_intermediate_size)


def test_mlx_reads_what_lily_writes(tmp_path):
    """mlx, the format's own implementation, loads lily's files (sharded) and its mx.dequantize gives
    exactly lily's values for every quantized module; every other tensor is the same bits."""
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed(), shard_bytes=150_000)
    arrays = {}
    for shard in sorted(path.glob("*.safetensors")):
        arrays.update(mx.load(str(shard)))
    for key, w in weights.items():
        name = mlx_name(key)
        if isinstance(w, QuantTensor):
            theirs = mx.dequantize(arrays[name + ".weight"], arrays[name + ".scales"], arrays[name + ".biases"],
                                   group_size=w.group_size, bits=w.bits)
            assert torch.equal(to_torch(theirs), w.dequantize(torch.bfloat16)), key
        else:
            theirs = to_torch(arrays[name])
            if key.endswith("conv1d.weight"):  # MLX keeps [C, K, 1]
                theirs = theirs[..., 0]
            assert theirs.dtype == w.dtype and torch.equal(theirs, w), key


def test_on_disk_format_is_mlxs(tmp_path):
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed())
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(names.values()) == {"model.safetensors"}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "mlx"}
        assert set(f.keys()) == set(names)
        conv = f.get_tensor("language_model.model.layers.0.linear_attn.conv1d.weight")
        assert conv.shape == (TINY.linear_conv_dim, TINY.linear_conv_kernel_dim, 1)
        head = f.get_tensor("language_model.lm_head.weight")
        assert head.dtype == torch.uint32 and head.shape == (TINY.vocab_size, TINY.hidden_size // 8)
        gate = f.get_tensor("language_model.model.layers.1.mlp.gate.weight")
        assert gate.shape == (TINY.num_experts, TINY.hidden_size // 4)  # 8-bit: 4 codes a word
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["quantization"] == cfg["quantization_config"]


def test_round_trip_sharded(tmp_path):
    limit = 150_000
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed(), shard_bytes=limit)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 4 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    for s in shards:
        tensors = read_safetensors_header(s)
        assert sum(t.nbytes for t in tensors.values()) <= limit or len(tensors) == 1
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    ckpt = load_checkpoint(path)
    for key, w in as_loaded(weights).items():
        assert same_weight(ckpt.weights[key], w), key


def test_loads_without_index(tmp_path):
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed())
    (path / "model.safetensors.index.json").unlink()
    ckpt = load_checkpoint(path)
    assert same_weight(ckpt.weights["lm_head"], weights["lm_head"])


def test_vision_and_foreign_mtp_weights_are_skipped(tmp_path):
    path, weights = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed())
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    extra = {"vision_tower.blocks.0.attn.qkv.weight": torch.randn(6, 4),
             "model.visual.patch_embed.proj.weight": torch.randn(4, 3),
             "language_model.mtp.fc.weight": torch.randn(4, 8),          # an MTP head in another layout
             "language_model.model.mtp.norm.weight": torch.randn(4)}
    save_file({**tensors, **extra}, str(f), metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    idx["weight_map"].update({k: "model.safetensors" for k in extra})
    index.write_text(json.dumps(idx))
    ckpt = load_checkpoint(path)
    assert list(ckpt.weights) == list(expected_tensors(TINY))
    assert same_weight(ckpt.weights["embed_tokens"], weights["embed_tokens"])


def test_mtp_head_round_trip(tmp_path):
    """lily's MTP head (`mtp.*`, 4-bit, 8-bit gates) is written and loaded whole, after the main weights."""
    config = dataclasses.replace(TINY, mtp_num_hidden_layers=1)
    weights = random_weights(config, seed=fresh_seed(), mtp=True)
    path = write_checkpoint(tmp_path / "ckpt", config, weights, shard_bytes=200_000)
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"mtp.fc.weight", "mtp.fc.scales", "mtp.norm.weight", "mtp.layers.0.mlp.switch_mlp.gate_proj.biases",
            "mtp.layers.0.self_attn.q_norm.weight"} <= set(names)
    quant = json.loads((path / "config.json").read_text())["quantization"]
    assert quant["mtp.layers.0.mlp.gate"]["bits"] == quant["mtp.layers.0.mlp.shared_expert_gate"]["bits"] == 8
    ckpt = load_checkpoint(path)
    assert list(ckpt.weights) == list(expected_tensors(config, mtp=True))
    assert list(ckpt.weights)[-1] == "mtp.norm.weight" and ckpt.weights["mtp.layers.0.mlp.gate"].bits == 8
    for key, w in as_loaded(weights).items():
        assert same_weight(ckpt.weights[key], w), key
    # the same config without MTP tensors loads too (the MLX release keeps mtp_num_hidden_layers: 1)
    plain = write_checkpoint(tmp_path / "plain", config, {k: w for k, w in weights.items() if not k.startswith("mtp.")})
    assert not any(k.startswith("mtp.") for k in load_checkpoint(plain).weights)


def test_progress_reports_every_tensor(tmp_path):
    path, _ = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed(), shard_bytes=300_000)
    calls = []
    load_checkpoint(path, progress=lambda *a: calls.append(a))
    stored = {}
    for s in path.glob("*.safetensors"):
        stored.update(read_safetensors_header(s))
    n, nbytes = len(stored), sum(t.nbytes for t in stored.values())
    assert len(calls) == n
    assert calls[-1] == (n, n, nbytes, nbytes)
    assert all(a[0] < b[0] and a[2] < b[2] for a, b in zip(calls, calls[1:]))


def test_quantized_weights_keep_mlx_layout(tmp_path):
    path, _ = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed())
    for key, w in load_checkpoint(path).weights.items():
        if isinstance(w, QuantTensor):
            *lead, out, n_in = w.shape
            assert w.weight.dtype == torch.uint32 and w.weight.shape == (*lead, out, n_in * w.bits // 32), key
            assert w.scales.dtype == w.biases.dtype == torch.bfloat16
            assert w.scales.shape == (*lead, out, n_in // 64), key
            assert w.weight.is_contiguous()
        assert mlx_name(key).startswith("language_model.")


def test_write_refuses_weights_that_do_not_match_config(tmp_path):
    weights = random_weights(TINY, seed=fresh_seed())
    del weights["layers.2.linear_attn.dt_bias"]
    with pytest.raises(ValueError, match="dt_bias"):
        write_checkpoint(tmp_path / "x", TINY, weights)


# -- synthetic weights ---------------------------------------------------------------------------

def test_random_weights_are_deterministic_and_seeded():
    a, b = random_weights(TINY, seed=5), random_weights(TINY, seed=5)
    c = random_weights(TINY, seed=6)
    assert all(same_weight(a[k], b[k]) for k in a)
    assert not same_weight(a["layers.0.linear_attn.in_proj_qkv"], c["layers.0.linear_attn.in_proj_qkv"])
    A = torch.exp(a["layers.1.linear_attn.A_log"])
    assert A.dtype == torch.float32 and (A >= 1 - 1e-4).all() and (A <= 16 + 1e-3).all()


def test_synthetic_model_is_well_conditioned():
    """Activations stay O(1), routing and logits are decisive, and bf16 mostly agrees with fp32."""
    from lily.model import reference
    config = with_layers(TINY, 8)
    weights = random_weights(config, seed=fresh_seed())
    ids = torch.tensor(random_prompt(48, config.vocab_size, fresh_seed()))
    m32 = reference.ReferenceModel(config, weights, dtype=torch.float32)
    m16 = reference.ReferenceModel(config, weights, dtype=torch.bfloat16)
    l32 = m32.forward(ids, m32.new_state())
    l16 = m16.forward(ids, m16.new_state())
    assert torch.isfinite(l32).all()
    std = l32.std(-1)
    assert (std > 0.5).all() and (std < 30).all(), std
    p = torch.softmax(l32, -1)
    assert p.max(-1).values.mean() > 0.1  # not flat: greedy decoding means something
    agree = (l32.argmax(-1) == l16.argmax(-1)).float().mean()
    assert agree >= 0.8, f"bf16 and fp32 pick the same token only {agree:.0%} of the time"


# -- commands --------------------------------------------------------------------------------------------

def test_make_synthetic_command(tmp_path, capsys):
    out = tmp_path / "tiny"
    seed = fresh_seed()
    assert lily_main(["make-synthetic", "--preset", "tiny", "--seed", str(seed), str(out)]) == 0
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    ckpt = load_checkpoint(out)
    assert ckpt.tokenizer_dir == out
    expect = as_loaded(random_weights(TINY, seed=seed))
    assert all(same_weight(ckpt.weights[k], expect[k]) for k in expect)
    # refuses to write over something
    assert lily_main(["make-synthetic", "--preset", "tiny", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert lily_main(["make-synthetic", "--device", "cuda", str(tmp_path / "gpu")]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_make_synthetic_streams_weight_by_weight(tmp_path, monkeypatch):
    """Each weight is written before the next is made (memory holds one shard and one weight, never the
    model), the progress bar starts at zero before any work, and its total is the bytes written."""
    import lily.progress
    import lily.synthetic as synthetic
    from lily.checkpoint.mlx_format import ShardWriter

    made, calls = [], []
    real_tensor, real_add = synthetic.random_tensor, ShardWriter.add

    def counting_tensor(key, *a, **k):
        made.append(key)
        return real_tensor(key, *a, **k)

    owner = {}  # MLX tensor name -> the weight it belongs to
    for spec in expected_tensors(TINY).values():
        for suffix in ((".weight", ".scales", ".biases") if spec.quantized else ("",)):
            owner[spec.mlx_name + suffix] = spec.key

    def checking_add(self, name, t):
        assert made[-1] == owner[name], (made[-1], name)  # the weight being written is the last one made
        real_add(self, name, t)

    monkeypatch.setattr(synthetic, "random_tensor", counting_tensor)
    monkeypatch.setattr(ShardWriter, "add", checking_add)
    monkeypatch.setattr(lily.progress, "bytes_progress", lambda what: lambda *a: calls.append((len(made), *a)))
    seed = fresh_seed()
    out = synthetic.make_synthetic("tiny", tmp_path / "tiny", seed=seed, shard_bytes=200_000)
    n = len(expected_tensors(TINY))
    total = synthetic.checkpoint_bytes(TINY)
    assert calls[0] == (0, 0, n, 0, total)  # shown before the first weight is made
    assert calls[-1][1:] == (n, n, total, total) and len(calls) == n + 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total and len(set(index["weight_map"].values())) > 3
    ckpt = load_checkpoint(out)
    expect = as_loaded(random_weights(TINY, seed=seed))
    assert all(same_weight(ckpt.weights[k], expect[k]) for k in expect)


def test_check_command(tmp_path, capsys):
    path, _ = write_tiny_checkpoint(tmp_path / "ckpt", seed=fresh_seed(), tokenizer=True)
    assert lily_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "4 layers" in out and "182 tensors" in out and "tokenizer: 508 tokens" in out
    assert lily_main(["check", "--load", str(path)]) == 0
    capsys.readouterr()

    broken = shutil.copytree(path, tmp_path / "broken")
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    assert lily_main(["check", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "truncated" in err and "model.safetensors" in err


@pytest.fixture
def random_umask():
    """A umask under which 0600 is not what a new file gets, restored after the test."""
    mask = random.choice((0o022, 0o002, 0o027, 0o007))
    old = os.umask(mask)
    yield mask
    os.umask(old)


def test_make_synthetic_weights_get_the_umask_like_the_other_files(tmp_path, random_umask):
    # safetensors' save_file makes its file 0600: another user or a container uid could not read the weights
    out = tmp_path / "tiny"
    assert lily_main(["make-synthetic", "--seed", str(fresh_seed()), "--preset", "tiny", str(out)]) == 0
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~random_umask}, {k: oct(v) for k, v in modes.items()}
    assert "model.safetensors" in modes
