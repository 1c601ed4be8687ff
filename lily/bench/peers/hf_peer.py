"""Peer: Hugging Face transformers `Qwen3_5MoeForCausalLM` with flash-linear-attention kernels (when the
`fla` package is importable), weights = the 4-bit checkpoint dequantized exactly, in bf16 on the GPU.

The checkpoint is read straight from its safetensors (not through lily's loader) so this peer is an
independent reading of the same bytes: MLX names -> HF names, 4/8-bit codes -> dense, MLX's pre-shifted
norm gains -> HF's zero-centred ones (docs/model.md section 2)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
from pathlib import Path

import torch

from lily.quant import dequantize

# Norms MLX stores as the effective gain (HF computes norm(x) * (1 + w)); linear_attn.norm is not one.
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight")


def hf_name(mlx_name: str) -> str:
    if mlx_name.startswith("language_model.model."):
        return "model." + mlx_name[len("language_model.model."):]
    if mlx_name.startswith("language_model.lm_head"):
        return "lm_head" + mlx_name[len("language_model.lm_head"):]
    raise ValueError(f"unexpected tensor {mlx_name!r} in the checkpoint")


def hf_state_dict(checkpoint: Path, device: str, dtype: torch.dtype):
    """Yield (hf_name, tensor) for every tensor HF's model holds, dequantized on `device`."""
    from safetensors import safe_open

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint}: no *.safetensors files")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    pending_experts: dict[str, dict[str, torch.Tensor]] = {}

    def get(k):
        return where[k].get_tensor(k).to(device)

    for key in sorted(where):
        if key.endswith((".scales", ".biases")) or key.startswith("mtp."):  # transformers has no MTP head
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        if f"{module}.scales" in where:                     # a quantized Linear / embedding
            w, s, b = get(key), get(f"{module}.scales"), get(f"{module}.biases")
            bits = w.shape[-1] * 32 // (s.shape[-1] * 64)
            t = dequantize(w, s, b, bits, 64, torch.float32)
        else:
            t = get(key).to(torch.float32)
        name = hf_name(module) + ".weight" if f"{module}.scales" in where else hf_name(key)
        if any(name.endswith(n) for n in SHIFTED_NORMS) or name == "model.norm.weight":
            t = t - 1.0
        if name.endswith("linear_attn.conv1d.weight"):
            t = t.reshape(t.shape[0], 1, -1) if t.dim() == 2 else t.permute(0, 2, 1)  # [C,K,1] -> [C,1,K]
        if ".mlp.switch_mlp." in name:                      # experts stacked -> HF's fused layout
            layer = name.split(".mlp.switch_mlp.")[0]
            part = name.split(".mlp.switch_mlp.")[1].split(".")[0]
            got = pending_experts.setdefault(layer, {})
            got[part] = t.to(dtype)
            if part == "down_proj":
                yield f"{layer}.mlp.experts.down_proj", got.pop("down_proj")
            if "gate_proj" in got and "up_proj" in got:
                yield f"{layer}.mlp.experts.gate_up_proj", torch.cat([got.pop("gate_proj"), got.pop("up_proj")], 1)
            continue
        yield name, t.to(dtype)


class HfEngine:
    name = "transformers"

    def __init__(self, model, device: str):
        self.model, self.device = model, torch.device(device)
        self.cache = None
        self.peak_mem_bytes: dict[int, int] = {}

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset(self, max_seq: int) -> None:
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    @torch.inference_mode()
    def _step(self, ids: list[int]) -> int:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return int(out.logits[0, -1].argmax().item())

    def prefill(self, ids: list[int]) -> int:
        self.context = len(ids)
        return self._step(ids)

    def decode_greedy(self, token: int, steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            token = self._step([token])
            out.append(token)
        self._sync()
        if self.device.type == "cuda":
            self.peak_mem_bytes[self.context] = max(torch.cuda.max_memory_allocated(self.device),
                                                    self.peak_mem_bytes.get(self.context, 0))
        return out


def _fla_version() -> str | None:
    """The flash-linear-attention version transformers will pick up, or None (torch fallback path)."""
    if importlib.util.find_spec("fla") is None:
        return None
    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            pass
    return "unknown"


def build(args):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    ckpt = Path(args.checkpoint)
    cfg = json.loads((ckpt / "config.json").read_text())
    text = dict(cfg.get("text_config", cfg))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = Qwen3_5MoeForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, t in hf_state_dict(ckpt, args.device, dtype):
            if name not in params:
                raise KeyError(f"checkpoint tensor maps to {name!r}, which the HF model lacks")
            if tuple(params[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint gives {tuple(t.shape)}, HF expects {tuple(params[name].shape)}")
            params[name].copy_(t)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"HF parameters the checkpoint did not fill: {missing[:5]} ...")
    info = {"transformers": md.version("transformers"), "torch": torch.__version__, "dtype": args.dtype,
            "fla": _fla_version(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    return HfEngine(model, args.device), text["vocab_size"], info


if __name__ == "__main__":
    from lily.bench.peers.common import peer_main

    sys.exit(peer_main("transformers", build))
