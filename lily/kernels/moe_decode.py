"""MoE for one decode token: routing, the selected experts' gate_up + SwiGLU, and down + combine, in two
launches (the router logits come from quant_gemv's 8-bit GEMV before them).

The shared expert is stacked at load as expert E (`prepare_experts`), so it is the (TOPK+1)-th slot with
weight sigmoid(logits[E]) (the shared_expert_gate row is stacked after the router's E rows).

Routing (softmax, top-k, renormalise) is done inside the gate_up kernel: every program recomputes the top-k
over the E logits (cheap next to its weight tile) and the programs of the first row block also write the
chosen experts and weights to `route` for the down kernel. Top-k packs each logit's order-preserving
integer image with its index into one int64, so each of the TOPK rounds is a single max-reduction
(ties go to the lower expert index, as torch.topk does on the CPU).

  gate_up: grid (I / BN, TOPK + 1): act[slot] = silu(gate_e x) * up_e x, x = RMSNorm(h) * gain (fused).
  down:    grid (H / BN,): h += sum_slot w_slot * down_e(act[slot])   (residual add in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import INTERPRET, PackedLinear, perm64, qdot_rows
from lily.quant import QuantTensor


@triton.jit
def _route(logits_ptr, slot, E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr,
           NORM_TOPK: tl.constexpr):
    """(expert, weight) of routing slot `slot` (slot == TOPK is the shared expert)."""
    offs = tl.arange(0, E_P2)
    lg = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"))
    bits = lg.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # monotone in the float value
    key = (ordered.to(tl.int64) << 32) | (E_P2 - 1 - offs).to(tl.int64)
    top = tl.max(lg, 0)
    sel_e = tl.min(offs, 0) + E
    sel_l = top
    denom = top * 0.0
    for i in tl.static_range(TOPK):
        best = tl.max(key, 0)
        hi = best >> 32
        idx = (E_P2 - 1 - (best - (hi << 32))).to(tl.int32)
        ob = hi.to(tl.int32)
        val = (ob ^ ((ob >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        denom += tl.exp(val - top)
        sel_e = tl.where(slot == i, idx, sel_e)
        sel_l = tl.where(slot == i, val, sel_l)
        key = tl.where(offs == idx, -9223372036854775807, key)
    if not NORM_TOPK:
        denom = tl.sum(tl.exp(lg - top), 0)
    w = tl.exp(sel_l - top) / denom
    w = tl.where(slot == TOPK, tl.sigmoid(tl.load(logits_ptr + E)), w)
    return sel_e, w


@triton.jit
def moe_gate_up_kernel(act_ptr, route_e_ptr, route_w_ptr, logits_ptr, hp_ptr, gain_p_ptr, eps,
                       gw, gs, gb, uw, us, ub,
                       E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr,
                       H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                       GDC: tl.constexpr):
    """act[slot, rows] = silu(gate_e x) * up_e x for the slot's expert, x = RMSNorm(h) * gain (h and gain in
    PERM64 order, so each code position's x is one contiguous run). Both weight tiles cover whole rows and
    are requested before any arithmetic; x is shared by the two dots."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    wait_prior(GDC)                      # the router logits and h come from the previous kernels
    expert, weight = _route(logits_ptr, slot, E, E_P2, TOPK, NORM_TOPK)
    if pid == 0:
        tl.store(route_e_ptr + slot, expert)
        tl.store(route_w_ptr + slot, weight)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < I
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    NG: tl.constexpr = H // 64
    WPR: tl.constexpr = H // PER
    HALF: tl.constexpr = PER // 2
    FIELD: tl.constexpr = (1 << BITS) - 1
    e64 = expert.to(tl.int64)
    g = tl.arange(0, NG)
    c = tl.arange(0, WPG)
    woff = e64 * (I * WPR) + rows.to(tl.int64)[:, None, None] * WPR + (g[:, None] * WPG + c[None, :])[None, :, :]
    m3 = rmask[:, None, None]
    wg = tl.load(gw + woff, mask=m3, other=0)                                       # [BN, NG, WPG]
    wu = tl.load(uw + woff, mask=m3, other=0)
    soff = e64 * (I * NG) + rows.to(tl.int64)[:, None] * NG + g[None, :]
    sg = tl.load(gs + soff, mask=rmask[:, None], other=0.0).to(tl.float32)
    bg = tl.load(gb + soff, mask=rmask[:, None], other=0.0).to(tl.float32)
    su = tl.load(us + soff, mask=rmask[:, None], other=0.0).to(tl.float32)
    bu = tl.load(ub + soff, mask=rmask[:, None], other=0.0).to(tl.float32)
    wg_hi = wg >> 16
    wu_hi = wu >> 16
    qg = tl.zeros([BN, NG, WPG], tl.float32)
    qu = tl.zeros([BN, NG, WPG], tl.float32)
    xsum = tl.zeros([NG], tl.float32)
    xsq = tl.zeros([NG, WPG], tl.float32)
    for j in tl.static_range(PER):
        k = g[:, None] * 64 + j * WPG + c[None, :]
        xk = tl.load(hp_ptr + k)
        xsq += xk * xk
        xk = xk * tl.load(gain_p_ptr + k)
        xsum += tl.sum(xk, axis=1)
        xs = (xk * (1.0 / (1 << ((j % HALF) * BITS))))[None, :, :]
        if j < HALF:
            srcg = wg
            srcu = wu
        else:
            srcg = wg_hi
            srcu = wu_hi
        fg = ((srcg & (FIELD << ((j % HALF) * BITS))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        fu = ((srcu & (FIELD << ((j % HALF) * BITS))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        qg += fg * xs
        qu += fu * xs
    rstd = tl.rsqrt(tl.sum(tl.sum(xsq, 1), 0) / H + eps)   # RMSNorm of the input is a scalar: after the dots
    gv = tl.sum(sg * tl.sum(qg, axis=2) + bg * xsum[None, :], axis=1) * rstd
    uv = tl.sum(su * tl.sum(qu, axis=2) + bu * xsum[None, :], axis=1) * rstd
    tl.store(act_ptr + slot * I + perm64(rows), gv * tl.sigmoid(gv) * uv, mask=rmask)   # PERM64 for down


@triton.jit
def moe_down_kernel(h_ptr, hp_ptr, act_ptr, route_e_ptr, route_w_ptr, dw, ds, db,
                    TOPK: tl.constexpr, TP2: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                    BITS: tl.constexpr, BN: tl.constexpr, GDC: tl.constexpr):
    """h[rows] += sum_slot w_slot * down_{e_slot}[rows] @ act[slot]. The routed slots are one 4-D tile
    [rows, slot, group, word], so every expert's words are requested at once (no per-slot load chain);
    the shared expert (slot TOPK) is a plain row dot."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < H
    rows64 = rows.to(tl.int64)
    wait_prior(GDC)                      # the routing and act come from gate_up
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    NG: tl.constexpr = I // 64
    WPR: tl.constexpr = I // PER
    HALF: tl.constexpr = PER // 2
    FIELD: tl.constexpr = (1 << BITS) - 1
    WOFF: tl.constexpr = H * WPR
    SOFF: tl.constexpr = H * NG
    sl = tl.arange(0, TP2)
    smask = sl < TOPK
    e = tl.load(route_e_ptr + sl, mask=smask, other=0).to(tl.int64)
    wt = tl.load(route_w_ptr + sl, mask=smask, other=0.0)
    g = tl.arange(0, NG)
    c = tl.arange(0, WPG)
    word = g[:, None] * WPG + c[None, :]                                           # [NG, WPG]
    m4 = rmask[:, None, None, None] & smask[None, :, None, None]
    w = tl.load(dw + e[None, :, None, None] * WOFF + rows64[:, None, None, None] * WPR + word[None, None, :, :],
                mask=m4, other=0)                                                 # [BN, TP2, NG, WPG]
    w_hi = w >> 16
    # the shared expert's dot is independent: issue it too before the routed arithmetic
    e_sh = tl.load(route_e_ptr + TOPK).to(tl.int64)
    sh, _ = qdot_rows(dw + e_sh * WOFF, ds + e_sh * SOFF, db + e_sh * SOFF, rows, rmask, act_ptr + TOPK * I,
                      act_ptr, act_ptr, act_ptr, 0.0, I, BITS, BN, NG, 0, 1, 1, True)
    qx = tl.zeros([BN, TP2, NG, WPG], tl.float32)
    xsum = tl.zeros([TP2, NG], tl.float32)
    for j in tl.static_range(PER):
        # act is PERM64-ordered: code position j of every word of a group is one contiguous run
        xk = tl.load(act_ptr + sl[:, None, None] * I + (g[:, None] * 64 + j * WPG + c[None, :])[None, :, :],
                     mask=smask[:, None, None], other=0.0)                        # [TP2, NG, WPG]
        xsum += tl.sum(xk, axis=2)
        if j < HALF:
            src = w
        else:
            src = w_hi
        field = (src & (FIELD << ((j % HALF) * BITS))) | 0x4B000000
        f = field.to(tl.float32, bitcast=True) - 8388608.0
        qx += f * (xk * (1.0 / (1 << ((j % HALF) * BITS))))[None, :, :, :]
    sums = tl.sum(qx, axis=3)                                                      # [BN, TP2, NG]
    soff = e[None, :, None] * SOFF + rows64[:, None, None] * NG + g[None, None, :]
    m3 = rmask[:, None, None] & smask[None, :, None]
    s = tl.load(ds + soff, mask=m3, other=0.0).to(tl.float32)
    b = tl.load(db + soff, mask=m3, other=0.0).to(tl.float32)
    per_slot = tl.sum(s * sums + b * xsum[None, :, :], axis=2)                     # [BN, TP2]
    acc = tl.sum(per_slot * wt[None, :], axis=1) + tl.load(route_w_ptr + TOPK) * sh
    h = tl.load(h_ptr + rows, mask=rmask, other=0.0)
    tl.debug_barrier()   # in place: every read before any write
    tl.store(h_ptr + rows, h + acc, mask=rmask)
    tl.store(hp_ptr + perm64(rows), h + acc, mask=rmask)


# -- load-time layout and launchers -----------------------------------------------------------------------

class PackedExperts:
    """Routed experts with the shared expert stacked last (index E): gate/up [E+1, I, H], down [E+1, H, I]."""

    def __init__(self, gate: QuantTensor, up: QuantTensor, down: QuantTensor,
                 shared_gate: QuantTensor, shared_up: QuantTensor, shared_down: QuantTensor, device=None):
        def stack(routed: QuantTensor, shared: QuantTensor) -> PackedLinear:
            cat = QuantTensor(torch.cat([routed.weight.to(device), shared.weight.to(device)[None]], 0),
                              torch.cat([routed.scales.to(device), shared.scales.to(device)[None]], 0),
                              torch.cat([routed.biases.to(device), shared.biases.to(device)[None]], 0),
                              routed.bits, routed.group_size)
            return PackedLinear(cat)
        self.gate = stack(gate, shared_gate)
        self.up = stack(up, shared_up)
        self.down = stack(down, shared_down)
        self.n_experts = gate.weight.shape[0]
        self.inter = gate.shape[-2]
        self.hidden = gate.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


def moe_decode(ex: PackedExperts, logits: torch.Tensor, h: torch.Tensor, h_p: torch.Tensor, gain_p: torch.Tensor,
               eps: float, top_k: int, act: torch.Tensor, route_e: torch.Tensor, route_w: torch.Tensor,
               norm_topk: bool = True, num_warps: int = 4, blocks: tuple[int, int] | None = None) -> None:
    """h += MoE(RMSNorm(h) * gain) given the router logits [E+1] (last = shared expert gate), in place;
    h_p (h in PERM64 order, read as the input and rewritten) and gain_p (the gain in PERM64 order).
    Scratch: act fp32 [top_k+1, I], route_e int32 [top_k+1], route_w fp32 [top_k+1]."""
    moe_gate_up(ex, logits, h_p, gain_p, eps, top_k, act, route_e, route_w, norm_topk, num_warps,
                blocks[0] if blocks else None)
    moe_down(ex, h, h_p, top_k, act, route_e, route_w, num_warps, blocks[1] if blocks else None)


def moe_gate_up(ex: PackedExperts, logits, h_p, gain_p, eps: float, top_k: int, act, route_e, route_w,
                norm_topk: bool = True, num_warps: int = 4, block: int | None = None) -> None:
    """Routing + act[slot] = SwiGLU of the slot's expert (the first of moe_decode's two launches)."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    E, I, H = ex.n_experts, ex.inter, ex.hidden
    bn = block or (min(64, triton.next_power_of_2(I)) if INTERPRET else 4)
    moe_gate_up_kernel[(triton.cdiv(I, bn), top_k + 1)](
        act, route_e, route_w, logits, h_p, gain_p, eps,
        ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b,
        E=E, E_P2=triton.next_power_of_2(E), TOPK=top_k, NORM_TOPK=norm_topk, H=H, I=I, BITS=ex.gate.bits,
        BN=bn, GDC=pdl.active(act), num_warps=num_warps, **pdl.launch_opts(act))


def moe_down(ex: PackedExperts, h, h_p, top_k: int, act, route_e, route_w, num_warps: int = 4,
             block: int | None = None) -> None:
    """h += sum_slot w_slot * down(act[slot]), h_p rewritten (the second launch)."""
    H, I = ex.hidden, ex.inter
    bn = block or (H if INTERPRET else 4)
    moe_down_kernel[(triton.cdiv(H, bn),)](
        h, h_p, act, route_e, route_w, ex.down.w, ex.down.s, ex.down.b,
        TOPK=top_k, TP2=triton.next_power_of_2(top_k), H=H, I=I, BITS=ex.down.bits, BN=bn, GDC=pdl.active(h),
        num_warps=num_warps, **pdl.launch_opts(h))


# -- plain torch reference ---------------------------------------------------------------------------------

def moe_reference(x: torch.Tensor, router_logits: torch.Tensor, shared_gate_logit: torch.Tensor,
                  gate: QuantTensor, up: QuantTensor, down: QuantTensor,
                  s_gate: QuantTensor, s_up: QuantTensor, s_down: QuantTensor, top_k: int,
                  norm_topk: bool = True) -> torch.Tensor:
    """MoE(x) for one token x [H] (already normed), fp32: softmax, top-k, renormalise, SwiGLU experts,
    plus the sigmoid-gated shared expert."""
    x = x.float()
    p = torch.softmax(router_logits.float(), -1)
    vals, idx = torch.topk(p, top_k)
    if norm_topk:
        vals = vals / vals.sum()
    silu = torch.nn.functional.silu
    out = torch.zeros_like(x)
    for w, e in zip(vals.tolist(), idx.tolist()):
        g = gate.weight[e], gate.scales[e], gate.biases[e]
        ge = QuantTensor(*g, gate.bits).dequantize() @ x
        ue = QuantTensor(up.weight[e], up.scales[e], up.biases[e], up.bits).dequantize() @ x
        de = QuantTensor(down.weight[e], down.scales[e], down.biases[e], down.bits).dequantize()
        out += w * (de @ (silu(ge) * ue))
    sh = s_down.dequantize() @ (silu(s_gate.dequantize() @ x) * (s_up.dequantize() @ x))
    return out + torch.sigmoid(shared_gate_logit.float()) * sh
