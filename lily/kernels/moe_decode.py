"""MoE for one decode token in three launches: router + routing, the selected experts' gate_up + SwiGLU,
and down + combine.

The shared expert is stacked at load as expert E (`PackedExperts`), so it is the (TOPK+1)-th slot with
weight sigmoid(logits[E]) (the shared_expert_gate row is stacked after the router's E rows).

  router:  grid (ceil((E+1) / BN),): logits = W_r RMSNorm(h) (8-bit); the last program to finish does
           softmax / top-k / renormalise and writes route_e, route_w [TOPK+1] (a device counter, reset
           by that program, tells which one is last).
  gate_up: grid (I / BN, TOPK + 1): act[slot] = silu(gate_e x) * up_e x, x = RMSNorm(h) * gain (fused).
  down:    grid (H / BN,): h += sum_slot w_slot * down_e(act[slot])   (residual add in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import INTERPRET, PackedLinear, code_value, perm64, qdot_rows, split_halves
from lily.quant import QuantTensor


@triton.jit
def moe_router_kernel(logits_ptr, route_e_ptr, route_w_ptr, count_ptr, w_ptr, s_ptr, b_ptr, h_ptr, gain_ptr, eps,
                      K: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
                      E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
                      NORM_TOPK: tl.constexpr):
    """logits[:E+1] = W_router @ (RMSNorm(h) * gain) (row E: the shared expert's gate); then the program
    that finishes last routes: route_e / route_w [TOPK+1] (slot TOPK = the shared expert, sigmoid gate).

    Routing once here, instead of in every gate_up program, takes the 256-wide top-k off the critical
    path of the expert kernels (they only load their slot's expert id before requesting weights).
    Top-k packs each logit's order-preserving integer image with its index into one int64, so each of the
    TOPK rounds is a single max-reduction (ties go to the lower expert index, as torch.topk does)."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < E + 1
    acc, xsq = qdot_rows(w_ptr, s_ptr, b_ptr, rows, rmask, h_ptr, gain_ptr, gain_ptr, gain_ptr, eps,
                         K, BITS, BN, BG, 1, 1, 1, False)
    tl.store(logits_ptr + rows, acc * tl.rsqrt(xsq / K + eps), mask=rmask)
    tl.debug_barrier()                       # every thread's logits are stored before the count moves
    done = tl.atomic_add(count_ptr, 1)       # acq_rel at gpu scope: publishes them to the last program
    if done == tl.num_programs(0) - 1:
        offs = tl.arange(0, E_P2)
        lg = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
        bits = lg.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # monotone in the float value
        key = (ordered.to(tl.int64) << 32) | (E_P2 - 1 - offs).to(tl.int64)
        top = tl.max(lg, 0)
        sl = tl.arange(0, TP2)
        sel_e = tl.zeros([TP2], tl.int32) + E
        sel_l = tl.zeros([TP2], tl.float32) + top
        for i in tl.static_range(TOPK):
            best = tl.max(key, 0)
            hi = best >> 32
            idx = (E_P2 - 1 - (best - (hi << 32))).to(tl.int32)
            ob = hi.to(tl.int32)
            val = (ob ^ ((ob >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            sel_e = tl.where(sl == i, idx, sel_e)
            sel_l = tl.where(sl == i, val, sel_l)
            key = tl.where(offs == idx, -9223372036854775807, key)
        p = tl.where(sl < TOPK, tl.exp(sel_l - top), 0.0)
        if NORM_TOPK:
            denom = tl.sum(p, 0)
        else:
            denom = tl.sum(tl.exp(lg - top), 0)
        shared = tl.load(logits_ptr + E + sl * 0, cache_modifier=".cg")
        wt = tl.where(sl == TOPK, tl.sigmoid(shared), p / denom)
        tl.store(route_e_ptr + sl, sel_e, mask=sl <= TOPK)
        tl.store(route_w_ptr + sl, wt, mask=sl <= TOPK)
        tl.store(count_ptr, 0)               # ready for the next layer


@triton.jit
def moe_gate_up_kernel(act_ptr, route_e_ptr, hp_ptr, gain_p_ptr, eps,
                       gw, gs, gb, uw, us, ub,
                       H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                       GDC: tl.constexpr):
    """act[slot, rows] = silu(gate_e x) * up_e x for the slot's expert, x = RMSNorm(h) * gain (h and gain in
    PERM64 order, so each code position's x is one contiguous run). Both weight tiles cover whole rows and
    are requested before any arithmetic; x is shared by the two dots."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    wait_prior(GDC)                      # the routing and h come from the previous kernels
    expert = tl.load(route_e_ptr + slot)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < I
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    NG: tl.constexpr = H // 64
    WPR: tl.constexpr = H // PER
    HALF: tl.constexpr = PER // 2
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
    # per-group sums of x and sum(h^2), from one [NG, 64] load (order inside a group does not matter)
    kg = g[:, None] * 64 + tl.arange(0, 64)[None, :]
    hg = tl.load(hp_ptr + kg)
    xsum = tl.sum(hg * tl.load(gain_p_ptr + kg), axis=1)
    rstd = tl.rsqrt(tl.sum(tl.sum(hg * hg, 1), 0) / H + eps)  # RMSNorm of the input is a scalar: after the dots
    wg_lo, wg_hi = split_halves(wg)
    wu_lo, wu_hi = split_halves(wu)
    qg = tl.zeros([BN, NG, WPG], tl.float32)
    qu = tl.zeros([BN, NG, WPG], tl.float32)
    for j in tl.static_range(PER):
        # x in the weight tiles' own shape (rows a broadcast): no re-layout through shared memory
        k = tl.broadcast_to((g[:, None] * 64 + j * WPG + c[None, :])[None, :, :], [BN, NG, WPG])
        xs = tl.load(hp_ptr + k) * tl.load(gain_p_ptr + k) * (1.0 / (1 << ((j % HALF) * BITS)))
        qg += code_value(wg_lo, wg_hi, j, BITS) * xs
        qu += code_value(wu_lo, wu_hi, j, BITS) * xs
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
    w_lo, w_hi = split_halves(w)
    # the shared expert's dot is independent: issue it too before the routed arithmetic
    e_sh = tl.load(route_e_ptr + TOPK).to(tl.int64)
    sh, _ = qdot_rows(dw + e_sh * WOFF, ds + e_sh * SOFF, db + e_sh * SOFF, rows, rmask, act_ptr + TOPK * I,
                      act_ptr, act_ptr, act_ptr, 0.0, I, BITS, BN, NG, 0, 1, 1, True)
    # per-(slot, group) sums of act (the bias term), from one load (order inside a group does not matter)
    kg = sl[:, None, None] * I + (g[:, None] * 64 + tl.arange(0, 64)[None, :])[None, :, :]
    xsum = tl.sum(tl.load(act_ptr + kg, mask=smask[:, None, None], other=0.0), axis=2)   # [TP2, NG]
    qx = tl.zeros([BN, TP2, NG, WPG], tl.float32)
    m4x = tl.broadcast_to(smask[None, :, None, None], [BN, TP2, NG, WPG])
    for j in tl.static_range(PER):
        # act is PERM64-ordered: code position j of every word of a group is one contiguous run; loaded
        # in the weight tile's own shape (rows a broadcast), so no re-layout through shared memory
        k = sl[:, None, None] * I + (g[:, None] * 64 + j * WPG + c[None, :])[None, :, :]
        xk = tl.load(act_ptr + tl.broadcast_to(k[None, :, :, :], [BN, TP2, NG, WPG]), mask=m4x, other=0.0)
        qx += code_value(w_lo, w_hi, j, BITS) * (xk * (1.0 / (1 << ((j % HALF) * BITS))))
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


class MoEScratch:
    """Per-step MoE buffers shared by all layers: logits [E+1], route_e/route_w [TOPK+1], act [TOPK+1, I],
    and the router's completion counter (zero between launches)."""

    def __init__(self, n_experts: int, top_k: int, inter: int, device=None):
        f32 = dict(dtype=torch.float32, device=device)
        self.top_k = top_k
        self.logits = torch.empty(n_experts + 1, **f32)
        self.route_e = torch.empty(top_k + 1, dtype=torch.int32, device=device)
        self.route_w = torch.empty(top_k + 1, **f32)
        self.act = torch.empty(top_k + 1, inter, **f32)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)


def moe_decode(ex: "PackedExperts", router: PackedLinear, h: torch.Tensor, h_p: torch.Tensor, gain: torch.Tensor,
               gain_p: torch.Tensor, eps: float, sc: MoEScratch, norm_topk: bool = True, num_warps: int = 4,
               blocks: tuple[int, int, int] | None = None) -> None:
    """h += MoE(RMSNorm(h) * gain), in place; h_p (h in PERM64 order, read as the experts' input and
    rewritten); gain and gain_p (the gain in natural and PERM64 order); router: the 8-bit [E+1, H] stack
    of the router and the shared expert gate."""
    moe_route(router, h, gain, eps, sc, norm_topk, blocks[0] if blocks else None)
    moe_gate_up(ex, h_p, gain_p, eps, sc, num_warps, blocks[1] if blocks else None)
    moe_down(ex, h, h_p, sc, num_warps, blocks[2] if blocks else None)


def router_programs(router: PackedLinear, block: int | None = None) -> tuple[int, int]:
    """(rows per program, programs) of the router launch."""
    bn = block or (triton.next_power_of_2(router.n) if INTERPRET else 2)
    return bn, triton.cdiv(router.n, bn)


def moe_route(router: PackedLinear, h, gain, eps: float, sc: MoEScratch, norm_topk: bool = True,
              block: int | None = None) -> None:
    """sc.logits = router(RMSNorm(h) * gain); sc.route_e / route_w = the routing (first of three launches)."""
    E = router.n - 1
    bn, n_prog = router_programs(router, block)
    moe_router_kernel[(n_prog,)](
        sc.logits, sc.route_e, sc.route_w, sc.count, router.w, router.s, router.b, h, gain, eps,
        K=router.k, BITS=router.bits, BN=bn, BG=triton.next_power_of_2(router.k // 64),
        E=E, E_P2=triton.next_power_of_2(E), TOPK=sc.top_k, TP2=triton.next_power_of_2(sc.top_k + 1),
        NORM_TOPK=norm_topk, num_warps=1)   # one warp: the top-k reductions are shuffles, no barriers


def moe_gate_up(ex: "PackedExperts", h_p, gain_p, eps: float, sc: MoEScratch, num_warps: int = 4,
                block: int | None = None) -> None:
    """act[slot] = SwiGLU of the slot's expert (the second launch)."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    I, H = ex.inter, ex.hidden
    bn = block or (min(64, triton.next_power_of_2(I)) if INTERPRET else 4)
    moe_gate_up_kernel[(triton.cdiv(I, bn), sc.top_k + 1)](
        sc.act, sc.route_e, h_p, gain_p, eps,
        ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b,
        H=H, I=I, BITS=ex.gate.bits, BN=bn, GDC=pdl.active(sc.act), num_warps=num_warps,
        **pdl.launch_opts(sc.act))


def moe_down(ex: "PackedExperts", h, h_p, sc: MoEScratch, num_warps: int = 4, block: int | None = None) -> None:
    """h += sum_slot w_slot * down(act[slot]), h_p rewritten (the third launch)."""
    H, I = ex.hidden, ex.inter
    bn = block or (H if INTERPRET else 4)
    moe_down_kernel[(triton.cdiv(H, bn),)](
        h, h_p, sc.act, sc.route_e, sc.route_w, ex.down.w, ex.down.s, ex.down.b,
        TOPK=sc.top_k, TP2=triton.next_power_of_2(sc.top_k), H=H, I=I, BITS=ex.down.bits, BN=bn,
        GDC=pdl.active(h), num_warps=num_warps, **pdl.launch_opts(h))


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
