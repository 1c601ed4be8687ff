"""Every way an original release is refused, each from a real broken directory on disk: transformers
writes a tiny release, a copy of it is damaged, and load_checkpoint (what serve, generate and convert
read through) must raise CheckpointError with one line naming the file, field or tensor at fault."""

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

from helpers_ckpt import edit_config, same_weight
from helpers_ckpt import refused as refused_to_load
from helpers_original import fp8_copy, read_dir, replace_tensors, save_original
from lily.checkpoint import load_checkpoint
from lily.cli import main as lily_main
from lily.config import TINY

CONFIG = dataclasses.replace(TINY, mtp_num_hidden_layers=1)
P = "model.language_model."
NOT_CONVERTED = ("lm_head", "model.language_model.embed_tokens", "in_proj_a", "in_proj_b", "mlp.gate",
                 "mlp.shared_expert_gate", "mtp.fc")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    base = tmp_path_factory.mktemp("pristine")
    src = save_original(base / "bf16", CONFIG, torch.Generator().manual_seed(seed))
    return {"bf16": src, "fp8": fp8_copy(src, base / "fp8", NOT_CONVERTED)}


@pytest.fixture
def bf16(pristine, tmp_path):
    return shutil.copytree(pristine["bf16"], tmp_path / "bf16")


@pytest.fixture
def fp8(pristine, tmp_path):
    return shutil.copytree(pristine["fp8"], tmp_path / "fp8")


def refused(path, *needles) -> str:
    return refused_to_load(path, *needles, quantize_device="cpu")


def edit(path, fn):
    """Rewrite the directory's tensors through fn(dict) (mutate in place), keeping the config."""
    tmp = path.parent / (path.name + ".new")
    replace_tensors(path, tmp, fn)
    shutil.rmtree(path)
    tmp.rename(path)


def test_pristine_copies_load(pristine):
    for kind in ("bf16", "fp8"):
        assert load_checkpoint(pristine[kind], quantize_device="cpu").config == CONFIG


def test_another_model(bf16):
    edit_config(bf16, lambda c: c.update(model_type="qwen3_moe"))
    refused(bf16, "config.json", "model_type", "qwen3_moe")


def test_another_quantization_method(bf16):
    edit_config(bf16, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    refused(bf16, "config.json", "quant_method", "gptq")


def test_missing_shard(bf16):
    shard = next(bf16.glob("model*.safetensors"))
    shard.unlink()
    refused(bf16, "model.safetensors.index.json", shard.name, "does not exist")


def test_truncated_file(bf16):
    f = bf16 / "mtp.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) * 2 // 3])
    refused(bf16, "mtp.safetensors", "truncated")


def test_wrong_shape(bf16):
    name = P + "layers.1.linear_attn.in_proj_z.weight"
    edit(bf16, lambda t: t.update({name: torch.cat([t[name], t[name][:1]])}))
    refused(bf16, name, "shape", "expected [128, 128]")


def test_conv1d_in_the_mlx_orientation(bf16):
    name = P + "layers.0.linear_attn.conv1d.weight"
    edit(bf16, lambda t: t.update({name: t[name].transpose(1, 2).contiguous()}))
    refused(bf16, name, "[256, 4, 1]", "expected [256, 1, 4]")


def test_wrong_dtype(bf16):
    name = P + "layers.3.self_attn.q_norm.weight"
    edit(bf16, lambda t: t.update({name: t[name].to(torch.int32)}))
    refused(bf16, name, "I32", "expected a float")


def test_config_disagrees_with_the_tensors(bf16):
    edit_config(bf16, lambda c: c["text_config"].update(num_experts=16))
    refused(bf16, P + "layers.0.mlp.gate.weight", "[8, 128]", "expected [16, 128]")


def test_mtp_tensors_without_mtp_layers_in_the_config(bf16):
    edit_config(bf16, lambda c: c["text_config"].pop("mtp_num_hidden_layers"))
    refused(bf16, "mtp.", "MTP head", "mtp_num_hidden_layers")


def test_missing_expert(bf16):
    name = P + "layers.2.mlp.experts.5.up_proj.weight"
    edit(bf16, lambda t: t.pop(name))
    refused(bf16, "missing tensor", name)


def test_incomplete_mtp_head(bf16):
    name = "mtp.layers.0.self_attn.k_norm.weight"
    edit(bf16, lambda t: t.pop(name))
    refused(bf16, "missing tensor", name)


def test_unexpected_tensor(bf16):
    name = P + "layers.0.mlp.extra_proj.weight"
    edit(bf16, lambda t: t.update({name: torch.randn(4, 4)}))
    refused(bf16, "unexpected tensor", name)


def test_fp8_weight_without_its_scales(fp8):
    name = P + "layers.1.linear_attn.out_proj.weight_scale_inv"
    edit(fp8, lambda t: t.pop(name))
    refused(fp8, "missing tensor", name)


def test_fp8_scales_of_the_wrong_shape(fp8):
    name = P + "layers.3.self_attn.q_proj.weight_scale_inv"
    edit(fp8, lambda t: t.update({name: t[name][:2]}))
    refused(fp8, name, "F32[2, 1]", "expected a float [4, 1]")


def test_fp8_in_a_module_left_unconverted(fp8):
    name = P + "layers.0.linear_attn.in_proj_a.weight"
    edit(fp8, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn),
                                  name + "_scale_inv": torch.ones(1, 1)}))
    refused(fp8, name, "modules_to_not_convert")


def test_fp8_weights_in_a_bf16_release(fp8):
    edit_config(fp8, lambda c: c.pop("quantization_config"))
    refused(fp8, "F8_E4M3", "no FP8 quantization_config")


def test_fp8_block_size_missing(fp8):
    edit_config(fp8, lambda c: c["quantization_config"].pop("weight_block_size"))
    refused(fp8, "config.json", "weight_block_size")


def test_mlx_tensors_without_their_quantization_block(bf16, tmp_path):
    """An MLX conversion whose config.json lost its quantization block is not taken for an original."""
    from helpers_ckpt import write_tiny_checkpoint

    path, _ = write_tiny_checkpoint(tmp_path / "mlx", seed=1)
    edit_config(path, lambda c: (c.pop("quantization"), c.pop("quantization_config")))
    refused(path, "config.json", "quantization", ".scales")


def test_convert_refuses_before_writing(bf16, tmp_path, capsys):
    name = P + "layers.2.linear_attn.dt_bias"
    edit(bf16, lambda t: t.pop(name))
    assert lily_main(["convert", str(bf16), str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing tensor" in err and name in err
    assert not (tmp_path / "out").exists()
    assert set(read_dir(bf16)) and not list(tmp_path.glob(".*lily-convert*"))


def test_null_eos_reads_as_absent_through_check_and_convert(bf16, tmp_path, capsys):
    """transformers 5 saves a Qwen3_5MoeConfig with text_config.eos_token_id null and none at the top: check,
    convert and the converted output read it as the model's default ids, as with the key left out."""
    from lily.checkpoint import read_config

    edit_config(bf16, lambda c: (c.pop("eos_token_id", None), c["text_config"].pop("eos_token_id", None)))
    absent = read_config(bf16).eos_token_ids
    edit_config(bf16, lambda c: c["text_config"].update(eos_token_id=None))
    assert read_config(bf16).eos_token_ids == absent
    out = tmp_path / "out"
    for argv in (["check", str(bf16)], ["convert", str(bf16), str(out), "--device", "cpu"], ["check", str(out)]):
        assert lily_main(argv) == 0, capsys.readouterr().err
    assert read_config(out).eos_token_ids == absent


@pytest.mark.parametrize("edit", [
    lambda d: (d / "tokenizer.json").unlink(),
    lambda d: (d / "chat_template.jinja").write_text("{{ raise_exception('no chats here') }}"),
    lambda d: (d / "generation_config.json").write_text('{"temperature": "hot"}'),
])
def test_convert_refuses_what_check_would_refuse_in_its_output(bf16, tmp_path, capsys, edit):
    """The tokenizer files are copied as they are: a source whose output lily check / serve would refuse
    is refused up front, with check's line, and nothing is written."""
    edit(bf16)
    assert lily_main(["check", str(bf16)]) == 2
    says = capsys.readouterr().err.strip().split(": error: ", 1)[1]
    assert lily_main(["convert", str(bf16), str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"lily convert: error: {says}\n"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*lily-convert*"))


# -- the output's size, and a disk too small for it --------------------------------------------------------------

def data_bytes(d) -> int:
    """The tensor data in a directory's safetensors files (each file less its 8-byte length and its header)."""
    import struct

    total = 0
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_the_output_size_is_known_from_the_shapes(pristine, tmp_path, kind):
    """What convert writes is known before it starts, from the tensors' shapes (4-bit codes and a bf16 scale and
    bias per 64, 8-bit router gates, the rest bf16): exactly, for the tensor data, whatever the source's dtype."""
    from lily.checkpoint import convert_checkpoint
    from lily.checkpoint.loading import inspect_original
    from lily.checkpoint.quantize_at_load import converted_bytes
    from lily.convert import output_bytes

    _, jobs, _ = inspect_original(pristine[kind])
    out = convert_checkpoint(pristine[kind], tmp_path / "out", device="cpu", shard_bytes=100_000 * random.randint(1, 4))
    assert converted_bytes(jobs) == data_bytes(out)
    written = sum(f.stat().st_size for f in out.iterdir())
    assert written <= output_bytes(pristine[kind], jobs) <= written + (200 << 10)


def test_convert_refuses_a_disk_too_small_for_an_fp8_release(pristine, fp8, tmp_path, monkeypatch, capsys):
    """An FP8 release reads 8 bits a weight and writes 4.5 (a third of the source is a bf16 release's measure):
    a disk with one byte less than the output needs is refused up front, measured where OUT will be made (its
    nearest existing folder when OUT's parent does not exist yet), and nothing is written."""
    import shutil as sh

    from lily.checkpoint import convert_checkpoint

    written = sum(f.stat().st_size for f in convert_checkpoint(fp8, tmp_path / "probe", device="cpu").iterdir())
    sh.rmtree(tmp_path / "probe")
    asked, usage = [], type(sh.disk_usage(tmp_path))

    def disk_usage(path):
        asked.append(Path(path))
        return usage(10**12, 10**12 - written + 1, written - 1)

    monkeypatch.setattr("lily.convert.shutil.disk_usage", disk_usage)
    base = tmp_path / "run"
    base.mkdir()
    out = base / "not" / "yet" / "out"
    assert lily_main(["convert", str(fp8), str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"lily convert: error: {base}: ") and "free, the converted checkpoint needs about" in err, err
    assert "larger disk" in err
    assert asked == [base] and list(base.iterdir()) == []


SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors 0.8


def fail_saving(monkeypatch):
    """safetensors' save_file as it fails on a full disk: a partial file, then its SafetensorError."""
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * random.randint(1, 4096))
        raise SafetensorError(SAFETENSORS_ENOSPC)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def fail_copying(monkeypatch):
    """The tokenizer files' copy, once the shards took the last of the disk."""
    import errno
    import os

    def copyfile(src, dst, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr("lily.checkpoint.quantize_at_load.shutil.copyfile", copyfile)


@pytest.mark.parametrize("fail", [fail_saving, fail_copying])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_a_disk_that_fills_while_writing(pristine, tmp_path, monkeypatch, capsys, fail, kind):
    """The check passed but the disk filled anyway (another writer): one line, exit 2, and the partial output
    and the folders made for it are gone."""
    fail(monkeypatch)
    out = tmp_path / "made" / "out"
    assert lily_main(["convert", str(pristine[kind]), str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"lily convert: error: {tmp_path}: No space left on device while writing the converted "
                          "checkpoint"), err
    assert "the partial output was removed" in err and "larger disk" in err
    assert list(tmp_path.iterdir()) == []


def test_convert_to_an_existing_file(bf16, tmp_path, capsys):
    f = tmp_path / f"out-{random.randrange(1000)}"
    f.write_text("something")
    assert lily_main(["convert", str(bf16), str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"lily convert: error: {f} exists and is a file, not a directory: give a new or empty directory " \
                  "for the output\n"
    assert f.read_text() == "something"


def test_an_empty_quantization_config_is_no_quantization(bf16, capsys):
    """A bf16 release whose config.json carries `"quantization_config": {}` is an original release, not an MLX
    checkpoint: it is quantised at load, to the same weights as without the block."""
    from lily.checkpoint import checkpoint_kind

    plain = load_checkpoint(bf16, quantize_device="cpu").weights
    edit_config(bf16, lambda c: c.update(quantization_config={}))
    assert checkpoint_kind(bf16).startswith("original release")
    assert lily_main(["check", str(bf16)]) == 0, capsys.readouterr().err
    loaded = load_checkpoint(bf16, quantize_device="cpu").weights
    assert set(loaded) == set(plain) and all(same_weight(loaded[k], plain[k]) for k in plain)
