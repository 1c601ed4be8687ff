"""Checkpoints mlx-lm loads (or a user reasonably hands lily) that lily does not run as they are: each is refused
by `lily check` / `serve` / `generate` with one line, exit 2, no traceback, naming the cause and what to do
instead; and the few lily can run after all (a flat qwen3_5_moe config, a partial or foreign MTP head) are run.
The 8-bit, group-32, float16 and mixed-precision directories are mlx_lm.convert's own output."""

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_ckpt import as_loaded, edit_config, edit_tensors, same_weight, write_tiny_checkpoint
from helpers_original import fused_copy, save_original
from lily.checkpoint import load_checkpoint
from lily.cli import main
from lily.config import TINY
from lily.quant import quantize

L = "language_model.model."
REMEDY = "mlx_lm.convert -q --q-bits 4 --q-group-size 64"


def fresh_seed() -> int:
    return random.randrange(2**31 - 1)


def one_error_line(capsys, command: str = "check") -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith(f"lily {command}: error: "), err
    return err


def refused_by_check(path, capsys, *needles) -> str:
    assert main(["check", str(path)]) == 2
    line = one_error_line(capsys)
    print(line)
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """A tiny original release (transformers' save, experts fused as mlx-lm reads them)."""
    base = tmp_path_factory.mktemp("src")
    seed = fresh_seed()
    print(f"seed {seed}")
    return fused_copy(save_original(base / "per_expert", TINY, torch.Generator().manual_seed(seed)), base / "fused")


def mlx_lm_convert(src, out, **kw):
    from mlx_lm.convert import convert

    kw.setdefault("dtype", "bfloat16")
    convert(str(src), str(out), quantize=True, **kw)
    return out


@pytest.fixture(scope="module")
def mlx_ckpt(tmp_path_factory):
    path, weights = write_tiny_checkpoint(tmp_path_factory.mktemp("mlx") / "ckpt", seed=fresh_seed(), tokenizer=True)
    return path, weights


@pytest.fixture
def ckpt(mlx_ckpt, tmp_path):
    return shutil.copytree(mlx_ckpt[0], tmp_path / "ckpt")


# -- quantized otherwise than lily runs it ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, says", [
    (dict(q_bits=8, q_group_size=64), "bits=8"),
    (dict(q_bits=4, q_group_size=32), "group_size=32"),
    (dict(q_bits=4, q_group_size=64, quant_predicate="mixed_4_6"), "mixed-precision"),
])
def test_mlx_lm_quantizations_lily_does_not_run_say_how_to_make_the_one_it_does(fused, tmp_path, capsys, kw, says):
    d = mlx_lm_convert(fused, tmp_path / "mlx", **kw)
    refused_by_check(d, capsys, "config.json", says, REMEDY, "`lily convert` the original release")


def test_float16_scales_name_the_dtype_flag(fused, tmp_path, capsys):
    """mlx_lm.convert --dtype float16 stores the scales and biases in float16; lily runs bf16 ones (refused
    rather than rounded to bf16: lily's weights are bit for bit what mlx-lm runs)."""
    d = mlx_lm_convert(fused, tmp_path / "mlx", q_bits=4, q_group_size=64, dtype="float16")
    refused_by_check(d, capsys, ".scales", "F16", "--dtype float16", f"{REMEDY} --dtype bfloat16")


def test_four_bit_router_gates_without_their_entries(ckpt, capsys):
    """A converter that quantized the router gates at 4 bits and wrote no per-layer entry (mlx-lm then reads them
    at the base 4 bits): the line names the tensor and says what config.json says of it."""
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    gates = [k[:-len(".weight")] for k in tensors if k.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))]
    for m in gates:
        w = torch.randn(tensors[m + ".weight"].shape[0], TINY.hidden_size) * 0.1
        q = quantize(w, bits=4)
        tensors[m + ".weight"], tensors[m + ".scales"], tensors[m + ".biases"] = q.weight, q.scales, q.biases
    save_file(tensors, str(f), metadata={"format": "mlx"})
    edit_config(ckpt, lambda c: [c[k].update({"group_size": 64, "bits": 4, "mode": "affine"})
                                 or [c[k].pop(g) for g in list(c[k]) if isinstance(c[k][g], dict)]
                                 for k in ("quantization", "quantization_config")])
    first = L + "layers.0.mlp.gate"
    refused_by_check(ckpt, capsys, first + ".weight", "is 4-bit", f"no entry for {first}", "8-bit router gates",
                     REMEDY)


# -- config.json -------------------------------------------------------------------------------------------------

def flatten(c):
    text = c.pop("text_config")
    c.update({k: v for k, v in text.items() if k != "model_type"})


def test_flat_qwen3_5_moe_config_is_read_as_transformers_reads_it(mlx_ckpt, ckpt, capsys):
    """model_type qwen3_5_moe with the text model's fields at the top level (no text_config)."""
    edit_config(ckpt, flatten)
    assert main(["check", str(ckpt)]) == 0, capsys.readouterr().err
    loaded = load_checkpoint(ckpt)
    assert loaded.config == TINY
    expected = as_loaded(mlx_ckpt[1])
    assert all(same_weight(loaded.weights[k], expected[k]) for k in expected)


def test_flat_config_missing_fields_says_which(ckpt, capsys):
    gone = random.choice(["hidden_size", "num_experts", "vocab_size"])
    edit_config(ckpt, lambda c: (flatten(c), c.pop(gone)))
    refused_by_check(ckpt, capsys, "config.json", "text_config", f"missing: {gone}")


# -- not the weights, not a directory ----------------------------------------------------------------------------

LFS = ("version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {}\n")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_git_lfs_pointer_in_place_of_a_file(ckpt, capsys, name):
    (ckpt / name).write_text(LFS.format("%064x" % random.getrandbits(256), random.randrange(10**6, 10**10)))
    refused_by_check(ckpt, capsys, name, "Git LFS pointer, not the weights", "git lfs pull")


@pytest.mark.parametrize("argv, command, says", [
    (["check", "{repo}"], "check", "{repo}: no such directory"),
    (["serve", "--model", "{repo}", "--port", "0"], "serve", "--model {repo}: no such directory"),
    (["generate", "--model", "{repo}", "--prompt-ids", "1"], "generate", "--model {repo}: not a directory"),
    (["convert", "{repo}", "{out}", "--device", "cpu"], "convert", "{repo}: no such directory"),
])
def test_hugging_face_repo_id_given_for_a_directory(tmp_path, monkeypatch, capsys, argv, command, says):
    monkeypatch.chdir(tmp_path)
    repo = f"Qwen{random.randrange(100)}/Qwen3.6-35B-A3B-{random.choice(['FP8', 'Base', 'x'])}"
    fill = {"repo": repo, "out": str(tmp_path / "out")}
    assert main([a.format(**fill) for a in argv]) == 2
    line = one_error_line(capsys, command)
    assert says.format(**fill) in line and "local checkpoint directory" in line, line
    assert f"`hf download {repo} --local-dir DIR`" in line, line


def test_a_missing_local_path_gets_no_repo_advice(tmp_path, capsys):
    assert main(["check", str(tmp_path / "a" / "b")]) == 2
    line = one_error_line(capsys)
    assert "no such directory" in line and "hf download" not in line


# -- the MTP head lily does not run -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """An MLX checkpoint whose config has an MTP layer, and lily's whole MTP head."""
    from lily.checkpoint import write_checkpoint
    from lily.demo_tokenizer import write_tokenizer_files
    from lily.synthetic import random_weights

    config = dataclasses.replace(TINY, mtp_num_hidden_layers=1)
    weights = random_weights(config, seed=fresh_seed(), mtp=True)
    path = write_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", config, weights)
    write_tokenizer_files(path)
    return path, weights


def drop_one_mtp_tensor(t):
    t.pop(random.choice(sorted(k for k in t if k.startswith("mtp."))))


def keep_only_a_foreign_fc(t):
    for k in [k for k in t if k.startswith("mtp.")]:
        t.pop(k)
    t["mtp.fc.weight"] = torch.randn(TINY.hidden_size, 2 * TINY.hidden_size).to(torch.bfloat16)  # unquantized


@pytest.mark.parametrize("edit", [drop_one_mtp_tensor, keep_only_a_foreign_fc])
def test_partial_or_foreign_mtp_head_is_skipped_with_one_warning(with_mtp, tmp_path, capsys, edit):
    d = shutil.copytree(with_mtp[0], tmp_path / "ckpt")
    edit_tensors(d, edit)
    assert main(["check", str(d)]) == 0
    captured = capsys.readouterr()
    warning = captured.err.strip()
    assert warning.count("\n") == 0 and warning.startswith("lily check: warning: "), captured.err
    assert "MTP head" in warning and "skipping" in warning and "lily does not run it" in warning, warning
    assert "with the MTP head" not in captured.out
    loaded = load_checkpoint(d)
    expected = {k: w for k, w in as_loaded(with_mtp[1]).items() if not k.startswith("mtp.")}
    assert set(loaded.weights) == set(expected)
    assert all(same_weight(loaded.weights[k], expected[k]) for k in expected)


def test_mtp_tensors_without_mtp_layers_in_the_config_are_skipped(with_mtp, tmp_path, capsys):
    d = shutil.copytree(with_mtp[0], tmp_path / "ckpt")
    edit_config(d, lambda c: c["text_config"].pop("mtp_num_hidden_layers"))
    assert main(["check", str(d)]) == 0
    warning = capsys.readouterr().err.strip()
    assert warning.count("\n") == 0 and "mtp_num_hidden_layers" in warning and "skipping" in warning, warning
    assert not any(k.startswith("mtp.") for k in load_checkpoint(d).weights)


def test_what_lily_runs_is_still_refused_beside_a_skipped_head(with_mtp, tmp_path, capsys):
    d = shutil.copytree(with_mtp[0], tmp_path / "ckpt")
    name = L + f"layers.{random.randrange(TINY.num_hidden_layers)}.post_attention_layernorm.weight"
    edit_tensors(d, lambda t: (drop_one_mtp_tensor(t), t.pop(name)))
    refused_by_check(d, capsys, "missing tensor", name)


def test_lilys_whole_mtp_head_is_still_loaded(with_mtp, capsys):
    assert main(["check", str(with_mtp[0])]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "with the MTP head" in captured.out
    assert any(k.startswith("mtp.") for k in load_checkpoint(with_mtp[0]).weights)
