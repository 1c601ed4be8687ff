"""Grouped 4-bit expert GEMMs for prefill: every (token, expert) pair of a layer in two launches.

1. Routing plan (`moe_plan`, on the GPU, no host sync): histogram of the chosen experts, exclusive scan
   into per-expert offsets, a stable sort that scatters the T*k (token, slot) pairs into expert order, and
   a block map: block b of BLOCK_M rows belongs to one expert and covers rows [start_b, end_b) of the
   sorted list. The grid is sized by an upper bound known on the host; spare blocks exit at once.
2. gate_up (`_moe_gate_up_kernel`): per block, gather the tokens' rows of x, multiply by the expert's
   gate and up tiles (4-bit codes dequantized to bf16 in registers, tensor-core dots), and write
   silu(gate) * up for the block's rows (sorted order).
3. down (`_moe_down_kernel`): per block, the expert's down projection of those rows, scaled by the
   routing weight, written to the row of its (token, slot); the k rows of a token are then summed in a
   fixed order into the fp32 output (usually the residual stream itself), so prefill is deterministic.
   A one-expert group (one writer per output element) adds into the output directly.

The weights stay in MLX layout ([E, out, in/8] uint32, [E, out, in/64] bf16 scales/biases).
The shared expert runs through the same kernels as a one-expert group (`identity_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.kernels.q4_gemm import UPCAST_DOT, dequant_tile, mma_nt
from lily.quant import QuantTensor


@dataclass
class MoePlan:
    slots: torch.Tensor        # int32 [T*k]: sorted position -> flat (token * k + j) slot
    block_expert: torch.Tensor  # int32 [max_blocks]: expert of each block, num_experts for a spare block
    block_start: torch.Tensor  # int32 [max_blocks]: first sorted row of the block
    block_end: torch.Tensor    # int32 [max_blocks]: one past the last sorted row of the expert
    top_k: int
    block_m: int
    num_experts: int


# Launch tiles: rows per block for a big batch, and (BLOCK_N, num_warps, num_stages) of each GEMM;
# the fastest of the sweep in scripts/gpu_prefill_check.py on the H200 at a 4K prompt.
BLOCK_M_LARGE = 128
GATE_UP_TILES = (64, 4, 4)
DOWN_TILES = (128, 4, 4)
# Blocks of fewer than 64 rows (a short prompt): (BLOCK_N, num_warps, num_stages) of gate_up, then of down.
SMALL_TILES = (64, 4, 3, 64, 4, 3)


def _block_m(rows_per_expert: float) -> int:
    if rows_per_expert <= 16:
        return 16
    if rows_per_expert <= 32:
        return 32
    if rows_per_expert <= 96:
        return 64
    return BLOCK_M_LARGE


def moe_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> MoePlan:
    """topk_ids [T, k] (any int dtype) -> the sorted, blocked routing plan. All on topk_ids' device."""
    T, k = topk_ids.shape
    n = T * k
    if block_m is None:
        block_m = _block_m(n / num_experts)
    flat = topk_ids.reshape(-1).to(torch.int64)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))                      # histogram
    offsets = torch.cumsum(counts, 0) - counts                             # exclusive scan
    slots = torch.sort(flat, stable=True).indices.to(torch.int32)          # scatter into expert order
    blocks = (counts + block_m - 1) // block_m
    block_end_excl = torch.cumsum(blocks, 0)
    max_blocks = min(triton.cdiv(n, block_m) + num_experts, n)             # host-side bound, no sync
    b = torch.arange(max_blocks, device=dev)
    e = torch.searchsorted(block_end_excl, b, right=True)                  # expert of block b (E = spare)
    ec = e.clamp(max=num_experts - 1)
    start = offsets[ec] + (b - (block_end_excl[ec] - blocks[ec])) * block_m
    end = offsets[ec] + counts[ec]
    return MoePlan(slots, e.to(torch.int32), start.to(torch.int32), end.to(torch.int32), k, block_m,
                   num_experts)


def identity_plan(T: int, device, block_m: int = 64) -> MoePlan:
    """Every token to expert 0, once (the shared expert as a one-expert group)."""
    nb = triton.cdiv(T, block_m)
    b = torch.arange(nb, device=device, dtype=torch.int32)
    return MoePlan(torch.arange(T, device=device, dtype=torch.int32), torch.zeros_like(b), b * block_m,
                   torch.full_like(b, T), 1, block_m, 1)


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
                        gw_ptr, gs_ptr, gb_ptr, uw_ptr, us_ptr, ub_ptr, h_ptr,
                        K, N, KP, KG, stride_x, NUM_EXPERTS, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_e_ptr + pid_b)
    if e >= NUM_EXPERTS:  # spare block of the host-side bound
        return
    rows, r_ok, slot, tok, offs_n, n_ok, n_idx = _block_rows(slot_ptr, blk_s_ptr, blk_t_ptr, e, pid_b, pid_n, N,
                                                            TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
        x = x.to(tl.bfloat16)
        wg = dequant_tile(gw_ptr, gs_ptr, gb_ptr, n_idx, k0, KP, KG, 4, BLOCK_K, BLOCK_N)
        acc_g = mma_nt(x, wg, acc_g, UPCAST)
        wu = dequant_tile(uw_ptr, us_ptr, ub_ptr, n_idx, k0, KP, KG, 4, BLOCK_K, BLOCK_N)
        acc_u = mma_nt(x, wu, acc_u, UPCAST)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    ptrs = h_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(ptrs, h.to(h_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, slot_ptr, wt_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                     dw_ptr, ds_ptr, db_ptr, out_ptr,
                     K, N, KP, KG, stride_out, NUM_EXPERTS, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BY_SLOT: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
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
        tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_out + offs_n[None, :], acc,
                 mask=r_ok[:, None] & n_ok[None, :])
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
        s += tl.load(src_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + h, acc + s, mask=ok)


def _check_experts(gate: QuantTensor, up: QuantTensor, down: QuantTensor, H: int) -> tuple[int, int]:
    E, I, Hg = gate.shape
    if (up.shape != gate.shape or down.shape != (E, H, I) or Hg != H
            or any(w.bits != 4 or w.group_size != 64 for w in (gate, up, down))):
        raise ValueError(f"grouped MoE: expert weights gate {gate.shape} up {up.shape} down {down.shape} "
                         f"do not fit hidden size {H} (4-bit, group 64, [E, I, H] / [E, H, I])")
    return E, I


def moe_grouped(x: torch.Tensor, plan: MoePlan, slot_weights: torch.Tensor,
                gate: QuantTensor, up: QuantTensor, down: QuantTensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] += sum_j slot_weights[t*k + j] * down_e(silu(gate_e x_t) * up_e x_t), e the plan's expert.

    x: bf16 [T, H] with contiguous rows; slot_weights: fp32 [T*k]; out: fp32 [T, H], updated in place.
    """
    T, H = x.shape
    E, I = _check_experts(gate, up, down, H)
    if (E != plan.num_experts or out.dtype != torch.float32 or out.shape != (T, H) or out.stride() != (H, 1)
            or x.stride(1) != 1):
        raise ValueError("grouped MoE: plan, x and out disagree in shape or dtype")
    n_slots = plan.slots.numel()
    hbuf = torch.empty(n_slots, I, device=x.device, dtype=torch.bfloat16)
    nb = plan.block_expert.numel()
    BM = plan.block_m
    (bn_gu, w_gu, s_gu), (bn_d, w_d, s_d) = GATE_UP_TILES, DOWN_TILES
    if BM < 64:  # small batches: narrow tiles, more programs
        bn_gu, w_gu, s_gu, bn_d, w_d, s_d = SMALL_TILES
    _moe_gate_up_kernel[(nb, triton.cdiv(I, bn_gu))](
        x, plan.slots, plan.block_expert, plan.block_start, plan.block_end,
        gate.weight.view(torch.int32), gate.scales, gate.biases,
        up.weight.view(torch.int32), up.scales, up.biases, hbuf,
        H, I, H // 8, H // 64, x.stride(0), E, TOP_K=plan.top_k, UPCAST=UPCAST_DOT,
        BLOCK_M=BM, BLOCK_N=bn_gu, BLOCK_K=64, num_warps=w_gu, num_stages=s_gu)
    # With several slots a token, each slot's row goes to its own buffer row and the k rows of a token are
    # summed in a fixed order: atomics would add them in whatever order the blocks finish, and the prompt's
    # logits (and a greedy continuation) would change from run to run.
    by_slot = plan.top_k > 1
    dst = torch.empty(T * plan.top_k, H, device=x.device, dtype=torch.float32) if by_slot else out
    _moe_down_kernel[(nb, triton.cdiv(H, bn_d))](
        hbuf, plan.slots, slot_weights, plan.block_expert, plan.block_start, plan.block_end,
        down.weight.view(torch.int32), down.scales, down.biases, dst,
        I, H, I // 8, I // 64, dst.stride(0), E, TOP_K=plan.top_k, UPCAST=UPCAST_DOT,
        BLOCK_M=BM, BLOCK_N=bn_d, BLOCK_K=64, BY_SLOT=by_slot, num_warps=w_d, num_stages=s_d)
    if by_slot:
        _combine_slots_kernel[(T, triton.cdiv(H, 1024))](dst, out, H, TOP_K=plan.top_k, BLOCK_H=1024, num_warps=4)
    return out


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
