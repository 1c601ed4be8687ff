"""The routing plan of the grouped expert GEMMs: which sorted rows each program block multiplies.

From the chosen experts topk_ids [T, k]: a stable sort of the T*k (token, slot) pairs into expert order
(`slots`: sorted position -> flat slot token * k + j) and block lists. A block covers rows
[start, min(start + BLOCK_M, end)) of the sorted list, all of one expert (end: one past that expert's
last row). The grids are sized by host-side bounds (no host sync); spare blocks carry expert E and exit.

Block sizes (`block_classes`): an expert's n rows get n // B full blocks of the largest size B and, for
the rest r, one block of the smallest size >= r; each size is its own launch of the GEMM kernels. With
one size, an expert of 130 rows at B = 128 costs two full blocks (half the second one's dequantization
and MMA work padding); with the tail in a 16-row block it costs little more than one.

On the GPU the plan is three small kernels (a histogram per tile of pairs; the scan into offsets and the
block lists; the scatter, stable within each tile by a cumulative one-hot count), instead of ~15 torch
operations (a radix sort of int64 keys alone is eight passes). `moe_plan_reference` is the same plan in
plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class MoePlan:
    slots: torch.Tensor        # int32 [T*k]: sorted position -> flat (token * k + j) slot
    block_expert: torch.Tensor  # int32 [max_blocks]: expert of each block, num_experts for a spare block
    block_start: torch.Tensor  # int32 [max_blocks]: first sorted row of the block
    block_end: torch.Tensor    # int32 [max_blocks]: one past the last sorted row of the expert
    top_k: int
    block_m: int
    num_experts: int
    # more block lists of smaller BLOCK_M (the experts' remainders): (block_m, expert, start, end) each
    tails: tuple = ()

    def block_groups(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(BLOCK_M, block_expert, block_start, block_end) of each launch, the largest blocks first."""
        return [(self.block_m, self.block_expert, self.block_start, self.block_end), *self.tails]


# The largest block size for an average of rows an expert (a short prompt: small blocks, more programs).
def _block_m(rows_per_expert: float) -> int:
    if rows_per_expert <= 16:
        return 16
    if rows_per_expert <= 32:
        return 32
    if rows_per_expert <= 96:
        return 64
    return 128


# Tail blocks in smaller sizes from 64 rows an expert on (below, the launches would cost more than the
# padding they save: a short prompt is bound by launches).
TAIL_CLASSES = True
TAIL_SIZES = (64, 32, 16)


def block_classes(n_pairs: int, num_experts: int) -> tuple[int, ...]:
    """The block sizes of a plan of n_pairs (token, expert) pairs, largest first."""
    bm = _block_m(n_pairs / num_experts)
    if not TAIL_CLASSES or bm < 64:
        return (bm,)
    return (bm, *(s for s in TAIL_SIZES if s < bm))


def _capacities(n: int, num_experts: int, classes: tuple[int, ...]) -> list[int]:
    """Host-side bound on the blocks of each size: the largest size at most n / B full blocks plus one tail
    an expert; a smaller size at most one block an expert."""
    caps = [min(cdiv(n, classes[0]) + num_experts, n)]
    caps += [min(num_experts, n)] * (len(classes) - 1)
    return [max(1, c) for c in caps]


PLAN_TILE = 256   # pairs a program histograms and scatters (H200: 1024 left the scatter latency-bound)
_SUB = 64         # pairs ranked at once within a tile ([_SUB, E] one-hot counts)
_BLOCK_CHUNK = 128  # block indices a program resolves to experts ([_BLOCK_CHUNK, E] comparisons)


@triton.jit
def _plan_count_kernel(ids_ptr, tile_counts_ptr, n, E: tl.constexpr, E_PAD: tl.constexpr, TILE: tl.constexpr):
    """tile_counts[t, e] = pairs of tile t routed to expert e."""
    t = tl.program_id(0)
    i = t * TILE + tl.arange(0, TILE)
    ok = i < n
    e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    ex = tl.arange(0, E_PAD)
    counts = tl.histogram(e, E_PAD) - tl.where(ex == 0, TILE - tl.sum(ok.to(tl.int32), 0), 0)
    tl.store(tile_counts_ptr + t * E + ex, counts, mask=ex < E)


@triton.jit
def _plan_blocks_kernel(tile_counts_ptr, tile_start_ptr, scratch_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr, n, n_tiles,
                        E: tl.constexpr, E_PAD: tl.constexpr, NG: tl.constexpr,
                        BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr, BM3: tl.constexpr,
                        CHUNK: tl.constexpr, TILE_ROWS: tl.constexpr):
    """Program (g, c) writes blocks c*CHUNK .. (c+1)*CHUNK - 1 of the block list of size class g (each
    program sums the tile counts itself: a few KB from L2, against a long serial walk over all the blocks
    in one program); program (0, 0) also each tile's first sorted row of each expert (tile_start[t, e] =
    offset of e + pairs of e in the tiles before t)."""
    g = tl.program_id(0)
    c = tl.program_id(1)
    # this class's capacity and place in the concatenated lists (host-side bounds, as _capacities)
    cap0 = tl.minimum(tl.cdiv(n, BM0) + E, n)
    cap_tail = tl.minimum(E, n)
    cap = tl.where(g == 0, cap0, cap_tail)
    if c * CHUNK < cap:
        ex = tl.arange(0, E_PAD)
        e_ok = ex < E
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        for t0 in range(0, n_tiles, TILE_ROWS):  # TILE_ROWS tiles at once: few dependent loads in a row
            tr = t0 + tl.arange(0, TILE_ROWS)
            ok = (tr < n_tiles)[:, None] & e_ok[None, :]
            counts += tl.sum(tl.load(tile_counts_ptr + tr[:, None] * E + ex[None, :], mask=ok, other=0), axis=0)
        offsets = tl.cumsum(counts, 0) - counts
        if (g == 0) & (c == 0):
            run = offsets
            for t0 in range(0, n_tiles, TILE_ROWS):
                tr = t0 + tl.arange(0, TILE_ROWS)
                ok = (tr < n_tiles)[:, None] & e_ok[None, :]
                cnt = tl.load(tile_counts_ptr + tr[:, None] * E + ex[None, :], mask=ok, other=0)
                tl.store(tile_start_ptr + tr[:, None] * E + ex[None, :], tl.cumsum(cnt, 0) - cnt + run[None, :],
                         mask=ok)
                run += tl.sum(cnt, axis=0)
        # this class's size and the next smaller one (0: none)
        bm = tl.where(g == 0, BM0, tl.where(g == 1, BM1, tl.where(g == 2, BM2, BM3)))
        smaller = tl.where(g == 0, BM1, tl.where(g == 1, BM2, tl.where(g == 2, BM3, 0)))
        if NG == 1:
            smaller = 0
        base = tl.where(g == 0, 0, cap0 + (g - 1) * cap_tail)
        full = counts // BM0
        rest = counts % BM0
        # the rest goes to the smallest class that holds it: class g takes smaller < rest <= bm
        takes = (rest > smaller) & (rest <= bm) & (rest > 0)
        nb = tl.where(g == 0, full + takes.to(tl.int32), takes.to(tl.int32))
        start = offsets + tl.where(g == 0, 0, full * BM0)
        cum = tl.cumsum(nb, 0)
        # per-expert values gathered below by expert index: through this program's scratch rows
        s_ptr = scratch_ptr + (g * tl.num_programs(1) + c) * 2 * E
        tl.store(s_ptr + ex, start - (cum - nb) * bm, mask=e_ok)  # start of the expert's block b: this + b * bm
        tl.store(s_ptr + E + ex, offsets + counts, mask=e_ok)
        tl.debug_barrier()
        cum_row = tl.where(e_ok, cum, 2147483647)
        b = c * CHUNK + tl.arange(0, CHUNK)
        b_ok = b < cap
        e = tl.sum((cum_row[None, :] <= b[:, None]).to(tl.int32), axis=1)  # E for a spare block
        ec = tl.minimum(e, E - 1)
        s = tl.load(s_ptr + ec) + b * bm
        tl.store(blk_e_ptr + base + b, e, mask=b_ok)
        tl.store(blk_s_ptr + base + b, s, mask=b_ok)
        tl.store(blk_t_ptr + base + b, tl.load(s_ptr + E + ec), mask=b_ok)


@triton.jit
def _plan_scatter_kernel(ids_ptr, tile_start_ptr, slots_ptr, n, E: tl.constexpr, E_PAD: tl.constexpr,
                         TILE: tl.constexpr, SUB: tl.constexpr):
    """slots[tile_start[t, e] + rank of the pair among tile t's pairs of e] = the pair's index (stable)."""
    t = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    seen = tl.zeros((E_PAD,), dtype=tl.int32)  # pairs of each expert already placed from this tile
    for s0 in range(0, TILE, SUB):
        i = t * TILE + s0 + tl.arange(0, SUB)
        ok = i < n
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
        hot = (e[:, None] == ex[None, :]) & ok[:, None]
        before = tl.cumsum(hot.to(tl.int32), 0) - 1 + seen[None, :]  # rank of each pair, read at its expert
        rank = tl.sum(tl.where(hot, before, 0), axis=1)
        pos = tl.load(tile_start_ptr + t * E + e, mask=ok, other=0) + rank
        tl.store(slots_ptr + pos, i, mask=ok)
        seen += tl.sum(hot.to(tl.int32), axis=0)


def _classes(n: int, num_experts: int, block_m) -> tuple[int, ...]:
    if block_m is None:
        return block_classes(n, num_experts)
    classes = (block_m,) if isinstance(block_m, int) else tuple(block_m)
    if not 0 < len(classes) <= 4 or list(classes) != sorted(set(classes), reverse=True) or min(classes) < 16:
        raise ValueError(f"moe_plan: block sizes must be one to four, descending, of 16 rows or more; got {classes}")
    return classes


def moe_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int | tuple[int, ...] | None = None,
             kernels: bool | None = None) -> MoePlan:
    """topk_ids [T, k] (any int dtype, values in [0, E)) -> the sorted, blocked routing plan, on topk_ids'
    device. block_m: the block size(s), largest first, instead of block_classes' choice. kernels: the Triton
    kernels (default on the GPU) or moe_plan_reference (default under the CPU interpreter, where the
    kernels take ~0.3 s a call; they are tested against it there, bit for bit, by tests/test_kernels_moe_plan.py)."""
    if not (kernels if kernels is not None else not INTERPRET):
        return moe_plan_reference(topk_ids, num_experts, block_m)
    T, k = topk_ids.shape
    n = T * k
    E = num_experts
    classes = _classes(n, E, block_m)
    caps = _capacities(n, E, classes)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    n_tiles = cdiv(n, PLAN_TILE)
    e_pad = next_power_of_2(E)
    i32 = dict(device=dev, dtype=torch.int32)
    tile_counts = torch.empty(n_tiles, E, **i32)
    tile_start = torch.empty(n_tiles, E, **i32)
    chunks = cdiv(max(caps), _BLOCK_CHUNK)
    scratch = torch.empty(len(classes), chunks, 2, E, **i32)
    blocks = torch.empty(3, sum(caps), **i32)
    slots = torch.empty(n, **i32)
    _plan_count_kernel[(n_tiles,)](ids, tile_counts, n, E=E, E_PAD=e_pad, TILE=PLAN_TILE, num_warps=4)
    bms = (*classes, 0, 0, 0)[:4]
    _plan_blocks_kernel[(len(classes), chunks)](tile_counts, tile_start, scratch, blocks[0], blocks[1], blocks[2],
                                                n, n_tiles, E=E, E_PAD=e_pad, NG=len(classes), BM0=bms[0],
                                                BM1=bms[1], BM2=bms[2], BM3=bms[3], CHUNK=_BLOCK_CHUNK,
                                                TILE_ROWS=32, num_warps=8)
    _plan_scatter_kernel[(n_tiles,)](ids, tile_start, slots, n, E=E, E_PAD=e_pad, TILE=PLAN_TILE, SUB=_SUB,
                                     num_warps=4)
    groups = []
    at = 0
    for bm, cap in zip(classes, caps):
        groups.append((bm, blocks[0, at:at + cap], blocks[1, at:at + cap], blocks[2, at:at + cap]))
        at += cap
    return MoePlan(slots, *groups[0][1:], k, classes[0], E, tuple(groups[1:]))


def moe_plan_reference(topk_ids: torch.Tensor, num_experts: int,
                       block_m: int | tuple[int, ...] | None = None) -> MoePlan:
    """moe_plan in plain torch (a stable sort, a histogram, cumulative sums)."""
    T, k = topk_ids.shape
    n = T * k
    E = num_experts
    classes = _classes(n, E, block_m)
    caps = _capacities(n, E, classes)
    flat = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cumsum(counts, 0) - counts
    slots = torch.sort(flat, stable=True).indices.to(torch.int32)
    full, rest = counts // classes[0], counts % classes[0]
    groups = []
    for g, (bm, cap) in enumerate(zip(classes, caps)):
        smaller = classes[g + 1] if g + 1 < len(classes) else 0
        takes = ((rest > smaller) & (rest <= bm) & (rest > 0)).long()
        nb = full + takes if g == 0 else takes
        first = offsets + (0 if g == 0 else full * classes[0])
        cum = torch.cumsum(nb, 0)
        b = torch.arange(cap, device=flat.device)
        e = torch.searchsorted(cum, b, right=True)
        ec = e.clamp(max=E - 1)
        start = first[ec] + (b - (cum[ec] - nb[ec])) * bm
        groups.append((bm, e.int(), start.int(), (offsets + counts)[ec].int()))
    return MoePlan(slots, *groups[0][1:], k, classes[0], E, tuple(groups[1:]))


def identity_plan(T: int, device, block_m: int = 64) -> MoePlan:
    """Every token to expert 0, once (the shared expert as a one-expert group)."""
    nb = cdiv(T, block_m)
    b = torch.arange(nb, device=device, dtype=torch.int32)
    return MoePlan(torch.arange(T, device=device, dtype=torch.int32), torch.zeros_like(b), b * block_m,
                   torch.full_like(b, T), 1, block_m, 1)
