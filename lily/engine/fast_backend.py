"""The fast backend: the Backend protocol (docs/internals.md) over lily.model.fast (Triton, CUDA graphs).

`decode` returns fp32 logits on the GPU for the server's sampler; `decode_greedy` / `generate_greedy` keep
the whole loop on the device (the chosen token feeds the next replay without the host) for benchmarks
and `lily generate`.
"""

from __future__ import annotations

import torch

from lily.config import ModelConfig
from lily.model.fast import FastModel, FastState

DEFAULT_MAX_SEQ = 32768


class FastBackend:
    name = "fast"

    def __init__(self, config: ModelConfig, weights: dict, device="cuda", max_seq: int = DEFAULT_MAX_SEQ,
                 **model_kwargs):
        self.config = config
        self.device = torch.device(device)
        self.max_seq = min(max_seq, config.max_position_embeddings)
        self.model = FastModel(config, weights, self.device, **model_kwargs)
        self.tokenizer_dir = None

    @classmethod
    def from_dir(cls, model_dir, device="cuda", max_seq: int = DEFAULT_MAX_SEQ) -> "FastBackend":
        from lily.checkpoint import load_checkpoint

        device = torch.device("cuda" if str(device) == "auto" else device)
        ckpt = load_checkpoint(model_dir, device="cpu")   # FastModel repacks onto the GPU layer by layer
        backend = cls(ckpt.config, ckpt.weights, device, max_seq=max_seq)
        backend.tokenizer_dir = ckpt.tokenizer_dir
        return backend

    def new_state(self, max_seq: int | None = None) -> FastState:
        return self.model.new_state(max_seq or self.max_seq)

    def prepare_state(self, state: FastState) -> None:
        """Capture the state's decode CUDA graph now (it is otherwise made on the first decode), so a
        timed or latency-sensitive first step does not pay for it. The capture records, it runs nothing."""
        if self.model.use_graph and state.graph is None:
            self.model._capture(state)

    def prefill(self, ids, state: FastState) -> torch.Tensor:
        """fp32 logits [V] of the prompt's last position (on the GPU)."""
        return self.model.prefill(torch.as_tensor(ids).reshape(-1).tolist(), state)

    def decode(self, token: int, state: FastState) -> torch.Tensor:
        return self.model.decode(int(token), state)

    def decode_greedy(self, token: int, state: FastState, steps: int, stop_ids=()) -> list[int]:
        """Feed `token`, then `steps` greedy tokens chosen on the device."""
        return self.model.decode_greedy(int(token), state, steps, stop_ids)

    def generate_greedy(self, ids, n: int, stop_ids=(), state: FastState | None = None) -> list[int]:
        """Greedy continuation of the prompt `ids`: n new tokens (fewer if a stop id comes)."""
        ids = torch.as_tensor(ids).reshape(-1).tolist()
        state = state or self.new_state(min(self.max_seq, len(ids) + n + 1))
        first = int(torch.argmax(self.prefill(ids, state)))
        if n <= 1 or first in set(stop_ids):
            return [first][:n]
        return [first] + self.decode_greedy(first, state, n - 1, stop_ids)

    def clone_state(self, state: FastState) -> FastState:
        return state.clone()

    def state_nbytes(self, state: FastState) -> int:
        return state.nbytes()
