"""The fast forward pass: Qwen3.6-35B-A3B decode as Triton kernels, the whole step in one CUDA graph.

Reads like docs/model.md §3, one token at a time. Per layer (launches):
  Gated DeltaNet: in-proj GEMV (RMSNorm in, q|k|v|z|b|a stacked, conv step + SiLU in the epilogue)
                  -> gdn_decode (L2 norms, gates, fp32 state update, output, gated RMSNorm by the
                     head's last program) -> out_proj GEMV (residual add in the epilogue)             3
  attention:      q|k|v GEMV (RMSNorm in) -> prep (q/k norm, RoPE, K/V append) -> split-K -> combine
                  (sigmoid gate) -> o_proj GEMV (+ residual)                                          5
  MoE:            router|shared-gate 8-bit GEMV (RMSNorm in) -> experts gate_up + SwiGLU (top-k
                  inside) -> down + weighted combine + shared expert + residual                       3
then lm_head GEMV (final RMSNorm in, per-block argmax partials) and the greedy finish, which writes
the chosen token into the next step's input on the device and advances the position. So a replayed
graph needs nothing from the host: the host reads tokens from the device log one step behind.

The residual stream is fp32, kept twice: h (natural order) and h_p (PERM64 order, quant_gemv's docstring:
the 4-bit GEMVs read their input that way so their loads are contiguous); every producer writes both.
Weights stay in MLX's packed layout (projections sharing an input are stacked at load, the shared expert
is stacked after the routed experts); `prefill_weights` hands the same memory to the prefill kernels as
views under the checkpoint's names. State layout: docs/internals.md.
On the CPU (tests, TRITON_INTERPRET=1) the same kernels run eagerly without a graph.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from triton.runtime.errors import OutOfResources

from lily.config import ModelConfig, check_rec_dtype
from lily.kernels.attention_decode import AttentionScratch, attention_decode
from lily.kernels.embedding import embed
from lily.kernels.gdn_decode import GDNScratch, gdn_decode
from lily.kernels.greedy import greedy_finish
from lily.kernels.kv_int8 import check_kv_dtype, kv_cache_zeros
from lily.kernels.moe_decode import MoEScratch, PackedExperts, moe_down, moe_gate_up, moe_route
from lily.kernels.quant_gemv import PackedLinear, gemv, gemv_programs, perm64_index, prepare_concat
from lily.model import rope
from lily.model.greedy_step import GreedyStep, pick_tokens
from lily.quant import QuantTensor

F32 = torch.float32
TOKEN_LOG = 4096  # device ring of greedy tokens read back by the host
PREFILL_PROBE_TOKENS = 64   # the prompt that checks once whether this GPU runs the prefill kernels

log = logging.getLogger("lily.model")


def rec_torch_dtype(rec_dtype: str) -> torch.dtype:
    """The GDN recurrent state's storage dtype for a `--recurrent-state-dtype` name (checked)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[check_rec_dtype(rec_dtype)]


def _prefill_kernels():
    """lily.model.fast_prefill (the prefill kernels' forward) when it is present, else None."""
    if importlib.util.find_spec("lily.model.fast_prefill") is None:
        return None
    from lily.model import fast_prefill
    return fast_prefill if hasattr(fast_prefill, "prefill_forward") else None


def _prefill_graphs(config: ModelConfig, prefill_weights: dict, device, kv_dtype: str, rec_dtype: str):
    """The prefill graphs, on a staging state of their own (allocated with the model, so the slots' memory
    budget, measured after loading, leaves room for it)."""
    from lily.model.prefill_graphs import BUCKETS, PrefillGraphs
    return PrefillGraphs(config, prefill_weights, device,
                         staging=FastState(config, max(BUCKETS), device, kv_dtype, rec_dtype))


class FastState:
    """One sequence's decode state, preallocated for max_seq tokens (docs/internals.md layout)."""

    def __init__(self, config: ModelConfig, max_seq: int, device, kv_dtype: str = "bf16", rec_dtype: str = "fp32"):
        c = config
        self.config = config
        self.max_seq = max_seq
        self.device = torch.device(device)
        n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
        # bf16 [n_attn, max_seq, Hkv, D], or int8 rows (lily.kernels.kv_int8)
        self.k_cache = kv_cache_zeros((n_attn, max_seq), c.num_key_value_heads, c.head_dim, kv_dtype, device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.conv_state = torch.zeros(n_gdn, c.linear_conv_kernel_dim - 1, c.linear_conv_dim, dtype=torch.bfloat16,
                                      device=device)
        # fp32, or bf16 (rec_dtype): the kernels update it in fp32 and store it rounded
        self.rec_state = torch.zeros(n_gdn, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim, dtype=rec_torch_dtype(rec_dtype),
                                     device=device)
        self.pos = 0
        self.pos_dev = torch.zeros(1, dtype=torch.int32, device=device)
        self.graph = None  # the decode step captured against these buffers (made on first use)
        self.prefill_graphs = {}  # bucket -> prefill graph against these buffers (lily.model.prefill_graphs)

    def clone(self) -> "FastState":
        s = FastState.__new__(FastState)
        s.config, s.max_seq, s.device, s.pos = self.config, self.max_seq, self.device, self.pos
        for name in ("k_cache", "v_cache", "conv_state", "rec_state", "pos_dev"):
            setattr(s, name, getattr(self, name).clone())
        s.graph, s.prefill_graphs = None, {}
        return s

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.k_cache, self.v_cache, self.conv_state, self.rec_state, self.pos_dev))


class _GDNLayer:
    def __init__(self, c: ModelConfig, w: dict, p: str, device):
        self.in_proj = prepare_concat([w[p + n] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")],
                                      device)
        self.out_proj = PackedLinear(w[p + "out_proj"], device)
        self.conv_w = w[p + "conv1d.weight"].to(device, F32).reshape(c.linear_conv_dim, -1).contiguous()
        self.a_log = w[p + "A_log"].to(device, F32).contiguous()
        self.dt_bias = w[p + "dt_bias"].to(device, F32).contiguous()
        self.norm = w[p + "norm.weight"].to(device, F32).contiguous()


class _AttnLayer:
    def __init__(self, c: ModelConfig, w: dict, p: str, device):
        self.qkv = prepare_concat([w[p + n] for n in ("q_proj", "k_proj", "v_proj")], device)
        self.o_proj = PackedLinear(w[p + "o_proj"], device)
        # (YaRN's attention factor folded into their rotary dims: lily.model.rope)
        self.q_norm = rope.qk_norm_gain(c, w[p + "q_norm.weight"]).to(device).contiguous()
        self.k_norm = rope.qk_norm_gain(c, w[p + "k_norm.weight"]).to(device).contiguous()


class _MoE:
    def __init__(self, c: ModelConfig, w: dict, p: str, device):
        self.router = prepare_concat([w[p + "gate"], w[p + "shared_expert_gate"]], device)
        self.experts = PackedExperts(*(w[p + f"switch_mlp.{m}"] for m in ("gate_proj", "up_proj", "down_proj")),
                                     *(w[p + f"shared_expert.{m}"] for m in ("gate_proj", "up_proj", "down_proj")),
                                     device=device)


def _rows(lin: PackedLinear, start: int, stop: int, lead: slice | int | None = None) -> QuantTensor:
    """A QuantTensor view of rows [start, stop) (of expert(s) `lead`) of a packed linear: shares memory."""
    idx = (lead,) if lead is not None else ()
    w, s_, b = (t[idx] if idx else t for t in (lin.w, lin.s, lin.b))
    w = w[..., start:stop, :]
    return QuantTensor(w.view(torch.uint32) if hasattr(torch, "uint32") else w, s_[..., start:stop, :],
                       b[..., start:stop, :], lin.bits)


class FastModel:
    def __init__(self, config: ModelConfig, weights: dict, device="cuda", n_split: int | None = None,
                 use_graph: bool | None = None, prefill_mode: str = "auto", kv_dtype: str = "bf16",
                 rec_dtype: str = "fp32"):
        if prefill_mode not in ("auto", "kernels", "decode"):
            raise ValueError(f"prefill_mode {prefill_mode!r}: expected 'auto', 'kernels' or 'decode'")
        self.kv_dtype = check_kv_dtype(kv_dtype)   # the KV cache of every state this model makes
        self.rec_dtype = check_rec_dtype(rec_dtype)   # and its GDN recurrent state
        c = self.config = config
        self.device = torch.device(device)
        dev = self.device
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.eps = c.rms_norm_eps
        self.embed = PackedLinear(weights["embed_tokens"], dev)
        self.lm_head = PackedLinear(weights["lm_head"], dev)
        self.final_norm = weights["norm.weight"].to(dev, F32).contiguous()
        perm_h = perm64_index(c.hidden_size, dev)     # the 4-bit GEMVs read h (and gains) in PERM64 order
        self.final_norm_p = self.final_norm[perm_h].contiguous()
        self.layers = []
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            mixer = (_AttnLayer(c, weights, p + "self_attn.", dev) if kind == "full_attention"
                     else _GDNLayer(c, weights, p + "linear_attn.", dev))
            in_norm = weights[p + "input_layernorm.weight"].to(dev, F32)
            post_norm = weights[p + "post_attention_layernorm.weight"].to(dev, F32).contiguous()
            self.layers.append((kind, mixer, _MoE(c, weights, p + "mlp.", dev), in_norm[perm_h].contiguous(),
                                post_norm, post_norm[perm_h].contiguous()))
        self.inv_freq = rope.inv_freq(c, dev, F32)
        # scratch, shared by all layers and states (one step at a time)
        H, hv, dv = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim
        f32 = dict(dtype=F32, device=dev)
        self.h = torch.empty(H, **f32)
        self.h_p = torch.empty(H, **f32)                       # h in PERM64 order
        self.proj_gdn = torch.empty(c.linear_conv_dim + c.linear_value_dim + 2 * hv, **f32)
        self.proj_attn = torch.empty(c.attn_q_dim + 2 * c.attn_kv_dim, **f32)
        self.o = torch.empty(max(c.linear_value_dim, c.num_attention_heads * c.head_dim), **f32)
        self.gdn_scratch = GDNScratch(hv, dv, dev)
        self.moe_scratch = MoEScratch(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, dev)
        self.logits = torch.empty(c.vocab_size, **f32)
        n_part = gemv_programs(self.lm_head)
        self.pmax = torch.empty(n_part, **f32)
        self.pidx = torch.empty(n_part, dtype=torch.int32, device=dev)
        self.next_tok = torch.zeros(1, dtype=torch.int32, device=dev)
        # the greedy pick's token bitmask (a grammar's; all ones when unconstrained): the graph reads it
        self.token_mask = torch.full(((c.vocab_size + 31) // 32,), -1, dtype=torch.int32, device=dev)
        self.tok_log = torch.zeros(TOKEN_LOG, dtype=torch.int32, device=dev)
        self.step_count = torch.zeros(1, dtype=torch.int32, device=dev)
        if n_split is None:
            n_split = max(1, 128 // c.num_key_value_heads) if dev.type == "cuda" else 4
        self.attn_scratch = AttentionScratch(c.num_attention_heads, c.head_dim, n_split, dev)
        self._warm = False
        self.prefill_mode = prefill_mode
        # tokens a prefill runs at once (a prompt longer than this in chunks): lily.model.fast_prefill's default,
        # or less where GPU memory is short (lily.engine.fast_backend sizes it against the sequence slots)
        kernels = _prefill_kernels()
        self.prefill_chunk = kernels.DEFAULT_CHUNK if kernels is not None else 16384
        self.prefill_weights = self._weights_view(weights)
        self._prefill_fits = None if dev.type == "cuda" else True   # (prefill_kernels_fit)
        # short prompts as CUDA graphs (the host is their bottleneck); None: every chunk eagerly
        self.prefill_graphs = (_prefill_graphs(c, self.prefill_weights, dev, self.kv_dtype, self.rec_dtype)
                               if self.use_graph and dev.type == "cuda" and _prefill_kernels() is not None else None)

    def prefill_kernels_fit(self) -> bool:
        """Whether this GPU runs the prefill kernels, found once by a short prompt on a scratch state. Their
        tiles are sized on an H200 (227 KiB of shared memory a program); where a card allows less, the two that
        would ask more than 99 KiB (the gated delta rule's chunk walk and attention) take smaller tiles
        (lily.kernels.shared_memory; scripts/shared_memory_check.py compiles every launch for such a card).
        A GPU that still refuses one (Triton's OutOfResources, raised as it loads, before anything runs) sends
        prompts through the decode step (slower), and the log says so once. With prefill_mode "kernels"
        nothing is probed."""
        if self._prefill_fits is None and _prefill_kernels() is None:
            self._prefill_fits = False
        if self._prefill_fits is None:
            n = PREFILL_PROBE_TOKENS
            ids = torch.arange(n, device=self.device) % self.config.vocab_size
            scratch = FastState(self.config, n, self.device, self.kv_dtype, self.rec_dtype)
            try:
                _prefill_kernels().prefill_forward(self.config, self.prefill_weights, scratch, ids, logits="none")
                self._prefill_fits = True
            except OutOfResources as e:
                log.warning("the prefill kernels need more than this GPU has (%s): prompts run through the decode "
                            "step, token by token", e)
                self._prefill_fits = False
        return self._prefill_fits

    def prefill_by_kernels(self) -> bool:
        """Whether prompts run on the prefill kernels (else through the decode step)."""
        if self.prefill_mode == "decode" or _prefill_kernels() is None:
            return False
        return self.prefill_mode == "kernels" or self.prefill_kernels_fit()

    def _weights_view(self, weights: dict) -> dict:
        """The checkpoint dict (docs/internals.md names) as views into this model's packed tensors, for the
        prefill kernels: the big weights are not held twice. Small plain tensors are copied to the device."""
        c, dev = self.config, self.device
        out = {k: v.to(dev) for k, v in weights.items() if not isinstance(v, QuantTensor)}
        out["embed_tokens"] = _rows(self.embed, 0, self.embed.n)
        out["lm_head"] = _rows(self.lm_head, 0, self.lm_head.n)
        E, vd, hv = c.num_experts, c.linear_value_dim, c.linear_num_value_heads
        for i, (kind, mix, moe, _, _, _) in enumerate(self.layers):
            p = f"layers.{i}."
            if kind == "full_attention":
                qd, kvd = c.attn_q_dim, c.attn_kv_dim
                for name, (a, b) in {"q_proj": (0, qd), "k_proj": (qd, qd + kvd),
                                     "v_proj": (qd + kvd, qd + 2 * kvd)}.items():
                    out[p + "self_attn." + name] = _rows(mix.qkv, a, b)
                out[p + "self_attn.qkv_proj"] = _rows(mix.qkv, 0, qd + 2 * kvd)
                out[p + "self_attn.o_proj"] = _rows(mix.o_proj, 0, mix.o_proj.n)
                out[p + "self_attn.q_norm.gain"] = mix.q_norm       # fast_prefill.QK_GAINS
                out[p + "self_attn.k_norm.gain"] = mix.k_norm
            else:
                cd = c.linear_conv_dim
                for name, (a, b) in {"in_proj_qkv": (0, cd), "in_proj_z": (cd, cd + vd),
                                     "in_proj_b": (cd + vd, cd + vd + hv),
                                     "in_proj_a": (cd + vd + hv, cd + vd + 2 * hv)}.items():
                    out[p + "linear_attn." + name] = _rows(mix.in_proj, a, b)
                out[p + "linear_attn.in_proj_qkvz"] = _rows(mix.in_proj, 0, cd + vd)
                out[p + "linear_attn.in_proj_ba"] = _rows(mix.in_proj, cd + vd, cd + vd + 2 * hv)
                out[p + "linear_attn.out_proj"] = _rows(mix.out_proj, 0, mix.out_proj.n)
            out[p + "mlp.gate"] = _rows(moe.router, 0, E)
            out[p + "mlp.shared_expert_gate"] = _rows(moe.router, E, E + 1)
            out[p + "mlp.router"] = _rows(moe.router, 0, E + 1)
            ex = moe.experts
            for name, lin in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
                n = lin.w.shape[-2]
                out[p + f"mlp.switch_mlp.{name}"] = _rows(lin, 0, n, slice(0, E))
                out[p + f"mlp.shared_expert.{name}"] = _rows(lin, 0, n, E)
                out[p + f"mlp.experts.{name}"] = _rows(lin, 0, n, slice(0, E + 1))   # fast_prefill.EXPERT_STACK
        return out

    # -- state ---------------------------------------------------------------------------------------
    def new_state(self, max_seq: int = 32768) -> FastState:
        if max_seq < 1 or max_seq > self.config.max_position_embeddings:
            raise ValueError(f"max_seq={max_seq} must be in 1..{self.config.max_position_embeddings}")
        return FastState(self.config, max_seq, self.device, self.kv_dtype, self.rec_dtype)

    # -- the decode step -----------------------------------------------------------------------------
    def step_plan(self, st: FastState) -> list[tuple[str, int, int, object]]:
        """The decode step as (kernel class, launches, bytes it must move, launcher) in order; reads the
        token from self.next_tok. The check script times each class from this list."""
        c, eps = self.config, self.eps
        hk = c.linear_num_key_heads
        kv_row = 2 * c.num_key_value_heads * st.k_cache.shape[-1] * st.k_cache.element_size()
        sc = self.moe_scratch
        plan = [("embed", 1, 0, lambda: embed(self.embed, self.next_tok, self.h, self.h_p))]
        gi = ai = 0
        for kind, mix, moe, in_norm_p, post_norm, post_norm_p in self.layers:
            if kind == "full_attention":
                kc, vc = st.k_cache[ai], st.v_cache[ai]
                plan += [
                    ("attn_qkv", 1, mix.qkv.nbytes,
                     lambda mix=mix, n=in_norm_p: gemv(mix.qkv, self.h_p, self.proj_attn, norm_gain=n, eps=eps,
                                                        perm_x=True, pdl_family="attn_in")),
                    ("attn_core", 3, kv_row * (st.pos + 1),
                     lambda mix=mix, kc=kc, vc=vc: attention_decode(
                         self.proj_attn, kc, vc, st.pos_dev, mix.q_norm, mix.k_norm, self.inv_freq, eps,
                         c.num_attention_heads, self.attn_scratch, self.o)),
                    ("attn_o", 1, mix.o_proj.nbytes,
                     lambda mix=mix: gemv(mix.o_proj, self.o, self.h, residual=self.h, perm_x=True,
                                          out2=self.h_p, pdl_family="attn_out")),
                ]
                ai += 1
            else:
                cs, rs = st.conv_state[gi], st.rec_state[gi]
                plan += [
                    ("gdn_in", 1, mix.in_proj.nbytes + 2 * cs.numel() * cs.element_size(),
                     lambda mix=mix, n=in_norm_p, cs=cs: gemv(mix.in_proj, self.h_p, self.proj_gdn, norm_gain=n,
                                                              eps=eps, conv=(mix.conv_w, cs), perm_x=True,
                                                              pdl_family="gdn_in")),
                    ("gdn_core", 1, 2 * rs.numel() * rs.element_size(),
                     lambda mix=mix, rs=rs: gdn_decode(self.proj_gdn, rs, mix.a_log, mix.dt_bias, mix.norm, eps,
                                                       self.gdn_scratch, self.o, hk)),
                    ("gdn_out", 1, mix.out_proj.nbytes,
                     lambda mix=mix: gemv(mix.out_proj, self.o, self.h, residual=self.h, perm_x=True,
                                          out2=self.h_p, pdl_family="gdn_out")),
                ]
                gi += 1
            ex = moe.experts
            per_expert = (ex.gate.nbytes + ex.up.nbytes + ex.down.nbytes) // (ex.n_experts + 1)
            plan += [
                ("moe_router", 1, moe.router.nbytes,
                 lambda moe=moe, n=post_norm: moe_route(moe.router, self.h, n, eps, sc)),
                ("moe_gate_up", 1, per_expert * 2 // 3 * (c.num_experts_per_tok + 1),
                 lambda moe=moe, n=post_norm_p: moe_gate_up(moe.experts, self.h_p, n, eps, sc,
                                                          norm_topk=c.norm_topk_prob)),
                ("moe_down", 1, per_expert // 3 * (c.num_experts_per_tok + 1),
                 lambda moe=moe: moe_down(moe.experts, self.h, self.h_p, sc, norm_topk=c.norm_topk_prob)),
            ]
        plan += [
            ("lm_head", 1, self.lm_head.nbytes,
             lambda: gemv(self.lm_head, self.h_p, self.logits, norm_gain=self.final_norm_p, eps=eps, perm_x=True,
                          argmax=(self.pmax, self.pidx), token_mask=self.token_mask, pdl_family="lm_head")),
            ("greedy", 1, 0, lambda: greedy_finish(self.pmax, self.pidx, c.vocab_size, self.next_tok,
                                                   self.tok_log, self.step_count, st.pos_dev)),
        ]
        return plan

    def _launch_step(self, st: FastState) -> None:
        for _, _, _, launch in self.step_plan(st):
            launch()

    def launches_per_step(self) -> int:
        return sum(n for _, n, _, _ in self.step_plan(self._probe_state()))

    def _probe_state(self) -> FastState:
        return self.new_state(max_seq=1)

    def _warmup(self) -> None:
        """Compile every kernel once on a throwaway state, so graph capture sees no compilation."""
        if not self._warm:
            self._launch_step(self.new_state(max_seq=64))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._warm = True

    def _capture(self, st: FastState) -> None:
        # the warm-up step overwrites the token slot and the step counter: keep the caller's values
        saved = (self.next_tok.clone(), self.step_count.clone())
        self._warmup()
        g = self._record(lambda: self._launch_step(st))   # recorded, not run: the state is untouched
        self._first_launch(g, st)
        self.next_tok.copy_(saved[0])
        self.step_count.copy_(saved[1])
        st.graph = g

    @staticmethod
    def _first_launch(g, st: FastState) -> None:
        """Replay a new graph once at capture and undo what the step changed in the state, so the first
        replay that counts is not a cold launch (the bench's rounds on a just-captured graph decoded ~80 us
        a step slower over 64 steps on the H200). Restored: conv and recurrent state, the device position;
        the K/V row the step wrote at pos is rewritten by the next real step before anything reads it."""
        if st.pos >= st.max_seq:
            return
        keep = (st.conv_state.clone(), st.rec_state.clone(), st.pos_dev.clone())
        g.replay()
        st.conv_state.copy_(keep[0])
        st.rec_state.copy_(keep[1])
        st.pos_dev.copy_(keep[2])

    @staticmethod
    def _record(step):
        """A CUDA graph of `step` (tests substitute a recorder that replays eagerly)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return g

    def _run_step(self, st: FastState) -> None:
        if st.pos >= st.max_seq:
            raise ValueError(f"the sequence is full: {st.pos} tokens, state allocated for max_seq={st.max_seq}")
        if self.use_graph:
            if st.graph is None:
                self._capture(st)
            st.graph.replay()
        else:
            self._launch_step(st)
        st.pos += 1

    def set_token_mask(self, bitmask: torch.Tensor | None) -> None:
        """The bitmask (int32 words, lily.engine.constraints' layout) the next steps' greedy pick honours;
        None: every token. Copied into the buffer the graph reads, so no recapture."""
        if bitmask is None:
            self.token_mask.fill_(-1)
        else:
            self.token_mask.copy_(bitmask[:self.token_mask.numel()], non_blocking=True)

    def _check_token(self, token: int) -> None:
        if not 0 <= int(token) < self.config.vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.config.vocab_size})")

    @torch.no_grad()
    def decode(self, token: int, st: FastState) -> torch.Tensor:
        """Feed one token; fp32 logits [V] for the next one (a copy, on the model's device)."""
        self._check_token(token)
        self.next_tok.fill_(int(token))
        self._run_step(st)
        return self.logits.clone()

    @torch.no_grad()
    def launch_greedy(self, st: FastState, token: int | None = None, after: GreedyStep | None = None,
                      pick=None) -> GreedyStep:
        """Queue one step and return at once: its input is `token`, or `after`'s pick (a step of this state
        launched just before, read on the device: the host need not know it yet). Its pick is the greedy one
        (honouring the token mask: set_token_mask; all tokens unless a caller set one), or the draw `pick` (a
        lily.kernels.sample.RowSampling) from the step's logits."""
        if after is not None:
            self.next_tok.copy_(after.token_dev)
        else:
            self._check_token(token)
            self.next_tok.fill_(int(token))
        self._run_step(st)
        if pick is not None and not pick.greedy:
            return GreedyStep(pick_tokens(self.logits.reshape(1, -1), [pick]), self.logits)
        return GreedyStep(self.next_tok, self.logits)

    @torch.no_grad()
    def decode_greedy(self, token: int, st: FastState, n: int, stop_ids=()) -> list[int]:
        """Feed `token`, then n greedy steps entirely on the device; returns the n chosen tokens (ending
        early after a stop id; the stop token itself has then been fed too, being one step ahead)."""
        self._check_token(token)
        if n <= 0:
            return []
        if st.pos + n > st.max_seq:
            raise ValueError(f"{n} more tokens would pass max_seq={st.max_seq} (at {st.pos})")
        self.next_tok.fill_(int(token))
        out: list[int] = []
        stop = set(int(s) for s in stop_ids)
        if stop and not self.use_graph:          # eager (CPU): the host waits each step anyway
            for _ in range(n):
                self._run_step(st)
                out.append(int(self.next_tok.item()))
                if out[-1] in stop:
                    break
            return out
        if not stop:                               # all n steps queued, one read at the end of each chunk
            while len(out) < n:
                chunk = min(n - len(out), TOKEN_LOG)
                self.step_count.zero_()
                for _ in range(chunk):
                    self._run_step(st)
                out += self.tok_log[:chunk].tolist()
            return out
        # graph path with stop ids: read token i-1 while step i runs (one step behind)
        pinned = torch.empty(2, dtype=torch.int32, pin_memory=True)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        self.step_count.zero_()
        for i in range(n):
            if i % TOKEN_LOG == 0 and i:
                self.step_count.zero_()
            self._run_step(st)
            pinned[i % 2:i % 2 + 1].copy_(self.tok_log[i % TOKEN_LOG:i % TOKEN_LOG + 1], non_blocking=True)
            events[i % 2].record()
            if i:
                events[(i - 1) % 2].synchronize()
                t = int(pinned[(i - 1) % 2])
                out.append(t)
                if t in stop:
                    return out
        events[(n - 1) % 2].synchronize()
        out.append(int(pinned[(n - 1) % 2]))
        return out

    # -- prefill: the seam for lily/model/fast_prefill.py -----------------------------------------------
    @torch.no_grad()
    def prefill(self, ids, st: FastState, logits: str = "last") -> torch.Tensor:
        """Feed a prompt; fp32 logits [V] of its last position, or of every position [T, V] (logits="all").
        Uses lily.model.fast_prefill.prefill_forward when that module exists, else runs the decode step
        token by token."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        for t in ids:
            self._check_token(t)
        if st.pos + len(ids) > st.max_seq:
            raise ValueError(f"a {len(ids)}-token prompt would pass max_seq={st.max_seq} (at {st.pos})")
        if self.prefill_by_kernels():
            ids_t = torch.tensor(ids, dtype=torch.long)
            if self.device.type == "cuda":   # (no host wait: the piece may be queued on a stream still busy)
                ids_t = ids_t.pin_memory()
            ids_t = ids_t.to(self.device, non_blocking=True)
            out = _prefill_kernels().prefill_forward(self.config, self.prefill_weights, st, ids_t, logits=logits,
                                                     chunk_tokens=self.prefill_chunk, graphs=self.prefill_graphs)
            st.pos_dev.fill_(st.pos)
            return out
        if self.prefill_mode == "kernels":
            raise RuntimeError("prefill_mode='kernels' but lily.model.fast_prefill.prefill_forward is not available")
        rows = []
        for t in ids:
            self.next_tok.fill_(t)
            self._run_step(st)
            if logits == "all":
                rows.append(self.logits.clone())
        return torch.stack(rows) if logits == "all" else self.logits.clone()
