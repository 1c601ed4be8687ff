"""The 4-bit codes' dot product with x two codes an instruction: fp16x2 arithmetic on centred codes.

A 4-bit field OR-ed into the mantissa of the fp16 1024 is exactly 1024 + code (bits 0-3 of a half) or
1024 + 16 code (bits 4-7); one fp16x2 subtraction of 1032 (or 1152) leaves code - 8 (or 16 (code - 8)),
exact and centred on zero. So one AND-OR (LOP3) yields two codes, one in each half of a word, and an fp16x2
FMA multiplies them by two x values: a word's 8 codes take one shift, 4 LOP3s, 4 subtractions and 4 FMAs,
against ~26 instructions for the fp32 path (quant_gemv's float trick: an AND, an FADD and an FMA a code).

  (w & 0x000F000F) | 0x64006400        -> 1024 + (c0, c4)      minus 1032: (c0, c4) - 8
  (w & 0x00F000F0) | 0x64006400        -> 1024 + 16 (c1, c5)   minus 1152: 16 ((c1, c5) - 8)
  and the same of w >> 8 for (c2, c6) and (c3, c7)

Centring keeps the fp16 sums small: sum (c - 8) x is what the row needs once the bias absorbs 8 * scale
(quant_gemv: per group  s * sum (c - 8) x + (b + 8 s) * sum x).
Range and precision: x is first scaled by one power of two a program (`x_scale`: max |x| in [2^8, 2^9)),
so a product is at most 2^12 and a half's sum of a pair of words' 8 products at most 2^15, below fp16's
65504; smaller x keep full precision down to 2^-14 (~1e-7 of the largest). x is rounded to fp16 once,
each FMA rounds to fp16 (11-bit mantissa), and each pair of words' sum goes on in fp32; the power of two
undoes itself exactly.

On the GPU the pair of words is one inline PTX block; under the interpreter (no PTX) the same sequence of
fp16 operations in Triton (an FMA rounds once there, a multiply and an add twice: the tests' bounds cover
the difference).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def x_scale(xmax):
    """A power of two p with xmax * p in [2^8, 2^9) (1 for a non-finite xmax: nothing to keep in range)."""
    e = (xmax.to(tl.int32, bitcast=True) >> 23) & 0xFF          # xmax in [2^(e-127), 2^(e-126))
    bits = (262 - tl.maximum(e, 8)) << 23                       # 2^(8 - (e - 127))
    return tl.where(e == 255, 1.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def pack_half2(lo, hi):
    """fp32 tensors -> fp16x2 words (lo in bits 0-15)."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lo_bits | hi_bits


@triton.jit
def x_half_pairs(x0, x1, x2, x3, x4, x5, x6, x7, scale):
    """The dot's x at the 8 code positions of a word (fp32, unscaled) -> the 4 fp16x2 words the FMAs take:
    (x0, x4) and (x2, x6) times scale, (x1, x5) and (x3, x7) times scale / 16 (their codes come times 16)."""
    hi = scale * 0.0625
    return pack_half2(x0 * scale, x4 * scale), pack_half2(x1 * hi, x5 * hi), pack_half2(x2 * scale, x6 * scale), \
        pack_half2(x3 * hi, x7 * hi)


@triton.jit
def even_odd(t):
    """[R, C] or [R, S, C] -> its even and odd columns, [..., C / 2] each (adjacent columns sit in one thread:
    a register split)."""
    if len(t.shape) == 2:
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 2, 2]))
    else:
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 2, 2]))


@triton.jit
def x_word_pairs(x0, x1, x2, x3, x4, x5, x6, x7, scale):
    """The dot's x at the 8 code positions of a row's words ([1, C] or [1, S, C] each, fp32, unscaled; scale
    broadcasts against them) -> x_half_pairs of the even words, then of the odd words ([..., C / 2] each): the
    operands half_dot_tile takes."""
    e0, o0 = even_odd(x0)
    e1, o1 = even_odd(x1)
    e2, o2 = even_odd(x2)
    e3, o3 = even_odd(x3)
    e4, o4 = even_odd(x4)
    e5, o5 = even_odd(x5)
    e6, o6 = even_odd(x6)
    e7, o7 = even_odd(x7)
    a04, a15, a26, a37 = x_half_pairs(e0, e1, e2, e3, e4, e5, e6, e7, scale)
    b04, b15, b26, b37 = x_half_pairs(o0, o1, o2, o3, o4, o5, o6, o7, scale)
    return a04, a15, a26, a37, b04, b15, b26, b37


@triton.jit
def _unpack(h):
    """fp16x2 words -> (lo, hi) fp16 tensors."""
    lo = (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = ((h >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _centred(t, centre):
    """(lo, hi) fp16 of t - centre on both halves, t = the fp16x2 word of two fields in 1024's mantissa."""
    tl_, th = _unpack(t | 0x64006400)
    return tl_ - centre, th - centre


@triton.jit
def _word_codes(w):
    """A word's 8 centred codes as the 4 (lo, hi) fp16 pairs the FMAs take: (c0, c4) - 8, 16 ((c1, c5) - 8),
    (c2, c6) - 8, 16 ((c3, c7) - 8)."""
    u = w >> 8
    return (_centred(w & 0x000F000F, 1032.0), _centred(w & 0x00F000F0, 1152.0), _centred(u & 0x000F000F, 1032.0),
            _centred(u & 0x00F000F0, 1152.0))


@triton.jit
def _codes_fma(codes, p04, p15, p26, p37, acc_lo, acc_hi):
    """acc += a word's centred codes (_word_codes) times its 4 x pairs, in fp16 on both halves."""
    ps = (p04, p15, p26, p37)
    for i in tl.static_range(4):
        xl, xh = _unpack(ps[i])
        acc_lo = acc_lo + codes[i][0] * xl
        acc_hi = acc_hi + codes[i][1] * xh
    return acc_lo, acc_hi


def _decode_ptx(word: str, t: tuple[str, str, str, str]) -> list[str]:
    """PTX: a word's 8 centred codes into the 4 fp16x2 registers t."""
    return [f"lop3.b32 {t[0]}, {word}, 0x000F000F, 0x64006400, 0xEA;",        # (a & b) | c
            f"lop3.b32 {t[1]}, {word}, 0x00F000F0, 0x64006400, 0xEA;",
            f"shr.u32 u, {word}, 8;", f"lop3.b32 {t[2]}, u, 0x000F000F, 0x64006400, 0xEA;",
            f"lop3.b32 {t[3]}, u, 0x00F000F0, 0x64006400, 0xEA;",
            f"sub.rn.f16x2 {t[0]}, {t[0]}, k8;", f"sub.rn.f16x2 {t[1]}, {t[1]}, k128;",
            f"sub.rn.f16x2 {t[2]}, {t[2]}, k8;", f"sub.rn.f16x2 {t[3]}, {t[3]}, k128;"]


def _fma_ptx(t: tuple[str, ...], pairs: tuple[str, ...], first: bool) -> list[str]:
    """PTX: acc += codes t times x pairs (first: acc = them), in fp16x2."""
    return [f"mul.rn.f16x2 acc, {t[i]}, {x};" if first and i == 0 else f"fma.rn.f16x2 acc, {t[i]}, {x}, acc;"
            for i, x in enumerate(pairs)]


def _word_ptx(word: str, pairs: tuple[str, str, str, str], first: bool) -> str:
    """PTX: a word's 8 centred codes (4 fp16x2 registers) times its 4 x pairs, into acc (first: acc = them)."""
    t = ("t0", "t1", "t2", "t3")
    return "\n".join(_decode_ptx(word, t) + _fma_ptx(t, pairs, first))


# one pair of words ($1, $2) with their x pairs ($3-$6, $7-$10) -> $0, the fp32 sum of the two fp16 halves
PAIR_PTX = tl.constexpr("\n".join([
    "{", ".reg .b32 t0, t1, t2, t3, u, acc, k8, k128;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;",
    "mov.b32 k8, 0x64086408;", "mov.b32 k128, 0x64806480;",          # fp16 1032 and 1152, twice
    _word_ptx("$1", ("$3", "$4", "$5", "$6"), True), _word_ptx("$2", ("$7", "$8", "$9", "$10"), False),
    "mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;", "}"]))


@triton.jit
def half_dot_words(wa, wb, a04, a15, a26, a37, b04, b15, b26, b37, ASM: tl.constexpr):
    """sum over the 16 codes of words wa and wb of (code - 8) * x (times the program's x scale), elementwise
    (fp32): the a* / b* pairs are x_half_pairs of wa's / wb's code positions. ASM: the PTX path (GPU)."""
    if ASM:
        return tl.inline_asm_elementwise(
            PAIR_PTX,
            "=f,r,r,r,r,r,r,r,r,r,r",
            [wa, wb, a04, a15, a26, a37, b04, b15, b26, b37], dtype=tl.float32, is_pure=True, pack=1)
    else:
        zero = tl.zeros(wa.shape, tl.float16)
        acc_lo, acc_hi = _codes_fma(_word_codes(wa), a04, a15, a26, a37, zero, zero)
        acc_lo, acc_hi = _codes_fma(_word_codes(wb), b04, b15, b26, b37, acc_lo, acc_hi)
        return acc_lo.to(tl.float32) + acc_hi.to(tl.float32)


@triton.jit
def half_dot_tile(w, a04, a15, a26, a37, b04, b15, b26, b37, ASM: tl.constexpr):
    """A tile of words [R, C] or [R, S, C] (each thread's words adjacent, as a row-contiguous load leaves them)
    -> the elementwise half_dot_words of its even and odd words, [..., C / 2]; the operands from x_word_pairs."""
    we, wo = even_odd(w)
    return half_dot_words(we, wo, a04, a15, a26, a37, b04, b15, b26, b37, ASM)


def pair_rows_ptx(rows: int) -> str:
    """PTX: a pair of words ($rows, $rows+1) decoded once, then dotted with each of `rows` input rows' x pairs
    (row r's 8 at $rows+2+8r ..) -> $r, the fp32 sum of its two fp16 halves; each row's sum is PAIR_PTX's,
    operation for operation."""
    ta, tb = ("t0", "t1", "t2", "t3"), ("t4", "t5", "t6", "t7")
    lines = ["{", ".reg .b32 t0, t1, t2, t3, t4, t5, t6, t7, u, acc, k8, k128;", ".reg .b16 lo, hi;",
             ".reg .f32 flo, fhi;", "mov.b32 k8, 0x64086408;", "mov.b32 k128, 0x64806480;"]
    lines += _decode_ptx(f"${rows}", ta) + _decode_ptx(f"${rows + 1}", tb)
    for r in range(rows):
        x = [f"${rows + 2 + 8 * r + i}" for i in range(8)]
        lines += _fma_ptx(ta, tuple(x[:4]), True) + _fma_ptx(tb, tuple(x[4:]), False)
        lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", f"add.f32 ${r}, flo, fhi;"]
    return "\n".join(lines + ["}"])


def pair_rows_constraints(rows: int) -> str:
    """pair_rows_ptx's operand constraints: `rows` fp32 outputs, then 2 + 8 rows 32-bit inputs."""
    return ",".join(["=f"] * rows + ["r"] * (2 + 8 * rows))


@triton.jit
def half_dot_rows(w, pairs, M: tl.constexpr, ASM: tl.constexpr, ROWS_PTX: tl.constexpr,
                  ROWS_CONSTRAINTS: tl.constexpr):
    """half_dot_tile of one tile of words w against M input rows at once, the codes decoded once: pairs is a tuple
    of M x_word_pairs results (8 each); returns a tuple of M [..., C / 2] fp32. ASM: the PTX path (GPU), whose
    text and constraints are pair_rows_ptx(M) / pair_rows_constraints(M)."""
    we, wo = even_odd(w)
    if ASM:
        args = (we, wo)
        for m in tl.static_range(M):
            args = args + pairs[m]
        # (the outputs' dtypes as a literal: a tuple of dtypes cannot be built up in a jitted function)
        f32 = tl.float32
        if M == 1:
            out = (tl.inline_asm_elementwise(ROWS_PTX, ROWS_CONSTRAINTS, args, dtype=f32, is_pure=True, pack=1),)
        elif M == 2:
            out = tl.inline_asm_elementwise(ROWS_PTX, ROWS_CONSTRAINTS, args, dtype=(f32, f32), is_pure=True, pack=1)
        elif M == 3:
            out = tl.inline_asm_elementwise(ROWS_PTX, ROWS_CONSTRAINTS, args, dtype=(f32, f32, f32), is_pure=True,
                                            pack=1)
        else:
            tl.static_assert(M == 4, "half_dot_rows: 1 to 4 rows")
            out = tl.inline_asm_elementwise(ROWS_PTX, ROWS_CONSTRAINTS, args, dtype=(f32, f32, f32, f32),
                                            is_pure=True, pack=1)
        return out
    else:
        ca = _word_codes(we)
        cb = _word_codes(wo)
        zero = tl.zeros(we.shape, tl.float16)
        out = ()
        for m in tl.static_range(M):
            p = pairs[m]
            acc_lo, acc_hi = _codes_fma(ca, p[0], p[1], p[2], p[3], zero, zero)
            acc_lo, acc_hi = _codes_fma(cb, p[4], p[5], p[6], p[7], acc_lo, acc_hi)
            out = out + (acc_lo.to(tl.float32) + acc_hi.to(tl.float32),)
        return out
