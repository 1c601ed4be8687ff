"""Causal depthwise conv1d + SiLU over a prefill chunk, continuing from the carried conv state.

y[t, c] = silu(sum_j w[c, j] * m[t - (K-1) + j, c]), where rows before the chunk come from the conv state
(the last K-1 pre-conv rows, oldest first; zeros for a fresh sequence). After the kernel the state holds
the last K-1 rows of [state; m], which is what the decode step reads next (`_conv_state_kernel`). When only
the first n rows of the chunk are the prompt (a padded prefill graph; n read from the device), the state
takes the last K-1 rows of [state; m[:n]] instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2

# (BLOCK_T, BLOCK_C, num_warps) of the conv kernel. H200 (benchmarks/results/prefill-h200-20261201-rope-conv.json,
# 9 shapes): the fastest at 8K and 4K rows (140 and 77 us), 5 us behind the best at 256
CONV_TILES = (32, 128, 4)


@triton.jit
def _conv1d_silu_kernel(x_ptr, w_ptr, st_ptr, y_ptr, T, C, stride_x, stride_y,
                        KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < T
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KW):
        src = offs_t - (KW - 1) + j  # source row; negative rows live in the conv state
        in_x = (src >= 0) & t_ok
        in_s = (src < 0) & t_ok
        xv = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_x + offs_c[None, :],
                     mask=in_x[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        sv = tl.load(st_ptr + (src + KW - 1)[:, None] * C + offs_c[None, :],
                     mask=in_s[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_c * KW + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * wv[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + offs_t[:, None].to(tl.int64) * stride_y + offs_c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, st_ptr, n_ptr, T, C, stride_x,
                       HAS_N: tl.constexpr, KW: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """state = rows n .. n+K-2 of [state; x] (n = T, or read from n_ptr). A program owns a column block and
    loads all it needs before storing, so the in-place update races with nothing."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    n = tl.load(n_ptr) if HAS_N else T
    rows = tl.arange(0, ROWS)           # ROWS: K-1 rounded up to a power of two
    r_ok = rows < KW - 1
    src = n + rows                      # row in [state; x]
    in_s = src < KW - 1
    sv = tl.load(st_ptr + tl.where(in_s, src, 0)[:, None] * C + c[None, :],
                 mask=(in_s & r_ok)[:, None] & c_ok[None, :], other=0.0)
    xr = tl.where(in_s, 0, src - (KW - 1)).to(tl.int64)
    xv = tl.load(x_ptr + xr[:, None] * stride_x + c[None, :], mask=(~in_s & r_ok)[:, None] & c_ok[None, :],
                 other=0.0)
    new = tl.where(in_s[:, None], sv.to(tl.float32), xv.to(tl.float32))
    tl.store(st_ptr + rows[:, None] * C + c[None, :], new.to(st_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                   out: torch.Tensor | None = None, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (pre-conv rows, contiguous rows), weight [C, K], state [K-1, C] (updated in place).
    n_valid: None, or an int32 [1] device tensor n <= T: only x[:n] continue the sequence (the state).

    Returns silu(conv(x)) as bf16 [T, C] (or into `out`)."""
    T, C = x.shape
    Cw, KW = weight.shape
    if Cw != C or state.shape != (KW - 1, C) or x.stride(1) != 1 or not state.is_contiguous():
        raise ValueError(f"conv1d_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)} disagree (expected weight [C, K], state [K-1, C])")
    if out is None:
        out = torch.empty(T, C, device=x.device, dtype=torch.bfloat16)
    BT, BC, warps = CONV_TILES
    _conv1d_silu_kernel[(cdiv(T, BT), cdiv(C, BC))](
        x, weight.contiguous(), state, out, T, C, x.stride(0), out.stride(0),
        KW=KW, BLOCK_T=BT, BLOCK_C=BC, num_warps=warps)
    # hand the last K-1 pre-conv rows to the decode step (after the kernel read the old ones)
    if KW > 1:
        _conv_state_kernel[(cdiv(C, 1024),)](x, state, state if n_valid is None else n_valid, T, C, x.stride(0),
                                             HAS_N=n_valid is not None, KW=KW, ROWS=next_power_of_2(KW - 1),
                                             BLOCK_C=1024, num_warps=4)
    return out


def conv1d_prefill_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, n: int | None = None):
    """fp32 (y [T, C], new_state [K-1, C]); state is not modified. n: only x[:n] continue the state."""
    KW = weight.shape[1]
    full = torch.cat([state.float(), x.float()])  # [K-1+T, C]
    T = x.shape[0]
    n = T if n is None else n
    y = sum(weight[:, j].float() * full[j:j + T] for j in range(KW))
    return torch.nn.functional.silu(y), full[n:n + KW - 1].clone() if KW > 1 else full[:0]
