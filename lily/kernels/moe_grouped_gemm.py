"""Grouped 4-bit expert GEMMs for prefill: every (token, expert) pair of a layer in two launches a
block size.

1. Routing plan (lily/kernels/moe_plan.py, on the GPU, no host sync): the T*k (token, slot) pairs in
   expert order and lists of blocks, each of BLOCK_M rows of one expert; one list (one launch of each
   kernel below) a block size. The grids are sized by host-side bounds; spare blocks exit at once.
2. gate_up (`_moe_gate_up_kernel`): per block, gather the tokens' rows of x, multiply by the expert's
   gate and up tiles (4-bit codes dequantized to bf16 in registers, tensor-core dots), and write
   silu(gate) * up for the block's rows (sorted order).
3. down (`_moe_down_kernel`): per block, the expert's down projection of those rows, scaled by the
   routing weight, written to the row of its (token, slot) (bf16: SLOT_DTYPE); the k rows of a token are
   then summed in fp32 in a fixed order into the fp32 output (usually the residual stream itself), so
   prefill is deterministic. A one-expert group (one writer per output element) adds into the output
   directly.

Both GEMMs' grids put the output-column tiles first (program_id(0)): the programs of one block run
together, so its gathered input rows are read from memory once and then from L2.

The weights stay in MLX layout ([E, out, in/8] uint32, [E, out, in/64] bf16 scales/biases).
The shared expert runs through the same kernels as a one-expert group (`identity_plan`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.moe_plan import MoePlan, identity_plan, moe_plan  # noqa: F401  (the plan's users import it here)
from lily.kernels.moe_plan import INTERPRET, block_classes
from lily.kernels.q4_gemm import UPCAST_DOT, dequant_rows, dequant_tile, mma_nt, rmsnorm_rows, splits_for
from lily.quant import QuantTensor

try:
    from lily.kernels import moe_wgmma
except ImportError:   # a Triton without Gluon's Hopper API (pyproject allows older ones): Triton kernels only
    moe_wgmma = None


# Launch tiles: (BLOCK_N, num_warps, num_stages) of each GEMM for blocks of 64 rows and more; the fastest
# of the sweep in scripts/gpu_prefill_check.py on the H200 at a 4K prompt (8 warps: two warpgroups share
# the dequantized tile; with 4, 255 registers and 94 KB of shared memory left 2 programs and 8 warps an SM).
GATE_UP_TILES = (64, 8, 4)
DOWN_TILES = (128, 8, 3)
# Blocks of fewer than 64 rows (a short prompt, an expert's remainder): (BLOCK_N, num_warps, num_stages)
# of gate_up, then of down.
SMALL_TILES = (64, 4, 3, 64, 4, 3)
# The same for a plan of at most FEW_PAIRS_MAX (token, expert) pairs: a decode batch (up to 64 rows), whose
# experts mostly get one row each.
FEW_PAIRS_TILES = (64, 4, 3, 64, 4, 3)
FEW_PAIRS_MAX = 64 * 9
# Blocks of 64 rows and more: gate and up rows in one dequantized tile and one dot (_moe_gate_up_kernel's
# PAIRED); else two of each. H200 (scripts/gpu_prefill_check.py --ab-paired): gate_up of a 4K prompt 29.8 ->
# 28.6 ms paired; at 256 (16-row blocks) paired was 2 % slower, so smaller blocks keep two tiles.
PAIRED_GATE_UP = True
PAIRED_MIN_BLOCK = 64
# The per-(token, slot) rows of the down projection, before the fixed-order sum: bf16 halves the largest
# memory stream of a long prompt's MoE (4K tokens x 8 slots x 2048 fp32 = 268 MB a layer written, then read);
# each weighted expert output is rounded once, as in a bf16 model. torch.float32 keeps the earlier path.
SLOT_DTYPE = torch.bfloat16
# On Hopper GPUs, a prompt's GEMMs on warpgroup MMA with the weights dequantized in registers
# (lily/kernels/moe_wgmma.py), where their shapes fit; the Triton kernels otherwise (and on the CPU). A decode
# batch's plan (at most FEW_PAIRS_MAX pairs) stays on the Triton kernels: on the Hopper ones it was slower at every
# batch size (benchmarks/results/batch-h100-20261206-grouped-wgmma.json: a 16-row block holds one or two real rows,
# so every weight tile is decoded for one row and the tensor cores save nothing).
WGMMA_MOE = True


@triton.jit
def _block_rows(slot_ptr, blk_s_ptr, blk_t_ptr, e, pid_b, pid_n, N, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Block pid_b's rows of the sorted list (and which are real), their slots and tokens, and the output
    columns of pid_n with their weight rows within the stacked [E * N, ...] matrix of expert e."""
    start = tl.load(blk_s_ptr + pid_b)
    end = tl.load(blk_t_ptr + pid_b)
    rows = start + tl.arange(0, BLOCK_M)
    r_ok = rows < end
    slot = tl.load(slot_ptr + rows, mask=r_ok, other=0)
    tok = (slot // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_idx = e.to(tl.int64) * N + tl.where(n_ok, offs_n, 0)
    return rows, r_ok, slot, tok, offs_n, n_ok, n_idx


@triton.jit
def _moe_gate_up_kernel(x_ptr, slot_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                        gw_ptr, gs_ptr, gb_ptr, uw_ptr, us_ptr, ub_ptr, h_ptr, part_ptr,
                        K, N, KP, KG, stride_x, NUM_EXPERTS, K_SPLIT, N_ROWS, up_w_off, up_s_off, up_b_off,
                        TOP_K: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        PAIRED: tl.constexpr):
    """h = silu(x Wg^T) * (x Wu^T) for a block's rows over K columns [split * K_SPLIT, +K_SPLIT); with SPLIT
    the fp32 partials of both products go to part[split] ([N_ROWS, 2N]) and _gate_up_sum_kernel finishes.
    PAIRED: the gate's and the up projection's BLOCK_N rows are dequantized into one [2 BLOCK_N, BLOCK_K]
    tile and multiplied in one dot (one shared-memory store and one barrier a step instead of two, and
    tensor-core instructions twice as wide); else two tiles, two dots. up_*_off: where the up projection's
    words, scales and biases are, in elements from the gate's (integer offsets from one base keep the row
    addresses plain integer arithmetic, which Triton forms in the loads' layout; a select between two
    pointers was formed once and moved to that layout through shared memory every step)."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(blk_e_ptr + pid_b)
    if e >= NUM_EXPERTS:  # spare block of the host-side bound
        return
    rows, r_ok, slot, tok, offs_n, n_ok, n_idx = _block_rows(slot_ptr, blk_s_ptr, blk_t_ptr, e, pid_b, pid_n, N,
                                                            TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo, k_hi = 0, K
    if SPLIT:  # (unsplit, the loop keeps its plain bounds, which the pipeliner handles best)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if PAIRED:
        # tile row r < BLOCK_N: the gate's row n_idx[r]; r >= BLOCK_N: the up projection's row n_idx[r - BLOCK_N]
        pair = tl.arange(0, 2 * BLOCK_N)
        up_row = pair >= BLOCK_N
        col = pid_n * BLOCK_N + pair % BLOCK_N
        idx = e.to(tl.int64) * N + tl.where(col < N, col, 0)
        w_off = idx * KP + tl.where(up_row, up_w_off, 0)
        s_off = idx * KG + tl.where(up_row, up_s_off, 0)
        b_off = idx * KG + tl.where(up_row, up_b_off, 0)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            w = dequant_rows(gw_ptr + w_off, gs_ptr + s_off, gb_ptr + b_off, k0, 4, BLOCK_K, 2 * BLOCK_N)
            acc = mma_nt(x.to(tl.bfloat16), w, acc, UPCAST)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            x = x.to(tl.bfloat16)
            wg = dequant_tile(gw_ptr, gs_ptr, gb_ptr, n_idx, k0, KP, KG, 4, BLOCK_K, BLOCK_N)
            acc_g = mma_nt(x, wg, acc_g, UPCAST)
            wu = dequant_tile(uw_ptr, us_ptr, ub_ptr, n_idx, k0, KP, KG, 4, BLOCK_K, BLOCK_N)
            acc_u = mma_nt(x, wu, acc_u, UPCAST)
    ok = r_ok[:, None] & n_ok[None, :]
    if SPLIT:
        p = part_ptr + (split * N_ROWS + rows[:, None]).to(tl.int64) * (2 * N) + offs_n[None, :]
        tl.store(p, acc_g, mask=ok)
        tl.store(p + N, acc_u, mask=ok)
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_sum_kernel(part_ptr, h_ptr, N_ROWS, N, SPLITS, BLOCK: tl.constexpr):
    """h = silu(g) * u of the split partials' sums (in split order). Rows no block wrote are garbage, as
    without splits; the down kernel reads only the blocks' rows."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N_ROWS * N
    r = (i // N).to(tl.int64)
    n = i % N
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        base = (s * N_ROWS + r) * (2 * N) + n
        g += tl.load(part_ptr + base, mask=ok, other=0.0)
        u += tl.load(part_ptr + base + N, mask=ok, other=0.0)
    tl.store(h_ptr + r * N + n, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_down_kernel(h_ptr, slot_ptr, wt_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                     dw_ptr, ds_ptr, db_ptr, out_ptr,
                     K, N, KP, KG, stride_out, NUM_EXPERTS, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BY_SLOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_b)
    if e >= NUM_EXPERTS:
        return
    rows, r_ok, slot, tok, offs_n, n_ok, n_idx = _block_rows(slot_ptr, blk_s_ptr, blk_t_ptr, e, pid_b, pid_n, N,
                                                            TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :], mask=r_ok[:, None],
                    other=0.0)
        w = dequant_tile(dw_ptr, ds_ptr, db_ptr, n_idx, k0, KP, KG, 4, BLOCK_K, BLOCK_N)
        acc = mma_nt(a.to(tl.bfloat16), w, acc, UPCAST)
    wt = tl.load(wt_ptr + slot, mask=r_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    if BY_SLOT:   # row (token * k + j) of a [T*k, N] buffer: summed per token in a fixed order afterwards
        tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])
    else:         # one writer per element (a one-expert group): the add is deterministic
        tl.atomic_add(out_ptr + tok[:, None] * stride_out + offs_n[None, :], acc,
                      mask=r_ok[:, None] & n_ok[None, :], sem="relaxed")


@triton.jit
def _combine_slots_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] += src[t*k] + src[t*k + 1] + ... (in that order: the prompt's result does not depend on which
    expert block finished first)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.load(out_ptr + t * H + h, mask=ok, other=0.0)
    s = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        s += tl.load(src_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc + s, mask=ok)


@triton.jit
def _combine_slots_norm_kernel(src_ptr, out_ptr, gain_ptr, x_ptr, H, eps, TOP_K: tl.constexpr,
                               BLOCK_H: tl.constexpr):
    """_combine_slots_kernel over a whole row (one program a token), then the next layer's input from it:
    x[t] = bf16(rmsnorm(out[t]) * gain), as lily.kernels.q4_gemm.rmsnorm_rows computes it (one launch and
    one read of the residual row fewer)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.load(out_ptr + t * H + h, mask=ok, other=0.0)
    s = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        s += tl.load(src_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0).to(tl.float32)
    row = acc + s
    tl.store(out_ptr + t * H + h, row, mask=ok)
    gain = tl.load(gain_ptr + h, mask=ok, other=0.0).to(tl.float32)
    y = row * tl.rsqrt(tl.sum(row * row, axis=0) / H + eps) * gain
    tl.store(x_ptr + t * H + h, y.to(x_ptr.dtype.element_ty), mask=ok)


def _wgmma(plan: MoePlan, a: torch.Tensor, w: QuantTensor, n_out: int, k: int, block_m: int,
           up_offsets=None) -> bool:
    """Whether a GEMM runs on lily/kernels/moe_wgmma.py's Hopper kernels (WGMMA_MOE, a prompt's plan, and
    they fit)."""
    return (WGMMA_MOE and moe_wgmma is not None and not INTERPRET and plan.slots.numel() > FEW_PAIRS_MAX
            and moe_wgmma.fits(a, w, n_out, k, block_m, up_offsets))


def _tiles(block_m: int, n_pairs: int):
    """((BLOCK_N, num_warps, num_stages) of gate_up, the same of down) for blocks of block_m rows in a plan
    of n_pairs (token, expert) pairs."""
    if block_m < 64:  # small blocks: narrow tiles, more programs
        small = FEW_PAIRS_TILES if n_pairs <= FEW_PAIRS_MAX else SMALL_TILES
        return small[:3], small[3:]
    return GATE_UP_TILES, DOWN_TILES


def _check_experts(gate: QuantTensor, up: QuantTensor, down: QuantTensor, H: int) -> tuple[int, int]:
    E, I, Hg = gate.shape
    if (up.shape != gate.shape or down.shape != (E, H, I) or Hg != H
            or any(w.bits != 4 or w.group_size != 64 for w in (gate, up, down))):
        raise ValueError(f"grouped MoE: expert weights gate {gate.shape} up {up.shape} down {down.shape} "
                         f"do not fit hidden size {H} (4-bit, group 64, [E, I, H] / [E, H, I])")
    return E, I


def _elements_between(a: torch.Tensor, b: torch.Tensor) -> int:
    """b's start minus a's, in elements of their (same) size."""
    step = a.element_size()
    if b.element_size() != step or (b.data_ptr() - a.data_ptr()) % step:
        raise ValueError("grouped MoE: gate and up tensors of different element sizes or misaligned")
    return (b.data_ptr() - a.data_ptr()) // step


# Programs an SM the gate/up split-K aims at (counting the plan's spare blocks, which exit at once).
GATE_UP_PROGRAMS_PER_SM = 4


def gate_up_splits(plan: MoePlan, I: int, H: int, device) -> int:
    """Splits of the gate/up GEMMs' K (the hidden size) for a plan of small blocks only (a few decode rows:
    few programs, each a long walk over K); 1 otherwise."""
    if plan.block_m >= 64:
        return 1
    (bn, _, _), _ = _tiles(plan.block_m, plan.slots.numel())
    programs = sum(blk_e.numel() for _, blk_e, _, _ in plan.block_groups()) * cdiv(I, bn)
    return splits_for(programs, H, device, GATE_UP_PROGRAMS_PER_SM)


def permuted_x_wanted(x: torch.Tensor, n_pairs: int, num_experts: int) -> bool:
    """Whether moe_grouped likely takes x's columns in moe_wgmma's permuted order for a plan of n_pairs (token,
    expert) pairs (its blocks small enough, on Hopper): a caller that makes x can then make that copy too, in
    the same kernel (`x_permuted`; lily.kernels.q4_gemm.rmsnorm_rows' permuted_copy). Only a hint: moe_grouped
    decides, and gathers the copy itself when it is not given."""
    return (WGMMA_MOE and moe_wgmma is not None and not INTERPRET and x.is_cuda and n_pairs > FEW_PAIRS_MAX
            and block_classes(n_pairs, num_experts)[0] <= moe_wgmma.PERMUTED_K_MAX_BLOCK)


def moe_grouped(x: torch.Tensor, plan: MoePlan, slot_weights: torch.Tensor,
                gate: QuantTensor, up: QuantTensor, down: QuantTensor, out: torch.Tensor,
                splits: int | None = None, x_permuted: torch.Tensor | None = None,
                next_input: tuple[torch.Tensor, float] | None = None):
    """out[t] += sum_j slot_weights[t*k + j] * down_e(silu(gate_e x_t) * up_e x_t), e the plan's expert.

    x: bf16 [T, H] with contiguous rows; slot_weights: fp32 [T*k]; out: fp32 [T, H], updated in place.
    splits: parts the gate/up GEMMs' K is split into (default `gate_up_splits`'s choice).
    x_permuted: x with each 64-group's columns in moe_wgmma.perm_k_index order, when the caller has it
    (`permuted_x_wanted`); used if the Hopper kernels take that order, else ignored.
    next_input: (gain, eps): also return the next layer's input bf16 rmsnorm(out) * gain [T, H] (made by the
    slot combine when there is one), as (out, x_next); without it, out.
    """
    T, H = x.shape
    E, I = _check_experts(gate, up, down, H)
    if (E != plan.num_experts or out.dtype != torch.float32 or out.shape != (T, H) or out.stride() != (H, 1)
            or x.stride(1) != 1 or (x_permuted is not None and (x_permuted.shape != x.shape
                                                                 or x_permuted.stride() != x.stride()))):
        raise ValueError("grouped MoE: plan, x and out disagree in shape or dtype")
    n_slots = plan.slots.numel()
    hbuf = torch.empty(n_slots, I, device=x.device, dtype=torch.bfloat16)
    # With several slots a token, each slot's row goes to its own buffer row and the k rows of a token are
    # summed in a fixed order: atomics would add them in whatever order the blocks finish, and the prompt's
    # logits (and a greedy continuation) would change from run to run.
    by_slot = plan.top_k > 1
    dst = torch.empty(T * plan.top_k, H, device=x.device, dtype=SLOT_DTYPE) if by_slot else out
    groups = plan.block_groups()
    n_split = gate_up_splits(plan, I, H, x.device) if splits is None else splits
    k_split = cdiv(H // 64, max(1, n_split)) * 64
    n_split = cdiv(H, k_split)
    part = torch.empty(n_split, n_slots, 2 * I, device=x.device, dtype=torch.float32) if n_split > 1 else hbuf
    up_offsets = [_elements_between(getattr(gate, f), getattr(up, f)) for f in ("weight", "scales", "biases")]
    # which launches run on the Hopper kernels; when all of both GEMMs' do and the blocks are small
    # (moe_wgmma.PERMUTED_K_MAX_BLOCK), they take x's columns (and write and read h's) in that kernel's cheaper
    # order: x is gathered into it once here
    gate_up_w = [n_split == 1 and _wgmma(plan, x, gate, 2 * I, H, BM, up_offsets) for BM, _, _, _ in groups]
    down_w = [_wgmma(plan, hbuf, down, H, I, BM) for BM, _, _, _ in groups]
    permuted = (moe_wgmma is not None and plan.block_m <= moe_wgmma.PERMUTED_K_MAX_BLOCK and all(gate_up_w)
                and all(down_w))
    xw = x
    if permuted:
        xw = x_permuted if x_permuted is not None else x.index_select(1, moe_wgmma.perm_k_index(H, x.device))
    for (BM, blk_e, blk_s, blk_t), on_wgmma in zip(groups, gate_up_w):
        if on_wgmma:
            moe_wgmma.gate_up(xw, plan.slots, blk_e, blk_s, blk_t, gate, up_offsets, hbuf, plan.top_k, BM, E,
                              permuted)
            continue
        (bn_gu, w_gu, s_gu), _ = _tiles(BM, n_slots)
        _moe_gate_up_kernel[(cdiv(I, bn_gu), blk_e.numel(), n_split)](
            x, plan.slots, blk_e, blk_s, blk_t,
            gate.weight.view(torch.int32), gate.scales, gate.biases,
            up.weight.view(torch.int32), up.scales, up.biases, hbuf, part,
            H, I, H // 8, H // 64, x.stride(0), E, k_split, n_slots, *up_offsets, TOP_K=plan.top_k, UPCAST=UPCAST_DOT,
            BLOCK_M=BM, BLOCK_N=bn_gu, BLOCK_K=64, SPLIT=n_split > 1, PAIRED=PAIRED_GATE_UP and BM >= PAIRED_MIN_BLOCK,
            num_warps=w_gu, num_stages=s_gu)
    if n_split > 1:
        _gate_up_sum_kernel[(cdiv(n_slots * I, 1024),)](part, hbuf, n_slots, I, n_split, BLOCK=1024,
                                                        num_warps=4)
    for (BM, blk_e, blk_s, blk_t), on_wgmma in zip(groups, down_w):
        if on_wgmma:
            moe_wgmma.down(hbuf, plan.slots, slot_weights, blk_e, blk_s, blk_t, down, dst, plan.top_k, BM, E,
                           by_slot, permuted)
            continue
        _, (bn_d, w_d, s_d) = _tiles(BM, n_slots)
        _moe_down_kernel[(cdiv(H, bn_d), blk_e.numel())](
            hbuf, plan.slots, slot_weights, blk_e, blk_s, blk_t,
            down.weight.view(torch.int32), down.scales, down.biases, dst,
            I, H, I // 8, I // 64, dst.stride(0), E, TOP_K=plan.top_k, UPCAST=UPCAST_DOT,
            BLOCK_M=BM, BLOCK_N=bn_d, BLOCK_K=64, BY_SLOT=by_slot, num_warps=w_d, num_stages=s_d)
    if next_input is None:
        if by_slot:
            _combine_slots_kernel[(T, cdiv(H, 1024))](dst, out, H, TOP_K=plan.top_k, BLOCK_H=1024, num_warps=4)
        return out
    gain, eps = next_input
    if not by_slot:
        return out, rmsnorm_rows(out, gain, eps)
    if gain.shape != (H,):
        raise ValueError(f"grouped MoE: next_input's gain {tuple(gain.shape)} is not [{H}]")
    x_next = torch.empty(T, H, device=x.device, dtype=torch.bfloat16)
    _combine_slots_norm_kernel[(T,)](dst, out, gain, x_next, H, eps, TOP_K=plan.top_k,
                                     BLOCK_H=next_power_of_2(H), num_warps=8)
    return out, x_next


def moe_grouped_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                          gate: QuantTensor, up: QuantTensor, down: QuantTensor) -> torch.Tensor:
    """fp32 sum_j w[t, j] * expert_{ids[t, j]}(x_t), dequantizing only the experts used."""
    x = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        wg = QuantTensor(gate.weight[e], gate.scales[e], gate.biases[e], 4).dequantize()
        wu = QuantTensor(up.weight[e], up.scales[e], up.biases[e], 4).dequantize()
        wd = QuantTensor(down.weight[e], down.scales[e], down.biases[e], 4).dequantize()
        xs = x[t]
        h = torch.nn.functional.silu(xs @ wg.T) * (xs @ wu.T)
        out.index_add_(0, t, (h @ wd.T) * topk_w[t, j].float()[:, None])
    return out
