"""CUDA graphs of the prefill forward for short prompts: a chunk of n <= max(BUCKETS) tokens runs as the graph
of the smallest bucket B >= n, its ids padded to B rows.

Why: a short prompt is bound by the host. A prefill launches ~730 kernels (Python, torch and Triton's launcher
for each); on the H200 a 256-token prompt took 68 ms of which its kernels were ~27 (453a803). A graph replays
them all in one call.

Padding stays invisible. Rows n .. B-1 hold real token ids (whatever the buffer held), so every value they
carry is finite, and they are masked wherever a row outlives the chunk: the gated delta rule sees beta = 0
and g = 0 on them (the recurrent state passes through them unchanged), the conv state takes the last K-1
rows of [state; m[:n]], and their K/V rows land in the cache past the prompt, where nothing reads them
before the next token overwrites them (attention reads rows < pos; rows past the cache's end are dropped).
Rows are independent everywhere else (GEMMs, MoE, norms; causal attention never looks forward), so the
prompt's rows are what the eager path computes, up to the summation order of tiles chosen for B rows.

The position and n live on the device (`at`, one int32 pair the kernels read), so one graph serves every
position. A graph bakes in its state's buffers, so the graphs belong to one staging state (`staging`, holding
the first max(BUCKETS) positions): a chunk that ends within it runs there, the target state's conv and
recurrent state and its KV rows before the chunk copied in, the chunk's KV rows and the new conv and
recurrent state copied back (~0.1 ms of copies at most, against the ~60 ms a capture cost a slot's first
prompt of each size in the server, where every slot used to capture its own). A chunk past the staging
state's positions runs as a graph of its own state (`state.prefill_graphs`, bucket -> graph). Either is
captured on first use: that chunk runs eagerly (compiling every kernel at B rows), then the same work is
recorded, not run. All graphs share one memory pool; they never run at the same time.
"""

from __future__ import annotations

import torch

from lily.config import ModelConfig
from lily.model import fast_prefill, rope

F32 = torch.float32

# Chunk sizes with a graph. Steps of 1.5x-2x: at most a third of a replay is padding. Up to 4K: there the
# host's launches still show (H200, 19dd1f9: a 4K prompt 86.1-86.5 ms eager with spikes to 141 ms, as a graph
# 84.7-85.3 ms; the graphs' pool grew 0.4 GiB); past it the GPU's time dwarfs them.
BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def graphs_of(state) -> dict:
    """The prefill graphs captured against this state's buffers (bucket -> (graph, what it must keep alive))."""
    graphs = getattr(state, "prefill_graphs", None)
    if graphs is None:
        graphs = state.prefill_graphs = {}
    return graphs


class PrefillGraphs:
    """Runs prompt chunks as per-bucket CUDA graphs of lily.model.fast_prefill's forward."""

    def __init__(self, config: ModelConfig, weights: dict, device, buckets: tuple[int, ...] = BUCKETS,
                 staging=None):
        """staging: the state the shared graphs run on (a FastState of max(buckets) positions or more), or None:
        each state captures its own."""
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"prefill graph buckets must be ascending positive sizes, got {buckets}")
        self.config, self.weights, self.device = config, weights, torch.device(device)
        self.buckets = tuple(buckets)
        self.staging = staging
        dev = self.device
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=dev)   # padding: earlier prompts' ids
        self.at = torch.zeros(2, dtype=torch.int32, device=dev)                  # [position, n] of the chunk
        self.h_last = torch.empty(1, config.hidden_size, dtype=F32, device=dev)  # the chunk's last prompt row
        self.inv_freq = rope.inv_freq(config, dev)
        self.row_index = {}  # bucket -> arange(B) int32, to mark the padding rows inside the graph
        self.pool = None
        self.captures = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n tokens (None: too long for a graph)."""
        return next((b for b in self.buckets if b >= n), None)

    def run(self, state, ids: torch.Tensor) -> torch.Tensor | None:
        """Prefill ids [n] at state.pos (n fits the state) as a graph; the last prompt row's hidden state
        h [1, H] fp32 (valid until the next call), or None when the chunk is too long for a bucket: then the
        caller runs it eagerly. state.pos is the caller's to advance."""
        n = ids.numel()
        B = self.bucket(n)
        if B is None:
            return None
        st = self.staging
        if st is not None and state is not st and state.pos + n <= st.k_cache.shape[1]:
            self._copy_in(state)
            h = self.run(st, ids)
            self._copy_out(state, n)
            return h
        self.ids[:n].copy_(ids)
        self.at[0].fill_(state.pos)
        self.at[1].fill_(n)
        graphs = graphs_of(state)
        if B in graphs:
            graphs[B][0].replay()
        else:
            step = self._step(state, B)
            step()                      # this chunk, eagerly: every kernel compiled at B rows before capture
            keep = fast_prefill._identity_plan(B, self.device)   # tensors the graph reads, not its own
            graphs[B] = (self._record(step), keep)
            self.captures += 1
        return self.h_last

    def _copy_in(self, state) -> None:
        """The staging state becomes `state` as far as a chunk at state.pos reads it."""
        st, p = self.staging, state.pos
        st.conv_state.copy_(state.conv_state)
        st.rec_state.copy_(state.rec_state)
        if p:
            st.k_cache[:, :p].copy_(state.k_cache[:, :p])
            st.v_cache[:, :p].copy_(state.v_cache[:, :p])
        st.pos = p

    def _copy_out(self, state, n: int) -> None:
        """What an n-token chunk at state.pos wrote into the staging state, back into `state` (pos is the
        caller's to advance, as for a graph of its own)."""
        st, p = self.staging, state.pos
        state.conv_state.copy_(st.conv_state)
        state.rec_state.copy_(st.rec_state)
        state.k_cache[:, p:p + n].copy_(st.k_cache[:, p:p + n])
        state.v_cache[:, p:p + n].copy_(st.v_cache[:, p:p + n])
        st.pos = 0

    def prepare(self, state=None) -> list[int]:
        """Capture every bucket's graph for an empty state now (pos 0; None: the staging state), so no prompt
        pays for a capture; the buckets captured. Each bucket runs once eagerly on placeholder ids (compiling
        its kernels) before it is recorded, then the state is emptied again (conv and recurrent state zeroed;
        the K/V rows written are past pos, where nothing reads). A bucket a state cannot hold a prompt for is
        skipped."""
        if state is None:
            state = self.staging
        if state is None:
            raise ValueError("no state to prepare prefill graphs on: these graphs have no staging state")
        if state.pos != 0:
            raise ValueError(f"prefill graphs are prepared on an empty state, this one is at {state.pos}")
        done, smaller = [], 0
        for B in self.buckets:
            n = min(B, state.max_seq)
            if n > smaller and B not in graphs_of(state):
                self.run(state, self.ids[:n].clone())
                done.append(B)
            smaller = B
        state.conv_state.zero_()
        state.rec_state.zero_()
        return done

    def _step(self, state, B: int):
        c, w = self.config, self.weights
        if B not in self.row_index:
            self.row_index[B] = torch.arange(B, dtype=torch.int32, device=self.device)
        ids, rows, pos, valid = self.ids[:B], self.row_index[B], self.at[0:1], self.at[1:2]

        def step() -> None:
            h = fast_prefill._forward_chunk(c, w, state, ids, self.inv_freq,
                                            fast_prefill.ChunkRows(pos, valid, rows >= valid))
            torch.index_select(h, 0, (valid - 1).long(), out=self.h_last)
        return step

    def _record(self, step):
        """A CUDA graph of `step` in the shared pool (tests substitute a recorder that replays eagerly)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            step()
        return g
