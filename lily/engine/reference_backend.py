"""The reference backend: the Backend protocol (docs/internals.md) over lily.model.reference.

Slow and exact (fp32 by default): the CPU fallback for `lily serve --demo` and CI, and the oracle the
fast backend is measured against.
"""

from __future__ import annotations

import time

import torch

from lily.config import ModelConfig
from lily.model.reference import ReferenceModel, ReferenceState


class ReferenceBackend:
    name = "reference"

    def __init__(self, config: ModelConfig, weights: dict, device="cpu", dtype: torch.dtype = torch.float32,
                 prefill_chunk: int = 4096, kv_dtype: str = "bf16", rec_dtype: str = "fp32"):
        self.config = config
        self.device = torch.device(_resolve_device(device))
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk  # long prompts run in pieces so scratch memory stays bounded
        self.model = ReferenceModel(config, weights, device=self.device, dtype=dtype, kv_dtype=kv_dtype,
                                    rec_dtype=rec_dtype)
        self.tokenizer_dir = None

    @classmethod
    def from_dir(cls, model_dir, device="cpu", dtype: torch.dtype = torch.float32,
                 progress=None, kv_dtype: str = "bf16", rec_dtype: str = "fp32") -> "ReferenceBackend":
        from lily.checkpoint import load_checkpoint

        device = _resolve_device(device)
        ckpt = load_checkpoint(model_dir, device=device, progress=progress)
        backend = cls(ckpt.config, ckpt.weights, device, dtype, kv_dtype=kv_dtype, rec_dtype=rec_dtype)
        backend.tokenizer_dir = ckpt.tokenizer_dir
        return backend

    def new_state(self) -> ReferenceState:
        return self.model.new_state()

    def prefill(self, ids, state: ReferenceState) -> torch.Tensor:
        """Run the prompt `ids` (list of ints or a 1-D tensor) from `state`; fp32 logits [V] of its last token."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        logits = None
        for s in range(0, ids.numel(), self.prefill_chunk):
            logits = self.model.forward(ids[s:s + self.prefill_chunk], state, logits_for="last")
        return logits[0]

    def prefill_logits(self, ids, state: ReferenceState) -> torch.Tensor:
        """Like prefill, but fp32 logits of every position [T, V] (prompt log-probabilities)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        return torch.cat([self.model.forward(ids[s:s + self.prefill_chunk], state, logits_for="all")
                          for s in range(0, ids.numel(), self.prefill_chunk)])

    def decode(self, token: int, state: ReferenceState) -> torch.Tensor:
        """One step: fp32 logits [V] for the token after `token`."""
        return self.model.forward(torch.tensor([int(token)]), state, logits_for="last")[0]

    samples_on_device = True   # a launched step's pick may be a draw (lily.kernels.sample's torch reference here)

    def launch_greedy(self, state: ReferenceState, token: int | None = None, after=None, pick=None):
        """One step (run at once here) as a lily.model.greedy_step.GreedyStep: input `token`, or `after`'s pick;
        its own pick the argmax, or the draw `pick` (a lily.kernels.sample.RowSampling)."""
        from lily.model.greedy_step import GreedyStep, pick_tokens

        t0 = time.perf_counter()   # (the step runs here: its time counts from before it)
        logits = self.decode(int(after.token_dev[0]) if after is not None else token, state)
        return GreedyStep(pick_tokens(logits[None], [pick]), logits, launched_at=t0)

    def launch_batch_greedy(self, states: list[ReferenceState], tokens: list[int] | None = None, after=None,
                            picks=None):
        """One step of several sequences (run at once here) as a lily.model.greedy_step.BatchGreedyStep: input
        `tokens`, or after = (an earlier BatchGreedyStep, each state's row in it): that row's pick; each row's own
        pick the argmax, or its draw in picks."""
        from lily.model.greedy_step import BatchGreedyStep

        t0 = time.perf_counter()
        if after is not None:
            step, rows = after
            tokens = [int(step.token_dev[r]) for r in rows]
        return BatchGreedyStep(self.decode_batch(tokens, states), launched_at=t0, picks=picks)

    def decode_batch(self, tokens: list[int], states: list[ReferenceState]) -> torch.Tensor:
        """One step for several sequences: fp32 logits [B, V], row i for tokens[i] fed to states[i]. Each row
        runs the arithmetic it runs alone (fp32 matmuls of different row counts need not round alike), so a
        batch's tokens are the solo tokens exactly: the oracle for the fast backend's batched kernels."""
        return torch.stack([self.decode(t, s) for t, s in zip(tokens, states)])

    def clone_state(self, state: ReferenceState) -> ReferenceState:
        return state.clone()

    def release_state(self, state: ReferenceState) -> None:
        """Nothing to recycle: a reference state is small and grows with its sequence."""

    def restore_state(self, snapshot: ReferenceState) -> ReferenceState:
        """The snapshot itself: the prefix cache's lookup already hands out a private copy."""
        return snapshot

    def state_nbytes(self, state: ReferenceState) -> int:
        return state.nbytes()


def _resolve_device(device) -> str | torch.device:
    if str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
