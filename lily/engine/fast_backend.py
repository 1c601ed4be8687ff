"""The fast backend: the Backend protocol (docs/internals.md) over lily.model.fast (Triton, CUDA graphs).

`decode` returns fp32 logits on the GPU for the server's sampler; `decode_greedy` / `generate_greedy` keep
the whole loop on the device (the chosen token feeds the next replay without the host) for benchmarks
and `lily generate`.

States are pooled: a FastState is preallocated for max_seq (GBs at 32K) and carries the CUDA graph
captured against its buffers (hundreds of ms to make), so a request's state goes back to the pool when
it ends (`release_state`) and the next request's `new_state` gets it back reset, graph and all.
"""

from __future__ import annotations

import threading

import torch

from lily.config import ModelConfig
from lily.model.fast import FastModel, FastState

DEFAULT_MAX_SEQ = 32768
POOL_SIZE = 2  # free states kept; the server's worker runs one request at a time


def reset_state(state: FastState) -> None:
    """Back to the empty sequence, in place (a captured graph keeps pointing at these buffers). The KV
    cache is left as it is: every attention read is bounded by pos (decode reads rows <= pos after
    writing row pos; prefill reads rows < pos0 + T after writing rows pos0..), so stale rows are never read."""
    state.pos = 0
    state.pos_dev.zero_()
    state.conv_state.zero_()
    state.rec_state.zero_()


def copy_state_into(dst: FastState, src: FastState) -> None:
    """Make dst hold what src holds (src unchanged): the recurrent state, the conv state, the KV rows
    in use and the position; in place, so dst keeps its graph."""
    n = src.pos
    if n > dst.max_seq:
        raise ValueError(f"a state at position {n} does not fit one allocated for max_seq={dst.max_seq}")
    dst.k_cache[:, :n].copy_(src.k_cache[:, :n])
    dst.v_cache[:, :n].copy_(src.v_cache[:, :n])
    dst.conv_state.copy_(src.conv_state)
    dst.rec_state.copy_(src.rec_state)
    dst.pos = n
    dst.pos_dev.fill_(n)


class StatePool:
    """Free states of one size (max_seq) for reuse; at most `size` are kept, the rest are freed."""

    def __init__(self, size: int):
        self.size = max(0, int(size))
        self._free: list[FastState] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> FastState | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, state: FastState) -> bool:
        """Reset `state` and keep it; False (not kept) when the pool is full or already holds it."""
        with self._lock:
            if len(self._free) >= self.size or any(s is state for s in self._free):
                return False
            reset_state(state)
            self._free.append(state)
            return True


class FastBackend:
    name = "fast"

    def __init__(self, config: ModelConfig, weights: dict, device="cuda", max_seq: int = DEFAULT_MAX_SEQ,
                 pool_size: int = POOL_SIZE, **model_kwargs):
        self.config = config
        self.device = torch.device(device)
        self.max_seq = min(max_seq, config.max_position_embeddings)
        self.model = FastModel(config, weights, self.device, **model_kwargs)
        self.pool = StatePool(pool_size)
        self.tokenizer_dir = None

    @classmethod
    def from_dir(cls, model_dir, device="cuda", max_seq: int = DEFAULT_MAX_SEQ, progress=None) -> "FastBackend":
        from lily.checkpoint import load_checkpoint

        device = torch.device("cuda" if str(device) == "auto" else device)
        # FastModel repacks onto the GPU layer by layer; an original release is quantised on the GPU first
        ckpt = load_checkpoint(model_dir, device="cpu", progress=progress)
        backend = cls(ckpt.config, ckpt.weights, device, max_seq=max_seq)
        backend.tokenizer_dir = ckpt.tokenizer_dir
        return backend

    def new_state(self, max_seq: int | None = None) -> FastState:
        """An empty state (pos 0): a pooled one when the default size is asked for and one is free (it
        keeps its captured decode graph), else a new allocation."""
        if max_seq is None or max_seq == self.max_seq:
            state = self.pool.take()
            if state is not None:
                return state
        return self.model.new_state(max_seq or self.max_seq)

    def release_state(self, state: FastState) -> None:
        """The state's sequence is over (finished, failed or cancelled): it goes back to the pool, reset,
        when it has the default size and the pool has room; otherwise it is dropped (freed)."""
        if isinstance(state, FastState) and state.max_seq == self.max_seq:
            self.pool.give(state)

    def recycle_state(self, state: FastState) -> FastState:
        """Empty `state` in place (pos 0, conv and recurrent state zeroed) to start a new sequence in it; its
        captured decode graph stays valid (the graph reads the position on the device)."""
        reset_state(state)
        return state

    def restore_state(self, snapshot: FastState) -> FastState:
        """A state to continue from `snapshot` (e.g. a prefix-cache entry's copy), which is left
        unchanged: a pooled state with the snapshot copied in, so the decode graph is not captured again."""
        state = self.new_state()
        try:
            copy_state_into(state, snapshot)
        except BaseException:
            self.release_state(state)
            raise
        return state

    def prepare_state(self, state: FastState) -> None:
        """Capture the state's decode CUDA graph now (it is otherwise made on the first decode), so a
        timed or latency-sensitive first step does not pay for it. The capture records, it runs nothing."""
        if self.model.use_graph and state.graph is None:
            self.model._capture(state)

    def prefill(self, ids, state: FastState) -> torch.Tensor:
        """fp32 logits [V] of the prompt's last position (on the GPU)."""
        return self.model.prefill(torch.as_tensor(ids).reshape(-1).tolist(), state)

    def prefill_logits(self, ids, state: FastState) -> torch.Tensor:
        """fp32 logits of every position [T, V] (prompt log-probabilities; T x V floats on the GPU)."""
        return self.model.prefill(torch.as_tensor(ids).reshape(-1).tolist(), state, logits="all")

    def decode(self, token: int, state: FastState) -> torch.Tensor:
        return self.model.decode(int(token), state)

    def set_token_mask(self, bitmask: torch.Tensor | None) -> None:
        """A grammar's token bitmask for the greedy pick inside the decode graph (None: all tokens)."""
        self.model.set_token_mask(bitmask)

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
        """A compact snapshot (the prefix cache's entries): the KV rows in use only (max_seq = pos), so it
        costs memory in proportion to its tokens, not max_seq. It is for restore_state (copied into a
        pooled state); it cannot take further tokens itself."""
        snap = FastState.__new__(FastState)
        for name, value in vars(state).items():
            if name in ("k_cache", "v_cache"):
                value = value[:, :state.pos].clone()
            elif isinstance(value, torch.Tensor):
                value = value.clone()
            setattr(snap, name, value)
        snap.max_seq, snap.graph = state.pos, None
        return snap

    def state_nbytes(self, state: FastState) -> int:
        return state.nbytes()
