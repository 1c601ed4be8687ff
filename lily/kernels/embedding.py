"""Embedding lookup for decode: gather row ids[0] (or a row per sequence, `embed_rows`) of the 4-bit table
and dequantize it (fp32).

The token id is read on the device, so a CUDA graph can replay the step with whatever token the previous
step chose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv
from lily.kernels import pdl
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import perm64


@triton.jit
def embed_kernel(out_ptr, out_p_ptr, tok_ptr, w_ptr, s_ptr, b_ptr, H: tl.constexpr, BITS: tl.constexpr,
                 BH: tl.constexpr, GDC: tl.constexpr):
    pid = tl.program_id(0)
    wait_prior(GDC)
    PER: tl.constexpr = 32 // BITS
    tok = tl.load(tok_ptr).to(tl.int64)
    c = pid * BH + tl.arange(0, BH)
    mask = c < H
    word = tl.load(w_ptr + tok * (H // PER) + c // PER, mask=mask, other=0)
    code = (word >> ((c % PER) * BITS)) & ((1 << BITS) - 1)
    s = tl.load(s_ptr + tok * (H // 64) + c // 64, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * (H // 64) + c // 64, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + c, s * code.to(tl.float32) + b, mask=mask)
    tl.store(out_p_ptr + perm64(c), s * code.to(tl.float32) + b, mask=mask)


def embed(table, tok: torch.Tensor, out: torch.Tensor, out_p: torch.Tensor, block: int = 512) -> torch.Tensor:
    """out fp32 [H] = dequantized row tok[0] of `table` (a quant_gemv.PackedLinear [V, H]); out_p the same
    in PERM64 order (the GEMVs' input layout)."""
    embed_kernel[(cdiv(table.k, block),)](out, out_p, tok, table.w, table.s, table.b, H=table.k,
                                          BITS=table.bits, BH=block, GDC=pdl.gdc(out),
                                          **pdl.launch_opts(out, "embed"))
    return out


def embed_reference(table_qt, token: int) -> torch.Tensor:
    from lily.quant import dequantize
    return dequantize(table_qt.weight[token:token + 1], table_qt.scales[token:token + 1],
                      table_qt.biases[token:token + 1], table_qt.bits)[0]


@triton.jit
def embed_rows_kernel(out_ptr, tok_ptr, w_ptr, s_ptr, b_ptr, H: tl.constexpr, BITS: tl.constexpr,
                      BH: tl.constexpr):
    r = tl.program_id(0)
    PER: tl.constexpr = 32 // BITS
    tok = tl.load(tok_ptr + r).to(tl.int64)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = c < H
    word = tl.load(w_ptr + tok * (H // PER) + c // PER, mask=mask, other=0)
    code = (word >> ((c % PER) * BITS)) & ((1 << BITS) - 1)
    s = tl.load(s_ptr + tok * (H // 64) + c // 64, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * (H // 64) + c // 64, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + c, s * code.to(tl.float32) + b, mask=mask)


def embed_rows(table, tokens: torch.Tensor, block: int = 512) -> torch.Tensor:
    """fp32 [B, H]: dequantized rows tokens[b] (int32 [B] on the device) of `table` (a PackedLinear [V, H]),
    in natural order: the batched decode step's input."""
    out = torch.empty(tokens.numel(), table.k, dtype=torch.float32, device=tokens.device)
    embed_rows_kernel[(tokens.numel(), cdiv(table.k, block))](out, tokens, table.w, table.s, table.b,
                                                              H=table.k, BITS=table.bits, BH=block)
    return out
