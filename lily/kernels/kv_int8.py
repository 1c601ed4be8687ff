"""The KV cache in 8 bits: one code a value and one scale a (token, KV head) row.

Layout: a bf16 cache is [..., max_seq, Hkv, D]; an int8 cache is uint8 [..., max_seq, Hkv, D + KV8_PAD]: each
(token, head) row holds its D codes, then its fp32 scale in the next 4 bytes, then padding that keeps every row
16-byte aligned (vector loads, TMA). Scale and codes travel together, so whatever copies or slices cache rows
(slot restores, prefix-cache snapshots, prefill staging) handles both caches alike.

Quantization is symmetric, per row: scale = max|x| / 127, code = clamp(round(x / scale), -127, 127) + 128 (offset
binary, 1..255). A row's error is at most half a step, 0.4 % of its largest value, against bf16's 0.4 % of each
value; the cache takes 0.53x the bytes (2 KiB a token a layer -> 1.06 KiB).

Decoding in the decode attention: OR-ing a code into the low byte of the fp16 1024 (0x6400) gives exactly
1024 + code, and one fp16 subtraction of 1152 leaves code - 128 (no int->float conversion, a fraction of the FMA
rate); the dots take those fp16 tiles (q in fp16 too) and apply the scales to their results, a K scale a score
column, a V scale folded into the probabilities. The prefill attention reads rows decoded to bf16 once a chunk
(kv8_dequantize_rows). On the H200 the decode attention over this cache is still slower than the bf16 kernel
over twice the bytes (benchmarks/results/decode-h200-20261204-kv-int8.json): the option saves memory, not time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.config import KV_CACHE_DTYPES

KV8_PAD = 16   # bytes after a row's codes: its fp32 scale, then padding to a multiple of 16
KV8_PAD_JIT = tl.constexpr(KV8_PAD)   # (the same, as jitted code may read a global)


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {kv_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_dtype


def kv_row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements a (token, head) row takes in the cache's last axis."""
    return head_dim + KV8_PAD if check_kv_dtype(kv_dtype) == "int8" else head_dim


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    return kv_row_width(head_dim, kv_dtype) * (1 if kv_dtype == "int8" else 2)


def kv_cache_zeros(lead: tuple[int, ...], n_kv: int, head_dim: int, kv_dtype: str, device) -> torch.Tensor:
    """A zeroed cache [*lead, n_kv, row] in kv_dtype's layout."""
    dtype = torch.uint8 if check_kv_dtype(kv_dtype) == "int8" else torch.bfloat16
    return torch.zeros(*lead, n_kv, kv_row_width(head_dim, kv_dtype), dtype=dtype, device=device)


def is_kv8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def kv_head_dim(cache: torch.Tensor) -> int:
    """D of a cache in either layout."""
    return cache.shape[-1] - KV8_PAD if is_kv8(cache) else cache.shape[-1]


# -- in kernels ----------------------------------------------------------------------------------------------

@triton.jit
def kv8_codes(x, amax):
    """fp32 values x and their row's max |x| (broadcast against x) -> the offset-binary codes (uint8)."""
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)   # (a NaN or inf row keeps its non-finite scale: see kv8_scale)
    q = tl.minimum(tl.maximum(tl.floor(x * inv + 0.5), -127.0), 127.0)
    return (q + 128.0).to(tl.uint8)


@triton.jit
def kv8_scale(amax):
    return amax * (1.0 / 127.0)


@triton.jit
def kv8_store_row(row_ptr, x, D: tl.constexpr):
    """One row x (fp32 [D]) quantized into the cache row at row_ptr (uint8): its codes, then its scale."""
    amax = tl.max(tl.abs(x), 0)
    tl.store(row_ptr + tl.arange(0, D), kv8_codes(x, amax))
    tl.store((row_ptr + D).to(tl.pointer_type(tl.float32)), kv8_scale(amax))


# four codes (a 32-bit word) -> two fp16x2 words: byte permutes put codes 0, 1 and 2, 3 under 0x64 high bytes
# (1024 + code each), one fp16x2 subtraction of 1152 a word
KV8_HALF_PTX = tl.constexpr("{ .reg .b32 lo, hi, k; mov.b32 k, 0x64806480; "
                            "prmt.b32 lo, $2, 0x64646464, 0x4140; prmt.b32 hi, $2, 0x64646464, 0x4342; "
                            "sub.rn.f16x2 $0, lo, k; sub.rn.f16x2 $1, hi, k; }")


@triton.jit
def kv8_half(codes, ASM: tl.constexpr = False):
    """uint8 codes -> fp16 code - 128, exactly: the code in the low byte of 1024's mantissa, minus 1152. ASM (the
    GPU): four codes in two byte permutes and two fp16x2 subtractions."""
    if ASM:
        return tl.inline_asm_elementwise(KV8_HALF_PTX, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    return (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def kv8_row_scales(cache_ptr, row_off, mask, D: tl.constexpr):
    """The fp32 scales of the rows at byte offsets row_off (any shape; 0 where not mask)."""
    return tl.load((cache_ptr + row_off + D).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)


@triton.jit
def kv8_dequantize_kernel(cache_ptr, out_ptr, limit_ptr, n_add, max_rows, HKV: tl.constexpr, D: tl.constexpr,
                          BR: tl.constexpr):
    """Rows [0, min(limit[0] + n_add, max_rows)) of one KV head (program_id 1) of an int8 cache -> bf16 values."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    ok = r < tl.minimum(tl.load(limit_ptr) + n_add, max_rows)
    row = (r.to(tl.int64) * HKV + h)
    d = tl.arange(0, D)
    codes = tl.load(cache_ptr + (row * (D + KV8_PAD_JIT))[:, None] + d[None, :], mask=ok[:, None], other=128)
    scale = kv8_row_scales(cache_ptr, row * (D + KV8_PAD_JIT), ok, D)
    vals = kv8_half(codes).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + (row * D)[:, None] + d[None, :], vals.to(tl.bfloat16), mask=ok[:, None])


def kv8_dequantize_rows(cache: torch.Tensor, limit: torch.Tensor, n_add: int, rows: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [max_seq, Hkv, D + KV8_PAD] (one layer, int8) -> a bf16 [rows, Hkv, D] copy of its first
    min(limit[0] + n_add, rows) rows (limit: an int32 [1] device tensor, so a captured graph serves any position;
    rows past that are left unwritten), in out[:rows] when given. For the prefill's attention, whose tiles then
    arrive as bf16 by TMA: a prompt is compute-bound there, and the decoding done once a chunk costs less than in
    each query block."""
    hkv, d = cache.shape[1], kv_head_dim(cache)
    if out is None:
        out = torch.empty(rows, hkv, d, dtype=torch.bfloat16, device=cache.device)
    elif out.shape[0] < rows or out.shape[1:] != (hkv, d) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"kv8_dequantize_rows: out {tuple(out.shape)} {out.dtype} cannot hold {rows} rows of "
                         f"{hkv} x {d} bf16")
    out = out[:rows]
    br = 32
    kv8_dequantize_kernel[(triton.cdiv(rows, br), hkv)](cache, out, limit, n_add, rows, HKV=hkv, D=d, BR=br,
                                                         num_warps=4)
    return out


# -- plain torch reference -----------------------------------------------------------------------------------

def kv8_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D], scales fp32 [...]), as the kernels quantize a row."""
    x = x.float()
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(x * inv[..., None] + 0.5).clamp(-127, 127)
    return (q + 128).to(torch.uint8), amax * (1.0 / 127.0)


def kv8_dequantize_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (codes.float() - 128.0) * scales[..., None]


def kv8_roundtrip_reference(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 cache gives it back (fp32)."""
    return kv8_dequantize_reference(*kv8_quantize_reference(x))


def kv8_pack_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> cache rows uint8 [..., D + KV8_PAD] (codes, scale, zero padding)."""
    codes, scales = kv8_quantize_reference(x)
    pad = torch.zeros(*codes.shape[:-1], KV8_PAD, dtype=torch.uint8, device=x.device)
    pad[..., :4] = scales.contiguous().view(torch.uint8).reshape(*codes.shape[:-1], 4)
    return torch.cat([codes, pad], -1)


def kv_rows_reference(cache: torch.Tensor) -> torch.Tensor:
    """A cache's rows [..., D] as fp32 values (int8: dequantized)."""
    if not is_kv8(cache):
        return cache.float()
    d = kv_head_dim(cache)
    scales = cache[..., d:d + 4].contiguous().view(torch.float32)[..., 0]
    return kv8_dequantize_reference(cache[..., :d], scales)
