"""The fast backend: the Backend protocol (docs/internals.md) over lily.model.fast (Triton, CUDA graphs).

`decode` returns fp32 logits on the GPU for the server's sampler; `decode_greedy` / `generate_greedy` keep
the whole loop on the device (the chosen token feeds the next replay without the host) for benchmarks
and `lily generate`. `decode_batch` steps many sequences at once (lily.model.fast_batch).

States live in a slot pool (lily.model.slots), sized at load from a memory budget: a request's state is a
slot, preallocated for max_seq (GBs at 32K), and carries the batch-1 CUDA graph captured against its
buffers (hundreds of ms to make), so when a request ends its slot goes back, reset, graph and all, and the
next request's `new_state` takes the lowest free slot. A lone request decodes through its slot's batch-1
graph (the product's headline speed); two or more decode together through the batched step's graphs.
"""

from __future__ import annotations

import logging
import time

import torch

from lily.config import ModelConfig
from lily.kernels.kv_int8 import kv_row_bytes
from lily.model.fast import FastModel, FastState
from lily.model.fast_batch import BatchedDecode, bucket
from lily.model.greedy_step import BatchGreedyStep
from lily.model.prefill_stream import PendingPrefill, PrefillStream
from lily.model.slots import SlotPool, copy_state_into, reset_state, slot_nbytes

log = logging.getLogger("lily.engine")

DEFAULT_MAX_SEQ = 32768
DEFAULT_MAX_BATCH = 1   # one sequence at a time unless asked (`lily serve --max-batch` asks for 16)
GIB = 2 ** 30


# prefill chunk sizes, largest first, that _state_budget falls back to where the model's chunk leaves no room for
# one sequence: an 8K chunk prefilled a 32K prompt 2.5 % slower than a 16K one on the H200
# (benchmarks/results/prefill-h200-20261201-chunk16k.json)
PREFILL_CHUNKS = (8192, 4096, 2048)


def slots_for(config: ModelConfig, max_seq: int, max_batch: int, state_bytes: int | None,
              kv_dtype: str = "bf16", rec_dtype: str = "fp32") -> int:
    """How many slots: max_batch, or fewer when state_bytes (the budget of the pool) cannot hold them."""
    if state_bytes is None:
        return max(1, max_batch)
    per = slot_nbytes(config, max_seq, kv_dtype, rec_dtype)
    n = min(max_batch, state_bytes // per)
    if n < 1:
        raise ValueError(f"the memory budget leaves {state_bytes / GIB:.2f} GiB for sequence states; one sequence of "
                         f"{max_seq} tokens needs {per / GIB:.2f} GiB: lower --max-seq, or raise "
                         "--gpu-memory-fraction / --state-memory-gib")
    return n


class FastBackend:
    name = "fast"

    def __init__(self, config: ModelConfig, weights: dict, device="cuda", max_seq: int = DEFAULT_MAX_SEQ,
                 max_batch: int = DEFAULT_MAX_BATCH, state_bytes: int | None = None,
                 memory_fraction: float | None = None, reserve_bytes: int = 0, **model_kwargs):
        """max_batch slots of max_seq tokens, fewer when the budget of the pool cannot hold them: state_bytes,
        or (on CUDA) what memory_fraction of the GPU leaves once the weights are loaded, minus the peak of a
        full prefill chunk and reserve_bytes (the prefix cache's budget)."""
        self.config = config
        self.device = torch.device(device)
        self.max_seq = min(max_seq, config.max_position_embeddings)
        self.model = FastModel(config, weights, self.device, **model_kwargs)
        if state_bytes is None and memory_fraction is not None and self.device.type == "cuda":
            state_bytes = self._state_budget(memory_fraction, reserve_bytes, max_batch)
        self.max_batch = slots_for(config, self.max_seq, max_batch, state_bytes, self.model.kv_dtype,
                                   self.model.rec_dtype)
        self._state_bytes = state_bytes
        self._pool: SlotPool | None = None   # allocated by the first new_state() of the default size
        self._batch: BatchedDecode | None = None
        self._prefill_stream = PrefillStream(self.device)
        self.tokenizer_dir = None

    @property
    def pool(self) -> SlotPool:
        """The slots (max_batch of them, for max_seq tokens each), allocated on first use: a caller that only
        ever asks for states of other sizes (lily bench's rounds) never pays for them."""
        if self._pool is None:
            self._pool = SlotPool(self.config, self.max_batch, self.max_seq, self.device, self.model.kv_dtype,
                                  self.model.rec_dtype)
            self._batch = BatchedDecode(self.model, self._pool)
            budget = self._state_bytes
            log.info("%d sequence slots of %d tokens (%.2f GiB)%s", self.max_batch, self.max_seq,
                     self._pool.nbytes() / GIB, "" if budget is None else f" within a budget of {budget / GIB:.2f} GiB")
        return self._pool

    @property
    def batch(self) -> BatchedDecode:
        """The batched decode step over the slots."""
        if self._batch is None:
            self.pool  # (allocates the slots and their batched step)
        return self._batch

    def _state_budget(self, fraction: float, reserve: int, max_batch: int) -> int:
        """Bytes the slots may take: fraction x the GPU's memory, less what the GPU holds now (the weights,
        every context), less the measured peak of the largest scratch a request makes (one full prefill chunk:
        a prompt is prefilled in chunks; and a piece of prompt scoring: every position's logits; with an int8 KV
        cache, also the bf16 rows a chunk at the end of max_seq decodes for its attention) with a
        quarter more for the allocator's slack, less the batched step's logits, less reserve (the prefix cache's
        budget, which shrinks, into prefix_cache_bytes, when it would leave no room for one sequence).
        Where the model's prefill chunk leaves no room for one sequence (a 24 GB card: the weights take ~18.5
        GiB, a 16K chunk's scratch ~2 GiB), the largest of PREFILL_CHUNKS that does becomes the model's chunk
        (where none does, the smallest: slots_for then names the flags that make room)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        per = slot_nbytes(self.config, self.max_seq, self.model.kv_dtype, self.model.rec_dtype)
        step = 2 * bucket(max_batch) * self.config.vocab_size * 4      # the batched step's logits, and a copy
        first = self.model.prefill_chunk
        chunks = [first] + [c for c in PREFILL_CHUNKS if c < min(first, self.max_seq)]
        for chunk in chunks:
            peak = self._scratch_peak(chunk)
            left = int(fraction * total) - (total - free) - int(1.25 * peak) - step
            if left >= per or chunk == chunks[-1]:
                break
        if chunk != first and left >= per:
            log.warning("GPU memory is short: prompts prefill in chunks of %d tokens (not %d), which leaves room "
                        "for sequence states", chunk, first)
        self.model.prefill_chunk = chunk
        if left - reserve < per <= left:   # the prefix cache gives way so that one sequence fits
            reserve = left - per
        self.prefix_cache_bytes = reserve
        log.info("memory: %.1f GiB of %.1f GiB in use after loading; a request's scratch peaks at %.2f GiB; %.2f "
                 "GiB for the prefix cache; %.2f GiB left for sequence states (--gpu-memory-fraction %.2f)",
                 (total - free) / GIB, total / GIB, peak / GIB, reserve / GIB, (left - reserve) / GIB, fraction)
        return max(0, left - reserve)

    def _scratch_peak(self, chunk: int) -> int:
        """The measured peak of the scratch a request makes with prefill chunks of `chunk` tokens: one chunk, and
        a piece of prompt scoring (with an int8 KV cache, also the rows the last chunk decodes to bf16)."""
        from lily.engine.sequence import PROMPT_SCORING_PIECE

        dev, V = self.device, self.config.vocab_size
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        scratch = self.model.new_state(chunk)
        ids = [i % V for i in range(min(chunk, self.max_seq))]
        if self.model.prefill_by_kernels():   # (through the decode step a prompt makes no chunk's scratch)
            self.model.prefill(ids, scratch)
            reset_state(scratch)
        rows = self.model.prefill(ids[:PROMPT_SCORING_PIECE], scratch, logits="all")
        torch.log_softmax(torch.cat([rows[-1:], rows[:-1]]), -1)          # what scoring a piece holds at once
        del rows
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base - scratch.nbytes()
        if self.model.kv_dtype == "int8":   # a chunk late in a long prompt decodes up to max_seq rows to bf16 (K and V)
            c = self.config
            peak += 2 * max(0, self.max_seq - chunk) * c.num_key_value_heads * kv_row_bytes(c.head_dim, "bf16")
        del scratch
        torch.cuda.empty_cache()
        return peak

    @classmethod
    def from_dir(cls, model_dir, device="cuda", max_seq: int = DEFAULT_MAX_SEQ, progress=None,
                 max_batch: int = DEFAULT_MAX_BATCH, state_bytes: int | None = None,
                 memory_fraction: float | None = None, reserve_bytes: int = 0,
                 kv_dtype: str = "bf16", rec_dtype: str = "fp32") -> "FastBackend":
        from lily.checkpoint import load_checkpoint

        device = torch.device("cuda" if str(device) == "auto" else device)
        # FastModel repacks onto the GPU layer by layer; an original release is quantised on the GPU first
        ckpt = load_checkpoint(model_dir, device="cpu", progress=progress)
        backend = cls(ckpt.config, ckpt.weights, device, max_seq=max_seq, max_batch=max_batch,
                      state_bytes=state_bytes, memory_fraction=memory_fraction, reserve_bytes=reserve_bytes,
                      kv_dtype=kv_dtype, rec_dtype=rec_dtype)
        backend.tokenizer_dir = ckpt.tokenizer_dir
        return backend

    def new_state(self, max_seq: int | None = None) -> FastState:
        """An empty state (pos 0): the lowest free slot when the default size is asked for (it keeps its
        captured decode graph), else (another size, or every slot taken) a new allocation of its own."""
        if max_seq is None or max_seq == self.max_seq:
            state = self.pool.take()
            if state is not None:
                return state
        return self.model.new_state(max_seq or self.max_seq)

    def release_state(self, state: FastState) -> None:
        """The state's sequence is over (finished, failed or cancelled): a slot goes back to the pool, reset;
        a state of its own is dropped (freed)."""
        if self._pool is not None:
            self._pool.give(state)

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

    def prepare_state(self, state: FastState, prefill: bool = True) -> None:
        """Capture the state's decode CUDA graph now (it is otherwise made on the first decode), so a
        timed or latency-sensitive first step does not pay for it. The capture records, it runs nothing.
        prefill: also the prefill graphs, one a bucket (lily.model.prefill_graphs: on their staging state, shared
        by every state; otherwise each is made by the first prompt that needs it: that prompt runs eagerly,
        ~1.2-2x slower, and waits for the capture)."""
        if self.model.use_graph and state.graph is None:
            self.model._capture(state)
        graphs = self.model.prefill_graphs
        if prefill and graphs is not None and self.model.prefill_by_kernels():
            graphs.prepare()

    def prefill(self, ids, state: FastState) -> torch.Tensor:
        """fp32 logits [V] of the prompt's last position (on the GPU)."""
        return self.model.prefill(torch.as_tensor(ids).reshape(-1).tolist(), state)

    def launch_prefill(self, ids, state: FastState):
        """Queue a prompt piece and return without waiting: a lily.model.prefill_stream.PendingPrefill of its last
        position's logits. On CUDA the prefill kernels run on a stream of their own, beside the decode steps the
        engine queues meanwhile (they touch other states and no buffer in common); a prompt run through the
        decode step's buffers (no prefill kernels) runs here, in order."""
        if not self.model.prefill_by_kernels():
            return PendingPrefill(self.prefill(ids, state))
        return self._prefill_stream.launch(lambda: self.prefill(ids, state))

    def prefill_logits(self, ids, state: FastState) -> torch.Tensor:
        """fp32 logits of every position [T, V] (prompt log-probabilities; T x V floats on the GPU)."""
        return self.model.prefill(torch.as_tensor(ids).reshape(-1).tolist(), state, logits="all")

    def decode(self, token: int, state: FastState) -> torch.Tensor:
        return self.model.decode(int(token), state)

    def set_token_mask(self, bitmask: torch.Tensor | None) -> None:
        """A grammar's token bitmask for the greedy pick inside the decode graph (None: all tokens)."""
        self.model.set_token_mask(bitmask)

    samples_on_device = True   # a launched step's pick may be a draw (lily.kernels.sample)

    def launch_greedy(self, state: FastState, token: int | None = None, after=None, pick=None):
        """Queue one step (through the state's batch-1 graph) and return without waiting: a
        lily.model.greedy_step.GreedyStep. Input: `token`, or `after`'s pick still on the device; its own pick
        the argmax, or the draw `pick` (a lily.kernels.sample.RowSampling)."""
        return self.model.launch_greedy(state, token, after, pick)

    def launch_batch_greedy(self, states: list[FastState], tokens: list[int] | None = None, after=None,
                            picks=None):
        """Queue one step of several sequences and return without waiting: a
        lily.model.greedy_step.BatchGreedyStep. Input: `tokens`, or after = (an earlier BatchGreedyStep, each
        state's row in it): those rows' picks, still on the device; each row's own pick the argmax, or its draw
        in picks. Slots step together through the batched step; other states (outside the pool) through
        decode_batch, on the picks read back first."""
        t0 = time.perf_counter()
        if len(states) < 2 or self._pool is None or not all(self._pool.owns(st) for st in states):
            if after is not None:
                step, rows = after
                earlier = step.result()[0]
                tokens = [earlier[r] for r in rows]
            return BatchGreedyStep(self.decode_batch(tokens, states), launched_at=t0, picks=picks)
        self._check_rows(tokens, states)
        slots = [st.slot for st in states]
        if after is None:
            logits = self.batch.run(tokens, slots)
        else:
            step, rows = after
            earlier = step.token_dev
            if list(rows) != list(range(step.rows)):
                earlier = earlier[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
            logits = self.batch.run_picks(earlier, slots)
        for st in states:
            st.pos += 1
        return BatchGreedyStep(logits, launched_at=t0, picks=picks)

    def _check_rows(self, tokens: list[int] | None, states: list[FastState]) -> None:
        """Each row's token is in the vocabulary (None: tokens on the device) and its state has room for it."""
        for t in tokens or ():
            self.model._check_token(t)
        for st in states:
            if st.pos >= st.max_seq:
                raise ValueError(f"the sequence is full: {st.pos} tokens, state allocated for max_seq={st.max_seq}")

    def decode_batch(self, tokens: list[int], states: list[FastState]) -> torch.Tensor:
        """One step of several sequences: fp32 logits [B, V] (on the GPU). Slots decode together through the
        batched step; a lone sequence, or a state of its own, through the batch-1 step."""
        if len(states) == 1:
            return self.decode(tokens[0], states[0])[None]
        self._check_rows(tokens, states)
        rows = [i for i, st in enumerate(states) if self._pool is not None and self._pool.owns(st)]
        if len(rows) < 2:
            return torch.stack([self.decode(t, st) for t, st in zip(tokens, states)])
        batched = self.batch.run([tokens[i] for i in rows], [states[i].slot for i in rows])
        for i in rows:
            states[i].pos += 1
        if len(rows) == len(states):  # (the usual case: every sequence holds a slot)
            return batched.clone()
        out = torch.empty(len(states), self.config.vocab_size, dtype=torch.float32, device=self.device)
        for j, i in enumerate(rows):
            out[i] = batched[j]
        for i in sorted(set(range(len(states))) - set(rows)):
            out[i] = self.decode(tokens[i], states[i])
        return out

    def prepare_batches(self) -> list[int]:
        """Capture what decode replays, before any request needs it (CUDA; call it while no slot is in use):
        each slot's batch-1 graph (the stream left alone, in whatever slot, keeps the batch-1 speed without a
        capture mid-stream) and the batched step of every batch-size bucket the slots allow; the buckets."""
        if self.model.use_graph:
            for state in self.pool.states:   # (the prefill graphs once: every slot shares them)
                self.prepare_state(state, prefill=state is self.pool.states[0])
        return self.batch.prepare()

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
        snap.max_seq, snap.graph, snap.prefill_graphs = state.pos, None, {}
        snap.__dict__.pop("kv_decoded", None)   # (a captured prefill's buffers: the state's, not its contents)
        snap.__dict__.pop("slot", None)   # a snapshot is no slot
        return snap

    def state_nbytes(self, state: FastState) -> int:
        return state.nbytes()
