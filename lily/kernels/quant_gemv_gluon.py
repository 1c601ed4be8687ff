"""The batch-1 decode GEMV of lily.kernels.quant_gemv in Gluon, with every layout written out (Hopper).

The Triton kernel (quant_gemv.q_gemv_kernel) leaves the layouts to the compiler, which spreads a row of a
K = 2048 weight tile over two warps and holds x, the scales and the partial sums each in a layout of its own:
ptxas sm_90 (triton 3.6) shows 16 bar.sync in its prologue (the 8 fp16 pairs of x moved between layouts) and
6 a block in its loop (the per-group sums to the scales' layout, the row sums across two warps, the row sums
to the store's layout, the conv epilogue's). Here one warp owns whole rows:

- words [BN, K/8]: lane l holds words 4l .. 4l+3 of every 128 (one 16-byte load each), warps split the rows.
  As fp16 pairs (even word, odd word) that is pairs 2l, 2l+1 of every 64, and as groups of 64 codes
  (8 words, 4 pairs) group l/2 of every 16, with lanes 2i and 2i+1 holding halves of group i. Every
  reshape between these views is a renaming of registers (`assert_trivial`).
- the scales and biases are loaded straight into the per-group sums' layout, the row sums stay in the
  warp (shuffles), and the epilogue works in the row sums' layout: no shared memory and no barrier
  in the loop.
- x: every warp loads all of it in the words' layout (from L1 after the first warp), so its RMSNorm sums,
  its power-of-two scale and its per-group sums are warp reductions too.

The arithmetic is q_gemv_kernel's HALF_DOT path operation for operation (lily.kernels.half_dot's PTX on each
pair of words, the same per-group sums in the same order up to fp32 reassociation), so the Triton kernel
and its plain-torch references (quant_gemv) are its oracle: tests marked gpu and scripts/gpu_decode_check.py
hold it to them at the real shapes. Gluon does not run under TRITON_INTERPRET: on the CPU the Triton
kernel runs, and tests/test_kernels_gemv_gluon.py checks the layouts' register mappings (the part the
compiler would otherwise choose) and the dispatch.

What it covers: 4-bit weights, x in PERM64 order, X_MODE 0 / 1 (quant_gemv's prologues; the gated norm stays there), the plain store,
the residual add with its PERM64 copy (OUT2) and the GDN conv step. The lm_head's argmax blocks stay on the
Triton kernel.
"""

from __future__ import annotations


import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # an older Triton: the Triton kernel serves every call
    gluon = None

from lily.kernels.half_dot import PAIR_PTX

# the words of a row a warp covers in one pass: 32 lanes x 4 words (one 16-byte load a lane)
PASS_WORDS = 128


def available() -> bool:
    return gluon is not None


if gluon is not None:

    @gluon.constexpr_function
    def words_layout(num_warps):
        """[rows, words]: lane l holds words 4l .. 4l+3 of every 128; warps split the rows."""
        return gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def word_pairs_layout(num_warps):
        """[rows, words / 2, 2]: the words' layout seen as (even, odd) pairs."""
        return gl.BlockedLayout([1, 2, 2], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])

    @gluon.constexpr_function
    def pairs_layout(num_warps):
        """[rows, words / 2]: one of the pair's words (or its dot) at each pair: pairs 2l, 2l+1 of every 64."""
        return gl.BlockedLayout([1, 2], [1, 32], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def pair_groups_layout(num_warps):
        """[rows, groups, 4 pairs]: lanes 2i and 2i+1 hold pairs 0-1 and 2-3 of group i of every 16."""
        return gl.BlockedLayout([1, 1, 2], [1, 16, 2], [num_warps, 1, 1], [2, 1, 0])

    @gluon.constexpr_function
    def word_groups_layout(num_warps):
        """[rows, groups, 8 words]: lanes 2i and 2i+1 hold words 0-3 and 4-7 of group i of every 16."""
        return gl.BlockedLayout([1, 1, 4], [1, 16, 2], [num_warps, 1, 1], [2, 1, 0])

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + gl.exp(-x))

    @gluon.jit
    def _pack_half2(lo, hi):
        lo_bits = lo.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        hi_bits = hi.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) << 16
        return lo_bits | hi_bits

    @gluon.jit
    def _even_odd(t, R: gl.constexpr, WPR: gl.constexpr, num_warps: gl.constexpr):
        """[R, WPR] in words_layout -> its even and odd words, [R, WPR / 2] in pairs_layout each (registers only)."""
        t3 = gl.convert_layout(gl.reshape(t, [R, WPR // 2, 2]), word_pairs_layout(num_warps), assert_trivial=True)
        e, o = gl.split(t3)
        return (gl.convert_layout(e, pairs_layout(num_warps), assert_trivial=True),
                gl.convert_layout(o, pairs_layout(num_warps), assert_trivial=True))

    @gluon.jit
    def _x_at(x_ptr, gain_ptr, k, X_MODE: gl.constexpr):
        """(x as the dot uses it, raw x) at PERM64 positions k: quant_gemv.x_prologue's modes 0 (x as stored) and 1
        (x * gain; RMSNorm's 1/rms applied to the row sums)."""
        raw = gl.load(x_ptr + k).to(gl.float32)
        xk = raw
        if X_MODE == 1:
            xk = raw * gl.load(gain_ptr + k).to(gl.float32)
        return xk, raw

    @gluon.jit
    def _x_pairs(x_ptr, gain_ptr, g8, j: gl.constexpr, xs, X_MODE: gl.constexpr, WPR: gl.constexpr,
                 num_warps: gl.constexpr):
        """The fp16x2 words (x_j, x_j+4) of the even words and of the odd words, [1, WPR / 2] in pairs_layout:
        half_dot.x_half_pairs' operands (positions 1 and 3 (and 5, 7) come times 16, so their x times 1/16)."""
        sc = xs
        if j % 2 == 1:
            sc = xs * 0.0625
        lo, _ = _x_at(x_ptr, gain_ptr, g8 + 8 * j, X_MODE)
        hi, _ = _x_at(x_ptr, gain_ptr, g8 + 8 * (j + 4), X_MODE)
        le, lo_ = _even_odd(lo * sc, 1, WPR, num_warps)
        he, ho = _even_odd(hi * sc, 1, WPR, num_warps)
        return _pack_half2(le, he), _pack_half2(lo_, ho)

    @gluon.jit
    def _x_scale(xmax):
        e = (xmax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        bits = (262 - gl.maximum(e, 8)) << 23
        return gl.where(e == 255, 1.0, bits.to(gl.float32, bitcast=True))

    @gluon.jit
    def q4_gemv_gluon_kernel(out_ptr, res_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr,
                             conv_w_ptr, conv_state_ptr, out2_ptr, N, eps,
                             K: gl.constexpr, BN: gl.constexpr, X_MODE: gl.constexpr,
                             OUT2_LO: gl.constexpr, OUT2_HI: gl.constexpr,
                             ADD_RES: gl.constexpr, CONV_ROWS: gl.constexpr, CONV_K: gl.constexpr,
                             CONV_KP: gl.constexpr, GDC: gl.constexpr, num_warps: gl.constexpr):
        """q_gemv_kernel's HALF_DOT path (4 bits, x in PERM64 order, no argmax) with the layouts above:
        persistent, program p takes blocks p, p + P, ... of BN rows, the next block's tiles requested before
        this block's arithmetic."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        WPR: gl.constexpr = K // 8
        NG: gl.constexpr = K // 64
        w_l: gl.constexpr = words_layout(num_warps)
        pg_l: gl.constexpr = pair_groups_layout(num_warps)
        wg_l: gl.constexpr = word_groups_layout(num_warps)
        sg_l: gl.constexpr = gl.SliceLayout(2, pg_l)            # [rows, groups]: the per-group sums
        row_l: gl.constexpr = gl.SliceLayout(1, sg_l)            # [rows]: the row sums and the epilogue

        wr = gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
        word = gl.arange(0, WPR, layout=gl.SliceLayout(0, w_l))
        gr = gl.arange(0, BN, layout=row_l)
        grp = gl.arange(0, NG, layout=gl.SliceLayout(0, sg_l))

        # the first block's tiles before waiting on the previous kernel (weights do not depend on it)
        wrows = pid * BN + wr
        w = gl.load(w_ptr + wrows.to(gl.int64)[:, None] * WPR + word[None, :], mask=(wrows < N)[:, None], other=0)
        srows = pid * BN + gr
        soff = srows.to(gl.int64)[:, None] * NG + grp[None, :]
        s = gl.load(s_ptr + soff, mask=(srows < N)[:, None], other=0.0)
        b = gl.load(b_ptr + soff, mask=(srows < N)[:, None], other=0.0)
        if GDC:
            _gdc_wait()
        res = 0.0
        if ADD_RES:
            res = gl.load(res_ptr + srows, mask=srows < N, other=0.0)

        # x at the 8 code positions of every word ([1, WPR] each, words_layout; PERM64: code j of word
        # 8g + c multiplies x_p[64g + 8j + c]). First pass: the RMSNorm sum, the largest |x| (the scale) and each
        # word's sum of x (the per-group sums); second pass (from L1): the fp16 pairs. Two passes keep ptxas
        # from spilling all 8 x 2 of a thread's vectors at once.
        g8 = ((word // 8) * 64 + word % 8)[None, :]
        xk, raw = _x_at(x_ptr, gain_ptr, g8, X_MODE)
        sq = raw * raw
        amax = gl.abs(xk)
        xw = xk
        for j in gl.static_range(1, 8):
            xk, raw = _x_at(x_ptr, gain_ptr, g8 + 8 * j, X_MODE)
            sq += raw * raw
            amax = gl.maximum(amax, gl.abs(xk))
            xw += xk
        rstd = gl.rsqrt(gl.sum(gl.sum(sq, 1), 0) / K + eps)
        xs = _x_scale(gl.max(gl.max(amax, 1), 0))
        xg = gl.convert_layout(gl.reshape(xw, [1, NG, 8]), wg_l, assert_trivial=True)
        xsum = gl.convert_layout(gl.sum(xg, 2), sg_l) * xs                  # [1, NG]
        a04, b04 = _x_pairs(x_ptr, gain_ptr, g8, 0, xs, X_MODE, WPR, num_warps)
        a15, b15 = _x_pairs(x_ptr, gain_ptr, g8, 1, xs, X_MODE, WPR, num_warps)
        a26, b26 = _x_pairs(x_ptr, gain_ptr, g8, 2, xs, X_MODE, WPR, num_warps)
        a37, b37 = _x_pairs(x_ptr, gain_ptr, g8, 3, xs, X_MODE, WPR, num_warps)
        unscale = 1.0 / xs

        nblk = gl.cdiv(N, BN)
        for blk in range(pid, nblk, nprog):
            rows = blk * BN + gr
            rmask = rows < N
            # the next block's tiles (and residual), in flight during this block's arithmetic
            nw = (blk + nprog) * BN + wr
            w_n = gl.load(w_ptr + nw.to(gl.int64)[:, None] * WPR + word[None, :], mask=(nw < N)[:, None], other=0)
            nrows = (blk + nprog) * BN + gr
            noff = nrows.to(gl.int64)[:, None] * NG + grp[None, :]
            s_n = gl.load(s_ptr + noff, mask=(nrows < N)[:, None], other=0.0)
            b_n = gl.load(b_ptr + noff, mask=(nrows < N)[:, None], other=0.0)
            res_n = 0.0
            if ADD_RES:
                res_n = gl.load(res_ptr + nrows, mask=nrows < N, other=0.0)
            we, wo = _even_odd(w, BN, WPR, num_warps)
            q = gl.inline_asm_elementwise(PAIR_PTX, "=f,r,r,r,r,r,r,r,r,r,r",
                                          [we, wo, a04, a15, a26, a37, b04, b15, b26, b37],
                                          dtype=gl.float32, is_pure=True, pack=1)       # [BN, WPR / 2]
            qg = gl.sum(gl.convert_layout(gl.reshape(q, [BN, NG, 4]), pg_l, assert_trivial=True), 2)
            sf = s.to(gl.float32)
            bias = b.to(gl.float32) + 8.0 * sf                                       # the dot was of code - 8
            acc = gl.sum(sf * qg + bias * xsum, 1) * unscale                         # [BN], row_l
            if X_MODE == 1:
                acc = acc * rstd
            if CONV_ROWS > 0:
                # GDN: rows < CONV_ROWS are conv channels, y = silu(sum_j w[c, j] window[j]) over
                # [state (last K-1 pre-conv rows, oldest first) | this row]; the state shifts by one. A channel's
                # reads and writes all come from the one warp that owns its row.
                cm = rmask & (rows < CONV_ROWS)
                jj = gl.arange(0, CONV_KP, layout=gl.SliceLayout(0, sg_l))
                in_state = cm[:, None] & (jj < CONV_K - 1)[None, :]
                old = gl.load(conv_state_ptr + jj[None, :] * CONV_ROWS + rows[:, None], mask=in_state, other=0.0)
                cw = gl.load(conv_w_ptr + rows[:, None] * CONV_K + jj[None, :],
                             mask=cm[:, None] & (jj < CONV_K)[None, :], other=0.0)
                win = gl.where((jj == CONV_K - 1)[None, :], acc[:, None], old.to(gl.float32))
                y = gl.sum(win * cw, 1)
                nxt = gl.load(conv_state_ptr + (jj[None, :] + 1) * CONV_ROWS + rows[:, None],
                              mask=cm[:, None] & (jj < CONV_K - 2)[None, :], other=0.0)
                new = gl.where((jj == CONV_K - 2)[None, :], acc[:, None], nxt.to(gl.float32))
                gl.store(conv_state_ptr + jj[None, :] * CONV_ROWS + rows[:, None],
                         new.to(conv_state_ptr.dtype.element_ty), mask=in_state)
                acc = gl.where(rows < CONV_ROWS, y * _sigmoid(y), acc)
            if ADD_RES:
                acc += res
            gl.store(out_ptr + rows, acc, mask=rmask)
            if OUT2_HI > OUT2_LO:
                m2 = rmask & (rows >= OUT2_LO) & (rows < OUT2_HI)
                r2 = gl.where(m2, rows - OUT2_LO, 0)
                gl.store(out2_ptr + (r2 // 64) * 64 + (r2 % 8) * 8 + (r2 // 8) % 8, acc, mask=m2)
            w, s, b, res = w_n, s_n, b_n, res_n


# -- launcher ----------------------------------------------------------------------------------------------

# (rows a block, programs an SM, warps, registers a thread) by K. K = 2048: quant_gemv's (8, 4, 4) at its 128
# registers (ptxas sm_90: 127, nothing spilled). K = 4096: 4 warps uncapped (239 registers, two programs an SM:
# the out-projections' 256 blocks in one wave; 8 warps spill the prologue at 128 and fit one program an SM at 186).
BLOCKS = {2048: (8, 4, 4, 128), 4096: (8, 2, 4, None)}


def block_for(k: int) -> tuple[int, int, int, int | None]:
    return BLOCKS.get(k) or BLOCKS[2048 if k < 4096 else 4096]


def supports(bits: int, k: int, perm_x: bool, x_mode: int, argmax: bool) -> bool:
    """Whether q4_gemv_gluon_kernel computes this GEMV: 4 bits, x in PERM64 order, no gated norm and no argmax,
    K a multiple of 1024 (whole passes of 128 words, whole passes of 16 groups)."""
    return bits == 4 and perm_x and x_mode in (0, 1) and not argmax and k % 1024 == 0


def gemv(lin, x: torch.Tensor, out: torch.Tensor, *, norm_gain=None, eps: float = 1e-6,
         residual: torch.Tensor | None = None, conv=None, out2: torch.Tensor | None = None,
         out2_rows: tuple[int, int] | None = None, gdc: bool = False, launch_opts: dict | None = None,
         sm_count: int = 1) -> torch.Tensor:
    """quant_gemv.gemv's contract for what `supports` admits (quant_gemv.gemv dispatches here on Hopper)."""
    bn, per_sm, warps, regs = block_for(lin.k)
    dummy = out
    conv_w, conv_state, conv_rows, conv_k = dummy, dummy, 0, 2
    if conv is not None:
        conv_w, conv_state = conv
        conv_rows, conv_k = conv_w.shape
    lo, hi = (out2_rows or (0, lin.n)) if out2 is not None else (0, 0)
    grid = (min(-(-lin.n // bn), sm_count * per_sm),)
    q4_gemv_gluon_kernel[grid](
        out, residual if residual is not None else dummy, lin.w, lin.s, lin.b, x,
        norm_gain if norm_gain is not None else dummy, conv_w, conv_state, out2 if out2 is not None else dummy,
        lin.n, eps, K=lin.k, BN=bn, X_MODE=1 if norm_gain is not None else 0, OUT2_LO=lo, OUT2_HI=hi,
        ADD_RES=residual is not None, CONV_ROWS=conv_rows, CONV_K=conv_k,
        CONV_KP=1 << max(0, (conv_k - 1).bit_length()), GDC=gdc, num_warps=warps,
        **({"maxnreg": regs} if regs else {}), **(launch_opts or {}))
    return out
