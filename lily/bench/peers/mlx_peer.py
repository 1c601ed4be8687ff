"""Peer: MLX-LM (CUDA build on the GPU, mlx[cpu] here) on the identical 4-bit checkpoint bytes, through
its fastest batch-1 path, `mlx_lm.generate.generate_step` (prefill in chunks, pipelined decode)."""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path


class MlxEngine:
    name = "mlx-lm"

    def __init__(self, model):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        self.mx, self.model = mx, model
        self._generate_step, self._make_cache = generate_step, make_prompt_cache
        self.gen = None
        self.max_seq = 0
        self.peak_mem_bytes: dict[int, int] = {}

    def reset(self, max_seq: int) -> None:
        self.gen = None
        self.max_seq = max_seq
        self.mx.clear_cache()
        self.mx.reset_peak_memory()

    def prefill(self, ids: list[int]) -> int:
        self.context = len(ids)
        self.gen = self._generate_step(self.mx.array(ids), self.model, max_tokens=self.max_seq - len(ids),
                                       prompt_cache=self._make_cache(self.model))
        return int(next(self.gen)[0])          # generate_step yields host ints (y.item())

    def decode_greedy(self, token: int, steps: int) -> list[int]:
        out = [int(next(self.gen)[0]) for _ in range(steps)]   # the generator carries `token` itself
        self.peak_mem_bytes[self.context] = max(int(self.mx.get_peak_memory()),
                                                self.peak_mem_bytes.get(self.context, 0))
        return out


def build(args):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    if args.device == "cuda" and not mx.cuda.is_available():
        raise RuntimeError("mlx has no CUDA backend here (install the mlx-cuda wheel)")
    mx.set_default_device(mx.gpu if args.device == "cuda" else mx.cpu)
    model, _ = load_model(Path(args.checkpoint))
    if args.dtype == "float32":
        model.set_dtype(mx.float32)           # bf16 -> fp32 is exact: same weights, fp32 activations
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["text_config"]["vocab_size"]
    info = {"mlx": md.version("mlx"), "mlx_lm": md.version("mlx-lm"), "device": str(mx.default_device()),
            "dtype": args.dtype}
    return MlxEngine(model), vocab, info


if __name__ == "__main__":
    from lily.bench.peers.common import peer_main

    sys.exit(peer_main("mlx-lm", build))
