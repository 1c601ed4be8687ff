"""Dense GEMM against an MLX affine-quantized weight, dequantized inside the tile (prefill projections).

y[M, N] = x[M, K] @ w[N, K]^T with w[n, k] = scales[n, k // 64] * q[n, k] + biases[n, k // 64] and q the
LSB-first code in weight[n, k // (32 / bits)]. The codes are unpacked and scaled in registers, turned into a
bf16 tile and fed to tl.dot (tensor cores); the dequantized matrix never exists in memory.

Works for 4-bit (projections, lm_head) and 8-bit (router, shared-expert gate) weights. The weight stays in
the checkpoint's MLX layout: no repacking at load.

Epilogues: store (bf16 or fp32 output), or add into an fp32 output in place (the residual stream: each
output element belongs to exactly one program, so no atomics are needed).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.quant import QuantTensor

# Triton 3.9's interpreter computes bf16 tl.dot wrongly; under TRITON_INTERPRET the kernels upcast to fp32
# (exact on the CPU). On the GPU the bf16 tensor-core path is used.
UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"
# How a 4-bit tile is unpacked (see dequant_tile_t); LILY_UNPACK=gather picks the other way.
UNPACK_RESHAPE = os.environ.get("LILY_UNPACK", "reshape") == "reshape"


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc += a @ b for bf16 tiles (fp32 accumulate); shared by the prefill kernels."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def dequant_tile_t(w_ptr, s_ptr, b_ptr, n_idx, k0, KP, KG, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, RESHAPE: tl.constexpr):
    """[BLOCK_K, BLOCK_N] bf16 tile of w^T: weight rows n_idx (int64 [BLOCK_N], in range) and columns
    k0 .. k0+BLOCK_K, which must be one quantization group (BLOCK_K == 64).

    RESHAPE: load each packed word once ([BLOCK_K/PER, BLOCK_N]) and unpack by broadcast + reshape;
    otherwise load word k // PER for every k (repeated addresses, served by L1) and shift."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # A code becomes a float without an int->float conversion (those issue at a fraction of the FMA rate
    # and made the dequantization as costly as the tensor-core dot): the field OR-ed into the mantissa of
    # 2^23 is exactly 2^23 + code, and one subtraction leaves the code.
    if RESHAPE:
        j = tl.arange(0, BLOCK_K // PER)
        words = tl.load(w_ptr + n_idx[None, :] * KP + (k0 // PER + j)[:, None])
        shifts = tl.arange(0, PER) * BITS
        codes = ((words[:, None, :] >> shifts[None, :, None]) & MASK) | 0x4B000000  # [BLOCK_K/PER, PER, BLOCK_N]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))  # row j*PER + s is column k0 + j*PER + s
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        words = tl.load(w_ptr + n_idx[None, :] * KP + (kk // PER)[:, None])
        codes = ((words >> ((kk % PER) * BITS)[:, None]) & MASK) | 0x4B000000
    g = n_idx * KG + k0 // 64
    scale = tl.load(s_ptr + g).to(tl.float32)
    bias = tl.load(b_ptr + g).to(tl.float32)
    q = codes.to(tl.float32, bitcast=True) - 8388608.0
    return (q * scale[None, :] + bias[None, :]).to(tl.bfloat16)


@triton.jit
def _q_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
                   M, N, K, stride_xm, stride_ym,
                   BITS: tl.constexpr, ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, RESHAPE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    # grouped ordering: programs that share weight columns run close together (L2 reuse)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_safe = tl.where(n_ok, offs_n, 0).to(tl.int64)
    kp = K // (32 // BITS)  # packed words per weight row
    kg = K // 64  # groups per weight row

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None], other=0.0).to(tl.bfloat16)
        w = dequant_tile_t(w_ptr, s_ptr, b_ptr, n_safe, k0, kp, kg, BITS, BLOCK_K, BLOCK_N, RESHAPE)
        acc = mma(x, w, acc, UPCAST)

    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=ok, other=0.0)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill-sized M: the fastest of the sweep in
# scripts/gpu_prefill_check.py on the H200 (393 TFLOP/s on [4096 x 2048] x [8192 x 2048]^T).
DENSE_LARGE = (128, 128, 4, 4)


def _config(M: int, N: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is one quantization group."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 64:
        return 64, 128, 4, 4
    return DENSE_LARGE


def q_gemm(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None, accumulate: bool = False,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ w^T, w a QuantTensor [N, K] (4- or 8-bit, group 64).

    With accumulate=True, `out` (fp32 [M, N]) is updated in place: out += x @ w^T.
    """
    *lead, N, K = w.shape
    if lead or w.group_size != 64 or w.bits not in (4, 8):
        raise ValueError(f"q_gemm needs a 2-D 4/8-bit group-64 weight, got shape {w.shape} bits {w.bits}")
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"q_gemm: x is {tuple(x.shape)}, expected [M, {K}] with contiguous rows")
    M = x.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("q_gemm: accumulate=True needs an out tensor")
        out = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"q_gemm: out is {tuple(out.shape)}, expected [{M}, {N}] with contiguous rows")
    BM, BN, warps, stages = _config(M, N)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _q_gemm_kernel[grid](x, w.weight.view(torch.int32), w.scales, w.biases, out,
                         M, N, K, x.stride(0), out.stride(0),
                         BITS=w.bits, ACCUMULATE=accumulate, UPCAST=UPCAST_DOT, RESHAPE=UNPACK_RESHAPE,
                         BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=64, GROUP_M=8,
                         num_warps=warps, num_stages=stages)
    return out


def q_gemm_reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """fp32 x @ dequant(w)^T."""
    return x.float() @ w.dequantize(torch.float32).T


@triton.jit
def _rmsnorm_kernel(x_ptr, g_ptr, y_ptr, M, stride_x, stride_y, eps, K: tl.constexpr, BLOCK_M: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < M
    r = tl.where(ok, r, 0).to(tl.int64)
    d = tl.arange(0, K)
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :]).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)[:, None] * tl.load(g_ptr + d).to(tl.float32)[None, :]
    tl.store(y_ptr + r[:, None] * stride_y + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok[:, None])


def rmsnorm_rows(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """The projections' input: bf16 RMSNorm(x) * gain of the fp32 residual rows x [M, K] (K a power of 2)."""
    M, K = x.shape
    if gain.shape != (K,) or x.stride(1) != 1 or K & (K - 1):
        raise ValueError(f"rmsnorm_rows: x {tuple(x.shape)}, gain {tuple(gain.shape)}")
    y = torch.empty(M, K, device=x.device, dtype=torch.bfloat16)
    bm = max(1, min(16, 4096 // K))
    _rmsnorm_kernel[(triton.cdiv(M, bm),)](x, gain, y, M, x.stride(0), y.stride(0), eps, K=K, BLOCK_M=bm,
                                          num_warps=4)
    return y
