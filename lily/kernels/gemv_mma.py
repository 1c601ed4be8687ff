"""Batch-1 4-bit GEMV on the tensor cores (mma.sync m16n8k16), y = W x, with the codes kept exact.

The CUDA-core GEMV (lily.kernels.quant_gemv) spends ~23 instructions a thread per packed word (ptxas sm_90,
its loop at K=2048): the decode step's GEMVs follow their instruction count, not HBM. Here a word costs one
shift, four LOP3 and one HMMA:

- A operand (registers): the weights, 16 rows a warp. A lane l = 4g + q holds rows g, g + 8 and MLX words 2q,
  2q + 1 of each 64-code group (moe_wgmma's permuted order, `moe_wgmma._words_layout_3d`): nibbles s and s + 4
  of a word go to the two fp16 halves of one register by one LOP3 each, OR-ed into 1024's exponent, so a half
  is exactly 1024 + code (s even: mask 0x000F000F of w or of w >> 8) or 1024 + 16 code (s odd: mask
  0x00F000F0, no shift of its own). No scale, no subtraction: the codes stay exact.
- B operand (shared memory): x' = fp16(x * xs / f) in the fragment's column order (`moe_wgmma.perm_k_index`),
  f = 16 where the code came in 16x, xs a power of two that keeps x in fp16's range (as the pair dot does).
  Each 64-group's B tile [64, 8] has x' in column (group % 8) and zeros elsewhere, so one accumulator chained
  over 8 groups holds each group's dot in its own column: acc[r, n] = xs * sum_k code x + O_g with
  O_g = 1024 * sum x' (exactly the rounded x' the tensor cores saw).
- Per 8 groups (a chunk), in fp32: tot[r, n] += s[r, g] * (acc[r, n] - O_g) + b[r, g] * XS_g with
  XS_g = sum x' f = xs * sum x (rounded as the dot saw it); y[r] = sum_n tot[r, n] / xs.
The products are exact in the tensor cores and summed in fp32 (the codes are integers, x' one fp16 rounding,
as the pair dot of quant_gemv rounds x).

Persistent programs take (row tile, chunk) steps in order, the next step's words and scales requested before
the current step's arithmetic. Gluon does not run under TRITON_INTERPRET: on the CPU,
tests/test_kernels_gemv_mma.py checks the dequantization PTX (emulated), the column order and the masked-column
algebra (`gemv_mma_emulated`, the kernel's arithmetic in plain torch) against the plain fp32 reference; on a
Hopper GPU (tests marked gpu, scripts/gpu_gemv_tc_probe.py) the kernel itself against gemv_reference.
"""

from __future__ import annotations

import functools
import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from lily.kernels.host_math import cdiv
from lily.kernels.moe_wgmma import _words_layout_3d, perm_k_index

# word $2, shift $3, mask $4 -> (lo, hi) fp16: the word's two masked nibbles (s, s + 4) OR-ed into 1024 (0x6400)
_CODES_ASM: gl.constexpr = gl.constexpr("""
{
.reg .b32 t, x;
shr.u32 t, $2, $3;
lop3.b32 x, t, $4, 0x64006400, 0xEA;
mov.b32 {$0, $1}, x;
}
""")

WORDS = gl.constexpr(8)   # packed words of a row a group
CHUNK = gl.constexpr(8)   # groups a chunk: the accumulator's 8 columns


@gluon.constexpr_function
def _words_load_layout(BW, num_warps):
    """_words_layout_3d(permuted)'s [BW, WORDS] slice with a lane's two words (2q, 2q + 1) as its first register
    pair, so each row's two load as one 8-byte vector (the fragment's register order differs only in order)."""
    frag = _words_layout_3d(BW, num_warps, True)
    regs = [[b[0], b[1]] for b in frag.reg_bases if b[2] == 0]
    regs = [r for r in regs if r == [0, 1]] + [r for r in regs if r != [0, 1]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[b[0], b[1]] for b in frag.lane_bases],
                                      warp_bases=[[b[0], b[1]] for b in frag.warp_bases], block_bases=[],
                                      shape=[BW, WORDS])


@gluon.jit
def _codes_fragment(words, BW: gl.constexpr, l3: gl.constexpr, a_l: gl.constexpr):
    """[BW, WORDS] words of one group (layout SliceLayout(2, l3)) -> the [BW, 64] fp16 A fragment, column
    k' = 16 s + 8 h + 2 q + e holding 1024 + code (s even) or 1024 + 16 code (s odd) of nibble s + 4 e of word
    2q + h."""
    w3 = gl.expand_dims(gl.convert_layout(words, gl.SliceLayout(2, l3)), 2) + gl.zeros([BW, WORDS, 4], gl.int32, layout=l3)
    s = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3))), 0), 0)
    zero = gl.zeros([BW, WORDS, 4], gl.int32, layout=l3)
    shift = zero + (s // 2) * 8
    mask = zero + gl.where(s % 2 == 0, 0x000F000F, 0x00F000F0)
    lo, hi = gl.inline_asm_elementwise(_CODES_ASM, "=h,=h,r,r,r", [w3, shift, mask],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    # [row, word j = 2q + h, s, e] -> [row, s, h, q, e]: k' = 16 s + 8 h + 2 q + e
    w5 = gl.reshape(gl.join(lo, hi), [BW, 4, 2, 4, 2])
    return gl.convert_layout(gl.reshape(gl.permute(w5, (0, 3, 2, 1, 4)), [BW, 64]), a_l, assert_trivial=True)


@gluon.jit
def _x_scale(xmax):
    """A power of two p with xmax * p in [2^8, 2^9) (1 for a non-finite xmax), as half_dot.x_scale."""
    e = (xmax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    bits = (262 - gl.maximum(e, 8)) << 23
    return gl.where(e == 255, 1.0, bits.to(gl.float32, bitcast=True))


@gluon.jit
def _load_step(w_ptr, s_ptr, b_ptr, tile, c, N, rows_w, words_w, rows_a, cols_a, K: gl.constexpr,
               BW: gl.constexpr, EVEN: gl.constexpr):
    """The words of chunk c of row tile `tile` (CHUNK tensors [BW, WORDS]) and its scales and biases [BW, CHUNK]
    in the accumulator's layout."""
    WPR: gl.constexpr = K // 8
    NG: gl.constexpr = K // 64
    r_w = tile * BW + rows_w
    r_a = tile * BW + rows_a
    base = w_ptr + r_w.to(gl.int64)[:, None] * WPR + (c * CHUNK * WORDS) + words_w[None, :]
    soff = r_a.to(gl.int64)[:, None] * NG + (c * CHUNK + cols_a)[None, :]
    out = ()
    if EVEN:
        for gi in gl.static_range(CHUNK):
            out = out + (gl.load(base + gi * WORDS),)
        sc = gl.load(s_ptr + soff)
        bi = gl.load(b_ptr + soff)
    else:
        wm = (r_w < N)[:, None]
        for gi in gl.static_range(CHUNK):
            out = out + (gl.load(base + gi * WORDS, mask=wm, other=0),)
        am = (r_a < N)[:, None]
        sc = gl.load(s_ptr + soff, mask=am, other=0.0)
        bi = gl.load(b_ptr + soff, mask=am, other=0.0)
    return out, sc, bi


@gluon.jit
def q4_gemv_mma_kernel(out_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr, N, eps,
                       K: gl.constexpr, X_MODE: gl.constexpr, PERM_X: gl.constexpr, BW: gl.constexpr,
                       EVEN: gl.constexpr, num_warps: gl.constexpr):
    """out[N] (fp32) = W x for 4-bit W [N, K] (MLX words, group 64); X_MODE 0: x as stored, 1: RMSNorm(x) * gain
    (the rms applied to the row sums). PERM_X: x (and gain) in quant_gemv's PERM64 order. EVEN: N % BW == 0."""
    NG: gl.constexpr = K // 64
    NCH: gl.constexpr = NG // CHUNK
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=2)
    l3: gl.constexpr = _words_layout_3d(BW, num_warps, True)
    w_l: gl.constexpr = _words_load_layout(BW, num_warps)
    # the prologue: x along K (fragment column order), the B tiles as [K, 8] (k', column)
    bl: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    kl: gl.constexpr = gl.SliceLayout(1, bl)
    bt_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)

    # -- prologue: x' in the fragment's column order, masked into each group's column, and its group sums
    kp = gl.arange(0, K, layout=kl)
    g64 = kp // 64
    m = kp % 64
    s_ = m // 16
    nat = g64 * 64 + 16 * ((m // 2) % 4) + 8 * ((m // 8) % 2) + 4 * (m % 2) + s_   # perm_k_index
    if PERM_X:
        src = g64 * 64 + (nat % 8) * 8 + (nat // 8) % 8
    else:
        src = nat
    raw = gl.load(x_ptr + src).to(gl.float32)
    xk = raw
    rstd = 1.0
    if X_MODE == 1:
        xk = raw * gl.load(gain_ptr + src).to(gl.float32)
        rstd = gl.rsqrt(gl.sum(raw * raw, 0) / K + eps)
    xs = _x_scale(gl.max(gl.abs(xk), 0))
    f = gl.where(s_ % 2 == 1, 16.0, 1.0)
    xh = (xk * xs / f).to(gl.float16)
    n8 = gl.arange(0, 8, layout=gl.SliceLayout(0, bl))
    bt = gl.where(n8[None, :] == (g64 % CHUNK)[:, None], xh[:, None], 0.0).to(gl.float16)     # [K, 8]
    bt_smem = gl.allocate_shared_memory(gl.float16, [K, 8], bt_sl, bt)
    xr = xh.to(gl.float32)
    o_smem = gl.allocate_shared_memory(gl.float32, [NG], v_sl, gl.sum(gl.reshape(xr, [NG, 64]), 1) * 1024.0)
    xs_smem = gl.allocate_shared_memory(gl.float32, [NG], v_sl, gl.sum(gl.reshape(xr * f, [NG, 64]), 1))
    gl.thread_barrier()

    rows_w = gl.arange(0, BW, layout=gl.SliceLayout(1, w_l))
    words_w = gl.arange(0, WORDS, layout=gl.SliceLayout(0, w_l))
    rows_a = gl.arange(0, BW, layout=gl.SliceLayout(1, acc_l))
    cols_a = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, acc_l))
    n_tiles = gl.cdiv(N, BW)
    wds, sc, bi = _load_step(w_ptr, s_ptr, b_ptr, pid, 0, N, rows_w, words_w, rows_a, cols_a, K, BW, EVEN)
    for tile in range(pid, n_tiles, nprog):
        tot = gl.zeros([BW, CHUNK], gl.float32, layout=acc_l)
        for c in gl.static_range(NCH):
            # the next chunk's tiles (past the tile's last: the next tile's first), in flight during this
            # chunk's arithmetic; past the program's last tile, its first chunk again
            if c + 1 < NCH:
                wds_n, sc_n, bi_n = _load_step(w_ptr, s_ptr, b_ptr, tile, c + 1, N, rows_w, words_w, rows_a,
                                               cols_a, K, BW, EVEN)
            else:
                nt = gl.where(tile + nprog < n_tiles, tile + nprog, tile)
                wds_n, sc_n, bi_n = _load_step(w_ptr, s_ptr, b_ptr, nt, 0, N, rows_w, words_w, rows_a,
                                               cols_a, K, BW, EVEN)
            # two accumulators (even and odd groups): two independent HMMA chains
            acc0 = gl.zeros([BW, CHUNK], gl.float32, layout=acc_l)
            acc1 = gl.zeros([BW, CHUNK], gl.float32, layout=acc_l)
            for gi in gl.static_range(CHUNK):
                a = _codes_fragment(wds[gi], BW, l3, a_l)
                b = bt_smem.slice((c * CHUNK + gi) * 64, 64).load(b_l)
                if gi % 2 == 0:
                    acc0 = mma_v2(a, b, acc0)
                else:
                    acc1 = mma_v2(a, b, acc1)
            acc = acc0 + acc1
            o_c = o_smem.slice(c * CHUNK, CHUNK).load(gl.SliceLayout(0, acc_l))
            xs_c = xs_smem.slice(c * CHUNK, CHUNK).load(gl.SliceLayout(0, acc_l))
            tot += sc.to(gl.float32) * (acc - o_c[None, :]) + bi.to(gl.float32) * xs_c[None, :]
            wds, sc, bi = wds_n, sc_n, bi_n
        y = gl.sum(tot, 1) * (rstd / xs)
        r = tile * BW + rows_a
        gl.store(out_ptr + r, y, mask=r < N)


# (rows a program's tile, warps, programs an SM)
TILE = (64, 4, 4)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv_mma(w: torch.Tensor, s: torch.Tensor, b: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *,
             norm_gain: torch.Tensor | None = None, eps: float = 1e-6, perm_x: bool = False,
             tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out[N] (fp32) = W @ x (norm_gain: W @ (RMSNorm(x) * gain)) for MLX 4-bit words w [N, K/8] (int32),
    scales / biases [N, K/64]; K a multiple of 512, perm_x: x (and gain) in PERM64 order."""
    n, kw = w.shape
    k = kw * 8
    if k % 512:
        raise ValueError(f"K={k}: the tensor-core GEMV takes K a multiple of 512 (8 groups a chunk)")
    bw, warps, per_sm = tile or TILE
    grid = (min(cdiv(n, bw), _sms(out.device.index or 0) * per_sm),)
    q4_gemv_mma_kernel[grid](out, w, s, b, x, norm_gain if norm_gain is not None else x, n, eps,
                             K=k, X_MODE=1 if norm_gain is not None else 0, PERM_X=perm_x, BW=bw,
                             EVEN=n % bw == 0, num_warps=warps)
    return out


# -- plain torch: the kernel's arithmetic, for the CPU tests ------------------------------------------------------

def codes_fragment_reference(words: torch.Tensor) -> torch.Tensor:
    """[R, 8] MLX words of a group -> the [R, 64] fp16 values the A fragment holds, column k' = 16 s + 8 h + 2 q
    + e: nibble s + 4 e of word 2q + h, as 1024 + code (s even) or 1024 + 16 code (s odd)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[:, :, None] >> (4 * torch.arange(8))) & 0xF
    out = torch.empty(w.shape[0], 64, dtype=torch.float64)
    for j, s, e in itertools.product(range(8), range(4), range(2)):
        out[:, 16 * s + 8 * (j % 2) + 2 * (j // 2) + e] = 1024 + nib[:, j, s + 4 * e] * (16 if s % 2 else 1)
    return out.to(torch.float16)


def gemv_mma_emulated(w: torch.Tensor, s: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64 on the CPU: A from codes_fragment_reference, x' rounded to fp16 in the
    fragment's column order, each chunk's accumulator [R, 8] from masked-column B tiles, the per-group scale
    and bias terms, y = sum / xs."""
    n, kw = w.shape
    k = kw * 8
    ng = k // 64
    xf = x.float()
    amax = xf.abs().max()
    e = int((amax.view(torch.int32) >> 23) & 0xFF)
    xs = 1.0 if e == 255 else 2.0 ** (8 - (max(e, 8) - 127))
    kp = torch.arange(k)
    idx = perm_k_index(k, "cpu")
    f = torch.where((kp % 64 // 16) % 2 == 1, 16.0, 1.0)
    xh = (xf[idx] * xs / f).to(torch.float16)
    xr = xh.double()
    tot = torch.zeros(n, 8, dtype=torch.float64)
    for c in range(ng // 8):
        acc = torch.zeros(n, 8, dtype=torch.float64)
        for gi in range(8):
            g = c * 8 + gi
            a = codes_fragment_reference(w[:, 8 * g:8 * g + 8]).double()
            bt = torch.zeros(64, 8, dtype=torch.float64)
            bt[:, gi] = xr[64 * g:64 * g + 64]
            acc += a @ bt
        o = torch.stack([xr[64 * g:64 * g + 64].sum() * 1024 for g in range(8 * c, 8 * c + 8)])
        xsg = torch.stack([(xr * f.double())[64 * g:64 * g + 64].sum() for g in range(8 * c, 8 * c + 8)])
        tot += s[:, 8 * c:8 * c + 8].double() * (acc - o) + b[:, 8 * c:8 * c + 8].double() * xsg
    return (tot.sum(1) / xs).float()
