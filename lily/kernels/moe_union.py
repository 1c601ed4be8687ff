"""The MoE of a decode batch over the union of its rows' experts: each chosen expert's 4-bit weights come from
memory once for all the rows that chose it, on CUDA cores with the batch-1 kernels' dot (fp16 pairs, or fp32
with LILY_HALF_DOT=0 / LILY_HALF_DOT_OFF naming gate_up, down), in three launches a layer.

  route:   grid (B,): row b's top-k experts and weights (moe_decode.route_topk: softmax, top-k, renormalise;
           the shared expert E last, sigmoid-gated). Each (row, slot) pair p = b * (k+1) + slot is appended
           to its expert's list by the expert's atomic counter; the pair that opens a list appends the expert
           to the list of live experts. Rows at and past n_valid (a CUDA graph's padding) route nowhere.
  gate_up: persistent over units (chunk of CH intermediate rows, pair in expert order: the live experts'
           lists one after the other), chunk-major, so the pairs of one expert are neighbouring units that
           neighbouring programs run at the same time: their expert's tiles come from memory once and from L2
           for the others. A unit keeps its pair's x (the row of RMSNorm(h) * gain, fp32, PERM64 order) in
           registers and walks its chunk in blocks of BN rows, the next block's tiles requested before this
           block's arithmetic: act[p, rows] = silu(gate x) * up x. (Triton's cp.async loop pipeline instead,
           3-6 stages: slower on the H200, 8 rows 1.75 -> 2.27 ms of gate_up a step.)
  down:    the same units over chunks of hidden rows: h[b, rows] += w_p * down_e(act[p]), by atomic adds (a
           row's k+1 terms land in any order, so their sum's rounding is not fixed from run to run; fp32).

A decode batch's rows mostly choose different experts (random routing: 8 rows ~58 of the 257 stacked experts for
72 pairs, 32 rows ~165 for 288), so this reads ~20-45 % fewer bytes than the batch-1 kernels a row
(moe_decode.moe_rows), which read one copy a pair. The counters are per layer and zeroed once a step
(`UnionScratch.reset`): a layer's route needs them zero, and nothing after the layer's down reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import next_power_of_2
from lily.kernels import moe_decode
from lily.kernels.half_dot import x_scale, x_word_pairs
from lily.kernels.moe_decode import _expert_tile, group_dots, groups_of, route_topk
from lily.kernels.quant_gemv import INTERPRET, perm64, sm_count, x_codes


@triton.jit
def moe_union_route_kernel(logits_ptr, n_valid_ptr, count_ptr, live_ptr, list_ptr, wts_ptr,
                           E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
                           NORM_TOPK: tl.constexpr, ROWS: tl.constexpr, KEY32: tl.constexpr = False,
                           PAIRS: tl.constexpr = False):
    """Row b's pairs onto their experts' lists (count_ptr: [E+1] counters, then the live experts' count)."""
    b = tl.program_id(0)
    if b < tl.load(n_valid_ptr):
        sel_e, sel_w = route_topk(logits_ptr + b * (E + 1), E, E_P2, TOPK, TP2, NORM_TOPK, KEY32, PAIRS)
        sl = tl.arange(0, TP2)
        ok = sl < TOPK + 1
        pair = b * (TOPK + 1) + sl
        tl.store(wts_ptr + pair, sel_w, mask=ok)
        at = tl.atomic_add(count_ptr + sel_e, 1, mask=ok)             # a row's experts are distinct
        tl.store(list_ptr + sel_e * ROWS + at, pair, mask=ok)
        opens = ok & (at == 0)
        li = tl.atomic_add(count_ptr + (E + 1) + sl * 0, 1, mask=opens)
        tl.store(live_ptr + li, sel_e, mask=opens)


@triton.jit
def _live_pairs(count_ptr, live_ptr, E: tl.constexpr, EP: tl.constexpr):
    """The live experts in list order: (expert [EP], its pairs [EP], running end of its pairs [EP], pairs in
    all): the pairs in expert order are the live experts' lists one after the other."""
    li = tl.arange(0, EP)
    ok = li < tl.load(count_ptr + E + 1)
    ev = tl.load(live_ptr + li, mask=ok, other=0)
    cv = tl.load(count_ptr + ev, mask=ok, other=0)
    ends = tl.cumsum(cv, 0)
    return ev, cv, ends, tl.sum(cv, 0)


@triton.jit
def _unit_at(u, n_pairs, ev, cv, ends, list_ptr, rr, CH: tl.constexpr, ROWS: tl.constexpr, EP: tl.constexpr):
    """(expert, pair id, its first block's rows) of unit u = (chunk u // n_pairs of CH rows, the (u % n_pairs)-th
    pair in expert order)."""
    q = u % n_pairs
    li = tl.sum((ends <= q).to(tl.int32), 0)
    here = tl.arange(0, EP) == li
    e = tl.sum(tl.where(here, ev, 0), 0)
    first = tl.sum(tl.where(here, ends - cv, 0), 0)
    return e.to(tl.int64), tl.load(list_ptr + e * ROWS + (q - first)), (u // n_pairs) * CH + rr


@triton.jit
def _row_codes(row_ptr, word, NG: tl.constexpr, WPG: tl.constexpr, HALF_DOT: tl.constexpr):
    """A row's x (fp32, PERM64 order) as moe_decode.group_dots takes it: (its per-group sums [1, NG], the factor
    that undoes the dot's scaling, then x per code position: [1, NG * WPG] scaled as quant_gemv.code_value's
    codes, or with HALF_DOT the fp16 pairs of x_word_pairs, the row scaled by a power of two (in the sums too))."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x_codes(row_ptr, row_ptr, row_ptr, row_ptr, 0.0, word, word >= 0, True, 0,
                                             1, 1, 4, HALF_DOT)
    if HALF_DOT:
        raw = ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7))
        top = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                         tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        xs = x_scale(tl.max(tl.max(top, 1), 0))
        x0, x1, x2, x3, x4, x5, x6, x7 = x_word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, xs)
        return tl.sum(groups_of(raw, NG, WPG), axis=2) * xs, 1.0 / xs, x0, x1, x2, x3, x4, x5, x6, x7
    else:
        # the raw sums from the scaled positions: j and j + 4 share the scale 2^-4(j % 4)
        raw = (x0 + x4) + (x1 + x5) * 16.0 + (x2 + x6) * 256.0 + (x3 + x7) * 4096.0
        return tl.sum(groups_of(raw, NG, WPG), axis=2), 1.0, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def moe_union_gate_up_kernel(act_ptr, xp_ptr, count_ptr, live_ptr, list_ptr, gw, gs, gb, uw, us, ub,
                             E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr,
                             I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, ROWS: tl.constexpr,
                             HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False):
    """Units (chunk c of CH intermediate rows, pair q in expert order), chunk-major: the pairs of one expert
    are neighbouring units, run at the same time by neighbouring programs, so their expert's tiles come from
    memory once and from L2 after. A unit: x of the pair's row (kept in registers), then its chunk in blocks
    of BN rows, the next block's tiles requested before this block's arithmetic. HALF_DOT: the codes' dot in
    fp16 pairs (lily.kernels.half_dot), as the batch-1 kernels'."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    BITS: tl.constexpr = 4
    WPG: tl.constexpr = 8
    NG: tl.constexpr = H // 64
    WPR: tl.constexpr = H // 8
    g = tl.arange(0, NG)
    word = tl.arange(0, WPR)[None, :]
    rr = tl.arange(0, BN)
    ev, cv, ends, n_pairs = _live_pairs(count_ptr, live_ptr, E, EP)
    for u in range(pid, n_pairs * (I // CH), nprog):
        e64, pair, rows = _unit_at(u, n_pairs, ev, cv, ends, list_ptr, rr, CH, ROWS, EP)
        wg, sg, bg = _expert_tile(gw, gs, gb, e64, rows, rr >= 0, word, g, I, NG, WPR)
        wu, su, bu = _expert_tile(uw, us, ub, e64, rows, rr >= 0, word, g, I, NG, WPR)
        xsum, unscale, x0, x1, x2, x3, x4, x5, x6, x7 = _row_codes(xp_ptr + (pair // (TOPK + 1)).to(tl.int64) * H,
                                                                   word, NG, WPG, HALF_DOT)
        for blk in range(CH // BN):
            nmask = rr < BN * (blk + 1 < CH // BN)
            wg_n, sg_n, bg_n = _expert_tile(gw, gs, gb, e64, rows + BN, nmask, word, g, I, NG, WPR)
            wu_n, su_n, bu_n = _expert_tile(uw, us, ub, e64, rows + BN, nmask, word, g, I, NG, WPR)
            qg, bgf = group_dots(wg, sg, bg, x0, x1, x2, x3, x4, x5, x6, x7, NG, WPG, BITS, HALF_DOT, ASM)
            qu, buf = group_dots(wu, su, bu, x0, x1, x2, x3, x4, x5, x6, x7, NG, WPG, BITS, HALF_DOT, ASM)
            gv = tl.sum(sg.to(tl.float32) * qg + bgf * xsum, axis=1) * unscale
            uv = tl.sum(su.to(tl.float32) * qu + buf * xsum, axis=1) * unscale
            tl.store(act_ptr + pair.to(tl.int64) * I + perm64(rows), gv * tl.sigmoid(gv) * uv)   # PERM64: down's x
            rows += BN
            wg, sg, bg, wu, su, bu = wg_n, sg_n, bg_n, wu_n, su_n, bu_n


@triton.jit
def moe_union_down_kernel(h_ptr, act_ptr, wts_ptr, count_ptr, live_ptr, list_ptr, dw, ds, db,
                          E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr,
                          I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, ROWS: tl.constexpr,
                          HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False):
    """Units (chunk c of CH hidden rows, pair q in expert order), chunk-major as gate_up's: the pair's act in
    registers, its chunk in blocks of BN rows (the next block's tiles requested first), each block's
    w_pair * down_e(act) added into h[row] atomically. HALF_DOT as gate_up's."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    BITS: tl.constexpr = 4
    WPG: tl.constexpr = 8
    NG: tl.constexpr = I // 64
    WPR: tl.constexpr = I // 8
    g = tl.arange(0, NG)
    word = tl.arange(0, WPR)[None, :]
    rr = tl.arange(0, BN)
    ev, cv, ends, n_pairs = _live_pairs(count_ptr, live_ptr, E, EP)
    for u in range(pid, n_pairs * (H // CH), nprog):
        e64, pair, rows = _unit_at(u, n_pairs, ev, cv, ends, list_ptr, rr, CH, ROWS, EP)
        w, s, b = _expert_tile(dw, ds, db, e64, rows, rr >= 0, word, g, H, NG, WPR)
        ysum, unscale, y0, y1, y2, y3, y4, y5, y6, y7 = _row_codes(act_ptr + pair.to(tl.int64) * I, word, NG, WPG,
                                                                   HALF_DOT)
        wt = tl.load(wts_ptr + pair) * unscale
        hrow = h_ptr + (pair // (TOPK + 1)).to(tl.int64) * H
        for blk in range(CH // BN):
            nmask = rr < BN * (blk + 1 < CH // BN)
            w_n, s_n, b_n = _expert_tile(dw, ds, db, e64, rows + BN, nmask, word, g, H, NG, WPR)
            qd, bf = group_dots(w, s, b, y0, y1, y2, y3, y4, y5, y6, y7, NG, WPG, BITS, HALF_DOT, ASM)
            out = tl.sum(s.to(tl.float32) * qd + bf * ysum, axis=1) * wt
            tl.atomic_add(hrow + rows, out, sem="relaxed")
            rows += BN
            w, s, b = w_n, s_n, b_n


# -- buffers and launchers ---------------------------------------------------------------------------------

# (rows a block, rows a unit, programs an SM, warps) of gate_up and of down on the GPU; the fastest of
# scripts/gpu_batch_check.py --sweep-tiles moe on the H200 at 8 and 32 rows (4K context).
GATE_UP_TILE = (4, 64, 4, 4)
DOWN_TILE = (16, 128, 4, 4)


class UnionScratch:
    """The union MoE's buffers for up to `rows` rows and `layers` layers: per-layer counters [layers, E+2]
    (pairs a stacked expert, then the live experts), the lists [E+1, rows] and live experts [E+1] (shared by
    the layers, which run one after the other), the pair weights [rows * (k+1)] and act [rows * (k+1), I]."""

    def __init__(self, n_experts: int, top_k: int, inter: int, rows: int, layers: int, device=None):
        i32 = dict(dtype=torch.int32, device=device)
        self.n_experts, self.top_k, self.rows = n_experts, top_k, rows
        self.counters = torch.zeros(layers, n_experts + 2, **i32)
        self.lists = torch.empty(n_experts + 1, rows, **i32)
        self.live = torch.empty(n_experts + 1, **i32)
        self.weights = torch.empty(rows * (top_k + 1), dtype=torch.float32, device=device)
        self.act = torch.empty(rows * (top_k + 1), inter, dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Zero every layer's counters (once a step, before the first layer's route)."""
        self.counters.zero_()


def moe_union(ex, h: torch.Tensor, x_p: torch.Tensor, logits: torch.Tensor, n_valid: torch.Tensor,
              sc: UnionScratch, layer: int, norm_topk: bool = True, tiles: tuple | None = None) -> None:
    """h[b] += MoE(x[b]) for the rows b < n_valid of a decode batch, in place. ex: moe_decode.PackedExperts
    (4-bit, the shared expert stacked as expert E); h fp32 [B, H] natural order; x_p fp32 [B, H]: RMSNorm(h) *
    gain in PERM64 order (q4_gemm.rmsnorm_rows' perm64_copy); logits fp32 [B, E+1] the router's, the shared
    expert's gate last; n_valid int32 [1] on the device; layer: whose counters (zeroed by sc.reset() this
    step). tiles = (gate_up's (rows a block, rows a unit, programs an SM, warps), down's (the same)), default
    GATE_UP_TILE / DOWN_TILE."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    B, H = h.shape
    I, E = ex.inter, sc.n_experts
    if (B > sc.rows or ex.hidden != H or x_p.shape != (B, H) or logits.shape != (B, E + 1)
            or not (h.is_contiguous() and x_p.is_contiguous() and logits.is_contiguous())
            or h.dtype != torch.float32 or x_p.dtype != torch.float32 or not 0 <= layer < sc.counters.shape[0]):
        raise ValueError(f"moe_union: h {tuple(h.shape)} {h.dtype}, x_p {tuple(x_p.shape)} {x_p.dtype}, logits "
                         f"{tuple(logits.shape)}, scratch for {sc.rows} rows and {sc.counters.shape[0]} layers "
                         f"(layer {layer}), experts [{I}, {ex.hidden}]")
    k1 = sc.top_k + 1
    count = sc.counters[layer]
    moe_union_route_kernel[(B,)](logits, n_valid, count, sc.live, sc.lists, sc.weights,
                                 E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, TP2=next_power_of_2(k1),
                                 NORM_TOPK=norm_topk, ROWS=sc.rows, **moe_decode.topk_keys(), num_warps=4)
    sms = sm_count(h.device)
    gate_tile, down_tile = tiles or (((min(I, 32), I, 1, 4), (min(H, 64), H, 1, 4)) if INTERPRET
                                     else (GATE_UP_TILE, DOWN_TILE))
    for (bn, ch, _, _), n, what in ((gate_tile, I, "gate_up"), (down_tile, H, "down")):
        if ch % bn or n % ch:
            raise ValueError(f"moe_union: {what}'s blocks of {bn} rows must divide its units of {ch}, and those {n}")
    ep = next_power_of_2(E + 1)   # the live list's length at most (E routed experts and the shared one)
    pairs = B * k1   # a bound known on the host (the grids: at most this many pairs are routed)
    bn, ch, per_sm, warps = gate_tile
    moe_union_gate_up_kernel[(max(1, min(pairs * (I // ch), sms * per_sm)),)](
        sc.act, x_p, count, sc.live, sc.lists, ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b,
        E=E, EP=ep, TOPK=sc.top_k, H=H, I=I, BN=bn, CH=ch, ROWS=sc.rows, **moe_decode.half_dot("gate_up"),
        num_warps=warps)
    bn, ch, per_sm, warps = down_tile
    moe_union_down_kernel[(max(1, min(pairs * (H // ch), sms * per_sm)),)](
        h, sc.act, sc.weights, count, sc.live, sc.lists, ex.down.w, ex.down.s, ex.down.b,
        E=E, EP=ep, TOPK=sc.top_k, H=H, I=I, BN=bn, CH=ch, ROWS=sc.rows, **moe_decode.half_dot("down"),
        num_warps=warps)
