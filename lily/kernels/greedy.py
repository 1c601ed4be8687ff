"""Greedy pick on the device, finishing the lm_head GEMV's per-program (max, argmax) partials.

One program reduces the partials, writes the chosen token into the next step's input slot and into the
token log at the step counter, and advances the counters (position and step), so a CUDA-graph decode loop
needs nothing from the host between steps. Ties go to the lowest token id (torch.argmax's choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import next_power_of_2
from lily.kernels import pdl
from lily.kernels.pdl import wait_prior


@triton.jit
def greedy_finish_kernel(pmax_ptr, pidx_ptr, n_part, n_vocab, next_tok_ptr, log_ptr, step_ptr, pos_ptr,
                         LOG_LEN: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    wait_prior(GDC)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for p0 in range(0, n_part, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < n_part
        v = tl.load(pmax_ptr + p, mask=m, other=float("-inf"))
        i = tl.load(pidx_ptr + p, mask=m, other=2147483647)
        better = (v > best_v) | ((v == best_v) & (i < best_i))
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, i, best_i)
    top = tl.max(best_v, 0)
    tok = tl.min(tl.where(best_v == top, best_i, 2147483647), 0)
    tok = tl.where(tok < n_vocab, tok, 0)   # all-NaN logits pick nothing: never index past the table
    step = tl.load(step_ptr)
    tl.store(next_tok_ptr, tok)
    tl.store(log_ptr + step % LOG_LEN, tok)
    tl.store(step_ptr, step + 1)
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)


def greedy_finish(pmax: torch.Tensor, pidx: torch.Tensor, n_vocab: int, next_tok: torch.Tensor,
                  log: torch.Tensor, step: torch.Tensor, pos: torch.Tensor) -> None:
    # all partials in one tile when they fit (16K: the lm_head's 248K rows in blocks of 16), so the one
    # program makes one pass of loads instead of a serial chain
    block = min(next_power_of_2(pmax.numel()), 16384)
    greedy_finish_kernel[(1,)](pmax, pidx, pmax.numel(), n_vocab, next_tok, log, step, pos,
                               LOG_LEN=log.numel(), BLOCK=block, GDC=pdl.gdc(pmax),
                               num_warps=16 if block >= 4096 else 4, **pdl.launch_opts(pmax, "greedy"))
