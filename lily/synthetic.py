"""Random-weight checkpoints in the exact MLX 4-bit format: `lily make-synthetic --preset tiny|full OUT`.

The weights are random but scaled so the network is numerically well-conditioned (the residual stream
stays O(1) across layers, routing and logits are decisive enough that bf16 and fp32 runs mostly pick
the same tokens). The full preset (19.5 GB) is generated and written tensor by tensor on `--device`
(cuda is much faster than the CPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lily.checkpoint import expected_tensors
from lily.config import PRESETS, ModelConfig
from lily.quant import quantize

# Output projections feeding the residual stream are damped so its growth over layers stays bounded.
_RESIDUAL_OUT = ("o_proj", "out_proj", "down_proj")


def _linear_std(key: str, n_in: int, n_layers: int) -> float:
    std = n_in ** -0.5
    if key.endswith(_RESIDUAL_OUT):
        std /= math.sqrt(2 * n_layers)
    if key.endswith("mlp.gate"):
        std *= 3.0  # decisive routing: clear gaps between the top-k and the rest
    if key == "lm_head":
        std *= 4.0  # logits with std ~4: a peaked next-token distribution
    return std


def random_tensor(key: str, shape: tuple[int, ...], config: ModelConfig, gen: torch.Generator,
                  device) -> torch.Tensor:
    """The fp32 value of one weight (before quantization), by what the weight is."""
    def normal(std):
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(lo, hi):
        return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo

    if key == "embed_tokens":
        return normal(1.0)
    if key.endswith("A_log"):
        return torch.log(uniform(1.0, 16.0))
    if key.endswith("dt_bias"):
        return normal(0.1)
    if key.endswith("conv1d.weight"):
        return normal(0.5) / math.sqrt(config.linear_conv_kernel_dim)
    if key.endswith("norm.weight"):  # all RMSNorm gains (MLX stores the effective gain)
        return 1.0 + normal(0.1)
    return normal(_linear_std(key, shape[-1], config.num_hidden_layers))


SEED_STRIDE = 1_000_003  # tensor idx's generator is seeded with seed * SEED_STRIDE + idx
SEED_MAX = (2 ** 64 - 1) // SEED_STRIDE - 1  # torch's generators take seeds below 2**64


def check_seed(seed: int, flag: str = "--seed") -> None:
    """A seed the weights' generators can take, else one line for the user (torch would raise mid-run)."""
    if not 0 <= seed <= SEED_MAX:
        from lily.cli import UserError

        raise UserError(f"{flag} {seed} is out of range (0 .. {SEED_MAX})")


def iter_random_weights(config: ModelConfig, seed: int = 0, device="cpu", mtp: bool = False):
    """(spec, weight) of every weight in order, made one at a time (see random_weights)."""
    device = torch.device(device)
    for idx, spec in enumerate(expected_tensors(config, mtp=mtp).values()):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * SEED_STRIDE + idx)
        w = random_tensor(spec.key, spec.shape, config, gen, device)
        if spec.quantized:
            # MLX quantizes the bf16-cast model; do the same so codes match what convert would produce
            yield spec, quantize(w.to(torch.bfloat16), bits=spec.bits, group_size=config.group_size)
        else:
            yield spec, w.to(spec.dtype)
        del w


def random_weights(config: ModelConfig, seed: int = 0, device="cpu", mtp: bool = False) -> dict:
    """A full weights dict (docs/internals.md names) for `config`, quantized like mlx_lm.convert:
    bf16 weights, group-64 affine, 4-bit (router gates 8-bit), norms / conv / dt_bias bf16, A_log fp32.
    With `mtp`, also the MTP head's weights. Each tensor is made from its own generator, so one tensor
    never depends on another's size."""
    return {spec.key: w for spec, w in iter_random_weights(config, seed, device, mtp)}


def checkpoint_bytes(config: ModelConfig) -> int:
    """The bytes of the safetensors files a config's checkpoint holds (what the disk must have free)."""
    total = 0
    for spec in expected_tensors(config).values():
        n = math.prod(spec.shape)
        if spec.quantized:
            total += n * spec.bits // 8 + 2 * 2 * (n // config.group_size)  # codes + bf16 scales and biases
        else:
            total += n * torch.empty((), dtype=spec.dtype).element_size()
    return total


def make_synthetic(preset: str, out_dir, seed: int = 0, device="cpu", shard_bytes: int | None = None) -> Path:
    """Write a random checkpoint for a preset: config.json + safetensors (+ index), the full preset in
    ~3 GB shards, with the preset's tokenizer, chat template and generation_config.json. The weights
    stream: each is made, quantized and handed to the shard writer before the next, so memory holds at
    most one shard and one weight (not the 19.5 GB model), and the progress bar moves from the start."""
    from lily.checkpoint.mlx_format import ShardWriter, mlx_tensors
    from lily.demo_tokenizer import write_tokenizer_files
    from lily.progress import bytes_progress

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    config = PRESETS[preset]
    if shard_bytes is None and preset == "full":
        shard_bytes = 3 << 30
    progress = bytes_progress("writing")
    n, total = len(expected_tensors(config)), checkpoint_bytes(config)
    progress(0, n, 0, total)
    writer, done = ShardWriter(out_dir, shard_bytes), 0
    for i, (spec, w) in enumerate(iter_random_weights(config, seed=seed, device=device)):
        for name, t in mlx_tensors(spec, w):
            writer.add(name, t)
            done += t.numel() * t.element_size()
        del w
        progress(i + 1, n, done, total)
    out = writer.close(config.mlx_config_json())
    write_tokenizer_files(out, preset)
    gen = {"eos_token_id": list(config.eos_token_ids), "pad_token_id": config.eos_token_ids[-1],
           "do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model shape: tiny (a few MB, for tests) or full (the real 35B-A3B shapes, 19.5 GB)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--device", default="cpu", help="where to generate the weights: cpu, cuda or cuda:N (auto: cuda when present)")
    p.add_argument("out_dir", help="output directory (must not exist or be empty)")


def run(args) -> int:
    import shutil

    from lily.cli import UserError

    from lily.engine import resolve

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory")
    check_seed(args.seed)
    device, _ = resolve(args.device, "reference")  # cpu or cuda[:N] this machine has; a DeviceError is one line
    config = PRESETS[args.preset]
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)  # a bad path fails here, before any work
    except OSError as e:
        raise UserError(f"{out}: cannot create the directory ({e.strerror})") from None
    try:
        need = checkpoint_bytes(config)
        free = shutil.disk_usage(out).free
        if free < need:
            raise UserError(f"{out}: {free / 1e9:.1f} GB free, the {args.preset} checkpoint needs {need / 1e9:.1f} GB")
        make_synthetic(args.preset, out, seed=args.seed, device=device)
    except BaseException:
        # leave no half-written checkpoint behind (disk full, Ctrl-C, ...)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for f in out.iterdir():
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        raise
    n = sum(1 for _ in out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {args.preset} checkpoint to {out}: {n} safetensors file(s), {size / 1e9:.3f} GB")
    return 0
