"""The prefill forward over the prefill kernels: a whole prompt, bounded chunks, the decode state written.

`prefill_forward(config, weights, state, ids)` runs ids (LongTensor [T] on the GPU) through the model
from whatever `state` already holds (a cached prefix continues), `chunk_tokens` tokens at a time so
scratch memory does not grow with the prompt, and leaves in `state` exactly what the decode step reads
(docs/internals.md: k_cache/v_cache, conv_state, rec_state, pos). Same math as docs/model.md §3:

  h = E[ids]                                          (fp32 residual stream)
  per layer:  x = rmsnorm_in(h)  (bf16)
      GDN:    [m | z] = x [Wqkv | Wz], [b | a] = x [Wb | Wa]   q_gemm x2 (fused projections, below)
              y = silu(conv(m))                          conv1d_prefill (conv state in/out)
              o = gated delta rule(y, b, a)              gdn_chunked_prefill (rec state in/out)
              h += (gain * rmsnorm(o) * silu(z)) Wout    gated_rmsnorm, q_gemm (residual epilogue)
      attn:   [qg | k | v] = x [Wq | Wk | Wv]            q_gemm
              cache[pos..] = rope(k_norm(k)), v          write_kv_prefill
              o = attn(rope(q_norm(q))) * sigmoid(gate)  flash_attention_prefill
              h += o Wo                                  q_gemm (residual epilogue)
      MoE:    x = rmsnorm_post(h); [r | s] = x [Wr | w_sg]; p = softmax(r); top-k, renormalised
              h += sum_k w_k E_k(x) + sigmoid(s) S(x)    moe_topk (k + 1 slots: the shared expert S is
                                                         expert E of the stack), moe_plan, moe_grouped
                                                         (fixed-order combine)
  logits = rmsnorm_final(h) W_lm                      q_gemm (last row only by default)

`weights` is the checkpoint's dict (docs/internals.md names) with every tensor on the GPU, plus the
fused projections of `FUSED`, the expert stack of `EXPERT_STACK` and attention's q / k norm gains with
RoPE's attention factor folded in (`QK_GAINS`, lily.model.rope.qk_norm_gain) (`with_fused_projections` adds
them; lily.model.fast hands out views of its concatenated weights and its own gains). Projections that read the same x are one
GEMM: fewer launches (a short prompt is bound by them), and each output element is the same dot product as
in its own GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lily.config import ModelConfig
from lily.kernels.conv1d_prefill import conv1d_prefill
from lily.kernels.flash_attention import flash_attention_prefill, position_tensor, write_kv_prefill
from lily.kernels.gdn_chunked import gated_rmsnorm, gdn_chunked_prefill
from lily.kernels.kv_int8 import is_kv8, kv_head_dim
from lily.kernels.moe_grouped_gemm import identity_plan, moe_grouped, moe_plan, permuted_x_wanted
from lily.kernels.moe_routing import moe_topk
from lily.kernels.q4_gemm import q_gemm, q_gemm_parts, rmsnorm_rows
from lily.model import rope
from lily.quant import QuantTensor

F32 = torch.float32
# H200: a 32K prompt 11 % faster in 8K chunks than in 4K (fuller expert blocks, +0.5 GiB peak), and at 0c87c59
# 722.9 -> 705.6 ms in 16K chunks (+0.9 GiB peak; benchmarks/results/prefill-h200-20261201-chunk16k.json)
DEFAULT_CHUNK = 16384


def _one_expert(w: QuantTensor) -> QuantTensor:
    """A [out, in] weight seen as a stack of one expert [1, out, in] (a view, no copy)."""
    return QuantTensor(w.weight[None], w.scales[None], w.biases[None], w.bits, w.group_size)


_IDENTITY_PLANS: dict = {}


def _identity_plan(T: int, device):
    """The shared expert's routing plan when it runs on its own (weights without EXPERT_STACK, or
    SHARED_WITH_ROUTED off), made once per (prompt chunk length, device). (16-row blocks with the gate/up's K
    split at short chunks lost on the H200: a 256-token prompt as a graph 18.8 -> 19.6 ms.)"""
    key = (T, str(device))
    if key not in _IDENTITY_PLANS:
        if len(_IDENTITY_PLANS) > 64:
            _IDENTITY_PLANS.clear()
        _IDENTITY_PLANS[key] = identity_plan(T, device, 64)
    return _IDENTITY_PLANS[key]


# fused name -> the projections it concatenates along the output rows, in order (a layer's prefix first)
FUSED = {
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.router": ("mlp.gate", "mlp.shared_expert_gate"),
}


# attention's q_norm / k_norm gains as the kernels take them: fp32, YaRN's attention factor folded into the
# rotary dims (lily.model.rope.qk_norm_gain); the checkpoint's ".weight" entries stay as loaded
QK_GAINS = {"self_attn.q_norm.gain": "self_attn.q_norm.weight", "self_attn.k_norm.gain": "self_attn.k_norm.weight"}


# The routed experts and the shared expert as one stack [E + 1, ...] (the shared expert last), a name a
# projection: the shared expert is one more (token, expert) pair a token in the routed experts' launches
# (its 16 rows a block at a short prompt re-read its 1.5 MB from L2) instead of two launches of its own.
EXPERT_STACK = {f"mlp.experts.{m}": (f"mlp.switch_mlp.{m}", f"mlp.shared_expert.{m}")
                for m in ("gate_proj", "up_proj", "down_proj")}
# Whether the prefill runs the shared expert inside the routed experts' launches (when the weights have
# EXPERT_STACK); else as a one-expert group of its own after them.
SHARED_WITH_ROUTED = True
# Where the router GEMM splits K (a short prompt: 257 columns, 8-bit), moe_topk sums its partials as it reads
# them (lily.kernels.q4_gemm.q_gemm_parts; the same sum, in the same order, bit for bit) instead of a sum
# kernel between them: one launch a layer fewer. H200, interleaved graph replays (median of 15): 17.70 ->
# 17.60 ms at 256 tokens, 78.80 -> 78.61 at 4K (benchmarks/results/prefill-h200-20261202-launch-savings.json).
ROUTER_PARTS_TO_TOPK = True
# The MoE's slot combine (which has each token's whole residual row) also writes the next layer's input norm
# (moe_grouped's next_input): one launch and one read of the residual a layer fewer. Measured in the same
# run: 17.70 -> 17.75 ms at 256 tokens, 78.80 -> 78.29 at 4K, within the rounds' spread either way: off.
NEXT_NORM_IN_COMBINE = False


def _cat(qs: list[QuantTensor]) -> QuantTensor:
    return QuantTensor(*(torch.cat([getattr(q, f) for q in qs]) for f in ("weight", "scales", "biases")),
                       qs[0].bits, qs[0].group_size)


def with_fused_projections(config: ModelConfig, weights: dict) -> dict:
    """weights plus FUSED's concatenations (copies) and EXPERT_STACK's stacks for every layer that lacks
    them. The stacked experts replace their parts with views of the stack (no second copy of the experts)."""
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for fused, parts in FUSED.items():
            if p + fused in out or p + parts[0] not in out:
                continue
            out[p + fused] = _cat([out[p + n] for n in parts])
        for gain, raw in QK_GAINS.items():
            if p + gain not in out and p + raw in out:
                out[p + gain] = rope.qk_norm_gain(config, out[p + raw]).to(out[p + raw].device)
        for stacked, (routed, shared) in EXPERT_STACK.items():
            if p + stacked in out or p + routed not in out:
                continue
            r, sh = out[p + routed], out[p + shared]
            st = out[p + stacked] = _cat([r, _one_expert(sh)])
            E = r.weight.shape[0]
            out[p + routed] = QuantTensor(st.weight[:E], st.scales[:E], st.biases[:E], st.bits, st.group_size)
            out[p + shared] = QuantTensor(st.weight[E], st.scales[E], st.biases[E], st.bits, st.group_size)
    return out


def _embed(w: QuantTensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows ids of the 4-bit table (gather the packed rows, then dequantize only those)."""
    words = w.weight.view(torch.int32)[ids]  # CUDA has no uint32 gather; the bits are the same
    return QuantTensor(words, w.scales[ids], w.biases[ids], w.bits, w.group_size).dequantize(F32)


class ChunkRows(NamedTuple):
    """Where a chunk sits, as its kernels read it from the device: pos (int32 [1], the position of its first
    row). A padded chunk (lily.model.prefill_graphs) also has valid (int32 [1]: its first n rows are the
    prompt) and pad (bool [T]: rows >= n)."""
    pos: torch.Tensor
    valid: torch.Tensor | None = None
    pad: torch.Tensor | None = None


def _gdn(c: ModelConfig, w: dict, p: str, x: torch.Tensor, h: torch.Tensor, conv_state: torch.Tensor,
         rec_state: torch.Tensor, rows: ChunkRows) -> None:
    mz = q_gemm(x, w[p + "in_proj_qkvz"])
    m, z = mz[:, :c.linear_conv_dim], mz[:, c.linear_conv_dim:]
    ba = q_gemm(x, w[p + "in_proj_ba"], out_dtype=F32)
    if rows.pad is not None:
        # padding rows get beta = sigmoid(-inf) = 0 and g = -exp(A) softplus(-inf) = 0: each leaves the
        # recurrent state exactly as it found it (no update, no decay)
        ba.masked_fill_(rows.pad[:, None], float("-inf"))
    b, a = ba[:, :c.linear_num_value_heads], ba[:, c.linear_num_value_heads:]
    y = conv1d_prefill(m, w[p + "conv1d.weight"], conv_state, n_valid=rows.valid)
    o = gdn_chunked_prefill(y, b, a, w[p + "A_log"], w[p + "dt_bias"], rec_state, c.linear_num_key_heads)
    o = gated_rmsnorm(o, z, w[p + "norm.weight"], c.rms_norm_eps)
    q_gemm(o, w[p + "out_proj"], out=h, accumulate=True)


def _kv_decode_buffers(state) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An int8-cache state's bf16 buffers for the rows the prefill attention decodes, made once a state, while a
    CUDA graph is being captured: each capture (a bucket's, a layer's) would otherwise keep a pair of its own for
    all the state's rows (eager chunks allocate theirs a call, for the rows they read). None: allocate a call."""
    if not is_kv8(state.k_cache) or not state.k_cache.is_cuda or not torch.cuda.is_current_stream_capturing():
        return None
    if getattr(state, "kv_decoded", None) is None:
        shape = (state.k_cache.shape[1], state.k_cache.shape[2], kv_head_dim(state.k_cache))
        state.kv_decoded = tuple(torch.empty(shape, dtype=torch.bfloat16, device=state.k_cache.device)
                                 for _ in range(2))
    return state.kv_decoded


def _attention(c: ModelConfig, w: dict, p: str, x: torch.Tensor, h: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, pos0: torch.Tensor, inv_freq: torch.Tensor,
               decoded: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    qkv = q_gemm(x, w[p + "qkv_proj"])
    qd, kvd = c.attn_q_dim, c.attn_kv_dim
    qg, k, v = qkv[:, :qd], qkv[:, qd:qd + kvd], qkv[:, qd + kvd:]
    write_kv_prefill(k, v, w[p + "k_norm.gain"], inv_freq, k_cache, v_cache, pos0, c.rms_norm_eps)
    o = flash_attention_prefill(qg, w[p + "q_norm.gain"], inv_freq, k_cache, v_cache, pos0,
                                c.num_attention_heads, c.rms_norm_eps, decoded=decoded)
    q_gemm(o, w[p + "o_proj"], out=h, accumulate=True)


def _moe(c: ModelConfig, w: dict, p: str, h: torch.Tensor, norm: torch.Tensor,
         next_norm: torch.Tensor | None = None) -> torch.Tensor | None:
    """h += the MoE block of rmsnorm(h) * norm. With next_norm (the next layer's input norm gain), and the
    shared expert with the routed ones: also returns that layer's input bf16 rmsnorm(h) * next_norm, made
    by the MoE's slot combine; else None."""
    stacked = SHARED_WITH_ROUTED and p + "experts.gate_proj" in w
    # the experts' input also in the Hopper kernels' permuted column order, from the same norm kernel, when
    # they will take it (a short prompt's small blocks)
    if permuted_x_wanted(h, h.shape[0] * (c.num_experts_per_tok + stacked), c.num_experts + stacked):
        x, xp = rmsnorm_rows(h, norm, c.rms_norm_eps, permuted_copy=True)
    else:
        x, xp = rmsnorm_rows(h, norm, c.rms_norm_eps), None
    if stacked:
        # [T, E + 1] (the experts', then the shared gate's), or where the router GEMM splits K its partials,
        # which moe_topk sums as it reads them (ROUTER_PARTS_TO_TOPK)
        parts = q_gemm_parts(x, w[p + "router"]) if ROUTER_PARTS_TO_TOPK else None
        logits = parts if parts is not None else q_gemm(x, w[p + "router"], out_dtype=F32)
        top, idx = moe_topk(logits, c.num_experts_per_tok, c.norm_topk_prob, shared=True)
        plan = moe_plan(idx, c.num_experts + 1)
        experts = [w[p + f"experts.{m}"] for m in ("gate_proj", "up_proj", "down_proj")]
        if next_norm is None:
            moe_grouped(x, plan, top.reshape(-1), *experts, out=h, x_permuted=xp)
            return None
        return moe_grouped(x, plan, top.reshape(-1), *experts, out=h, x_permuted=xp,
                           next_input=(next_norm, c.rms_norm_eps))[1]
    logits = q_gemm(x, w[p + "router"], out_dtype=F32)  # [T, E + 1]: the experts', then the shared gate's
    top, idx = moe_topk(logits[:, :c.num_experts], c.num_experts_per_tok, c.norm_topk_prob)
    plan = moe_plan(idx, c.num_experts)
    moe_grouped(x, plan, top.reshape(-1).contiguous(), w[p + "switch_mlp.gate_proj"],
                w[p + "switch_mlp.up_proj"], w[p + "switch_mlp.down_proj"], out=h)
    shared_w = torch.sigmoid(logits[:, c.num_experts])
    moe_grouped(x, _identity_plan(x.shape[0], x.device), shared_w,
                *(_one_expert(w[p + f"shared_expert.{m}"]) for m in ("gate_proj", "up_proj", "down_proj")),
                out=h)
    return None


def _forward_chunk(c: ModelConfig, w: dict, state, ids: torch.Tensor, inv_freq: torch.Tensor,
                   rows: ChunkRows) -> torch.Tensor:
    """One chunk at rows.pos; returns the final hidden rows h [T, H] fp32. Writes the state's KV rows, conv
    and recurrent state; state.pos is the caller's to advance. Nothing here waits for the device, so a CUDA
    graph can capture it."""
    h = _embed(w["embed_tokens"], ids)
    gi = ai = 0
    x = None   # the layer's input, when the previous layer's MoE made it (NEXT_NORM_IN_COMBINE)
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        if x is None:
            x = rmsnorm_rows(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        if kind == "full_attention":
            _attention(c, w, p + "self_attn.", x, h, state.k_cache[ai], state.v_cache[ai], rows.pos, inv_freq,
                       _kv_decode_buffers(state))
            ai += 1
        else:
            _gdn(c, w, p + "linear_attn.", x, h, state.conv_state[gi], state.rec_state[gi], rows)
            gi += 1
        last = i + 1 == c.num_hidden_layers
        next_norm = None if last or not NEXT_NORM_IN_COMBINE else w[f"layers.{i + 1}.input_layernorm.weight"]
        x = _moe(c, w, p + "mlp.", h, w[p + "post_attention_layernorm.weight"], next_norm)
    return h


@torch.no_grad()
def prefill_forward(config: ModelConfig, weights: dict, state, ids: torch.Tensor, logits: str = "last",
                    chunk_tokens: int = DEFAULT_CHUNK, graphs=None) -> torch.Tensor | None:
    """Run ids [T] (T >= 1, on the weights' device) from state.pos; advance the state.

    logits: "last" -> fp32 [V] of the last position; "all" -> fp32 [T, V]; "none" -> None.
    graphs: a lily.model.prefill_graphs.PrefillGraphs for these weights, or None: a chunk that fits one of
    its buckets runs as that bucket's CUDA graph (not with logits="all", which needs every row)."""
    c = config
    if logits not in ("last", "all", "none"):
        raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
    ids = ids.reshape(-1)
    T = ids.numel()
    if T == 0:
        raise ValueError("prefill needs at least one token")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    max_seq = state.k_cache.shape[1]
    if state.pos + T > max_seq:
        raise ValueError(f"prompt of {T} tokens after {state.pos} cached does not fit max_seq={max_seq}")
    if not any(k.endswith(tuple(FUSED)) for k in weights) or not any(k.endswith(tuple(QK_GAINS)) for k in weights):
        raise ValueError("prefill_forward: the weights lack the fused projections (with_fused_projections adds them)")
    inv_freq = rope.inv_freq(c, ids.device)
    rows = []
    for s in range(0, T, chunk_tokens):
        piece = ids[s:s + chunk_tokens]
        h = graphs.run(state, piece) if graphs is not None and logits != "all" else None
        if h is None:
            h = _forward_chunk(c, weights, state, piece, inv_freq, ChunkRows(position_tensor(state.pos, ids.device)))
        state.pos += piece.numel()
        if logits == "all":
            rows.append(h)
    if getattr(state, "pos_dev", None) is not None:
        state.pos_dev.fill_(state.pos)
    if logits == "none":
        return None
    h = torch.cat(rows) if logits == "all" else h[-1:]
    x = rmsnorm_rows(h, weights["norm.weight"], c.rms_norm_eps)
    out = q_gemm(x, weights["lm_head"], out_dtype=F32)
    return out if logits == "all" else out[0]
