"""The grouped expert GEMMs for blocks of 16 or 32 rows (a short prompt, a long one's remainders), in Gluon.

At a 256-token prompt every expert gets ~8 rows and the expert GEMMs stream the 4-bit weights once; the
Triton kernels (lily/kernels/moe_grouped_gemm.py) turn each 64x64 weight tile into bf16 in shared memory
for the tensor cores, and that store and its reload (~12x the packed bytes) keep the L1/shared pipe 89 %
busy while HBM runs at 1.3 TB/s (ncu, benchmarks/results/prefill-h200-20261201-moe-grid-slots.json).
Here each thread dequantizes exactly the weights its mma.sync (m16n8k16) B fragment holds, in registers:

- B fragment of a k16 x n8 tile (k_width 2): thread with lane l holds column n = l / 4 and rows
  k = 2q, 2q+1, 2q+8, 2q+9 with q = l % 4. An MLX word holds codes k = 8w .. 8w+7 (LSB first), so the pair
  (2q, 2q+1) of every word is its byte q: a thread reads whole words and takes one byte of each.
- The words are loaded as a [BK/2, BN] int32 tensor in the same fragment layout at k_width 1 (one 32-bit
  element a k pair); `_PAIR_ASM` turns (word, byte) into the two bf16 weights s*c + b; joining the two and
  folding the pair axis into k gives the k_width-2 fragment itself (checked: `assert_trivial`).
- The activation rows are loaded straight into the A fragment layout. No shared memory is used at all.

Gluon does not run under TRITON_INTERPRET: the CPU tests run the Triton kernels, and the GPU check
(scripts/gpu_prefill_check.py, kernel group "moe") holds these to the same plain-torch reference.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# byte `shift` of a 4-bit word (codes c0 = low nibble, c1 = high) -> (s * c0 + b, s * c1 + b) in bf16: the
# nibbles go to the two halves of a register OR-ed with 0x4300 (bf16 128 + c, exact), an fma removes the
# 128 exactly, a second applies scale and bias (one rounding, as in lily.kernels.q4_gemm's _Q4_BF16_ASM).
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

BLOCK_N = 64
WARPS = 4


@gluon.jit
def _load_words(w_rows, s_rows, b_rows, k0):
    """The packed words of columns k0 .. k0+63 of the tile's rows (w_rows: [BK/2, BN] pointers to each k
    pair's word at k0 = 0) and the rows' scale and bias of that group (s_rows, b_rows: [BN] pointers)."""
    g = k0 // 64
    return gl.load(w_rows + k0 // 8), gl.load(s_rows + g), gl.load(b_rows + g)


@gluon.jit
def _weight_fragment(words, sc, bi, shift, BK: gl.constexpr, BN: gl.constexpr, p_l: gl.constexpr,
                     b_l: gl.constexpr):
    """The [BK, BN] bf16 B fragment of _load_words' words (shift: each k pair's byte in its word, x8)."""
    sc2 = gl.zeros([BK // 2, BN], gl.bfloat16, layout=p_l) + sc[None, :]
    bi2 = gl.zeros([BK // 2, BN], gl.bfloat16, layout=p_l) + bi[None, :]
    lo, hi = gl.inline_asm_elementwise(_PAIR_ASM, "=h,=h,r,r,h,h", [words, shift, sc2, bi2],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    w = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (BK, BN))
    return gl.convert_layout(w, b_l, assert_trivial=True)


@gluon.jit
def _moe_small_kernel(a_ptr, slot_ptr, wt_ptr, blk_e_ptr, blk_s_ptr, blk_t_ptr,
                      w1_ptr, s1_ptr, b1_ptr, w2_ptr, s2_ptr, b2_ptr, out_ptr,
                      K, N, KP, KG, stride_a, stride_out, NUM_EXPERTS,
                      TOP_K: gl.constexpr, GATE_UP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      BK: gl.constexpr, NUM_WARPS: gl.constexpr):
    """GATE_UP: h[row] = silu(x[tok] W1^T) * (x[tok] W2^T) for a block's sorted rows (a = x, gathered by
    token); else out[slot] = wt[slot] * (h[row] W1^T) (a = h, the block's own rows; W2 unused)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=1)
    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    e = gl.load(blk_e_ptr + pid_b)
    if e < NUM_EXPERTS:  # else a spare block of the host-side bound
        start = gl.load(blk_s_ptr + pid_b)
        end = gl.load(blk_t_ptr + pid_b)
        rows_a = start + gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
        ok_a = rows_a < end
        if GATE_UP:
            src = (gl.load(slot_ptr + rows_a, mask=ok_a, other=0) // TOP_K).to(gl.int64)
        else:
            src = rows_a.to(gl.int64)
        ka = gl.arange(0, BK, layout=gl.SliceLayout(0, a_l))
        a_rows = a_ptr + src[:, None] * stride_a + ka[None, :]
        kp = gl.arange(0, BK // 2, layout=gl.SliceLayout(1, p_l))
        n_p = e.to(gl.int64) * N + pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, p_l))
        w_off = n_p[None, :] * KP + (kp // 4)[:, None]
        shift = gl.zeros([BK // 2, BN], gl.int32, layout=p_l) + ((kp % 4) * 8)[:, None]
        w1_rows = w1_ptr + w_off
        w2_rows = w2_ptr + w_off
        s1_rows, b1_rows = s1_ptr + n_p * KG, b1_ptr + n_p * KG
        s2_rows, b2_rows = s2_ptr + n_p * KG, b2_ptr + n_p * KG
        acc1 = gl.zeros([BM, BN], gl.float32, layout=mma)
        acc2 = gl.zeros([BM, BN], gl.float32, layout=mma)
        # the next step's words are loaded before this step's arithmetic (no shared memory to stage them in)
        q1, sc1, bi1 = _load_words(w1_rows, s1_rows, b1_rows, 0)
        q2, sc2, bi2 = q1, sc1, bi1
        if GATE_UP:
            q2, sc2, bi2 = _load_words(w2_rows, s2_rows, b2_rows, 0)
        for k0 in range(0, K, BK):
            a = gl.load(a_rows + k0, mask=ok_a[:, None], other=0.0).to(gl.bfloat16)
            k_next = (k0 + BK) % K  # the last step reloads the first words: in bounds, unused
            n1, nsc1, nbi1 = _load_words(w1_rows, s1_rows, b1_rows, k_next)
            acc1 = mma_v2(a, _weight_fragment(q1, sc1, bi1, shift, BK, BN, p_l, b_l), acc1)
            q1, sc1, bi1 = n1, nsc1, nbi1
            if GATE_UP:
                n2, nsc2, nbi2 = _load_words(w2_rows, s2_rows, b2_rows, k_next)
                acc2 = mma_v2(a, _weight_fragment(q2, sc2, bi2, shift, BK, BN, p_l, b_l), acc2)
                q2, sc2, bi2 = n2, nsc2, nbi2
        rows = start + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        ok = rows < end
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        if GATE_UP:
            h = acc1 / (1.0 + gl.exp(-acc1)) * acc2
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_out + cols[None, :],
                     h.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        else:
            slot = gl.load(slot_ptr + rows, mask=ok, other=0)
            wt = gl.load(wt_ptr + slot, mask=ok, other=0.0).to(gl.float32)
            y = acc1 * wt[:, None]
            gl.store(out_ptr + slot.to(gl.int64)[:, None] * stride_out + cols[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def gate_up_small(x, slots, blk_e, blk_s, blk_t, gate, up, hbuf, top_k: int, block_m: int, num_experts: int):
    """hbuf[rows] = silu(x Wg^T) * (x Wu^T) for the blocks of one block list (block_m 16 or 32)."""
    E, I, H = gate.shape
    _moe_small_kernel[(I // BLOCK_N, blk_e.numel())](
        x, slots, slots, blk_e, blk_s, blk_t,
        gate.weight.view(torch.int32), gate.scales, gate.biases, up.weight.view(torch.int32), up.scales, up.biases,
        hbuf,
        H, I, H // 8, H // 64, x.stride(0), hbuf.stride(0), num_experts,
        TOP_K=top_k, GATE_UP=True, BM=block_m, BN=BLOCK_N, BK=64, NUM_WARPS=WARPS, num_warps=WARPS)


def down_small(hbuf, slots, slot_weights, blk_e, blk_s, blk_t, down, dst, top_k: int, block_m: int,
               num_experts: int):
    """dst[slot] = w[slot] * (hbuf[row] Wd^T) for the blocks of one block list (block_m 16 or 32)."""
    E, H, I = down.shape
    _moe_small_kernel[(H // BLOCK_N, blk_e.numel())](
        hbuf, slots, slot_weights, blk_e, blk_s, blk_t,
        down.weight.view(torch.int32), down.scales, down.biases, down.weight.view(torch.int32), down.scales,
        down.biases, dst,
        I, H, I // 8, I // 64, hbuf.stride(0), dst.stride(0), num_experts,
        TOP_K=top_k, GATE_UP=False, BM=block_m, BN=BLOCK_N, BK=64, NUM_WARPS=WARPS, num_warps=WARPS)
