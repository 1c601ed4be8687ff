"""The reference forward pass of Qwen3.6-35B-A3B in plain PyTorch: the executable spec (docs/model.md §3).

Reads top to bottom like the spec: embedding, then per layer `h += Mixer(norm_in(h)); h += MoE(norm_post(h))`
with the mixer a Gated DeltaNet or gated full attention, then the final norm and the head.

`kv_dtype` "int8" stores each appended K and V row as an int8 cache holds it (lily.kernels.kv_int8: quantized
per (token, head) and dequantized back to fp32), the oracle of the fast backend's int8 cache. `rec_dtype` "bf16"
stores each GDN layer's recurrent state rounded to bf16 at the end of every forward call (a decode step, a prompt
or a piece of one), as the fast backend's bf16 state is stored; the recurrence itself stays fp32.

`dtype` is the activation dtype: float32 is the oracle; bfloat16 gives the "bf16 spread" (the noise
floor a bf16 engine should land in): every matmul, norm and mixer output is rounded to it, the KV cache
and conv state are stored in it. Weights are dequantized to fp32 (4-bit codes times bf16 scales are exact
there, as in a kernel that dequantizes in registers) and every product accumulates in fp32. Norms,
softmaxes, RoPE, the conv and the gated delta recurrence are fp32, and the recurrent state is fp32 (unless
rec_dtype says otherwise).

Weights stay MLX-quantized (`QuantTensor`) in memory and are dequantized on use. When the whole model
dequantized would be small (`dense_cache_bytes`, 2 GB by default) they are dequantized once and kept;
otherwise each matrix is dequantized when a layer runs and only the experts the router picked are touched,
so the full-size model runs on one GPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lily.config import ModelConfig, check_rec_dtype
from lily.kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent
from lily.kernels.kv_int8 import check_kv_dtype, kv8_roundtrip_reference
from lily.model import rope
from lily.quant import QuantTensor

F32 = torch.float32


@dataclass
class ReferenceState:
    """Everything a sequence carries between forward calls (docs/model.md §4), keyed by layer index."""

    pos: int = 0
    keys: dict[int, torch.Tensor] = field(default_factory=dict)    # [L, n_kv, head_dim], after k_norm + RoPE
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # [L, n_kv, head_dim]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)    # [K-1, conv_dim]: last pre-conv rows, oldest first
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # fp32 [Hv, dk, dv]

    def clone(self) -> "ReferenceState":
        return copy.deepcopy(self)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for d in (self.keys, self.values, self.conv, self.recurrent) for t in d.values())


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm with a plain gain (MLX checkpoints hold the effective gain). Returns fp32."""
    x = x.to(F32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32; eps added to the sum of squares as transformers and flash-linear-attention do."""
    x = x.to(F32)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class ReferenceModel:
    """model = ReferenceModel(config, weights); state = model.new_state(); logits = model.forward(ids, state).
    `weights` is the internals.md dict (QuantTensors and plain tensors, on any device)."""

    def __init__(self, config: ModelConfig, weights: dict, device="cpu", dtype: torch.dtype = torch.float32,
                 dense_cache_bytes: int = 2 * 1024**3, kv_dtype: str = "bf16", rec_dtype: str = "fp32"):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.rec_dtype = check_rec_dtype(rec_dtype)
        self._check_weights(weights)
        self.w: dict = {}
        for name, t in weights.items():
            if isinstance(t, QuantTensor):
                self.w[name] = t.to(self.device)
            else:  # norms, conv, dt_bias, A_log: applied in fp32 (pitfall 5: A_log is fp32 on disk too)
                self.w[name] = t.to(self.device, F32)
        dense = sum(_numel(t.shape) for t in self.w.values() if isinstance(t, QuantTensor))
        self._dense: dict[str, torch.Tensor] = {}
        if dense * 4 <= dense_cache_bytes:
            for name, t in self.w.items():
                if isinstance(t, QuantTensor):
                    self._dense[name] = t.dequantize(F32)
        self._inv_freq = rope.inv_freq(config, self.device)
        self._rope_factor = rope.attention_factor(config)      # YaRN's scale of cos and sin

    # -- weights -----------------------------------------------------------------------------------
    def _check_weights(self, weights: dict) -> None:
        c = self.config
        need = ["embed_tokens", "lm_head", "norm.weight"]
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate",
                     p + "mlp.shared_expert_gate"]
            need += [p + f"mlp.switch_mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            need += [p + f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            if kind == "full_attention":
                need += [p + f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                         "q_norm.weight", "k_norm.weight")]
            else:
                need += [p + f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                           "out_proj", "conv1d.weight", "A_log", "dt_bias",
                                                           "norm.weight")]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, first {missing[0]!r}")
        conv = weights[f"layers.{c.linear_attention_layers[0]}.linear_attn.conv1d.weight"] \
            if c.linear_attention_layers else None
        if conv is not None and tuple(conv.shape) != (c.linear_conv_dim, c.linear_conv_kernel_dim):
            raise ValueError(f"linear_attn.conv1d.weight is {tuple(conv.shape)}, expected "
                             f"[{c.linear_conv_dim}, {c.linear_conv_kernel_dim}] (normalised [C, K])")

    def _dense_weight(self, name: str) -> torch.Tensor:
        if name in self._dense:
            return self._dense[name]
        return self.w[name].dequantize(F32)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T accumulated in fp32, rounded to the activation dtype."""
        return (x.to(F32) @ self._dense_weight(name).T).to(self.dtype)

    def _expert(self, name: str, e: int) -> torch.Tensor:
        """One expert's dense [out, in] matrix; dequantizes only that expert when not cached."""
        if name in self._dense:
            return self._dense[name][e]
        q = self.w[name]
        return QuantTensor(q.weight[e], q.scales[e], q.biases[e], q.bits, q.group_size).dequantize(F32)

    # -- state -------------------------------------------------------------------------------------
    def new_state(self) -> ReferenceState:
        c = self.config
        s = ReferenceState()
        for i in c.linear_attention_layers:
            s.conv[i] = torch.zeros(c.linear_conv_kernel_dim - 1, c.linear_conv_dim, dtype=self.dtype,
                                    device=self.device)
            s.recurrent[i] = torch.zeros(c.linear_num_value_heads, c.linear_key_head_dim,
                                         c.linear_value_head_dim, dtype=F32, device=self.device)
        for i in c.full_attention_layers:
            s.keys[i] = torch.zeros(0, c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=self.device)
            s.values[i] = torch.zeros_like(s.keys[i])
        return s

    # -- forward -----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids, state: ReferenceState, logits_for: str = "all") -> torch.Tensor:
        """ids [T] (T >= 1) continuing `state` (advanced in place). Returns fp32 logits [T, V], or [1, V]
        for the last position with logits_for="last"."""
        # an oracle must not silently run its fp32 matmuls in TF32 because someone else allowed it
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            return self._forward(ids, state, logits_for)
        finally:
            torch.set_float32_matmul_precision(precision)

    __call__ = forward

    def _forward(self, ids, state: ReferenceState, logits_for: str) -> torch.Tensor:
        c = self.config
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("forward needs at least one token")
        if logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all' or 'last', got {logits_for!r}")
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {int(ids.min())}..{int(ids.max())}")
        h = self._embed(ids)
        for i, kind in enumerate(c.layer_types):
            x = rms_norm(h, self.w[f"layers.{i}.input_layernorm.weight"], c.rms_norm_eps).to(self.dtype)
            if kind == "full_attention":
                h = h + self._attention(i, x, state)
            else:
                h = h + self._gated_deltanet(i, x, state)
            x = rms_norm(h, self.w[f"layers.{i}.post_attention_layernorm.weight"], c.rms_norm_eps).to(self.dtype)
            h = h + self._moe(i, x)
        state.pos += ids.numel()
        if logits_for == "last":
            h = h[-1:]
        x = rms_norm(h, self.w["norm.weight"], c.rms_norm_eps).to(self.dtype)
        return self._head(x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if "embed_tokens" in self._dense:
            return self._dense["embed_tokens"][ids].to(self.dtype)
        q = self.w["embed_tokens"]  # a row gather, then dequantize just those rows
        packed = q.weight.view(torch.int32)[ids]  # CUDA cannot gather uint32; the codes unpack the same
        return QuantTensor(packed, q.scales[ids], q.biases[ids], q.bits, q.group_size).dequantize(self.dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(F32)
        if "lm_head" in self._dense:
            return x @ self._dense["lm_head"].T
        q = self.w["lm_head"]
        rows = 32768  # bound the dequantized slice of the [V, H] head
        return torch.cat([x @ QuantTensor(q.weight[s:s + rows], q.scales[s:s + rows], q.biases[s:s + rows], q.bits,
                                          q.group_size).dequantize(F32).T
                          for s in range(0, q.weight.shape[0], rows)], dim=-1)

    # -- gated full attention ------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """NeoX rotate-half RoPE on the first rotary_dim dims of x [T, heads, head_dim] (fp32 in and out)."""
        rd = self.config.rotary_dim
        pos = torch.arange(pos0, pos0 + x.shape[0], dtype=torch.float64, device=x.device)
        freqs = (pos[:, None] * self._inv_freq[None]).to(F32)
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None] * self._rope_factor
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None] * self._rope_factor
        r = x[..., :rd]
        return torch.cat([r * cos + rotate_half(r) * sin, x[..., rd:]], dim=-1)

    def _attention(self, i: int, x: torch.Tensor, state: ReferenceState) -> torch.Tensor:
        c = self.config
        p = f"layers.{i}.self_attn."
        T, H, Hkv, D = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg = self._linear(x, p + "q_proj").view(T, H, 2 * D)  # per head [query | gate] (pitfall 2)
        q, gate = qg[..., :D], qg[..., D:]
        q = self._rope(rms_norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps), state.pos)
        k = self._rope(rms_norm(self._linear(x, p + "k_proj").view(T, Hkv, D), self.w[p + "k_norm.weight"],
                                c.rms_norm_eps), state.pos)
        v = self._linear(x, p + "v_proj").view(T, Hkv, D)
        if self.kv_dtype == "int8":
            k, v = kv8_roundtrip_reference(k), kv8_roundtrip_reference(v.to(self.dtype))
        state.keys[i] = torch.cat([state.keys[i], k.to(self.dtype)])
        state.values[i] = torch.cat([state.values[i], v.to(self.dtype)])
        rep = H // Hkv
        K = state.keys[i].to(F32).transpose(0, 1)[:, None]    # [Hkv, 1, L, D]
        V = state.values[i].to(F32).transpose(0, 1)[:, None]  # query head h reads KV head h // rep
        L = K.shape[2]
        q = q.to(self.dtype).to(F32).reshape(T, Hkv, rep, D).permute(1, 2, 0, 3)  # [Hkv, rep, T, D]
        out = torch.empty(Hkv, rep, T, D, dtype=F32, device=x.device)
        block = max(1, (1 << 27) // max(1, H * L))  # query rows per block: scores stay under ~512 MB
        for s in range(0, T, block):
            e = min(s + block, T)
            scores = (q[:, :, s:e] @ K.transpose(-1, -2)) * D ** -0.5
            qpos = state.pos + torch.arange(s, e, device=x.device)
            future = torch.arange(L, device=x.device)[None, :] > qpos[:, None]
            probs = scores.masked_fill(future, float("-inf")).softmax(-1)
            out[:, :, s:e] = probs @ V
        out = out.permute(2, 0, 1, 3).reshape(T, H, D)
        o = (out * torch.sigmoid(gate.to(F32))).to(self.dtype)
        return self._linear(o.reshape(T, H * D), p + "o_proj")

    # -- Gated DeltaNet ------------------------------------------------------------------------------
    def _gated_deltanet(self, i: int, x: torch.Tensor, state: ReferenceState) -> torch.Tensor:
        c = self.config
        p = f"layers.{i}.linear_attn."
        T, Hk, Hv, dk, dv = x.shape[0], c.linear_num_key_heads, c.linear_num_value_heads, \
            c.linear_key_head_dim, c.linear_value_head_dim
        m = self._linear(x, p + "in_proj_qkv")                    # [T, conv_dim]: q | k | v, flat (pitfall 4)
        z = self._linear(x, p + "in_proj_z").view(T, Hv, dv)
        b = self._linear(x, p + "in_proj_b").to(F32)
        a = self._linear(x, p + "in_proj_a").to(F32)

        # causal depthwise conv over [conv state | new rows], fp32 accumulation, then SiLU
        K = c.linear_conv_kernel_dim
        seq = torch.cat([state.conv[i], m.to(self.dtype)]).to(F32)  # [K-1+T, C]
        w = self.w[p + "conv1d.weight"]                              # [C, K]
        y = sum(seq[j:j + T] * w[:, j] for j in range(K))
        state.conv[i] = seq[T:].to(self.dtype)                       # the last K-1 pre-conv rows
        y = F.silu(y).to(self.dtype)

        q = y[:, :Hk * dk].reshape(T, Hk, dk)
        k = y[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
        v = y[:, 2 * Hk * dk:].reshape(T, Hv, dv)
        q = l2_normalize(q) * dk ** -0.5
        k = l2_normalize(k)
        beta = torch.sigmoid(b)
        g = -self.w[p + "A_log"].exp() * F.softplus(a + self.w[p + "dt_bias"])
        rule = gated_delta_recurrent if T == 1 else gated_delta_chunked
        o, state.recurrent[i] = rule(q, k, v.to(F32), g, beta, state.recurrent[i])  # value head j -> key j // rep
        if self.rec_dtype == "bf16":
            state.recurrent[i] = state.recurrent[i].to(torch.bfloat16).to(F32)

        o = rms_norm(o, self.w[p + "norm.weight"], c.rms_norm_eps) * F.silu(z.to(F32))  # plain gain (pitfall 1)
        return self._linear(o.to(self.dtype).reshape(T, Hv * dv), p + "out_proj")

    # -- mixture of experts --------------------------------------------------------------------------
    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        p = f"layers.{i}.mlp."
        probs = self._linear(x, p + "gate").to(F32).softmax(-1)     # router is 8-bit (pitfall 6)
        top, idx = probs.topk(c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=F32, device=x.device)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            xe = x[tok].to(F32)
            gate = (xe @ self._expert(p + "switch_mlp.gate_proj", e).T).to(self.dtype)
            up = (xe @ self._expert(p + "switch_mlp.up_proj", e).T).to(self.dtype)
            hid = (F.silu(gate.to(F32)) * up.to(F32)).to(self.dtype)
            ye = (hid.to(F32) @ self._expert(p + "switch_mlp.down_proj", e).T).to(self.dtype)
            out.index_add_(0, tok, ye.to(F32) * top[tok, slot, None])
        hid = F.silu(self._linear(x, p + "shared_expert.gate_proj").to(F32)) \
            * self._linear(x, p + "shared_expert.up_proj").to(F32)
        shared = self._linear(hid.to(self.dtype), p + "shared_expert.down_proj")
        shared_gate = torch.sigmoid(self._linear(x, p + "shared_expert_gate").to(F32))
        return (out + shared_gate * shared.to(F32)).to(self.dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
