"""The MoE of a decode batch over the union of its rows' experts: each chosen expert's 4-bit weights come from
memory once for all the rows that chose it, on CUDA cores with the batch-1 kernels' dot (fp16 pairs, or fp32
with LILY_HALF_DOT=0 / LILY_HALF_DOT_OFF naming gate_up, down), in three launches a layer.

  route:   grid (B,): row b's top-k experts and weights (moe_decode.route_topk: softmax, top-k, renormalise;
           the shared expert E last, sigmoid-gated). Each (row, slot) pair p = b * (k+1) + slot is appended
           to its expert's list by the expert's atomic counter; the pair that opens a list appends the expert
           to the list of live experts. Rows at and past n_valid (a CUDA graph's padding) route nowhere.
  gate_up: persistent over units (chunk of CH intermediate rows, group of up to M pairs of one expert: each
           live expert's list cut into runs of M, the experts one after the other), chunk-major, so the groups
           of one expert are neighbouring units that neighbouring programs run at the same time: their
           expert's tiles come from memory once and from L2 for the others. A unit keeps its pairs' x (rows of
           RMSNorm(h) * gain, fp32, PERM64 order) in registers and walks its chunk in blocks of BN rows, the
           next block's tiles requested before this block's arithmetic, each tile's codes decoded once for the
           group (half_dot.half_dot_rows; a lone pair takes the one-row code): act[p, rows] = silu(gate x) *
           up x. (Triton's cp.async loop pipeline instead, 3-6 stages: slower on the H200, 8 rows 1.75 -> 2.27
           ms of gate_up a step.)
  down:    the same units over chunks of hidden rows: h[b, rows] += w_p * down_e(act[p]) for each pair p of the
           group, by atomic adds (a row's k+1 terms land in any order, so their sum's rounding is not fixed
           from run to run; fp32).

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
from lily.kernels.half_dot import half_dot_rows, pair_rows_constraints, pair_rows_ptx, x_scale, x_word_pairs
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
def _live_groups(count_ptr, live_ptr, E: tl.constexpr, EP: tl.constexpr, M: tl.constexpr):
    """The live experts in list order: (expert [EP], its pairs [EP], its groups of up to M pairs [EP], the
    running end of those groups [EP], groups in all): the groups in expert order are each live expert's list cut
    into runs of M pairs (the last shorter), one expert after the other."""
    li = tl.arange(0, EP)
    ok = li < tl.load(count_ptr + E + 1)
    ev = tl.load(live_ptr + li, mask=ok, other=0)
    cv = tl.load(count_ptr + ev, mask=ok, other=0)
    gv = (cv + (M - 1)) // M
    ends = tl.cumsum(gv, 0)
    return ev, cv, gv, ends, tl.sum(gv, 0)


@triton.jit
def _group_at(u, n_groups, ev, cv, gv, ends, rr, CH: tl.constexpr, EP: tl.constexpr, M: tl.constexpr):
    """(expert, the group's first place in the expert's list, its pairs (1..M), its first block's rows) of unit
    u = (chunk u // n_groups of CH rows, the (u % n_groups)-th group in expert order)."""
    q = u % n_groups
    li = tl.sum((ends <= q).to(tl.int32), 0)
    here = tl.arange(0, EP) == li
    e = tl.sum(tl.where(here, ev, 0), 0)
    at = (q - tl.sum(tl.where(here, ends - gv, 0), 0)) * M
    n = tl.minimum(tl.sum(tl.where(here, cv, 0), 0) - at, M)
    return e.to(tl.int64), at, n, (u // n_groups) * CH + rr


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
        return tl.sum(groups_of(raw, NG, WPG), axis=2) * xs, 1.0 / xs, (x0, x1, x2, x3, x4, x5, x6, x7)
    else:
        # the raw sums from the scaled positions: j and j + 4 share the scale 2^-4(j % 4)
        raw = (x0 + x4) + (x1 + x5) * 16.0 + (x2 + x6) * 256.0 + (x3 + x7) * 4096.0
        return tl.sum(groups_of(raw, NG, WPG), axis=2), 1.0, (x0, x1, x2, x3, x4, x5, x6, x7)


@triton.jit
def _group_rows(list_ptr, e64, at, n, rows_ptr, row_len, pair_row: tl.constexpr, word, NG: tl.constexpr,
                WPG: tl.constexpr, HALF_DOT: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
                TOPK: tl.constexpr):
    """The group's M pairs (places past n repeat its last pair: their results are not stored) and the inputs
    their dots take: (pairs, per-group sums, unscale factors, _row_codes' x) as tuples of M. The input of a pair
    is row (pair // (TOPK + 1)) of rows_ptr when pair_row, else row pair (gate_up: x of the pair's batch row;
    down: act of the pair)."""
    pairs = ()
    sums = ()
    factors = ()
    xs = ()
    for m in tl.static_range(M):
        pair = tl.load(list_ptr + e64 * ROWS + at + tl.minimum(m, n - 1))
        row = pair // (TOPK + 1) if pair_row else pair
        xsum, unscale, x = _row_codes(rows_ptr + row.to(tl.int64) * row_len, word, NG, WPG, HALF_DOT)
        pairs = pairs + (pair,)
        sums = sums + (xsum,)
        factors = factors + (unscale,)
        xs = xs + (x,)
    return pairs, sums, factors, xs


@triton.jit
def _group_dots(w, s, b, sums, factors, xs, NG: tl.constexpr, WPG: tl.constexpr, HALF_DOT: tl.constexpr,
                ASM: tl.constexpr, M: tl.constexpr, ROWS_PTX: tl.constexpr, ROWS_CONSTRAINTS: tl.constexpr):
    """A tile's rows dotted with each of the group's M inputs (a tuple of M [BN] fp32): with HALF_DOT the
    codes decoded once for all M (lily.kernels.half_dot.half_dot_rows), else moe_decode.group_dots an input."""
    sf = s.to(tl.float32)
    out = ()
    if HALF_DOT:
        dots = half_dot_rows(w, xs, M, ASM, ROWS_PTX, ROWS_CONSTRAINTS)
        bias = b.to(tl.float32) + 8.0 * sf           # the pair dot is of code - 8
        for m in tl.static_range(M):
            q = tl.sum(groups_of(dots[m], NG, WPG // 2), axis=-1)
            out = out + (tl.sum(sf * q + bias * sums[m], axis=1) * factors[m],)
    else:
        for m in tl.static_range(M):
            x = xs[m]
            q, bias = group_dots(w, s, b, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], NG, WPG, 4, False, ASM)
            out = out + (tl.sum(sf * q + bias * sums[m], axis=1) * factors[m],)
    return out


@triton.jit
def _gate_up_unit(act_ptr, xp_ptr, list_ptr, gw, gs, gb, uw, us, ub, e64, at, n, rows, rr, word, g,
                  TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                  ROWS: tl.constexpr, HALF_DOT: tl.constexpr, ASM: tl.constexpr, M: tl.constexpr,
                  ROWS_PTX: tl.constexpr, ROWS_CONSTRAINTS: tl.constexpr):
    """One unit of gate_up: a group of n <= M pairs of expert e64 over CH intermediate rows from `rows`."""
    WPG: tl.constexpr = 8
    NG: tl.constexpr = H // 64
    WPR: tl.constexpr = H // 8
    wg, sg, bg = _expert_tile(gw, gs, gb, e64, rows, rr >= 0, word, g, I, NG, WPR)
    wu, su, bu = _expert_tile(uw, us, ub, e64, rows, rr >= 0, word, g, I, NG, WPR)
    pairs, sums, factors, xs = _group_rows(list_ptr, e64, at, n, xp_ptr, H, True, word, NG, WPG, HALF_DOT, M,
                                           ROWS, TOPK)
    for blk in range(CH // BN):
        nmask = rr < BN * (blk + 1 < CH // BN)
        wg_n, sg_n, bg_n = _expert_tile(gw, gs, gb, e64, rows + BN, nmask, word, g, I, NG, WPR)
        wu_n, su_n, bu_n = _expert_tile(uw, us, ub, e64, rows + BN, nmask, word, g, I, NG, WPR)
        gvs = _group_dots(wg, sg, bg, sums, factors, xs, NG, WPG, HALF_DOT, ASM, M, ROWS_PTX, ROWS_CONSTRAINTS)
        uvs = _group_dots(wu, su, bu, sums, factors, xs, NG, WPG, HALF_DOT, ASM, M, ROWS_PTX, ROWS_CONSTRAINTS)
        for m in tl.static_range(M):
            gv = gvs[m]
            tl.store(act_ptr + pairs[m].to(tl.int64) * I + perm64(rows), gv * tl.sigmoid(gv) * uvs[m],
                     mask=rr < BN * (n > m))                                 # PERM64: down's x
        rows += BN
        wg, sg, bg, wu, su, bu = wg_n, sg_n, bg_n, wu_n, su_n, bu_n


@triton.jit
def moe_union_gate_up_kernel(act_ptr, xp_ptr, count_ptr, live_ptr, list_ptr, gw, gs, gb, uw, us, ub,
                             E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr,
                             I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, ROWS: tl.constexpr,
                             HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False, M: tl.constexpr = 1,
                             ROWS_PTX: tl.constexpr = "", ROWS_CONSTRAINTS: tl.constexpr = "",
                             ONE_PTX: tl.constexpr = "", ONE_CONSTRAINTS: tl.constexpr = ""):
    """Units (chunk c of CH intermediate rows, group of up to M pairs of one expert), chunk-major: the groups
    of one expert are neighbouring units, run at the same time by neighbouring programs, so their expert's
    tiles come from memory once and from L2 after. A unit: x of its pairs' rows (kept in registers), then its
    chunk in blocks of BN rows, the next block's tiles requested before this block's arithmetic, each tile's
    codes decoded once for the group's pairs (a lone pair takes the one-row code, no padding). HALF_DOT: the
    codes' dot in fp16 pairs (lily.kernels.half_dot), as the batch-1 kernels'."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NG: tl.constexpr = H // 64
    g = tl.arange(0, NG)
    word = tl.arange(0, H // 8)[None, :]
    rr = tl.arange(0, BN)
    ev, cv, gv, ends, n_groups = _live_groups(count_ptr, live_ptr, E, EP, M)
    for u in range(pid, n_groups * (I // CH), nprog):
        e64, at, n, rows = _group_at(u, n_groups, ev, cv, gv, ends, rr, CH, EP, M)
        if M > 1:
            if n > 1:
                _gate_up_unit(act_ptr, xp_ptr, list_ptr, gw, gs, gb, uw, us, ub, e64, at, n, rows, rr, word, g,
                              TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, M, ROWS_PTX, ROWS_CONSTRAINTS)
            else:
                _gate_up_unit(act_ptr, xp_ptr, list_ptr, gw, gs, gb, uw, us, ub, e64, at, n, rows, rr, word, g,
                              TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, 1, ONE_PTX, ONE_CONSTRAINTS)
        else:
            _gate_up_unit(act_ptr, xp_ptr, list_ptr, gw, gs, gb, uw, us, ub, e64, at, n, rows, rr, word, g,
                          TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, 1, ONE_PTX, ONE_CONSTRAINTS)


@triton.jit
def _down_unit(h_ptr, act_ptr, wts_ptr, list_ptr, dw, ds, db, e64, at, n, rows, rr, word, g,
               TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
               ROWS: tl.constexpr, HALF_DOT: tl.constexpr, ASM: tl.constexpr, M: tl.constexpr,
               ROWS_PTX: tl.constexpr, ROWS_CONSTRAINTS: tl.constexpr):
    """One unit of down: a group of n <= M pairs of expert e64 over CH hidden rows from `rows`."""
    WPG: tl.constexpr = 8
    NG: tl.constexpr = I // 64
    WPR: tl.constexpr = I // 8
    w, s, b = _expert_tile(dw, ds, db, e64, rows, rr >= 0, word, g, H, NG, WPR)
    pairs, sums, factors, ys = _group_rows(list_ptr, e64, at, n, act_ptr, I, False, word, NG, WPG, HALF_DOT, M,
                                           ROWS, TOPK)
    wts = ()
    for m in tl.static_range(M):
        wts = wts + (tl.load(wts_ptr + pairs[m]),)
    for blk in range(CH // BN):
        nmask = rr < BN * (blk + 1 < CH // BN)
        w_n, s_n, b_n = _expert_tile(dw, ds, db, e64, rows + BN, nmask, word, g, H, NG, WPR)
        outs = _group_dots(w, s, b, sums, factors, ys, NG, WPG, HALF_DOT, ASM, M, ROWS_PTX, ROWS_CONSTRAINTS)
        for m in tl.static_range(M):
            hrow = h_ptr + (pairs[m] // (TOPK + 1)).to(tl.int64) * H
            tl.atomic_add(hrow + rows, outs[m] * wts[m], mask=rr < BN * (n > m), sem="relaxed")
        rows += BN
        w, s, b = w_n, s_n, b_n


@triton.jit
def moe_union_down_kernel(h_ptr, act_ptr, wts_ptr, count_ptr, live_ptr, list_ptr, dw, ds, db,
                          E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr,
                          I: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, ROWS: tl.constexpr,
                          HALF_DOT: tl.constexpr = False, ASM: tl.constexpr = False, M: tl.constexpr = 1,
                          ROWS_PTX: tl.constexpr = "", ROWS_CONSTRAINTS: tl.constexpr = "",
                          ONE_PTX: tl.constexpr = "", ONE_CONSTRAINTS: tl.constexpr = ""):
    """Units (chunk c of CH hidden rows, group of up to M pairs of one expert), chunk-major as gate_up's: the
    group's act in registers, its chunk in blocks of BN rows (the next block's tiles requested first), each
    tile decoded once for the group and each pair's w_pair * down_e(act) added into h[its row] atomically.
    HALF_DOT as gate_up's."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NG: tl.constexpr = I // 64
    g = tl.arange(0, NG)
    word = tl.arange(0, I // 8)[None, :]
    rr = tl.arange(0, BN)
    ev, cv, gv, ends, n_groups = _live_groups(count_ptr, live_ptr, E, EP, M)
    for u in range(pid, n_groups * (H // CH), nprog):
        e64, at, n, rows = _group_at(u, n_groups, ev, cv, gv, ends, rr, CH, EP, M)
        if M > 1:
            if n > 1:
                _down_unit(h_ptr, act_ptr, wts_ptr, list_ptr, dw, ds, db, e64, at, n, rows, rr, word, g,
                           TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, M, ROWS_PTX, ROWS_CONSTRAINTS)
            else:
                _down_unit(h_ptr, act_ptr, wts_ptr, list_ptr, dw, ds, db, e64, at, n, rows, rr, word, g,
                           TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, 1, ONE_PTX, ONE_CONSTRAINTS)
        else:
            _down_unit(h_ptr, act_ptr, wts_ptr, list_ptr, dw, ds, db, e64, at, n, rows, rr, word, g,
                       TOPK, H, I, BN, CH, ROWS, HALF_DOT, ASM, 1, ONE_PTX, ONE_CONSTRAINTS)


# -- buffers and launchers ---------------------------------------------------------------------------------

# (rows a block, rows a unit, programs an SM, warps) of gate_up and of down on the GPU; the fastest of
# scripts/gpu_batch_check.py --sweep-tiles moe on the H200 at 8 and 32 rows (4K context).
GATE_UP_TILE = (4, 64, 4, 4)
DOWN_TILE = (16, 128, 4, 4)
# pairs a unit at most (gate_up's, down's): an expert's pairs in groups of this many share each tile's loads and
# code decoding (1: a unit a pair, their tiles shared through L2 only)
GROUP = (2, 2)


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
              sc: UnionScratch, layer: int, norm_topk: bool = True, tiles: tuple | None = None,
              group: tuple[int, int] | None = None) -> None:
    """h[b] += MoE(x[b]) for the rows b < n_valid of a decode batch, in place. ex: moe_decode.PackedExperts
    (4-bit, the shared expert stacked as expert E); h fp32 [B, H] natural order; x_p fp32 [B, H]: RMSNorm(h) *
    gain in PERM64 order (q4_gemm.rmsnorm_rows' perm64_copy); logits fp32 [B, E+1] the router's, the shared
    expert's gate last; n_valid int32 [1] on the device; layer: whose counters (zeroed by sc.reset() this
    step). tiles = (gate_up's (rows a block, rows a unit, programs an SM, warps), down's (the same)), default
    GATE_UP_TILE / DOWN_TILE; group = (gate_up's, down's) pairs a unit at most (1-4), default GROUP."""
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
    group = group or GROUP
    if not all(1 <= m <= 4 for m in group):
        raise ValueError(f"moe_union: 1 to 4 pairs a unit, got {group}")
    ep = next_power_of_2(E + 1)   # the live list's length at most (E routed experts and the shared one)
    pairs = B * k1   # a bound known on the host (the grids: at most this many pairs are routed)
    bn, ch, per_sm, warps = gate_tile
    moe_union_gate_up_kernel[(max(1, min(pairs * (I // ch), sms * per_sm)),)](
        sc.act, x_p, count, sc.live, sc.lists, ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b,
        E=E, EP=ep, TOPK=sc.top_k, H=H, I=I, BN=bn, CH=ch, ROWS=sc.rows, **_grouped("gate_up", group[0]),
        num_warps=warps)
    bn, ch, per_sm, warps = down_tile
    moe_union_down_kernel[(max(1, min(pairs * (H // ch), sms * per_sm)),)](
        h, sc.act, sc.weights, count, sc.live, sc.lists, ex.down.w, ex.down.s, ex.down.b,
        E=E, EP=ep, TOPK=sc.top_k, H=H, I=I, BN=bn, CH=ch, ROWS=sc.rows, **_grouped("down", group[1]),
        num_warps=warps)


def _grouped(family: str, m: int) -> dict:
    """A launch's dot constexprs (moe_decode.half_dot) with its group of m pairs and the pair-rows PTX of m rows
    and of one (a lone pair's units)."""
    dot = moe_decode.half_dot(family)
    asm = dot["ASM"]
    return dict(dot, M=m, ROWS_PTX=pair_rows_ptx(m) if asm else "", ROWS_CONSTRAINTS=pair_rows_constraints(m) if asm
                else "", ONE_PTX=pair_rows_ptx(1) if asm else "", ONE_CONSTRAINTS=pair_rows_constraints(1) if asm
                else "")
