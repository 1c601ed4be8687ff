"""Block-wise FP8 dequantisation (Qwen's FP8 release): w = fp8 * weight_scale_inv[block], one float32 scale per
block of bm x bn weights (128 x 128; the last blocks of a dimension may be partial), rounded to bfloat16.

The product is one float32 multiply of two exact values (every float8_e4m3fn value is exact in float32)
and one round to bfloat16, so the result is the same bits on any device. Memory: a float32 copy of the
rows being dequantised; callers bound it by passing row slices (multiples of bm rows).
"""

from __future__ import annotations

import torch


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w float8_e4m3fn [..., R, C] with scale_inv float32 [..., ceil(R/bm), ceil(C/bn)] -> dtype [..., R, C]."""
    bm, bn = block
    *lead, rows, cols = w.shape
    if tuple(scale_inv.shape) != (*lead, -(-rows // bm), -(-cols // bn)):
        raise ValueError(f"scale_inv {list(scale_inv.shape)} does not cover {list(w.shape)} in {bm}x{bn} blocks")
    scale = scale_inv.to(torch.float32).repeat_interleave(bm, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(bn, dim=-1)[..., :cols]
    return (w.to(torch.float32) * scale).to(dtype)


def dequantize_fp8_rows(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                        max_elements: int = 1 << 26) -> torch.Tensor:
    """dequantize_fp8_blocks to bfloat16, a slab of whole blocks of rows (and one leading index) at a time,
    so the float32 temporaries stay near `max_elements` elements whatever the matrix size."""
    bm = block[0]
    *lead, rows, cols = w.shape
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    step = max(bm, (max_elements // max(cols, 1)) // bm * bm)
    for idx in (torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)).tolist()
                if lead else [[]]):
        wi, si, oi = w[tuple(idx)], scale_inv[tuple(idx)], out[tuple(idx)]
        for r in range(0, rows, step):
            oi[r:r + step] = dequantize_fp8_blocks(wi[r:r + step], si[r // bm:(r + step + bm - 1) // bm], block)
    return out
