"""One GPU run that measures quantise-at-load of an original bf16 release (lily/checkpoint/quantize_at_load.py).

1. writes a full-width partial original-layout bf16 checkpoint to disk (the real shapes and names of
   Qwen/Qwen3.6-35B-A3B: `model.language_model.*`, experts fused, conv1d [C, 1, K], A_log float32, the
   MTP head; --layers of the 40 layers, random values) in shards of about 4 GB;
2. reads it once so it sits in the page cache, then times reading it alone (source tensors to the GPU,
   the ceiling) and quantise-at-load as `lily serve` runs it (quantised on the GPU, weights handed to the
   CPU for the fast backend to repack), twice each; GB of source read a second, and the time projected
   for the full model (40 layers, embeddings, head, MTP head: the bytes of the real release's text model);
3. checks the GPU's bits against the CPU's for every weight of one GDN layer, one attention layer and
   the embedding (quantise-at-load must give the same bits on any device).
JSON and a log under $OUT (or ./out); a short table is printed last. Needs only torch and safetensors.

Run: PYTHONPATH=$PWD python3 scripts/gpu_convert_check.py [--layers 8] [--dir /tmp/lily-convert-check]
     PYTHONPATH=$PWD python3 scripts/gpu_convert_check.py --tiny       (a dry run on the CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lily.checkpoint import expected_tensors
from lily.checkpoint.loading import inspect_original, load_checkpoint
from lily.checkpoint.quantize_at_load import _read_job, stream_quantized
from lily.config import FULL, TINY, ModelConfig, with_layers
from lily.quant import QuantTensor

OUT = Path(os.environ.get("OUT") or "out")
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "convert_check.log", "w")
MUST_S = 90.0  # the full bf16 model must load in under this from the page cache


def log(*a) -> None:
    print(*a, flush=True)
    print(*a, file=LOG, flush=True)


def source_tensors(config: ModelConfig):
    """(name, shape, dtype) of every tensor of the original bf16 release's text model, in file order."""
    bf16 = torch.bfloat16
    for key, spec in expected_tensors(config, mtp=config.mtp_num_hidden_layers > 0).items():
        base = key if key == "lm_head" or key.startswith("mtp.") else "model.language_model." + key
        if ".switch_mlp." in key:
            layer = base[:base.index(".mlp.switch_mlp.")]
            E, rows, cols = spec.shape
            if key.endswith("gate_proj"):
                yield f"{layer}.mlp.experts.gate_up_proj", (E, 2 * rows, cols), bf16
            elif key.endswith("down_proj"):
                yield f"{layer}.mlp.experts.down_proj", spec.shape, bf16
        elif spec.quantized:
            yield base + ".weight", spec.shape, bf16
        elif key.endswith("conv1d.weight"):
            yield base, (spec.shape[0], 1, spec.shape[1]), bf16
        else:
            yield base, spec.shape, torch.float32 if key.endswith("A_log") else bf16


def release_bytes(config: ModelConfig) -> int:
    return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for _, s, dt in source_tensors(config))


def write_release(d: Path, config: ModelConfig, dev: torch.device, shard_bytes: int = 4 << 30) -> int:
    """The original-layout checkpoint of `config` (random values, made on `dev`); returns its bytes."""
    d.mkdir(parents=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    shard, size, n, weight_map, total = {}, 0, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for name, shape, dtype in source_tensors(config):
        t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(dtype).cpu()
        nb = t.numel() * t.element_size()
        if shard and size + nb > shard_bytes:
            flush()
        shard[name] = t
        size += nb
        total += nb
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    text = config.text_config_dict()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                               "model_type": "qwen3_5_moe", "text_config": text,
                                               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return total


def warm_page_cache(d: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def time_read_only(d: Path, dev: torch.device) -> float:
    """Every source tensor read and copied to `dev`, nothing computed: the I/O ceiling."""
    _, jobs, _ = inspect_original(d)
    files: dict = {}
    t0 = time.perf_counter()
    for job in jobs:
        for t in _read_job(job, files):
            t.to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_load(d: Path, qdev: torch.device) -> float:
    t0 = time.perf_counter()
    ckpt = load_checkpoint(d, device="cpu", quantize_device=qdev)
    if qdev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del ckpt
    return dt


def same_bits(d: Path, qdev: torch.device, layers: tuple[str, ...]) -> dict:
    """The weights of `layers` (lily key prefixes) quantised on `qdev` and on the CPU: equal bit for bit?"""
    config, jobs, fp8 = inspect_original(d)
    picked = [j for j in jobs if any(s.key.startswith(layers) for s in j.specs)]
    a = {s.key: p for s, p in stream_quantized(picked, fp8, qdev)}
    b = {s.key: p for s, p in stream_quantized(picked, fp8, torch.device("cpu"))}
    bad = [k for k in b if not all(x.dtype == y.dtype and torch.equal(x.cpu(), y) for x, y in zip(a[k], b[k]))]
    return {"weights": len(b), "differ": bad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the partial model (default 8 of 40)")
    ap.add_argument("--dir", default="/tmp/lily-convert-check", help="where the checkpoint is written (removed after)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a dry run of this script")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    base = TINY if args.tiny else FULL
    config = with_layers(base, args.layers if not args.tiny else 4)
    import dataclasses
    config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    full = dataclasses.replace(base, mtp_num_hidden_layers=1)
    d = Path(args.dir) / ("tiny" if args.tiny else f"full-{args.layers}-layers")
    shutil.rmtree(d, ignore_errors=True)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                 "torch": torch.__version__, "python": platform.python_version(), "layers": config.num_hidden_layers,
                 "dir": str(d)}
    try:
        t0 = time.perf_counter()
        nbytes = write_release(d, config, dev)
        res["write_s"] = time.perf_counter() - t0
        res["source_gb"] = nbytes / 1e9
        log(f"wrote {nbytes / 1e9:.2f} GB ({config.num_hidden_layers} layers + embeddings, head, MTP head) to {d} "
            f"in {res['write_s']:.1f} s")
        res["page_cache_read_s"] = warm_page_cache(d)
        log(f"read once into the page cache in {res['page_cache_read_s']:.1f} s")

        res["read_only_s"] = [time_read_only(d, dev) for _ in range(2)]
        res["quantize_at_load_s"] = [time_load(d, dev) for _ in range(2)]
        best_read, best_load = min(res["read_only_s"]), min(res["quantize_at_load_s"])
        res["read_only_gb_s"] = nbytes / 1e9 / best_read
        res["quantize_at_load_gb_s"] = nbytes / 1e9 / best_load
        res["full_source_gb"] = release_bytes(full) / 1e9
        res["full_projected_s"] = res["full_source_gb"] / res["quantize_at_load_gb_s"]
        res["must_s"] = MUST_S
        res["meets_must"] = res["full_projected_s"] < MUST_S
        log(f"read only: {res['read_only_s']} s; quantise at load: {res['quantize_at_load_s']} s")

        layers = ("layers.0.", "layers.3.", "embed_tokens") if not args.tiny else ("layers.0.", "layers.3.",
                                                                                   "embed_tokens", "mtp.")
        res["gpu_vs_cpu_bits"] = same_bits(d, dev, layers) if cuda or args.tiny else None
        if cuda:
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        shutil.rmtree(d, ignore_errors=True)
    (OUT / "convert_check.json").write_text(json.dumps(res, indent=2))

    bits = res.get("gpu_vs_cpu_bits") or {}
    rows = [("device", res["device"]),
            ("partial model", f"{res['layers']} layers, {res['source_gb']:.2f} GB bf16 source"),
            ("read only (to the device)", f"{res['read_only_gb_s']:.2f} GB/s"),
            ("quantise at load", f"{res['quantize_at_load_gb_s']:.2f} GB/s ({min(res['quantize_at_load_s']):.1f} s)"),
            ("full model, projected", f"{res['full_projected_s']:.1f} s for {res['full_source_gb']:.1f} GB "
                                      f"(must: < {MUST_S:.0f} s: {'yes' if res['meets_must'] else 'NO'})"),
            ("GPU bits == CPU bits", f"{bits.get('weights', 0)} weights, {len(bits.get('differ', []))} differ"
                                     if bits else "not checked")]
    width = max(len(r[0]) for r in rows)
    log("")
    for k, v in rows:
        log(f"{k:<{width}}  {v}")
    ok = res["meets_must"] and not bits.get("differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
