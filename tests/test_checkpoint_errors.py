"""Every way the loader refuses a checkpoint, each made from a real broken directory on disk: a tiny
checkpoint is written, then damaged; load_checkpoint must raise CheckpointError with one line that
names the file / field / tensor at fault (and never a raw KeyError, JSONDecodeError or safetensors error)."""

import json
import shutil
import struct

import pytest
import torch

from helpers_ckpt import edit_config, edit_tensors, refused, write_tiny_checkpoint
from lily.checkpoint import load_checkpoint
from lily.config import TINY
from lily.quant import quantize

L = "language_model.model."


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    path, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt", seed=seed)
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of the good checkpoint to break."""
    return shutil.copytree(pristine, tmp_path / "ckpt")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path, _ = write_tiny_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", seed=3, shard_bytes=200_000)
    return path


def edit_header(file, fn):
    """Rewrite a safetensors header through fn(dict), keeping the data section as it was."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


# -- the directory and config.json ---------------------------------------------------------------------

def test_not_a_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    refused(f, str(f), "not a directory")


def test_no_such_directory(tmp_path):
    refused(tmp_path / "nope", "nope", "no such directory")


def test_no_config(ckpt):
    (ckpt / "config.json").unlink()
    refused(ckpt, "no config.json")


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe", ')
    refused(ckpt, "config.json", "invalid JSON")


@pytest.mark.parametrize("text, kind", [("[]", "list"), ('"qwen3_5_moe"', "str"), ("7", "int")])
def test_config_json_not_an_object(ckpt, text, kind):
    (ckpt / "config.json").write_text(text)
    refused(ckpt, "config.json", f"expected a JSON object, found {kind}")


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, lambda c: c.update(model_type="llama"))
    refused(ckpt, "config.json", "model_type", "llama")


@pytest.mark.parametrize("change, needle", [
    (lambda q: q.update(bits=8), "bits=8"),
    (lambda q: q.update(group_size=32), "group_size=32"),
    (lambda q: q.update(mode="mxfp4"), "mxfp4"),
])
def test_unsupported_quantization(ckpt, change, needle):
    def edit(c):
        change(c["quantization"])
        change(c["quantization_config"])
    edit_config(ckpt, edit)
    refused(ckpt, "config.json", needle)


def test_not_quantized(ckpt):
    edit_config(ckpt, lambda c: (c.pop("quantization"), c.pop("quantization_config")))
    refused(ckpt, "config.json", "quantization")


def test_per_module_override_to_other_bits(ckpt):
    key = L + "layers.0.linear_attn.in_proj_qkv"
    edit_config(ckpt, lambda c: c["quantization"].update({key: {"group_size": 64, "bits": 6}}))
    refused(ckpt, "config.json", key)


def test_config_field_wrong_type(ckpt):
    edit_config(ckpt, lambda c: c["text_config"].update(num_experts="eight"))
    refused(ckpt, "config.json", "num_experts")


@pytest.mark.parametrize("field, value, tensor", [
    ("moe_intermediate_size", 128, L + "layers.0.mlp.switch_mlp.gate_proj"),
    ("vocab_size", 640, L + "embed_tokens"),
    ("linear_num_value_heads", 8, L + "layers.0.linear_attn.in_proj_qkv"),
])
def test_config_lies_about_a_dimension(ckpt, field, value, tensor):
    edit_config(ckpt, lambda c: c["text_config"].update({field: value}))
    refused(ckpt, tensor, "shape", "expected")


# -- tensors ---------------------------------------------------------------------------------------------

def test_missing_tensor(ckpt):
    name = L + "layers.1.linear_attn.A_log"
    edit_tensors(ckpt, lambda t: t.pop(name))
    refused(ckpt, "missing tensor", name)


def test_missing_part_of_quantized_module(ckpt):
    name = L + "layers.3.self_attn.o_proj.biases"
    edit_tensors(ckpt, lambda t: t.pop(name))
    refused(ckpt, "missing tensor", name)


def test_unexpected_tensor(ckpt):
    name = L + "layers.0.mlp.extra_proj.weight"
    edit_tensors(ckpt, lambda t: t.update({name: torch.randn(4, 4)}))
    refused(ckpt, "model.safetensors", "unexpected tensor", name)


def test_plain_tensor_wrong_dtype(ckpt):
    name = L + "layers.2.linear_attn.norm.weight"
    edit_tensors(ckpt, lambda t: t.update({name: t[name].to(torch.int32)}))
    refused(ckpt, name, "I32", "expected a float")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_float_tensors_in_other_dtypes_are_upcast(ckpt, dtype):
    """A_log stored in half precision (what converting a bf16 source writes) is read, not refused: in memory
    it is float32, holding exactly the stored values; so is dt_bias stored in float32."""
    a_log, dt_bias = L + "layers.2.linear_attn.A_log", L + "layers.1.linear_attn.dt_bias"
    stored = {}

    def edit(t):
        stored[a_log], stored[dt_bias] = t[a_log].to(dtype), t[dt_bias].float() + 1e-3  # not bf16-representable
        t.update(stored)
    edit_tensors(ckpt, edit)
    w = load_checkpoint(ckpt).weights
    for name in (a_log, dt_bias):
        key = name[len(L):]
        assert w[key].dtype == torch.float32 and torch.equal(w[key], stored[name].float()), key


def test_scales_wrong_dtype(ckpt):
    name = L + "layers.0.mlp.shared_expert.up_proj.scales"
    edit_tensors(ckpt, lambda t: t.update({name: t[name].to(torch.float16)}))
    refused(ckpt, name, "F16", "expected BF16")


def test_packed_weight_wrong_dtype(ckpt):
    name = "language_model.lm_head.weight"  # the head lives outside language_model.model.
    edit_tensors(ckpt, lambda t: t.update({name: t[name].view(torch.int32)}))
    refused(ckpt, name, "I32", "expected U32")


def test_plain_tensor_wrong_shape(ckpt):
    name = L + "layers.0.linear_attn.conv1d.weight"  # MLX stores [C, K, 1]; HF's [C, 1, K] is refused
    edit_tensors(ckpt, lambda t: t.update({name: t[name].reshape(t[name].shape[0], 1, -1)}))
    refused(ckpt, name, "shape", str([TINY.linear_conv_dim, TINY.linear_conv_kernel_dim, 1]))


def test_eight_bit_where_four_expected(ckpt):
    name = L + "layers.1.mlp.switch_mlp.down_proj"
    E, H, I = TINY.num_experts, TINY.hidden_size, TINY.moe_intermediate_size
    q = quantize(torch.randn(E, H, I) * I ** -0.5, bits=8)

    def put(t):
        t[name + ".weight"], t[name + ".scales"], t[name + ".biases"] = q.weight, q.scales, q.biases
    edit_tensors(ckpt, put)
    refused(ckpt, name + ".weight", "8-bit", "expected 4-bit")


def test_four_bit_router_where_eight_expected(ckpt):
    name = L + "layers.2.mlp.gate"
    q = quantize(torch.randn(TINY.num_experts, TINY.hidden_size) * 0.1, bits=4)

    def put(t):
        t[name + ".weight"], t[name + ".scales"], t[name + ".biases"] = q.weight, q.scales, q.biases
    edit_tensors(ckpt, put)
    refused(ckpt, name + ".weight", "4-bit", "expected 8-bit")


# -- damaged files -----------------------------------------------------------------------------------------

def test_truncated_shard(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    cut = int(torch.randint(len(data) // 2, len(data) - 1, ()).item())
    f.write_bytes(data[:cut])
    refused(ckpt, "model.safetensors", "truncated")


def test_truncated_inside_header(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    refused(ckpt, "model.safetensors", "header length")


def test_damaged_header_json(ckpt):
    f = ckpt / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"#garbage!#{{"
    f.write_bytes(bytes(raw))
    refused(ckpt, "model.safetensors", "corrupt", "JSON")


def test_header_offsets_disagree_with_shape(ckpt):
    name = L + "layers.0.input_layernorm.weight"
    edit_header(ckpt / "model.safetensors", lambda h: h[name].update(shape=[TINY.hidden_size * 2]))
    refused(ckpt, "model.safetensors", name, "data_offsets")


def test_header_unknown_dtype(ckpt):
    name = L + "norm.weight"
    edit_header(ckpt / "model.safetensors", lambda h: h[name].update(dtype="Q4"))
    refused(ckpt, "model.safetensors", name, "Q4")


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    refused(ckpt, "no *.safetensors")


def test_index_names_missing_shard(sharded, tmp_path):
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    refused(ckpt, "model.safetensors.index.json", shards[1].name, "does not exist")


def test_index_puts_tensor_in_wrong_shard(sharded, tmp_path):
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    index = ckpt / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    name = L + "layers.0.input_layernorm.weight"
    other = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    idx["weight_map"][name] = other
    index.write_text(json.dumps(idx))
    refused(ckpt, "index", name, other)


def test_invalid_index_json(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    refused(ckpt, "model.safetensors.index.json", "invalid index")


def test_tensor_missing_from_index(ckpt):
    index = ckpt / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    name = L + "layers.0.mlp.gate.scales"
    del idx["weight_map"][name]
    index.write_text(json.dumps(idx))
    refused(ckpt, name, "not listed")
