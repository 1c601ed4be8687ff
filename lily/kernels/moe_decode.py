"""MoE for one decode token in three launches: the router GEMV, routing + the selected experts' gate_up +
SwiGLU, and down + combine.

The shared expert is stacked at load as expert E (`PackedExperts`), so it is the (TOPK+1)-th slot with
weight sigmoid(logits[E]) (the shared_expert_gate row is stacked after the router's E rows).

  router:  logits = W_r RMSNorm(h) (8-bit, the persistent GEMV of quant_gemv).
  gate_up: grid (programs,): each program routes (softmax / top-k / renormalise over the E logits, once)
           and program 0 writes route_e, route_w [TOPK+1]; then units (slot, BN rows):
           act[slot] = silu(gate_e x) * up_e x, x = RMSNorm(h) * gain (fused).
  down:    grid (programs,): gate_up's routing (or, launched programmatically, each program routes again
           and requests its weight tiles before waiting on gate_up); blocks of BN rows,
           h += sum_slot w_slot * down_e(act[slot]) (residual in place).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.pdl import wait_prior
from lily.kernels import quant_gemv
from lily.kernels.half_dot import half_dot_tile, x_scale, x_word_pairs
from lily.kernels.quant_gemv import INTERPRET, PackedLinear, dot_codes, gemv, perm64, sm_count, x_codes
from lily.quant import QuantTensor


@triton.jit
def _top2(a1, b1, a2, b2):
    """The two largest of two (largest, second) pairs of distinct keys."""
    return tl.maximum(a1, a2), tl.maximum(tl.minimum(a1, a2), tl.maximum(b1, b2))


@triton.jit
def _key_expert(key, E_P2: tl.constexpr):
    """The expert index an int32 routing key carries in its low log2(E_P2) bits (stored as E_P2 - 1 - index)."""
    return E_P2 - 1 - (key & (E_P2 - 1))


@triton.jit
def route_topk(logits_ptr, E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
               NORM_TOPK: tl.constexpr, KEY32: tl.constexpr = False, PAIRS: tl.constexpr = False,
               BY_EXPERT: tl.constexpr = False):
    """(expert [TP2] int32, weight [TP2] fp32) of each slot from the router logits [E+1]: softmax, top-k,
    renormalise; slot TOPK is the shared expert (index E, weight sigmoid(logits[E])).

    Top-k packs each logit's order-preserving integer image with its index into one int64, so each of the
    TOPK rounds is a single max-reduction (ties go to the lower expert index, as torch.topk does).
    KEY32: into one int32 instead, the index in the image's low log2(E_P2) bits (logits within ~2^-15 of each
    other then count as tied: the lower index first); the chosen logits are read back exactly. PAIRS (with KEY32):
    the two largest keys a round (one reduction of (largest, second) pairs), so TOPK / 2 rounds.
    BY_EXPERT: the routed slots in ascending expert order instead of the logits' (the shared expert's slot and
    the padding stay where they are)."""
    offs = tl.arange(0, E_P2)
    lg = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"))
    bits = lg.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # monotone in the float value
    top = tl.max(lg, 0)
    sl = tl.arange(0, TP2)
    sel_e = tl.zeros([TP2], tl.int32) + E
    sel_l = tl.zeros([TP2], tl.float32) + top
    if KEY32:
        key = (ordered & ~(E_P2 - 1)) | (E_P2 - 1 - offs)
        taken = -2147483647 - 1                                  # int32's least: below every key
        if PAIRS:
            for i in tl.static_range(0, TOPK, 2):
                k1, k2 = tl.reduce((key, tl.full([E_P2], taken, tl.int32)), 0, _top2)
                idx1 = _key_expert(k1, E_P2)
                idx2 = _key_expert(k2, E_P2)
                sel_e = tl.where(sl == i, idx1, sel_e)
                if i + 1 < TOPK:
                    sel_e = tl.where(sl == i + 1, idx2, sel_e)
                key = tl.where((offs == idx1) | (offs == idx2), taken, key)
        else:
            for i in tl.static_range(TOPK):
                idx = _key_expert(tl.max(key, 0), E_P2)
                sel_e = tl.where(sl == i, idx, sel_e)
                key = tl.where(offs == idx, taken, key)
        sel_l = tl.load(logits_ptr + sel_e, mask=sl < TOPK, other=0.0)
    else:
        key = (ordered.to(tl.int64) << 32) | (E_P2 - 1 - offs).to(tl.int64)
        for i in tl.static_range(TOPK):
            best = tl.max(key, 0)
            hi = best >> 32
            idx = (E_P2 - 1 - (best - (hi << 32))).to(tl.int32)
            ob = hi.to(tl.int32)
            val = (ob ^ ((ob >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            sel_e = tl.where(sl == i, idx, sel_e)
            sel_l = tl.where(sl == i, val, sel_l)
            key = tl.where(offs == idx, -9223372036854775807, key)
    if BY_EXPERT:
        # each routed slot's place among them by expert index (distinct), the others after them in their order
        order = tl.where(sl < TOPK, sel_e, E_P2 + sl)
        place = tl.sum((order[None, :] < order[:, None]).to(tl.int32), 1)                  # [TP2]
        moved = place[None, :] == sl[:, None]                                              # [place, slot]
        sel_e = tl.sum(tl.where(moved, sel_e[None, :], 0), 1)
        sel_l = tl.sum(tl.where(moved, sel_l[None, :], 0.0), 1)
    p = tl.where(sl < TOPK, tl.exp(sel_l - top), 0.0)
    if NORM_TOPK:
        denom = tl.sum(p, 0)
    else:
        denom = tl.sum(tl.exp(lg - top), 0)
    shared = tl.load(logits_ptr + E + sl * 0)
    return sel_e, tl.where(sl == TOPK, tl.sigmoid(shared), p / denom)


@triton.jit
def _expert_tile(w_ptr, s_ptr, b_ptr, e64, rows, rmask, word, g, R: tl.constexpr, NG: tl.constexpr,
                 WPR: tl.constexpr):
    """Words [BN, WPR] and scales / biases [BN, NG] of rows `rows` of expert e64 (R rows an expert); word:
    [1, WPR] (a row as one contiguous run, so the compiler spreads the threads along it)."""
    w = tl.load(w_ptr + e64 * (R * WPR) + rows.to(tl.int64)[:, None] * WPR + word, mask=rmask[:, None], other=0)
    soff = e64 * (R * NG) + rows.to(tl.int64)[:, None] * NG + g[None, :]
    s = tl.load(s_ptr + soff, mask=rmask[:, None], other=0.0)
    b = tl.load(b_ptr + soff, mask=rmask[:, None], other=0.0)
    return w, s, b


@triton.jit
def groups_of(t, NG: tl.constexpr, W: tl.constexpr):
    """Words (or their x) [R, NG * W] or [R, S, NG * W] seen as [R, NG, W] or [R, S, NG, W]: a view, the
    per-thread layout is kept."""
    if len(t.shape) == 2:
        return tl.reshape(t, [t.shape[0], NG, W])
    else:
        return tl.reshape(t, [t.shape[0], t.shape[1], NG, W])


@triton.jit
def group_dots(w, s, b, x0, x1, x2, x3, x4, x5, x6, x7, NG: tl.constexpr, WPG: tl.constexpr, BITS: tl.constexpr,
               HALF_DOT: tl.constexpr, ASM: tl.constexpr):
    """(per-group dots of the codes of words w [R, NG * WPG] or [R, S, NG * WPG] with x, [R, (S,) NG]; the biases
    b as they multiply the group sums of x, fp32). x: per code position, [1, (S,) NG * WPG] as x_codes gives it,
    or with HALF_DOT its x_word_pairs; that dot is of code - 8, so its bias takes 8 * s."""
    if HALF_DOT:
        q = tl.sum(groups_of(half_dot_tile(w, x0, x1, x2, x3, x4, x5, x6, x7, ASM), NG, WPG // 2), axis=-1)
        return q, b.to(tl.float32) + 8.0 * s.to(tl.float32)
    else:
        q = dot_codes(groups_of(w, NG, WPG), groups_of(x0, NG, WPG), groups_of(x1, NG, WPG), groups_of(x2, NG, WPG),
                      groups_of(x3, NG, WPG), groups_of(x4, NG, WPG), groups_of(x5, NG, WPG), groups_of(x6, NG, WPG),
                      groups_of(x7, NG, WPG), BITS)
        return tl.sum(q, axis=-1), b.to(tl.float32)


@triton.jit
def unit_place(u, NBI: tl.constexpr, SLOTS: tl.constexpr, SHARED_FIRST: tl.constexpr,
               BLOCK_MAJOR: tl.constexpr = False):
    """(routing slot, rows block) of gate_up's unit u: (u // NBI, u % NBI), with SHARED_FIRST the shared expert's
    slot (SLOTS - 1) for the first NBI units and the routed slots after them; BLOCK_MAJOR: (u % SLOTS, u // SLOTS),
    every slot's block b before any slot's block b + 1, so a decode batch's rows that chose one expert in any slots
    read each of its blocks within one round of SLOTS units of each other (from L2 after the first)."""
    if BLOCK_MAJOR:
        return u % SLOTS, u // SLOTS
    elif SHARED_FIRST:
        return (u // NBI + SLOTS - 1) % SLOTS, u % NBI
    else:
        return u // NBI, u % NBI


@triton.jit
def _unit_tiles(u, n_units, sel_e, sl, gw, gs, gb, uw, us, ub, rr, word, g,
                NBI: tl.constexpr, BN: tl.constexpr, I: tl.constexpr, NG: tl.constexpr, WPR: tl.constexpr,
                SLOTS: tl.constexpr, SHARED_FIRST: tl.constexpr = False, BLOCK_MAJOR: tl.constexpr = False):
    """The gate and up tiles (words, scales, biases) of unit u = (slot, rows block) unit_place(u); nothing is read
    past the last unit."""
    ok = rr < BN - (u >= n_units).to(tl.int32) * BN
    slot, block = unit_place(u, NBI, SLOTS, SHARED_FIRST, BLOCK_MAJOR)
    rows = block * BN + rr
    e = tl.sum(tl.where(sl == slot, sel_e, 0), 0).to(tl.int64)
    wg, sg, bg = _expert_tile(gw, gs, gb, e, rows, ok, word, g, I, NG, WPR)
    wu, su, bu = _expert_tile(uw, us, ub, e, rows, ok, word, g, I, NG, WPR)
    return wg, sg, bg, wu, su, bu


@triton.jit
def _swiglu_unit(act_row_ptr, rows, wg, sg, bg, wu, su, bu, x0, x1, x2, x3, x4, x5, x6, x7, xsum, rstd,
                 NG: tl.constexpr, WPG: tl.constexpr, BITS: tl.constexpr, HALF_DOT: tl.constexpr, ASM: tl.constexpr):
    """act_row[rows] (PERM64 order, down's input) = silu(gate x) * up x from one unit's gate and up tiles."""
    qg, bgf = group_dots(wg, sg, bg, x0, x1, x2, x3, x4, x5, x6, x7, NG, WPG, BITS, HALF_DOT, ASM)
    qu, buf = group_dots(wu, su, bu, x0, x1, x2, x3, x4, x5, x6, x7, NG, WPG, BITS, HALF_DOT, ASM)
    gv = tl.sum(sg.to(tl.float32) * qg + bgf * xsum, axis=1) * rstd
    uv = tl.sum(su.to(tl.float32) * qu + buf * xsum, axis=1) * rstd
    tl.store(act_row_ptr + perm64(rows), gv * tl.sigmoid(gv) * uv)


@triton.jit
def moe_gate_up_kernel(act_ptr, route_e_ptr, route_w_ptr, logits_ptr, hp_ptr, gain_p_ptr, eps,
                       gw, gs, gb, uw, us, ub, n_valid_ptr,
                       E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
                       NORM_TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr,
                       BN: tl.constexpr, GDC: tl.constexpr, ROWS: tl.constexpr = False, AHEAD: tl.constexpr = 1,
                       HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False, KEY32: tl.constexpr = False,
                       PAIRS: tl.constexpr = False, SHARED_FIRST: tl.constexpr = False,
                       BY_EXPERT: tl.constexpr = False, BLOCK_MAJOR: tl.constexpr = False):
    """Routing, then act[slot, rows] = silu(gate_e x) * up_e x for each slot's expert, x = RMSNorm(h) * gain
    (h and gain in PERM64 order). Every program routes from the logits itself (in parallel, instead of one
    program serialising it at the end of the router); program 0 also writes route_e / route_w for down.
    Persistent over units (slot, block of BN rows): x per code position stays in registers, and the weight
    tiles of the program's next AHEAD units (1 or 2) are requested before this unit's arithmetic (2: for
    grids that give each program many units, as a decode batch's rows do).
    ROWS: one row of a decode batch per program_id(1) (rows past *n_valid_ptr: padding, nothing done), each with
    its own logits [E+1], h (natural order) and act / route slots; gain_p is then in natural order too.
    HALF_DOT: the codes' dot in fp16 pairs (lily.kernels.half_dot, as the GEMVs; ASM: its PTX, on the GPU).
    SHARED_FIRST (AHEAD 1): the shared expert's units come first (unit_place), and a program whose first unit is one
    of them computes it before waiting on the router: it needs no routing, so it overlaps the router's launch, and
    no program has more than two routed units after the wait where the 96 with three units had three.
    BY_EXPERT (route_topk's) and BLOCK_MAJOR (unit_place's): for a decode batch's rows, so that rows that chose one
    expert read its tiles at about the same time (moe_rows)."""
    tl.static_assert(not (SHARED_FIRST and BLOCK_MAJOR), "gate_up: SHARED_FIRST walks the units slot by slot")
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    SLOTS: tl.constexpr = TOPK + 1
    if ROWS:
        row = tl.program_id(1)
        if row >= tl.load(n_valid_ptr):
            return
        logits_ptr += row * (E + 1)
        hp_ptr += row * H
        act_ptr += row * (SLOTS * I)
        route_e_ptr += row * SLOTS
        route_w_ptr += row * SLOTS
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    NG: tl.constexpr = H // 64
    WPR: tl.constexpr = H // PER
    NBI: tl.constexpr = I // BN
    g = tl.arange(0, NG)
    word = tl.arange(0, WPR)[None, :]                                               # [1, WPR]
    x0, x1, x2, x3, x4, x5, x6, x7 = x_codes(hp_ptr, gain_p_ptr, hp_ptr, hp_ptr, eps, word, word >= 0, not ROWS,
                                             1, 1, 1, BITS, HALF_DOT)
    kg = g[:, None] * 64 + tl.arange(0, 64)[None, :]
    hg = tl.load(hp_ptr + kg)
    xg = hg * tl.load(gain_p_ptr + kg)
    xsum = tl.sum(xg, axis=1)[None, :]
    rstd = tl.rsqrt(tl.sum(tl.sum(hg * hg, 1), 0) / H + eps)  # RMSNorm of the input is a scalar: after the dots
    if HALF_DOT:
        # x in fp16 pairs (even words, odd words) scaled by a power of two, undone with rstd after the dots
        xs = x_scale(tl.max(tl.max(tl.abs(xg), 1), 0))
        x0, x1, x2, x3, x4, x5, x6, x7 = x_word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, xs)
        xsum = xsum * xs
        rstd = rstd / xs
    rr = tl.arange(0, BN)
    n_units = SLOTS * NBI
    start = pid
    if SHARED_FIRST:
        tl.static_assert(AHEAD == 1, "gate_up: SHARED_FIRST with one unit ahead")
        if pid < NBI:
            # unit pid is the shared expert's (index E, no routing needed): before the wait
            rows = pid * BN + rr
            wg, sg, bg = _expert_tile(gw, gs, gb, E, rows, rr < BN, word, g, I, NG, WPR)
            wu, su, bu = _expert_tile(uw, us, ub, E, rows, rr < BN, word, g, I, NG, WPR)
            _swiglu_unit(act_ptr + TOPK * I, rows, wg, sg, bg, wu, su, bu, x0, x1, x2, x3, x4, x5, x6, x7, xsum, rstd,
                         NG, WPG, BITS, HALF_DOT, ASM)
            start = pid + nprog
    # h is two launches back: with a programmatic launch, everything above overlaps the router GEMV
    wait_prior(GDC)                      # the router logits come from the previous kernel
    sel_e, sel_w = route_topk(logits_ptr, E, E_P2, TOPK, TP2, NORM_TOPK, KEY32, PAIRS, BY_EXPERT)
    sl = tl.arange(0, TP2)
    if pid == 0:
        tl.store(route_e_ptr + sl, sel_e, mask=sl < SLOTS)
        tl.store(route_w_ptr + sl, sel_w, mask=sl < SLOTS)
    wg, sg, bg, wu, su, bu = _unit_tiles(start, n_units, sel_e, sl, gw, gs, gb, uw, us, ub, rr, word, g,
                                         NBI, BN, I, NG, WPR, SLOTS, SHARED_FIRST, BLOCK_MAJOR)
    if AHEAD == 2:
        wg1, sg1, bg1, wu1, su1, bu1 = _unit_tiles(pid + nprog, n_units, sel_e, sl, gw, gs, gb, uw, us, ub, rr,
                                                   word, g, NBI, BN, I, NG, WPR, SLOTS, SHARED_FIRST, BLOCK_MAJOR)
    for u in range(start, n_units, nprog):
        slot, block = unit_place(u, NBI, SLOTS, SHARED_FIRST, BLOCK_MAJOR)
        rows = block * BN + rr
        # the unit AHEAD further on: its expert id, then its tiles, in flight during this unit's arithmetic
        wg_n, sg_n, bg_n, wu_n, su_n, bu_n = _unit_tiles(u + AHEAD * nprog, n_units, sel_e, sl, gw, gs, gb, uw, us,
                                                         ub, rr, word, g, NBI, BN, I, NG, WPR, SLOTS, SHARED_FIRST,
                                                         BLOCK_MAJOR)
        _swiglu_unit(act_ptr + slot * I, rows, wg, sg, bg, wu, su, bu, x0, x1, x2, x3, x4, x5, x6, x7, xsum, rstd,
                     NG, WPG, BITS, HALF_DOT, ASM)
        if AHEAD == 2:
            wg, sg, bg, wu, su, bu = wg1, sg1, bg1, wu1, su1, bu1
            wg1, sg1, bg1, wu1, su1, bu1 = wg_n, sg_n, bg_n, wu_n, su_n, bu_n
        else:
            wg, sg, bg, wu, su, bu = wg_n, sg_n, bg_n, wu_n, su_n, bu_n


@triton.jit
def moe_down_kernel(h_ptr, hp_ptr, act_ptr, route_e_ptr, route_w_ptr, logits_ptr, dw, ds, db, n_valid_ptr,
                    E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
                    NORM_TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                    BITS: tl.constexpr, BN: tl.constexpr, GDC: tl.constexpr, ROUTE_SELF: tl.constexpr,
                    ROWS: tl.constexpr = False, HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False,
                    KEY32: tl.constexpr = False, PAIRS: tl.constexpr = False, BY_EXPERT: tl.constexpr = False):
    """h[rows] += sum_slot w_slot * down_{e_slot}[rows] @ act[slot] + w_shared * down_shared[rows] @ act[TOPK].
    Persistent over blocks of BN rows: the routed slots are one 4-D tile [rows, slot, group, word], so every
    expert's words are requested at once; act per code position stays in registers; the next block's
    tiles are requested before this block's arithmetic.
    The routing: gate_up's (route_e / route_w, after the wait), or with ROUTE_SELF computed again from the
    router's logits (route_topk, as gate_up does: the same experts and weights, bit for bit). The logits are
    two launches back, so with a programmatic launch the routing and the first block's weight tiles are
    requested before waiting on gate_up (without one, that routing would only lengthen the chain).
    ROWS: one row of a decode batch per program_id(1), as in moe_gate_up_kernel (h in natural order only:
    hp is not written).
    HALF_DOT: the codes' dot in fp16 pairs, as moe_gate_up_kernel's, act scaled by a power of two a slot.
    BY_EXPERT: a ROUTE_SELF routing in gate_up's BY_EXPERT slot order (act's)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if ROWS:
        row = tl.program_id(1)
        if row >= tl.load(n_valid_ptr):
            return
        h_ptr += row * H
        act_ptr += row * ((TOPK + 1) * I)
        logits_ptr += row * (E + 1)
        route_e_ptr += row * (TOPK + 1)
        route_w_ptr += row * (TOPK + 1)
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = 64 // PER
    NG: tl.constexpr = I // 64
    WPR: tl.constexpr = I // PER
    WOFF: tl.constexpr = H * WPR
    SOFF: tl.constexpr = H * NG
    sl = tl.arange(0, TP2)
    smask = sl < TOPK
    if ROUTE_SELF:
        SP2: tl.constexpr = triton.next_power_of_2(TOPK + 1)
        sel_e, sel_w = route_topk(logits_ptr, E, E_P2, TOPK, SP2, NORM_TOPK, KEY32, PAIRS,   # [SP2]: routed, shared
                                  BY_EXPERT)
        ss = tl.arange(0, SP2)
        e = tl.sum(tl.where(ss[None, :] == sl[:, None], sel_e[None, :], 0), 1).to(tl.int64)
        e = tl.where(smask, e, 0)
        wt = tl.sum(tl.where(ss[None, :] == sl[:, None], sel_w[None, :], 0.0), 1)
        wt = tl.where(smask, wt, 0.0)
        e_sh = tl.sum(tl.where(ss == TOPK, sel_e, 0), 0).to(tl.int64)
        w_sh = tl.sum(tl.where(ss == TOPK, sel_w, 0.0), 0)
    else:
        wait_prior(GDC)                  # the routing comes from gate_up
        e = tl.load(route_e_ptr + sl, mask=smask, other=0).to(tl.int64)
        wt = tl.load(route_w_ptr + sl, mask=smask, other=0.0)
        e_sh = tl.load(route_e_ptr + TOPK).to(tl.int64)
        w_sh = tl.load(route_w_ptr + TOPK)
    g = tl.arange(0, NG)
    word = tl.arange(0, WPR)                                                        # a row, one contiguous run
    rr = tl.arange(0, BN)
    m3 = smask[None, :, None]
    rows = pid * BN + rr
    rm = rows < H
    w4 = tl.load(dw + e[None, :, None] * WOFF + rows.to(tl.int64)[:, None, None] * WPR
                 + word[None, None, :], mask=m3 & rm[:, None, None], other=0)     # [BN, TP2, WPR]
    soff = e[None, :, None] * SOFF + rows.to(tl.int64)[:, None, None] * NG + g[None, None, :]
    s4 = tl.load(ds + soff, mask=m3 & rm[:, None, None], other=0.0)
    b4 = tl.load(db + soff, mask=m3 & rm[:, None, None], other=0.0)
    ws, ss_, bs = _expert_tile(dw, ds, db, e_sh, rows, rm, word[None, :], g, H, NG, WPR)
    if ROUTE_SELF:
        wait_prior(GDC)                  # act comes from gate_up
    # act (PERM64 order) per code position: routed slots [1, TP2, NG, WPG], shared [1, NG, WPG]
    kw4 = (sl[:, None] * WPR + word[None, :])[None, :, :]
    y0, y1, y2, y3, y4, y5, y6, y7 = x_codes(act_ptr, act_ptr, act_ptr, act_ptr, 0.0, kw4, smask[None, :, None],
                                             True, 0, 1, 1, BITS, HALF_DOT)
    kw2 = TOPK * WPR + word[None, :]
    z0, z1, z2, z3, z4, z5, z6, z7 = x_codes(act_ptr, act_ptr, act_ptr, act_ptr, 0.0, kw2, kw2 >= 0, True, 0,
                                             1, 1, BITS, HALF_DOT)
    # per-(slot, group) sums of act (the bias term), from one load (order inside a group does not matter)
    kg = sl[:, None, None] * I + (g[:, None] * 64 + tl.arange(0, 64)[None, :])[None, :, :]
    act_g = tl.load(act_ptr + kg, mask=smask[:, None, None], other=0.0)                        # [TP2, NG, 64]
    xsum = tl.sum(act_g, axis=2)[None, :, :]                                                  # [1, TP2, NG]
    sh_g = tl.load(act_ptr + TOPK * I + g[:, None] * 64 + tl.arange(0, 64)[None, :])          # [NG, 64]
    xsum_sh = tl.sum(sh_g, axis=1)[None, :]
    if HALF_DOT:
        # each slot's act in fp16 pairs, scaled by a power of two of its own (undone on its row sums)
        xs = x_scale(tl.max(tl.max(tl.abs(act_g), 2), 1))                                     # [TP2]
        y0, y1, y2, y3, y4, y5, y6, y7 = x_word_pairs(y0, y1, y2, y3, y4, y5, y6, y7, xs[None, :, None])
        xsum = xsum * xs[None, :, None]
        wt = wt / xs
        xs_sh = x_scale(tl.max(tl.max(tl.abs(sh_g), 1), 0))
        z0, z1, z2, z3, z4, z5, z6, z7 = x_word_pairs(z0, z1, z2, z3, z4, z5, z6, z7, xs_sh)
        xsum_sh = xsum_sh * xs_sh
        w_sh = w_sh / xs_sh
    for blk in range(pid, H // BN, nprog):
        rows = blk * BN + rr
        nrows = (blk + nprog) * BN + rr
        nm = nrows < H
        w4_n = tl.load(dw + e[None, :, None] * WOFF + nrows.to(tl.int64)[:, None, None] * WPR
                       + word[None, None, :], mask=m3 & nm[:, None, None], other=0)
        noff = e[None, :, None] * SOFF + nrows.to(tl.int64)[:, None, None] * NG + g[None, None, :]
        s4_n = tl.load(ds + noff, mask=m3 & nm[:, None, None], other=0.0)
        b4_n = tl.load(db + noff, mask=m3 & nm[:, None, None], other=0.0)
        ws_n, ss_n, bs_n = _expert_tile(dw, ds, db, e_sh, nrows, nm, word[None, :], g, H, NG, WPR)
        sums, b4f = group_dots(w4, s4, b4, y0, y1, y2, y3, y4, y5, y6, y7, NG, WPG, BITS, HALF_DOT, ASM)  # [BN,TP2,NG]
        per_slot = tl.sum(s4.to(tl.float32) * sums + b4f * xsum, axis=2)           # [BN, TP2]
        sh_sums, bsf = group_dots(ws, ss_, bs, z0, z1, z2, z3, z4, z5, z6, z7, NG, WPG, BITS, HALF_DOT, ASM)
        sh = tl.sum(ss_.to(tl.float32) * sh_sums + bsf * xsum_sh, axis=1)
        acc = tl.sum(per_slot * wt[None, :], axis=1) + w_sh * sh
        h = tl.load(h_ptr + rows)
        tl.debug_barrier()   # in place: every read before any write
        tl.store(h_ptr + rows, h + acc)
        if not ROWS:
            tl.store(hp_ptr + perm64(rows), h + acc)
        w4, s4, b4, ws, ss_, bs = w4_n, s4_n, b4_n, ws_n, ss_n, bs_n


# -- load-time layout and launchers -----------------------------------------------------------------------

# the batch-1 gate_up's and down's (rows a unit or block, programs an SM), from the H200 sweep of the whole MoE
# (scripts/gpu_decode_check.py tune, the fp16-pair dot): down's blocks of 8 rows, 256 programs of one block
# each (all their tiles requested at once), 16.9 us a layer against 18.4 with (2, 4) (three programs of 162+
# registers fit an SM, so (2, 4) ran a second wave). Down on the fp32 dot keeps (2, 4): its 8-row tile's codes
# need registers it does not have (the whole step 515 against 590 tok/s at 4K).
GATE_UP_BLOCK = (4, 4)
ROUTER_BLOCK = (2, 4)           # the router GEMV's (rows a block, programs an SM), read at each launch
# the batch-1 gate_up computes the shared expert's units first, before its wait on the router where its launch is
# programmatic (moe_gate_up_kernel's SHARED_FIRST); LILY_GATE_UP_SHARED_FIRST=0: the units in slot order. Read at
# each launch. H200, alternating rounds: 658.3 -> 668.2 tok/s at 4K, 465.7 -> 470.4 at 128K, gate_up 294 -> 281 us
# a step (benchmarks/results/decode-h200-20261203-gate-up-shared-first.json).
GATE_UP_SHARED_FIRST = os.environ.get("LILY_GATE_UP_SHARED_FIRST", "1") != "0"
DOWN_BLOCK = (8, 2)
DOWN_BLOCK_FP32 = (2, 4)
# the routing's top-k on int32 keys (route_topk's KEY32) instead of int64: its TOPK block-wide rounds were what
# gate_up waited on most (the short scoreboard, decode-ncu-h200-20261203.json); on int32 gate_up's class took 296
# against 371 us a step and the step 642.7 against 629.3 tok/s at 4K, 459.0 against 452.7 at 128K (alternating
# rounds, benchmarks/results/decode-h200-20261203-topk-key32.json). LILY_TOPK_KEY=64 keeps int64. Read at each launch.
TOPK_KEY32 = os.environ.get("LILY_TOPK_KEY", "32") != "64"
# with int32 keys, the two largest a round (route_topk's PAIRS: half the block-wide rounds): 646.4 against 643.8
# tok/s at 4K, 459.2 against 457.8 at 128K (the same A/B, decode-h200-20261203-topk-pairs.json). LILY_TOPK_PAIRS=0
# takes one a round. Read at each launch.
TOPK_PAIRS = os.environ.get("LILY_TOPK_PAIRS", "1") != "0"


def topk_keys() -> dict:
    """The KEY32 / PAIRS constexprs of a launch that routes (TOPK_KEY32, TOPK_PAIRS, read at each launch)."""
    return {"KEY32": TOPK_KEY32, "PAIRS": TOPK_KEY32 and TOPK_PAIRS}


def half_dot(family: str) -> dict:
    """The HALF_DOT / ASM constexprs of an MoE launch: the fp16-pair dot with quant_gemv's switch (LILY_HALF_DOT),
    unless its family ("gate_up" / "down") is in LILY_HALF_DOT_OFF; read at each launch (A/B runs switch it)."""
    on = quant_gemv.HALF_DOT and family not in quant_gemv.HALF_DOT_OFF
    return {"HALF_DOT": on, "ASM": on and not pdl.INTERPRET}   # (the tests patch this module's INTERPRET)


# moe_down_kernel's registers a thread with ROUTE_SELF on the fp32 dot: its own routing takes ptxas sm_90 from 128
# to 150 (triton 3.6), which fits three programs of 4 warps an SM where DOWN_BLOCK_FP32 asks four; capped at 128 it
# spills nothing. (The pair dot's 8-row blocks, two programs an SM, fit its 255 uncapped; capped, they spill.)
DOWN_REGS = {} if INTERPRET else {"maxnreg": 128}


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
    """Per-step MoE buffers shared by all layers: logits [E+1], route_e/route_w [TOPK+1], act [TOPK+1, I]."""

    def __init__(self, n_experts: int, top_k: int, inter: int, device=None):
        f32 = dict(dtype=torch.float32, device=device)
        self.top_k = top_k
        self.logits = torch.empty(n_experts + 1, **f32)
        self.route_e = torch.empty(top_k + 1, dtype=torch.int32, device=device)
        self.route_w = torch.empty(top_k + 1, **f32)
        self.act = torch.empty(top_k + 1, inter, **f32)


def moe_decode(ex: "PackedExperts", router: PackedLinear, h: torch.Tensor, h_p: torch.Tensor, gain: torch.Tensor,
               gain_p: torch.Tensor, eps: float, sc: MoEScratch, norm_topk: bool = True, num_warps: int = 4,
               blocks: tuple | None = None) -> None:
    """h += MoE(RMSNorm(h) * gain), in place; h_p (h in PERM64 order, read as the experts' input and
    rewritten); gain and gain_p (the gain in natural and PERM64 order); router: the 8-bit [E+1, H] stack
    of the router and the shared expert gate. blocks = (router rows per program, gate_up (rows, programs
    per SM), down (rows, programs per SM))."""
    moe_route(router, h, gain, eps, sc, norm_topk, blocks[0] if blocks else None)
    moe_gate_up(ex, h_p, gain_p, eps, sc, num_warps, blocks[1] if blocks else None, norm_topk)
    moe_down(ex, h, h_p, sc, num_warps, blocks[2] if blocks else None, norm_topk)


def moe_route(router: PackedLinear, h, gain, eps: float, sc: MoEScratch, norm_topk: bool = True,
              block: tuple[int, int] | None = None) -> None:
    """sc.logits = router(RMSNorm(h) * gain) (first of three launches; the routing itself is done by
    gate_up). block = (rows per block, programs per SM) of the GEMV."""
    gemv(router, h, sc.logits, norm_gain=gain, eps=eps, block=block or (None if INTERPRET else ROUTER_BLOCK),
         pdl_family="router")


def moe_gate_up(ex: "PackedExperts", h_p, gain_p, eps: float, sc: MoEScratch, num_warps: int = 4,
                block: tuple[int, int] | None = None, norm_topk: bool = True) -> None:
    """Routing from sc.logits, then act[slot] = SwiGLU of the slot's expert (the second launch);
    block = (rows per unit, programs per SM)."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    I, H = ex.inter, ex.hidden
    bn, per_sm = block or ((min(64, next_power_of_2(I)), 2) if INTERPRET else GATE_UP_BLOCK)
    if I % bn:
        raise ValueError(f"moe_gate_up: {bn} rows a unit must divide the intermediate size {I}")
    units = cdiv(I, bn) * (sc.top_k + 1)
    E = sc.logits.numel() - 1
    moe_gate_up_kernel[(min(units, sm_count(h_p.device) * per_sm),)](
        sc.act, sc.route_e, sc.route_w, sc.logits, h_p, gain_p, eps,
        ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b, sc.route_e,
        E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, TP2=next_power_of_2(sc.top_k + 1),
        NORM_TOPK=norm_topk, H=H, I=I, BITS=ex.gate.bits, BN=bn, GDC=pdl.gdc(sc.act), ROWS=False,
        SHARED_FIRST=GATE_UP_SHARED_FIRST, **topk_keys(), **half_dot("gate_up"), num_warps=num_warps,
        **pdl.launch_opts(sc.act, "gate_up"))


def moe_down(ex: "PackedExperts", h, h_p, sc: MoEScratch, num_warps: int = 4,
             block: tuple[int, int] | None = None, norm_topk: bool = True, route_self: bool | None = None) -> None:
    """h += sum_slot w_slot * down(act[slot]), h_p rewritten (the third launch); block = (rows, programs per SM).
    route_self: route from sc.logits itself instead of reading gate_up's routing (default: when the launch is
    programmatic, which lets that overlap gate_up)."""
    H, I = ex.hidden, ex.inter
    dot = half_dot("down")
    bn, per_sm = block or ((max(1, H // 2), 2) if INTERPRET else DOWN_BLOCK if dot["HALF_DOT"] else DOWN_BLOCK_FP32)
    if H % bn:
        raise ValueError(f"moe_down: {bn} rows a block must divide the hidden size {H}")
    E = sc.logits.numel() - 1
    route_self = pdl.active(h, "down") if route_self is None else route_self
    moe_down_kernel[(min(H // bn, sm_count(h.device) * per_sm),)](
        h, h_p, sc.act, sc.route_e, sc.route_w, sc.logits, ex.down.w, ex.down.s, ex.down.b, sc.route_e,
        E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, TP2=next_power_of_2(sc.top_k), NORM_TOPK=norm_topk,
        H=H, I=I, BITS=ex.down.bits, BN=bn, GDC=pdl.gdc(h), ROUTE_SELF=route_self, ROWS=False,
        **topk_keys(), **dot, num_warps=num_warps, **(DOWN_REGS if route_self and not dot["HALF_DOT"] else {}),
        **pdl.launch_opts(h, "down"))


# moe_rows' launches on the GPU: (rows a unit or block, programs an SM for the whole batch) of gate_up and of
# down, and how many units ahead gate_up requests (a batch row's programs take many units each).
# H200 at 4K, the whole step's graph (scripts/gpu_batch_check.py --sweep-moe-rows 8,16,
# benchmarks/results/batch-h200-20261203-moe-rows-8-16.json): gate_up on 8-row units and down on the batch-1
# step's 8-row blocks took 8 rows from 4.760 to 4.424 ms a step and 16 rows from 6.858 to 6.229 in alternating
# rounds (before: (4, 4) and (2, 4), swept when the MoE dotted in fp32).
ROWS_GATE_UP_BLOCK = (8, 4)
ROWS_DOWN_BLOCK = (8, 2)
ROWS_AHEAD = 1
# moe_rows' gate_up takes each row's routed experts in ascending expert order (route_topk's BY_EXPERT; down reads
# the stored routing, so its slots follow) at ROWS_ORDER_MIN_ROWS rows or more: rows that chose one expert then
# reach it at about the same point of their walk, and all but the first may read it from L2 (random routing at 32
# rows: 36 % of the routed reads repeat an expert another row reads, 14 % of them in the same slot's wave sorted
# against 6 % in the logits' order). H100, alternating rounds at 4K: 32 rows 11.07 -> 10.73 ms a step (gate_up
# 4.40 -> 4.05 ms), 16 rows 6.83 -> 6.71, 8 rows 4.59 -> 4.57; at 2 and 4 rows the sort cost ~0.5 %
# (benchmarks/results/batch-h100-20261206-by-expert.json). Read at each launch; LILY_ROWS_BY_EXPERT=0 turns it off.
ROWS_BY_EXPERT = os.environ.get("LILY_ROWS_BY_EXPERT", "1") != "0"
ROWS_ORDER_MIN_ROWS = 8   # (rows from which gate_up orders its walk: the expert order and the block walk below)
# moe_rows' gate_up walks its units block by block, every slot's block b before any slot's block b + 1
# (unit_place's BLOCK_MAJOR), at ROWS_ORDER_MIN_ROWS rows or more: rows that chose one expert in any slots then
# read each of its blocks within one round of 9 units of each other, where the expert order alone lines them up
# only when their places among the row's experts agree. H100, alternating rounds at 4K, with the expert order on
# in both: 32 rows 10.72 -> 10.19 ms a step (gate_up 4.05 -> 3.51 ms), 16 rows 6.72 -> 6.53, 8 rows 4.58 -> 4.52
# (benchmarks/results/batch-h100-20261206-block-major.json). Read at each launch; LILY_ROWS_BLOCK_MAJOR=0: slot by
# slot.
ROWS_BLOCK_MAJOR = os.environ.get("LILY_ROWS_BLOCK_MAJOR", "1") != "0"
# ((gate_up block), (down block)) by batch rows where another than ROWS_*_BLOCK measured faster: at 2 rows gate_up
# on two programs an SM (--sweep-moe-rows-small, benchmarks/results/batch-h200-20261203-moe-rows-small.json:
# 2 rows 2.360 -> 2.244 ms a step with down's 8-row blocks, gate_up's choice worth ~1 % of that)
ROWS_BLOCKS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {2: ((8, 2), (8, 2))}


class MoERowsScratch:
    """The row-batched MoE's buffers for up to `rows` rows: act [rows, TOPK+1, I], route_e / route_w [rows, TOPK+1]."""

    def __init__(self, n_experts: int, top_k: int, inter: int, rows: int, device=None):
        self.n_experts, self.top_k, self.rows = n_experts, top_k, rows
        self.route_e = torch.empty(rows, top_k + 1, dtype=torch.int32, device=device)
        self.route_w = torch.empty(rows, top_k + 1, dtype=torch.float32, device=device)
        self.act = torch.empty(rows, top_k + 1, inter, dtype=torch.float32, device=device)


def moe_rows(ex: "PackedExperts", h: torch.Tensor, gain: torch.Tensor, eps: float, logits: torch.Tensor,
             n_valid: torch.Tensor, sc: MoERowsScratch, norm_topk: bool = True, num_warps: int = 4,
             blocks: tuple | None = None, ahead: int | None = None, route_self: bool | None = None) -> None:
    """h[b] += MoE(RMSNorm(h[b]) * gain) for the rows b < n_valid of a decode batch (h fp32 [B, H] natural order,
    in place; logits fp32 [B, E+1] the router's, the shared expert's gate last; n_valid int32 [1] on the
    device): the batch-1 kernels, one grid row a batch row, each reading its own experts' weights (a
    decode batch's experts rarely repeat: 8 rows choose ~60 of 256). blocks = (gate_up (rows, programs
    per SM), down (rows, programs per SM)) for the whole batch, default ROWS_BLOCKS[B] or ROWS_*_BLOCK; ahead:
    gate_up's units requested ahead (default ROWS_AHEAD). The launches are programmatic by the lily.kernels.pdl
    families rows_gate_up and rows_down (gate_up reads h before its wait: h must be two launches back); route_self:
    down routes from the logits itself, before its wait (default: where its launch is programmatic)."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    B, H = h.shape
    I, E = ex.inter, sc.n_experts
    if (B > sc.rows or ex.hidden != H or logits.shape != (B, E + 1) or not logits.is_contiguous()
            or not h.is_contiguous() or h.dtype != torch.float32):
        raise ValueError(f"moe_rows: h {tuple(h.shape)} {h.dtype}, logits {tuple(logits.shape)}, "
                         f"scratch for {sc.rows} rows, experts [{I}, {ex.hidden}]")
    sms = sm_count(h.device)
    blocks = blocks or (None if INTERPRET else ROWS_BLOCKS.get(B))
    bn, per_sm = (blocks[0] if blocks else None) or ((min(64, next_power_of_2(I)), 2) if INTERPRET
                                                      else ROWS_GATE_UP_BLOCK)
    units = cdiv(I, bn) * (sc.top_k + 1)
    ordered = B >= ROWS_ORDER_MIN_ROWS
    by_expert = ROWS_BY_EXPERT and ordered
    route_self = pdl.active(h, "rows_down") if route_self is None else route_self
    moe_gate_up_kernel[(max(1, min(units, sms * per_sm // B)), B)](
        sc.act, sc.route_e, sc.route_w, logits, h, gain, eps,
        ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b, n_valid,
        E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, TP2=next_power_of_2(sc.top_k + 1),
        NORM_TOPK=norm_topk, H=H, I=I, BITS=ex.gate.bits, BN=bn, GDC=pdl.gdc(h), ROWS=True,
        AHEAD=ahead or ROWS_AHEAD, BY_EXPERT=by_expert, BLOCK_MAJOR=ROWS_BLOCK_MAJOR and ordered, **topk_keys(),
        **half_dot("gate_up"), num_warps=num_warps, **pdl.launch_opts(h, "rows_gate_up"))
    bn, per_sm = (blocks[1] if blocks else None) or ((max(1, H // 2), 2) if INTERPRET else ROWS_DOWN_BLOCK)
    moe_down_kernel[(max(1, min(H // bn, sms * per_sm // B)), B)](
        h, h, sc.act, sc.route_e, sc.route_w, logits, ex.down.w, ex.down.s, ex.down.b, n_valid,
        E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, TP2=next_power_of_2(sc.top_k), NORM_TOPK=norm_topk,
        H=H, I=I, BITS=ex.down.bits, BN=bn, GDC=pdl.gdc(h), ROUTE_SELF=route_self, ROWS=True, BY_EXPERT=by_expert,
        **topk_keys(), **half_dot("down"), num_warps=num_warps, **pdl.launch_opts(h, "rows_down"))


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
