"""The slot pool: the per-sequence decode state of up to n_slots sequences, one allocation per buffer, so the
batched decode kernels reach any sequence's state by its slot index.

  k_cache, v_cache  bf16  [n_attn_layers, slots, max_seq, n_kv_heads, head_dim]  (K after k_norm and RoPE;
                          or uint8 rows of head_dim codes and a scale: lily.kernels.kv_int8)
  conv_state        bf16  [n_gdn_layers, slots, K-1, conv_dim]                   (last pre-conv rows, oldest first)
  rec_state         fp32  [n_gdn_layers, slots, Hv, dk, dv]                      (or bf16: rec_dtype)
  pos               int32 [slots]                                                 (each slot's position, on the device)

A slot is handed out as a FastState whose tensors are views into these (each layer's slice is contiguous),
so the batch-1 decode step, its CUDA graph and the prefill kernels run on it unchanged. Slots are handed
out lowest index first: a lone request keeps getting slot 0, whose batch-1 graph is then captured once.
"""

from __future__ import annotations

import heapq
import threading

import torch

from lily.config import ModelConfig
from lily.kernels.kv_int8 import kv_cache_zeros, kv_row_bytes
from lily.model.fast import FastState, rec_torch_dtype


def slot_nbytes(config: ModelConfig, max_seq: int, kv_dtype: str = "bf16", rec_dtype: str = "fp32") -> int:
    """Device bytes of one slot: its KV rows for max_seq tokens, its conv and recurrent state, its position."""
    c = config
    kv = 2 * len(c.full_attention_layers) * max_seq * c.num_key_value_heads * kv_row_bytes(c.head_dim, kv_dtype)
    conv = len(c.linear_attention_layers) * (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim * 2
    rec = len(c.linear_attention_layers) * c.linear_num_value_heads * c.linear_key_head_dim \
        * c.linear_value_head_dim * rec_torch_dtype(rec_dtype).itemsize
    return kv + conv + rec + 4


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


class SlotPool:
    def __init__(self, config: ModelConfig, n_slots: int, max_seq: int, device, kv_dtype: str = "bf16",
                 rec_dtype: str = "fp32"):
        if n_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {n_slots}")
        c = config
        self.config, self.n_slots, self.max_seq = config, n_slots, max_seq
        self.device = torch.device(device)
        n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
        dev = dict(device=self.device)
        self.k_cache = kv_cache_zeros((n_attn, n_slots, max_seq), c.num_key_value_heads, c.head_dim, kv_dtype,
                                      self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.conv_state = torch.zeros(n_gdn, n_slots, c.linear_conv_kernel_dim - 1, c.linear_conv_dim,
                                      dtype=torch.bfloat16, **dev)
        self.rec_state = torch.zeros(n_gdn, n_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim, dtype=rec_torch_dtype(rec_dtype), **dev)
        self.pos = torch.zeros(n_slots, dtype=torch.int32, **dev)
        self.states = [self._view(s) for s in range(n_slots)]
        self._free = list(range(n_slots))  # a heap: the lowest free slot first
        self._lock = threading.Lock()

    def _view(self, s: int) -> FastState:
        st = FastState.__new__(FastState)
        st.config, st.max_seq, st.device, st.pos, st.graph = self.config, self.max_seq, self.device, 0, None
        st.prefill_graphs = {}
        st.k_cache, st.v_cache = self.k_cache[:, s], self.v_cache[:, s]
        st.conv_state, st.rec_state = self.conv_state[:, s], self.rec_state[:, s]
        st.pos_dev = self.pos[s:s + 1]
        st.slot = s
        return st

    @property
    def free(self) -> int:
        return len(self._free)

    def owns(self, state) -> bool:
        s = getattr(state, "slot", None)
        return s is not None and 0 <= s < self.n_slots and self.states[s] is state

    def take(self) -> FastState | None:
        """The lowest free slot's state, empty (pos 0), or None when all are in use."""
        with self._lock:
            if not self._free:
                return None
            return self.states[heapq.heappop(self._free)]

    def give(self, state: FastState) -> None:
        """A slot's sequence is over: reset its state in place (its graph stays valid) and free it."""
        with self._lock:
            if not self.owns(state) or state.slot in self._free:
                return
            reset_state(state)
            heapq.heappush(self._free, state.slot)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache, self.conv_state,
                                                          self.rec_state, self.pos))
