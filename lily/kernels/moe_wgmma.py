"""The grouped expert GEMMs on Hopper's warpgroup MMA with the 4-bit weights dequantized in registers.

The Triton kernels (lily/kernels/moe_grouped_gemm.py) turn each 4-bit weight tile into bf16 in shared
memory for the tensor cores: a store and a reload of ~4x the packed bytes a step, which keeps the
shared-memory pipe busy (89 % at a 256-token prompt) and the tensor cores waiting (35 % at 4K, ncu).
Here the product is taken transposed, out^T[n, t] = W[n, :] . A[t, :], so the weights are wgmma's
A operand, which may live in registers:

- A fragment (k_width 2) of a warp's 16 weight rows: lane l holds rows g, g + 8 (g = l / 4) and, in each
  k16 slab, the code pairs (2q, 2q+1) and (2q+8, 2q+9), q = l % 4. An MLX word holds codes 8j .. 8j+7
  (least significant nibble first), so both pairs are byte q of a word: each thread reads its rows'
  whole words (the quad's four lanes read the same ones) and dequantizes byte q of each
  (`_weight_fragment`; the layouts below make the step from words to fragment free: `assert_trivial`).
- The packed words and the activation rows reach shared memory by cp.async, STAGES steps of 64 codes
  deep; the activations are wgmma's B operand there ([BT, 64] rows, K contiguous). The rows' scales and
  biases (2 bytes a row a step: too small for cp.async) are loaded into registers two steps ahead.
- A wgmma reads its register operand while in flight, and ptxas gives every step's fragment the same
  registers: each step's wgmma is retired before the next fragment is written (the copies, the barrier
  and the word loads of the next step still overlap it).
- gate_up: a tile row r is the gate's row n (r % 16 < 8) or the up projection's row n (r % 16 >= 8),
  n = 8 (r // 16) + r % 8: each thread then holds gate and up of the same (n, token) in registers and
  writes silu(gate) * up straight away.
- The tokens of a block are wgmma's N (BT = the plan's block size, 16 .. 128), so a short prompt's few
  rows an expert cost no padding to 64 rows.
- The permuted order (small blocks, PERMUTED_K_MAX_BLOCK): the product does not care in which order k runs,
  so with the activations' columns permuted within each 64-group (`perm_k_index`; gate_up then writes h in
  that order for down) lane q takes MLX words 2q and 2q + 1 whole: one shift and one lop3 put nibbles s and
  s + 4 of a word into the two halves of a fragment register, where the natural order needs a per-lane byte
  select, a shift and two lop3.

The same kernel in its DENSE mode multiplies one [N, K] matrix (no block list: token blocks in order, the
epilogue a store or an fp32 accumulate): lily.kernels.q4_gemm's 4-bit GEMMs of a short prompt (`dense`).

Gluon does not run under TRITON_INTERPRET: on the CPU, tests/test_kernels_moe_wgmma.py checks the word
layout against the PTX ISA's A fragment and the plain-torch references at the end of this file (the byte
order against MLX dequantization, the gate/up interleave against the epilogue's split), and the CPU runs
the Triton kernels; on the GPU (tests marked gpu; scripts/gpu_prefill_check.py's "moe" checks) these
kernels are held to the same plain-torch reference as the Triton ones. lily.kernels.moe_grouped_gemm
sends a prompt's plans here on Hopper GPUs (WGMMA_MOE).
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                             warpgroup_mma_wait)

from lily.kernels.host_math import cdiv

# byte `shift` / 8 of a 4-bit word (codes c0 = low nibble, c1 = high) -> (s * c0 + b, s * c1 + b) in bf16: the
# nibbles go to the two halves of a register OR-ed with 0x4300 (bf16 128 + c, exact), an fma removes the
# 128 exactly, a second applies scale and bias (one rounding, as lily.kernels.q4_gemm's _Q4_BF16_ASM).
_PAIR_ASM: gl.constexpr = gl.constexpr("""
{
.reg .b32 t, h, x, s2, b2, one, m128;
mov.b32 one, 0x3F803F80;
mov.b32 m128, 0xC300C300;
mov.b32 s2, {$4, $4};
mov.b32 b2, {$5, $5};
shr.u32 t, $2, $3;
shl.b32 h, t, 12;
lop3.b32 x, t, 0x0000000F, 0x43004300, 0xEA;
lop3.b32 x, h, 0x000F0000, x, 0xEA;
fma.rn.bf16x2 x, x, one, m128;
fma.rn.bf16x2 x, x, s2, b2;
mov.b32 {$0, $1}, x;
}
""")

# PERMUTED_K: nibbles s and s + 4 of a word (codes 8j + s, 8j + s + 4) -> the two halves of one register by a
# shift and one lop3 (no per-lane byte select, no second lop3); the same two fmas.
_PAIR_PERM_ASM: gl.constexpr = gl.constexpr("""
{
.reg .b32 t, x, s2, b2, one, m128;
mov.b32 one, 0x3F803F80;
mov.b32 m128, 0xC300C300;
mov.b32 s2, {$4, $4};
mov.b32 b2, {$5, $5};
shr.u32 t, $2, $3;
lop3.b32 x, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 x, x, one, m128;
fma.rn.bf16x2 x, x, s2, b2;
mov.b32 {$0, $1}, x;
}
""")

BK = gl.constexpr(64)          # codes a step: one quantization group
WORDS = gl.constexpr(8)        # packed words of a row a step


@gluon.constexpr_function
def _warp_row_bases(num_warps):
    """Each warp owns 16 consecutive tile rows (the wgmma layout with warps_per_cta [num_warps, 1])."""
    return [[16 << i, 0] for i in range((num_warps).bit_length() - 1)]


@gluon.constexpr_function
def _words_layout_3d(BW, num_warps, permuted=False):
    """[BW, WORDS, 4] (row, word, byte): lane l holds rows g, g+8 (+ the warp's and repeat's offsets) and
    byte q of all WORDS words; register order (row + 8, word bits, repeats) as in the A fragment.
    permuted (PERMUTED_K): [BW, WORDS, 4] (row, word, shift s): lane l holds words 2q and 2q + 1 of its rows,
    each taken at the four shifts 4s; register order (row + 8, word bit 0, s bits, repeats)."""
    reps = [[16 * num_warps << i, 0, 0] for i in range((BW // (16 * num_warps)).bit_length() - 1)]
    if permuted:
        regs, lanes = [[8, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 2]], [[0, 2, 0], [0, 4, 0]]
    else:
        regs, lanes = [[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [[0, 0, 1], [0, 0, 2]]
    return gl.DistributedLinearLayout(
        reg_bases=regs + reps, lane_bases=lanes + [[1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[b[0], 0, 0] for b in _warp_row_bases(num_warps)],
        block_bases=[], shape=[BW, 8, 4])


@gluon.jit
def _weight_fragment(words, sc, bi, BW: gl.constexpr, l3: gl.constexpr, a_l: gl.constexpr,
                     PERMUTED_K: gl.constexpr):
    """[BW, WORDS] words (layout SliceLayout(2, l3)), [BW] scales and biases -> the [BW, BK] bf16 A fragment.
    Natural order: the quad's four lanes hold the same words, lane q dequantizes byte q of each. PERMUTED_K:
    lane q holds words 2q, 2q + 1 and the fragment's column k' = 16 s + 8 h + 2 q + e is code 8 (2q + h) + s + 4 e
    (`perm_k_index`: the activations come in that order)."""
    w3 = gl.expand_dims(words, 2) + gl.zeros([BW, WORDS, 4], gl.int32, layout=l3)
    idx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    s3 = gl.zeros([BW, WORDS, 4], gl.bfloat16, layout=l3) + gl.expand_dims(gl.expand_dims(sc, 1), 2)
    b3 = gl.zeros([BW, WORDS, 4], gl.bfloat16, layout=l3) + gl.expand_dims(gl.expand_dims(bi, 1), 2)
    if PERMUTED_K:
        shift = gl.zeros([BW, WORDS, 4], gl.int32, layout=l3) + gl.expand_dims(gl.expand_dims(4 * idx, 0), 0)
        lo, hi = gl.inline_asm_elementwise(_PAIR_PERM_ASM, "=h,=h,r,r,h,h", [w3, shift, s3, b3],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        # [row, word j = 2q + h, s, e] -> [row, s, h, q, e]: k' = 16 s + 8 h + 2 q + e
        w5 = gl.reshape(gl.join(lo, hi), [BW, 4, 2, 4, 2])
        w = gl.reshape(gl.permute(w5, (0, 3, 2, 1, 4)), [BW, BK])
    else:
        shift = gl.zeros([BW, WORDS, 4], gl.int32, layout=l3) + gl.expand_dims(gl.expand_dims(8 * idx, 0), 0)
        lo, hi = gl.inline_asm_elementwise(_PAIR_ASM, "=h,=h,r,r,h,h", [w3, shift, s3, b3],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        w = gl.reshape(gl.join(lo, hi), [BW, BK])
    return gl.convert_layout(w, a_l, assert_trivial=True)


@gluon.jit
def _tile_weight_rows(r, pid_n, BW: gl.constexpr, GATE_UP: gl.constexpr):
    """(n, is_up) of tile rows r: the weight row each holds (tile_rows_reference below, in plain torch)."""
    if GATE_UP:
        return pid_n * (BW // 2) + (r // 16) * 8 + r % 8, (r % 16) >= 8
    return pid_n * BW + r, r < 0


@gluon.jit
def _moe_wgmma_kernel(a_ptr, slot_ptr, wt_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                      w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
                      N, stride_a, stride_out, NUM_EXPERTS, up_w_off, up_s_off, up_b_off, M_ROWS,
                      K: gl.constexpr, TOP_K: gl.constexpr, GATE_UP: gl.constexpr, BY_SLOT: gl.constexpr,
                      DENSE: gl.constexpr, ACCUMULATE: gl.constexpr, PERMUTED_K: gl.constexpr,
                      SPLIT: gl.constexpr, BW: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    """GATE_UP: h[row] = silu(x[tok] Wg^T) * (x[tok] Wu^T) for a block's sorted rows (a = x gathered by
    token; N = the intermediate size; a program's BW tile rows are BW/2 columns of h). Else
    out[slot] = wt[slot] * (h[row] Wd^T) (a = h, the block's own rows; BW columns of out), or with
    BY_SLOT False out[tok] += that (fp32 atomics: a one-expert group, one writer an element).
    DENSE: one [N, K] matrix and no block list: program (n, b) takes rows b*BT .. of a = x (M_ROWS of them),
    out[row] = x[row] W^T, or with ACCUMULATE out[row] += that (one writer an element). SPLIT (DENSE only):
    program (n, b, k) walks the k-th of SPLIT equal parts of K and stores its fp32 partial in part[k]; the
    tile's last part to arrive (count_ptr: an arrival count a tile, zero between calls, which that program sets
    back) sums the partials in part order into out, so the result does not depend on which part ended first.
    PERMUTED_K: a's columns are in `perm_k_index` order within each 64-group (the cheaper dequantization);
    gate_up then writes h in that order too (down's input)."""
    KP: gl.constexpr = K // 8
    KG: gl.constexpr = K // 64
    STEPS: gl.constexpr = K // BK // SPLIT     # steps of one program: its part of K
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BT, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    l3: gl.constexpr = _words_layout_3d(BW, num_warps, PERMUTED_K)
    w_l: gl.constexpr = gl.SliceLayout(2, l3)
    row_l: gl.constexpr = gl.SliceLayout(1, w_l)
    # cp.async sources: 16 bytes a thread
    cw_l: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])
    ca_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    if SPLIT > 1:
        k_part = gl.program_id(2)
    else:
        k_part = pid_n * 0
    k_step0 = k_part * STEPS                   # the part's first step (a group of BK codes)
    if DENSE:
        e = pid_b * 0
    else:
        e = gl.load(blk_e_ptr + pid_b)
    if e < NUM_EXPERTS:  # else a spare block of the host-side bound
        if DENSE:
            start = pid_b * BT
            end = M_ROWS
        else:
            start = gl.load(blk_s_ptr + pid_b)
            end = gl.load(blk_t_ptr + pid_b)

        # the tile's weight rows within the stacked [E * N, ...] matrices (gate_up: up rows offset by up_*_off)
        n_c, up_c = _tile_weight_rows(gl.arange(0, BW, layout=gl.SliceLayout(1, cw_l)), pid_n, BW, GATE_UP)
        r_c = e.to(gl.int64) * N + n_c
        w_src = (w_ptr + (r_c * KP + gl.where(up_c, up_w_off, 0) + k_step0 * WORDS)[:, None]
                 + gl.arange(0, WORDS, layout=gl.SliceLayout(0, cw_l))[None, :])

        t_c = start + gl.arange(0, BT, layout=gl.SliceLayout(1, ca_l))
        t_ok = t_c < end
        if GATE_UP:
            src = (gl.load(slot_ptr + t_c, mask=t_ok, other=0) // TOP_K).to(gl.int64)
        else:
            src = t_c.to(gl.int64)
        a_src = (a_ptr + src[:, None] * stride_a + k_step0 * BK
                 + gl.arange(0, BK, layout=gl.SliceLayout(0, ca_l))[None, :])
        a_mask = t_ok[:, None] & (gl.arange(0, BK, layout=gl.SliceLayout(0, ca_l)) < BK)[None, :]

        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], a_sl)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BW, WORDS], w_sl)

        # the rows' scales and biases of a step are loaded two steps ahead (2 bytes a row: too small for cp.async)
        n_s, up_s = _tile_weight_rows(gl.arange(0, BW, layout=row_l), pid_n, BW, GATE_UP)
        r_s = (e.to(gl.int64) * N + n_s) * KG + k_step0
        s_src = s_ptr + r_s + gl.where(up_s, up_s_off, 0)
        b_src = b_ptr + r_s + gl.where(up_s, up_b_off, 0)
        sc0, bi0 = gl.load(s_src), gl.load(b_src)
        sc1, bi1 = gl.load(s_src + 1 % STEPS), gl.load(b_src + 1 % STEPS)

        # prologue: steps 0 .. STAGES-3 in flight
        for i in gl.static_range(STAGES - 2):
            if i < STEPS:
                async_copy.async_copy_global_to_shared(w_smem.index(i), w_src + i * WORDS)
                async_copy.async_copy_global_to_shared(a_smem.index(i), a_src + i * BK, mask=a_mask)
            async_copy.commit_group()

        acc = warpgroup_mma_init(gl.zeros([BW, BT], gl.float32, layout=acc_l))  # (the loop carries a wgmma's)
        for i in range(STEPS):
            # step i's copies have landed (everyone's, and visible to wgmma's async proxy: the fence, then the
            # barrier), and step i-2's wgmma is done everywhere (retired before step i-1's was issued), so its
            # stage takes step i + STAGES - 2
            async_copy.wait_group(STAGES - 3)
            fence_async_shared()
            gl.thread_barrier()
            j = i + STAGES - 2
            if j < STEPS:
                async_copy.async_copy_global_to_shared(w_smem.index(j % STAGES), w_src + j * WORDS)
                async_copy.async_copy_global_to_shared(a_smem.index(j % STAGES), a_src + j * BK, mask=a_mask)
            async_copy.commit_group()
            s = i % STAGES
            words = w_smem.index(s).load(w_l)
            # step i-1's wgmma ran during the above; it must end before its A fragment's registers are
            # rewritten (a wgmma in flight reads them: ptxas gives each step's fragment the same registers)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            a = _weight_fragment(words, sc0, bi0, BW, l3, a_l, PERMUTED_K)
            acc = warpgroup_mma(a, a_smem.index(s).permute((1, 0)), acc, is_async=True)
            k_next = (i + 2) % STEPS  # (the last two steps reload the first groups: in bounds, unused)
            sc0, bi0 = sc1, bi1
            sc1, bi1 = gl.load(s_src + k_next), gl.load(b_src + k_next)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        if GATE_UP:
            # tile rows (16 i + 8 u + m): u = 0 the gate's row 8 i + m, u = 1 the up projection's
            acc4 = gl.reshape(acc, [BW // 16, 2, 8, BT])
            g, u = gl.split(gl.permute(acc4, (0, 2, 3, 1)))
            h = gl.reshape(g / (1.0 + gl.exp(-g)) * u, [BW // 2, BT])
            o_l: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, num_warps], [0, 1])
            h = gl.convert_layout(h.to(out_ptr.dtype.element_ty), o_l)
            n_o = pid_n * (BW // 2) + gl.arange(0, BW // 2, layout=gl.SliceLayout(1, o_l))
            if PERMUTED_K:  # column n at its place k' in down's input order (perm_k_index's inverse)
                m = n_o % 64
                n_o = n_o - m + 16 * (m % 4) + 8 * ((m // 8) % 2) + 2 * (m // 16) + (m // 4) % 2
            t_o = start + gl.arange(0, BT, layout=gl.SliceLayout(0, o_l))
            gl.store(out_ptr + t_o.to(gl.int64)[None, :] * stride_out + n_o[:, None], h,
                     mask=(t_o < end)[None, :])
        else:
            o_l: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, num_warps], [0, 1])
            y = gl.convert_layout(acc, o_l)
            n_o = pid_n * BW + gl.arange(0, BW, layout=gl.SliceLayout(1, o_l))
            t_o = start + gl.arange(0, BT, layout=gl.SliceLayout(0, o_l))
            ok = t_o < end
            if DENSE:
                dst = out_ptr + t_o.to(gl.int64)[None, :] * stride_out + n_o[:, None]
                if SPLIT > 1:
                    # every thread's partial is stored before the count goes up (the barrier, then a release at
                    # GPU scope); the last part to arrive reads the others' through L2 after its acquire
                    part = part_ptr + t_o.to(gl.int64)[None, :] * N + n_o[:, None]
                    part_stride = M_ROWS * N   # (M_ROWS may come as the constant 1; M_ROWS * N < 2^31)
                    gl.store(part + k_part * part_stride, y, mask=ok[None, :])
                    gl.thread_barrier()
                    tile = pid_n * gl.num_programs(1) + pid_b
                    arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                    if arrived == SPLIT - 1:
                        y = gl.zeros([BW, BT], gl.float32, layout=o_l)
                        for kp in gl.static_range(SPLIT):
                            y += gl.load(part + kp * part_stride, mask=ok[None, :], other=0.0, cache_modifier=".cg")
                        if ACCUMULATE:
                            y = y + gl.load(dst, mask=ok[None, :], other=0.0).to(gl.float32)
                        gl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok[None, :])
                        gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
                else:
                    if ACCUMULATE:
                        y = y + gl.load(dst, mask=ok[None, :], other=0.0).to(gl.float32)
                    gl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok[None, :])
            else:
                slot = gl.load(slot_ptr + t_o, mask=ok, other=0)
                wt = gl.load(wt_ptr + slot, mask=ok, other=0.0).to(gl.float32)
                y = y * wt[None, :]
                if BY_SLOT:
                    gl.store(out_ptr + slot.to(gl.int64)[None, :] * stride_out + n_o[:, None],
                             y.to(out_ptr.dtype.element_ty), mask=ok[None, :])
                else:
                    tok = (slot // TOP_K).to(gl.int64)
                    gl.atomic_add(out_ptr + tok[None, :] * stride_out + n_o[:, None], y, mask=ok[None, :],
                                  sem="relaxed")


# (BW weight rows a program, num_warps, STAGES) by the plan's block size (wgmma's N), for gate_up and for
# down. H200 sweep (scripts/gpu_moe_profile.py --wgmma-sweep, 256 and 4K tokens): one warpgroup of 64 rows
# and 4 stages was the fastest or within 1 % at every block size; two warpgroups (BW 128 or 256, one
# program an SM at 256) gained nothing, their per-step barrier keeping both warpgroups in step.
GATE_UP_TILES = {128: (64, 4, 4), 64: (64, 4, 4), 32: (64, 4, 4), 16: (64, 4, 4)}
DOWN_TILES = {128: (64, 4, 4), 64: (64, 4, 4), 32: (64, 4, 4), 16: (64, 4, 4)}

# The grouped MoE (gate_up, then down) with its activations' columns permuted within each 64-group
# (`perm_k_index`): a lane then dequantizes two whole words (nibbles s and s + 4 into one register) instead of
# one byte of all eight, 3.75 instructions a code pair instead of 6, and reads a quarter of the words from
# shared memory (offline sm_90 build, triton 3.6: 179 -> 140 instructions a step of gate_up's loop at 16-row
# blocks, 72 -> 63 registers). The cost: one gather of x's columns a layer (lily.kernels.moe_grouped_gemm).
# H200, a prompt as a graph (interleaved replays, the median of 15, at 49c1433): 256 tokens (16-row blocks)
# 17.82 -> 17.00 ms permuted, 4K tokens (128-row blocks first) 76.95 -> 78.40 ms. So a plan takes the permuted
# order when its largest blocks have at most PERMUTED_K_MAX_BLOCK rows (0: never; 128: always);
# LILY_MOE_PERMUTED_K_MAX_BLOCK sets it for a whole run (lily bench).
PERMUTED_K_MAX_BLOCK = int(os.environ.get("LILY_MOE_PERMUTED_K_MAX_BLOCK", "16"))


@functools.cache
def _perm_k_index_cached(n: int, device: str) -> torch.Tensor:
    k = torch.arange(n)
    g, kp = k // 64 * 64, k % 64
    s, h, q, e = kp // 16, (kp // 8) % 2, (kp // 2) % 4, kp % 2
    return (g + 16 * q + 8 * h + 4 * e + s).to(device)


def perm_k_index(n: int, device) -> torch.Tensor:
    """idx [n] (n a multiple of 64) with x_p = x[:, idx] the PERMUTED_K column order: within each 64-group,
    position k' = 16 s + 8 h + 2 q + e holds natural column 16 q + 8 h + 4 e + s, the code a lane's register
    takes from MLX word 2q + h at nibble s + 4e."""
    return _perm_k_index_cached(n, str(torch.device(device)))


@functools.cache
def _is_hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def fits(a: torch.Tensor, w, n_out: int, k: int, block_m: int, up_offsets=None) -> bool:
    """Whether these kernels take a GEMM of this shape (else the Triton ones do): a Hopper GPU, 4-bit
    group-64 weights, tile-aligned sizes, 16-byte aligned rows for cp.async."""
    tiles = DOWN_TILES if up_offsets is None else GATE_UP_TILES
    if not a.is_cuda or not _is_hopper(a.device.index) or block_m not in tiles:
        return False
    bw = tiles[block_m][0]
    # (k of one step only fails an assertion in Triton 3.6's lowering of the one-iteration loop)
    return (w.bits == 4 and w.group_size == 64 and k % 64 == 0 and k >= 128 and n_out % bw == 0
            and a.stride(1) == 1 and a.stride(0) % 8 == 0 and a.data_ptr() % 16 == 0
            and (up_offsets is None or up_offsets[0] % 4 == 0))


def gate_up(x, slots, blk_e, blk_s, blk_t, gate, up_offsets, hbuf, top_k: int, block_m: int,
            num_experts: int, permuted: bool = False) -> None:
    """hbuf[rows] = silu(x Wg^T) * (x Wu^T) for one block list (gate: [E, I, H]; the up projection's
    words, scales and biases are up_offsets elements from the gate's). permuted: x's columns, and hbuf's as
    written, in `perm_k_index` order."""
    E, I, H = gate.shape
    bw, warps, stages = GATE_UP_TILES[block_m]
    _moe_wgmma_kernel[(2 * I // bw, blk_e.numel())](
        x, slots, slots, blk_e, blk_s, blk_t, gate.weight.view(torch.int32), gate.scales, gate.biases, hbuf,
        hbuf, slots, I, x.stride(0), hbuf.stride(0), num_experts, *up_offsets, 0,
        K=H, TOP_K=top_k, GATE_UP=True, BY_SLOT=True, DENSE=False, ACCUMULATE=False, PERMUTED_K=permuted,
        SPLIT=1, BW=bw, BT=block_m,
        STAGES=stages, num_warps=warps)


def down(hbuf, slots, slot_weights, blk_e, blk_s, blk_t, down_w, dst, top_k: int, block_m: int,
         num_experts: int, by_slot: bool, permuted: bool = False) -> None:
    """dst[slot] = w[slot] * (hbuf[row] Wd^T) (by_slot), else dst[token] += that, for one block list
    (permuted: hbuf's columns in `perm_k_index` order, as gate_up writes them with permuted)."""
    E, H, I = down_w.shape
    bw, warps, stages = DOWN_TILES[block_m]
    _moe_wgmma_kernel[(H // bw, blk_e.numel())](
        hbuf, slots, slot_weights, blk_e, blk_s, blk_t, down_w.weight.view(torch.int32), down_w.scales,
        down_w.biases, dst, dst, slots,
        H, hbuf.stride(0), dst.stride(0), num_experts, 0, 0, 0, 0,
        K=I, TOP_K=top_k, GATE_UP=False, BY_SLOT=by_slot, DENSE=False, ACCUMULATE=False, PERMUTED_K=permuted,
        SPLIT=1, BW=bw, BT=block_m,
        STAGES=stages, num_warps=warps)


# A dense 4-bit GEMM of a short prompt's rows (lily.kernels.q4_gemm sends WGMMA_DENSE_MIN_M .. WGMMA_DENSE_MAX_M
# rows here on Hopper, and fewer against a tall weight): (BW weight rows a program, num_warps, STAGES, BT rows
# a program at most: `dense_block_rows`). H200
# (scripts/gpu_moe_profile.py --dense-wgmma-ab): the fastest of 7 at 256 .. 1024 rows in the first run.
DENSE_TILES = (64, 4, 4, 128)
# A decode batch's few rows leave ~1.5 programs an SM, each a walk over all of K: up to DENSE_SPLIT_MAX_M rows K is
# split over more programs (dense_splits). H200, a launch in a CUDA graph at 1-32 rows
# (benchmarks/results/batch-h200-20261204-dense-split.json): the GDN in-projection 12.6-15.7 -> 11.3-13.8 us in
# 2 parts, attention's q|k|v 12.6-15.4 -> 10.7-13.0 in 4 (more parts lose); the batched step at 4K 4.38 -> 4.29 ms
# at 8 rows, 6.21 -> 6.12 at 16, 10.54 -> 10.48 at 32. At least 8 steps a part: the GDN out-projection (K = 4096)
# in 8 parts 7.7 us at 8 rows, in 16 parts 9.3 (H100, batch-h100-20261206-skinny-split.json); the others' parts
# are the same with 4 or 8.
DENSE_SPLIT_MAX_M = 32
DENSE_SPLIT_PROGRAMS_PER_SM = 4
DENSE_SPLIT_MIN_STEPS = 8


def dense_fits(x: torch.Tensor, w, out: torch.Tensor) -> bool:
    """Whether `dense` takes out (+)= x @ w^T: a Hopper GPU, a 4-bit group-64 [N, K] weight with N a multiple
    of the tile, bf16 x and out rows 16-byte aligned."""
    N, K = w.shape
    return (x.is_cuda and _is_hopper(x.device.index) and x.dtype == torch.bfloat16 and w.bits == 4
            and w.group_size == 64 and K % 64 == 0 and K >= 128 and N % DENSE_TILES[0] == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and out.stride(1) == 1 and (out.stride(0) * out.element_size()) % 16 == 0)


def dense_block_rows(m: int) -> int:
    """x's rows a program takes (wgmma's N): DENSE_TILES' block, or the power of two >= 16 that holds m
    rows when fewer (a decode batch's 1 .. 16 rows cost no 128-row block of tensor-core work)."""
    bt = DENSE_TILES[3]
    return min(bt, max(16, 1 << (max(1, m) - 1).bit_length()))


def dense(x: torch.Tensor, w, out: torch.Tensor, accumulate: bool, stages: int | None = None, split: int = 1,
          counts: torch.Tensor | None = None) -> None:
    """out = x @ w^T (out bf16 or fp32), or out += that (fp32), for x [M, K] bf16 and w a 4-bit [N, K]
    QuantTensor (dense_fits); stages: the cp.async depth (default DENSE_TILES'). split > 1 (`dense_splits`):
    K in that many parts a tile, their fp32 partials summed in order by the tile's last part to finish, whose
    arrival counts are `counts` (int32 zeros, one a tile at least: left at zero again)."""
    (M, K), N = x.shape, w.shape[0]
    bw, warps, default_stages, _ = DENSE_TILES
    stages = stages or default_stages
    bt = dense_block_rows(M)
    tiles = (N // bw, cdiv(M, bt))
    if split > 1:
        if (K // 64) % split or K // 64 // split < 2 or counts is None or counts.numel() < tiles[0] * tiles[1]:
            raise ValueError(f"moe_wgmma.dense: {split} parts of K={K} (an even share of at least two groups "
                             f"of 64 each, and an arrival count for each of {tiles[0] * tiles[1]} tiles)")
        part = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    else:
        part, counts = out, out
    _moe_wgmma_kernel[(*tiles, split)](
        x, x, x, x, x, x, w.weight.view(torch.int32), w.scales, w.biases, out, part, counts,
        N, x.stride(0), out.stride(0), 1, 0, 0, 0, M,
        K=K, TOP_K=1, GATE_UP=False, BY_SLOT=False, DENSE=True, ACCUMULATE=accumulate, PERMUTED_K=False,
        SPLIT=split, BW=bw, BT=bt,
        STAGES=stages, num_warps=warps)


def dense_splits(m: int, n: int, k: int, sms: int) -> int:
    """Parts of K for `dense` at m rows of an [n, k] weight: up to DENSE_SPLIT_MAX_M rows, enough that about
    DENSE_SPLIT_PROGRAMS_PER_SM programs an SM run, each over at least DENSE_SPLIT_MIN_STEPS groups of 64, K an
    even share each (1: unsplit)."""
    if m > DENSE_SPLIT_MAX_M:
        return 1
    tiles = (n // DENSE_TILES[0]) * cdiv(m, dense_block_rows(m))
    want = cdiv(DENSE_SPLIT_PROGRAMS_PER_SM * sms, max(1, tiles))
    groups = k // 64
    best = 1
    for s in range(2, min(want, groups // DENSE_SPLIT_MIN_STEPS) + 1):
        if groups % s == 0:
            best = s
    return best


# -- plain-torch references of the kernel's index arithmetic (Gluon does not run under the interpreter) ------

def tile_rows_reference(pid_n: int, bw: int, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, is_up) of each of a program's bw tile rows: the weight row (gate's or up's with gate_up) it holds."""
    r = torch.arange(bw)
    if gate_up:
        return pid_n * (bw // 2) + (r // 16) * 8 + r % 8, (r % 16) >= 8
    return pid_n * bw + r, torch.zeros(bw, dtype=torch.bool)


def fragment_reference(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """The [R, 64] bf16 tile `_weight_fragment` assembles from words [R, 8] (int32) and a scale and bias a
    row: element (r, j, q) of the word axis dequantizes byte q of word j into codes k = 8j + 2q + p."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    byte = (w[:, :, None] >> (8 * torch.arange(4))) & 0xFF                      # [R, 8, 4]
    codes = torch.stack([byte & 0xF, byte >> 4], -1).reshape(w.shape[0], 64)   # k = 8j + 2q + p
    return (codes.float() * scales.float()[:, None] + biases.float()[:, None]).to(torch.bfloat16)


def fragment_perm_reference(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """The [R, 64] bf16 tile the PERMUTED_K fragment holds, in its column order k': element (r, j, s, e) of
    the kernel's (word, shift, half) axes is nibble s + 4e of word j, placed at k' = 16 s + 8 (j % 2) +
    2 (j // 2) + e."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    R = w.shape[0]
    nib = (w[:, :, None] >> (4 * torch.arange(8))) & 0xF                      # [R, word j, nibble]
    val = (nib.float() * scales.float()[:, None, None] + biases.float()[:, None, None]).to(torch.bfloat16)
    out = torch.empty(R, 64, dtype=torch.bfloat16)
    for j, s, e in itertools.product(range(8), range(4), range(2)):
        out[:, 16 * s + 8 * (j % 2) + 2 * (j // 2) + e] = val[:, j, s + 4 * e]
    return out


def perm_k_store_reference(n: torch.Tensor) -> torch.Tensor:
    """Where gate_up's PERMUTED_K epilogue writes h's natural column n (the inverse of perm_k_index)."""
    m = n % 64
    return n - m + 16 * (m % 4) + 8 * ((m // 8) % 2) + 2 * (m // 16) + (m // 4) % 2


def gate_up_epilogue_reference(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gate_up tile's [BW, BT] accumulator as the kernel splits them: [BW/2, BT]
    each, row n' of both being h's column pid_n * BW/2 + n'."""
    bw, bt = acc.shape
    g, u = acc.reshape(bw // 16, 2, 8, bt).permute(0, 2, 3, 1).unbind(-1)
    return g.reshape(bw // 2, bt), u.reshape(bw // 2, bt)
