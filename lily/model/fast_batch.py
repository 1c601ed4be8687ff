"""The batched decode step: B sequences, each in its own slot of the slot pool, one token each.

Reads like shared/MODEL.md §3 with a row per sequence (h is [B, H], fp32):
  h = E[tokens]                                              embed_rows
  per layer:  x = rmsnorm_in(h)  (bf16)                      rmsnorm_rows
      GDN:    proj = x [Wqkv | Wz | Wb | Wa]                 q_gemm (the stacked in-projection, weights read once)
              y = silu(conv(m)) with the slot's conv state   conv_step_rows
              o = gated delta step on the slot's state       gdn_step_rows
              h += (gain * rmsnorm(o) * silu(z)) Wout        gated_rmsnorm (or in the step: FUSED_GATED_NORM), q_gemm
      attn:   proj = x [Wq | Wk | Wv]                        q_gemm
              o = attention over the slot's own length       attention_decode_rows (K/V appended at its position)
              h += o Wo                                      q_gemm (residual epilogue)
      MoE:    x = rmsnorm_post(h); logits = x [Wr | w_sg]    rmsnorm_rows, q_gemm (8-bit)
              h += sum_k w_k E_k(x) + sigmoid(x w_sg) S(x)   moe_path(B): "rows" (moe_rows: the
                                                             batch-1 kernels, a grid row a batch row), "union"
                                                             (moe_union: each chosen expert's weights stream
                                                             once for all the rows that chose it, on CUDA
                                                             cores) or "grouped" (moe_route_rows' plan, then
                                                             the prefill's grouped expert GEMMs)
  logits = rmsnorm_final(h) W_lm                             q_gemm
  positions of the valid rows += 1
The projections (the in- and out-projections, the router, the lm_head) read each weight once a step whatever B
is: up to quant_gemv_rows.MAX_ROWS rows as GEMVs over the rows (each tile's codes decoded once, the pre-norms in
their prologues: rmsnorm_in, rmsnorm_post before the router and rmsnorm_final launch no kernel of their own),
above it as skinny 4-bit GEMMs (the prefill's q_gemm: bf16 tiles on tensor cores, weights dequantized in
registers). Rows past n_valid pad the batch to its CUDA-graph bucket (1, 2, 4, 8, 16, ...): they route to no
expert and touch no state.

On CUDA each bucket's step is captured once as a CUDA graph (inputs: the token and slot of each row and
n_valid, copied in with one transfer); on the CPU (tests, TRITON_INTERPRET=1) it runs eagerly at B rows.
"""

from __future__ import annotations

import os

import torch

from lily.kernels.attention_decode_batch import attention_decode_rows
from lily.kernels.embedding import embed_rows
from lily.kernels.gdn_chunked import gated_rmsnorm
from lily.kernels.gdn_decode_batch import StepNormScratch, conv_step_rows, gdn_step_norm_rows, gdn_step_rows
from lily.kernels.host_math import next_power_of_2
from lily.kernels.moe_decode import MoERowsScratch, moe_rows
from lily.kernels.moe_grouped_gemm import moe_grouped
from lily.kernels.moe_route_batch import moe_route_rows
from lily.kernels.moe_union import UnionScratch, moe_union
from lily.kernels.q4_gemm import q_gemm, rmsnorm_rows
from lily.kernels.quant_gemv import PackedLinear
from lily.kernels.quant_gemv_rows import MAX_ROWS as GEMV_MAX_ROWS, gemv_rows
from lily.model.fast import FastModel, _rows
from lily.model.slots import SlotPool

F32 = torch.float32
# The MoE of the step: "union" (lily.kernels.moe_union: the union of the batch's experts, each read once for
# all the rows that chose it, CUDA-core dots, atomic adds into h), "rows" (the batch-1 decode kernels with a
# grid row a batch row: an expert chosen by two rows is read twice), "grouped" (the grouped expert GEMMs over
# the batch's routing plan, in blocks of 16 rows) or "auto": "union" from UNION_MIN_ROWS rows (None: never),
# "rows" below. H200 at 4K, random routing (scripts/gpu_batch_check.py --ab-moe): with moe_rows on 8-row units
# and blocks (benchmarks/results/batch-h200-20261203-moe-rows-8-16.json) "rows" beats "union" at every bucket,
# 3,014 against 2,776 tok/s at 32 rows and 3,543 against 3,279 at 64 (with its blocks before, union had led from
# 32 rows: 2,489 against 2,371, batch-h200-20261202-union.json); batch-h200-20261201-moe-rows.json: "rows" beat
# "grouped" at every bucket (+17 % to +38 %), and still does with "grouped" on the Hopper wgmma kernels (12.1
# against 13.8 ms a step at 32 rows, batch-h100-20261206-grouped-wgmma.json). LILY_BATCH_MOE overrides the default.
MOE_PATHS = ("auto", "union", "rows", "grouped")
MOE_PATH = os.environ.get("LILY_BATCH_MOE", "auto")
UNION_MIN_ROWS: int | None = None


def moe_path(rows: int) -> str:
    """The MoE path a step of `rows` rows takes (MOE_PATH, "auto" resolved by the row count)."""
    if MOE_PATH not in MOE_PATHS:
        raise ValueError(f"fast_batch.MOE_PATH (LILY_BATCH_MOE) {MOE_PATH!r}: expected one of {MOE_PATHS}")
    if MOE_PATH == "auto":
        return "union" if UNION_MIN_ROWS is not None and rows >= UNION_MIN_ROWS else "rows"
    return MOE_PATH


# The dense projections: "gemv" (quant_gemv_rows, up to GEMV_MAX_ROWS rows), "gemm" (q4_gemm.q_gemm) or "auto":
# "gemv" up to GEMV_MAX_ROWS rows, "gemm" above. LILY_BATCH_DENSE overrides the default.
DENSE_PATHS = ("auto", "gemv", "gemm")
DENSE_PATH = os.environ.get("LILY_BATCH_DENSE", "auto")


def dense_path(rows: int) -> str:
    """The dense projections' path in a step of `rows` rows (DENSE_PATH; "gemv" only up to GEMV_MAX_ROWS rows)."""
    if DENSE_PATH not in DENSE_PATHS:
        raise ValueError(f"fast_batch.DENSE_PATH (LILY_BATCH_DENSE) {DENSE_PATH!r}: expected one of {DENSE_PATHS}")
    return "gemv" if DENSE_PATH != "gemm" and rows <= GEMV_MAX_ROWS else "gemm"


# The GDN layers' gated RMSNorm inside the state update's launch (gdn_step_norm_rows: 30 launches fewer a step)
# or a launch of its own after it (gated_rmsnorm; LILY_BATCH_GDN_NORM=0). H100, alternating rounds at 4K: 2.299 /
# 2.307 against 2.361 / 2.357 ms a step at 2 rows, 4.571 / 4.590 against 4.647 / 4.643 at 8, 6.846 / 6.847 against
# 6.881 / 6.868 at 16, 32 rows even (11.08) (benchmarks/results/batch-h100-20261206-gdn-norm.json)
FUSED_GATED_NORM = os.environ.get("LILY_BATCH_GDN_NORM", "1") != "0"


def bucket(n: int) -> int:
    """The batch-size bucket whose graph serves n rows: the next power of two."""
    return next_power_of_2(max(1, n))


class _Layer:
    """One layer's weights as the batched step reads them: stacked projections as QuantTensor views of the
    fast model's packed tensors (no copy), norms in natural order."""

    def __init__(self, model: FastModel, i: int):
        c, w = model.config, model.prefill_weights
        kind, mix, moe, _, _, _ = model.layers[i]
        p = f"layers.{i}."
        self.kind = kind
        self.mix, self.router_gemv = mix, moe.router                  # the packed linears (for gemv_rows)
        self.in_norm = w[p + "input_layernorm.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        if kind == "full_attention":
            self.qkv = _rows(mix.qkv, 0, mix.qkv.n)
            self.o_proj = w[p + "self_attn.o_proj"]
            self.q_norm, self.k_norm = mix.q_norm, mix.k_norm
        else:
            self.in_proj = _rows(mix.in_proj, 0, mix.in_proj.n)
            self.out_proj = w[p + "linear_attn.out_proj"]
            self.conv_w, self.a_log, self.dt_bias, self.norm = mix.conv_w, mix.a_log, mix.dt_bias, mix.norm
        self.router = _rows(moe.router, 0, c.num_experts + 1)        # 8-bit: the router and the shared gate
        self.experts = moe.experts                                    # (for moe_union, moe_rows)
        ex, E1 = moe.experts, c.num_experts + 1                       # the shared expert stacked as expert E
        self.gate = _rows(ex.gate, 0, ex.gate.w.shape[-2], slice(0, E1))
        self.up = _rows(ex.up, 0, ex.up.w.shape[-2], slice(0, E1))
        self.down = _rows(ex.down, 0, ex.down.w.shape[-2], slice(0, E1))


class BatchedDecode:
    def __init__(self, model: FastModel, pool: SlotPool):
        self.model, self.pool = model, pool
        c = self.config = model.config
        dev = model.device
        self.max_rows = bucket(pool.n_slots) if model.use_graph else pool.n_slots
        self.layers = [_Layer(model, i) for i in range(c.num_hidden_layers)]
        self.final_norm = model.prefill_weights["norm.weight"]
        self.lm_head = model.prefill_weights["lm_head"]
        self.lm_head_gemv = model.lm_head
        # what a step reads from the host, in one buffer: tokens [max_rows] | slots [max_rows] | n_valid
        m = self.max_rows
        self.inputs = torch.zeros(2 * m + 1, dtype=torch.int32, device=dev)
        self.tokens, self.slots, self.n_valid = self.inputs[:m], self.inputs[m:2 * m], self.inputs[2 * m:]
        self.row_index = torch.arange(m, dtype=torch.int32, device=dev)
        self.logits = torch.empty(m, c.vocab_size, dtype=F32, device=dev)
        self.moe_rows_scratch = MoERowsScratch(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, m, dev)
        self.moe_union_scratch = UnionScratch(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, m,
                                              c.num_hidden_layers, dev)
        self.gdn_norm_scratch = StepNormScratch(m, c.linear_num_value_heads, c.linear_value_head_dim, dev)
        self.graphs: dict[int, object] = {}
        self._graph_pool = None

    # -- the step ------------------------------------------------------------------------------------
    def _step(self, rows: int) -> None:
        """The step's launches for `rows` rows (n_valid of them real): reads self.inputs, writes
        self.logits[:rows], advances the valid rows' slot positions."""
        c, m, pool = self.config, self.model, self.pool
        eps, hk = c.rms_norm_eps, c.linear_num_key_heads
        tokens, slots, nv = self.tokens[:rows], self.slots[:rows], self.n_valid
        cd, vd = c.linear_conv_dim, c.linear_value_dim
        path = moe_path(rows)
        gemv = dense_path(rows) == "gemv"
        h = embed_rows(m.embed, tokens)
        if path == "union":
            self.moe_union_scratch.reset()

        def project(lin: PackedLinear, qt, gain, n: int):
            """fp32 [rows, n] = RMSNorm(h) * gain @ W^T (a GEMV over the rows with the norm in its prologue, or the
            norm's kernel and a skinny GEMM)."""
            if gemv:
                return gemv_rows(lin, h, torch.empty(rows, n, dtype=F32, device=h.device), norm_gain=gain, eps=eps,
                                 pdl_family="rows_gemv")
            return q_gemm(rmsnorm_rows(h, gain, eps, pdl_family="rows_norm"), qt, out_dtype=F32,
                          pdl_family="rows_gemm")

        def add_projected(x, lin: PackedLinear, qt):
            """h += x @ W^T."""
            if gemv:
                gemv_rows(lin, x, h, accumulate=True, pdl_family="rows_gemv")
            else:
                q_gemm(x, qt, out=h, accumulate=True, pdl_family="rows_gemm")

        gi = ai = 0
        for li, L in enumerate(self.layers):
            if L.kind == "full_attention":
                proj = project(L.mix.qkv, L.qkv, L.in_norm, L.mix.qkv.n)
                o = attention_decode_rows(proj, pool.k_cache[ai], pool.v_cache[ai], pool.pos, slots, nv,
                                          L.q_norm, L.k_norm, m.inv_freq, eps, c.num_attention_heads)
                add_projected(o, L.mix.o_proj, L.o_proj)
                ai += 1
            else:
                proj = project(L.mix.in_proj, L.in_proj, L.in_norm, L.mix.in_proj.n)
                conv_step_rows(proj, L.conv_w, pool.conv_state[gi], slots, nv)
                if FUSED_GATED_NORM:
                    x = gdn_step_norm_rows(proj, pool.rec_state[gi], L.a_log, L.dt_bias, slots, nv, hk, L.norm, eps,
                                           self.gdn_norm_scratch)
                else:
                    o = gdn_step_rows(proj, pool.rec_state[gi], L.a_log, L.dt_bias, slots, nv, hk)
                    x = gated_rmsnorm(o, proj[:, cd:cd + vd], L.norm, eps)
                add_projected(x, L.mix.out_proj, L.out_proj)
                gi += 1
            if path == "rows":           # (moe_rows normalises h itself: only the router needs the norm)
                logits = project(L.router_gemv, L.router, L.post_norm, c.num_experts + 1)
                moe_rows(L.experts, h, L.post_norm, eps, logits, nv, self.moe_rows_scratch, c.norm_topk_prob)
                continue
            x, x_p = rmsnorm_rows(h, L.post_norm, eps, perm64_copy=True) if path == "union" else (
                rmsnorm_rows(h, L.post_norm, eps), None)
            logits = q_gemm(x, L.router, out_dtype=F32)
            if path == "union":
                moe_union(L.experts, h, x_p, logits, nv, self.moe_union_scratch, li, c.norm_topk_prob)
            else:
                plan, weights = moe_route_rows(logits, nv, c.num_experts_per_tok, c.norm_topk_prob)
                moe_grouped(x, plan, weights, L.gate, L.up, L.down, out=h)
        if gemv:
            gemv_rows(self.lm_head_gemv, h, self.logits[:rows], norm_gain=self.final_norm, eps=eps,
                      pdl_family="rows_gemv")
        else:
            q_gemm(rmsnorm_rows(h, self.final_norm, eps, pdl_family="rows_norm"), self.lm_head,
                   out=self.logits[:rows], pdl_family="rows_gemm")
        pool.pos.index_add_(0, slots, (self.row_index[:rows] < nv).to(torch.int32))

    # -- running it --------------------------------------------------------------------------------------
    def run(self, tokens: list[int], slots: list[int]) -> torch.Tensor:
        """fp32 logits [B, V] (a view, valid until the next run) after feeding tokens[b] to slot slots[b]."""
        return self._run(self.load_inputs(tokens, slots))

    def run_picks(self, picks: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """run() with each row's token on the device already (int32 [B], e.g. the previous step's picks)."""
        n = self.load_inputs([0] * len(slots), slots)
        self.tokens[:n].copy_(picks)
        return self._run(n)

    def _run(self, n: int) -> torch.Tensor:
        rows = bucket(n) if self.model.use_graph else n
        if self.model.use_graph:
            self.graph(rows).replay()
        else:
            self._step(rows)
        return self.logits[:n]

    def load_inputs(self, tokens: list[int], slots: list[int]) -> int:
        """Copy a step's inputs (tokens[b] for slot slots[b]; n_valid = their number) to the device in one
        transfer; returns n_valid."""
        n = len(tokens)
        if not 0 < n <= self.max_rows or len(slots) != n:
            raise ValueError(f"a batch of {n} rows ({len(slots)} slots); this step takes 1..{self.max_rows}")
        pad = self.max_rows - n
        host = torch.tensor(list(tokens) + [0] * pad + list(slots) + [0] * pad + [n], dtype=torch.int32)
        self.inputs.copy_(host, non_blocking=self.inputs.is_cuda)
        return n

    def graph(self, rows: int):
        """The bucket's CUDA graph, captured on first use: its kernels are compiled by one eager run with
        n_valid = 0 (nothing real happens, no state is touched), then the step is recorded."""
        if rows not in self.graphs:
            keep = self.inputs.clone()
            self.n_valid.zero_()
            self._step(rows)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
            self.graphs[rows] = self._record(lambda: self._step(rows))
            self.inputs.copy_(keep)
        return self.graphs[rows]

    def _record(self, step):
        """A CUDA graph of `step`, in the memory pool the buckets' graphs share (they never run at once;
        tests substitute a recorder that replays eagerly)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool):
            step()
        return g

    def prepare(self, up_to: int | None = None) -> list[int]:
        """Capture every bucket's graph up to `up_to` rows (default: all the slots), so no request waits for a
        compilation or a capture; the buckets captured."""
        if not self.model.use_graph:
            return []
        done, rows = [], 2
        while rows <= bucket(min(up_to or self.pool.n_slots, self.pool.n_slots)):
            self.graph(rows)
            done.append(rows)
            rows *= 2
        return done
