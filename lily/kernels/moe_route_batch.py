"""MoE routing for B decode rows at once, in one launch: each row's top-k experts and weights, and the
grouped plan that lets each chosen expert's weights stream once for all the rows that chose it.

Input: the router logits [B, E+1] fp32 (the 8-bit router stacked with the shared-expert gate row, as the
decode path loads them). Each row routes to its top-k of the E experts (softmax, renormalised over the k
when norm_topk) plus the shared expert, stacked at load as expert E, with weight sigmoid(logit E): k+1
(row, expert) pairs a row, pair p = row * (k+1) + j. The plan is lily.kernels.moe_grouped_gemm's MoePlan
over those pairs (so the prefill's grouped expert GEMMs run the batch):
  counts[e] = rows that chose e;  offset[e] = sum of counts before e;  rank(row, e) = rows before it that chose e
  pair (row, e) sits at sorted position offset[e] + rank;  expert e has ceil(counts[e] / BM) blocks of BM rows.
One program computes it all (B <= a few hundred pairs), ROWS_AT_ONCE rows a pass: top-k by packed integer keys
(ties to the lower index, as torch.topk), counts and ranks by prefix sums over the rows' [rows, E+1] membership
table (carried from pass to pass), then the pairs and blocks scattered through small scratch tables. Rows b >= n_valid (a CUDA graph's padding) route nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.moe_grouped_gemm import MoePlan

ROWS_AT_ONCE = 8  # rows whose [rows, E] routing tables one pass holds in registers


@triton.jit
def moe_route_rows_kernel(logits_ptr, n_valid_ptr, weights_ptr, slots_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                          sel_ptr, rank_ptr, table_ptr, logits_stride, B, max_blocks,
                          BP: tl.constexpr, RB: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                          TOPK: tl.constexpr, TP2: tl.constexpr, NORM_TOPK: tl.constexpr, BM: tl.constexpr,
                          MAXB_P2: tl.constexpr):
    n_valid = tl.load(n_valid_ptr)
    offs = tl.arange(0, EP)
    sl = tl.arange(0, TP2)
    in_row = (sl < TOPK + 1)[None, :]
    counts = tl.zeros([EP], tl.int32)                                    # rows per expert, so far
    for r0 in range(0, BP, RB):                                          # RB rows at a time: bounded registers
        rows = r0 + tl.arange(0, RB)
        ok = (rows < n_valid) & (rows < B)
        lg = tl.load(logits_ptr + rows[:, None] * logits_stride + offs[None, :],
                     mask=(rows < B)[:, None] & (offs < E)[None, :], other=float("-inf"))
        bits = lg.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)                     # monotone in the float value
        key = (ordered.to(tl.int64) << 32) | (EP - 1 - offs).to(tl.int64)[None, :]
        top = tl.where(rows < B, tl.max(lg, 1), 0.0)                     # (rows past B: all -inf)
        sel_e = tl.zeros([RB, TP2], tl.int32) + E                       # slot TOPK: the shared expert
        sel_l = tl.zeros([RB, TP2], tl.float32) + top[:, None]
        member = tl.where((offs == E)[None, :], 1, 0) + tl.zeros([RB, EP], tl.int32)
        for i in tl.static_range(TOPK):
            best = tl.max(key, 1)
            hi = best >> 32
            idx = (EP - 1 - (best - (hi << 32))).to(tl.int32)
            ob = hi.to(tl.int32)
            val = (ob ^ ((ob >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            sel_e = tl.where(sl[None, :] == i, idx[:, None], sel_e)
            sel_l = tl.where(sl[None, :] == i, val[:, None], sel_l)
            hit = offs[None, :] == idx[:, None]
            key = tl.where(hit, -9223372036854775807, key)
            member = tl.where(hit, 1, member)
        member = tl.where(ok[:, None], member, 0)
        p = tl.where(sl[None, :] < TOPK, tl.exp(sel_l - top[:, None]), 0.0)
        if NORM_TOPK:
            denom = tl.sum(p, 1)
        else:
            denom = tl.sum(tl.exp(lg - top[:, None]), 1)
        shared = tl.load(logits_ptr + rows * logits_stride + E, mask=rows < B, other=0.0)
        denom = tl.where(rows < B, denom, 1.0)                           # (rows past B: nothing to divide)
        w = tl.where(sl[None, :] == TOPK, tl.sigmoid(shared)[:, None], p / denom[:, None])
        pair = rows[:, None] * (TOPK + 1) + sl[None, :]
        tl.store(weights_ptr + pair, w, mask=(rows < B)[:, None] & in_row)
        tl.store(sel_ptr + rows[:, None] * TP2 + sl[None, :], sel_e)
        # rank(row, e): rows before this one (in earlier chunks, or earlier in this one) that chose e
        tl.store(rank_ptr + rows[:, None] * EP + offs[None, :], tl.cumsum(member, 0) - member + counts[None, :])
        counts += tl.sum(member, 0)

    offset = tl.cumsum(counts, 0) - counts
    blocks = (counts + BM - 1) // BM
    tl.store(table_ptr + offs, offset)
    tl.store(table_ptr + EP + offs, counts)
    tl.store(table_ptr + 2 * EP + offs, tl.cumsum(blocks, 0) - blocks)
    nb = tl.arange(0, MAXB_P2)
    tl.store(blk_e_ptr + nb, E + 1, mask=nb < max_blocks)              # spare, unless written below
    tl.debug_barrier()

    for r0 in range(0, BP, RB):
        rows = r0 + tl.arange(0, RB)
        pm = ((rows < n_valid) & (rows < B))[:, None] & in_row
        sel_e = tl.load(sel_ptr + rows[:, None] * TP2 + sl[None, :])
        r = tl.load(rank_ptr + rows[:, None] * EP + sel_e, mask=pm, other=0)
        off = tl.load(table_ptr + sel_e, mask=pm, other=0)
        cnt = tl.load(table_ptr + EP + sel_e, mask=pm, other=0)
        base = tl.load(table_ptr + 2 * EP + sel_e, mask=pm, other=0)
        at = off + r                                                     # the pair's place in expert order
        tl.store(slots_ptr + at, rows[:, None] * (TOPK + 1) + sl[None, :], mask=pm)
        first = pm & (r % BM == 0)                                       # it opens a block of its expert
        bid = base + r // BM
        tl.store(blk_e_ptr + bid, sel_e, mask=first)
        tl.store(blk_s_ptr + bid, at, mask=first)
        tl.store(blk_t_ptr + bid, off + cnt, mask=first)


def max_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Blocks a plan of n_pairs can have (a bound known on the host: the grid of the grouped GEMMs)."""
    return max(1, min(cdiv(n_pairs, block_m) + n_experts, n_pairs))


def moe_route_rows(logits: torch.Tensor, n_valid: torch.Tensor, top_k: int, norm_topk: bool = True,
                   block_m: int = 16) -> tuple[MoePlan, torch.Tensor]:
    """logits fp32 [B, E+1] (router | shared gate) -> (the plan over the E+1 stacked experts, the pair weights
    fp32 [B * (top_k+1)]). n_valid: int32 [1] on the device, rows at and past it route nowhere."""
    B, E1 = logits.shape
    E = E1 - 1
    if logits.stride(1) != 1 or top_k > E:
        raise ValueError(f"moe_route_rows: logits {tuple(logits.shape)}, top_k {top_k}")
    k1 = top_k + 1
    n = B * k1
    nblk = max_blocks(n, E1, block_m)
    dev = logits.device
    i32 = dict(dtype=torch.int32, device=dev)
    ep = next_power_of_2(E1)
    bp = next_power_of_2(B)
    weights = torch.empty(n, dtype=torch.float32, device=dev)
    slots, blk_e, blk_s, blk_t = (torch.empty(n, **i32), torch.empty(nblk, **i32), torch.empty(nblk, **i32),
                                  torch.empty(nblk, **i32))
    tp2 = next_power_of_2(k1)
    rb = min(bp, ROWS_AT_ONCE)
    sel, rank, table = torch.empty(bp, tp2, **i32), torch.empty(bp, ep, **i32), torch.empty(3, ep, **i32)
    moe_route_rows_kernel[(1,)](logits, n_valid, weights, slots, blk_e, blk_s, blk_t, sel, rank, table,
                                logits.stride(0), B, nblk, BP=bp, RB=rb, E=E, EP=ep, TOPK=top_k, TP2=tp2,
                                NORM_TOPK=norm_topk, BM=block_m, MAXB_P2=next_power_of_2(nblk),
                                num_warps=8 if rb * ep >= 4096 else 4)
    return MoePlan(slots, blk_e, blk_s, blk_t, k1, block_m, E1), weights


def moe_route_rows_reference(logits: torch.Tensor, top_k: int, norm_topk: bool = True):
    """(expert ids [B, k+1], weights [B, k+1]) in plain torch: the top-k of softmax over the E routed logits
    (renormalised when norm_topk), then the shared expert E with sigmoid(logit E)."""
    E = logits.shape[1] - 1
    probs = torch.softmax(logits[:, :E].float(), -1)
    vals, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        vals = vals / vals.sum(-1, keepdim=True)
    shared = torch.sigmoid(logits[:, E:].float())
    return torch.cat([idx, torch.full_like(idx[:, :1], E)], 1), torch.cat([vals, shared], 1)
