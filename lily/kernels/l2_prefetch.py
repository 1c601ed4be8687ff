"""L2 prefetch: ask the L2 for the weights a later decode kernel reads while earlier kernels run.

The decode step is a chain of small dependent kernels; each one waits for its input before its weights
start to stream, so HBM idles through every kernel's ramp. A prefetch kernel on a side branch of the
step's graph requests weights that do not depend on the chain (cp.async.bulk.prefetch.L2: fire and forget,
nothing comes back to the SM and nothing can change a result), so the kernel that reads them later finds
them in L2. Routed experts are known only after the router: the routed variant routes from the router's
logits itself (route_topk, as gate_up does) and requests the chosen experts' rows.

A prefetch is described by a chunk table, int64 [n, 3]: (address, bytes, expert stride in bytes); bytes is
a multiple of 16 and each address 16-byte aligned (the bulk prefetch's rule). A routed table's addresses are
those of expert 0: program (chunk block, slot) adds expert(slot) x stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.moe_decode import route_topk
from lily.kernels.quant_gemv import INTERPRET

CHUNK_BYTES = 1 << 16      # one bulk prefetch's bytes (the table splits regions into these)
BLOCK = 128                # chunks a program (one a thread from 32 up)


@triton.jit
def l2_prefetch_kernel(table_ptr, n_chunks, logits_ptr, trace_ptr,
                       E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TP2: tl.constexpr,
                       NORM_TOPK: tl.constexpr, ROUTED: tl.constexpr, BLOCK: tl.constexpr, TRACE: tl.constexpr):
    """Each thread requests one chunk. ROUTED: program_id(1) is a routed slot; the chunk moves to its expert.
    TRACE: instead of prefetching, write (address, bytes) of each chunk to trace [slots, n_chunks, 2]
    (the CPU tests; the prefetch itself is an instruction the interpreter does not have)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_chunks
    addr = tl.load(table_ptr + c * 3, mask=m, other=0)
    size = tl.load(table_ptr + c * 3 + 1, mask=m, other=0)
    slot = 0
    if ROUTED:
        slot = tl.program_id(1)
        sel_e, _ = route_topk(logits_ptr, E, E_P2, TOPK, TP2, NORM_TOPK)
        e = tl.sum(tl.where(tl.arange(0, TP2) == slot, sel_e, 0), 0).to(tl.int64)
        addr += e * tl.load(table_ptr + c * 3 + 2, mask=m, other=0)
    if TRACE:
        out = trace_ptr + (slot * n_chunks + c).to(tl.int64) * 2
        tl.store(out, addr, mask=m)
        tl.store(out + 1, size, mask=m)
    else:
        # a zero size (past the table's end) requests nothing
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def chunk_table(regions, chunk: int = CHUNK_BYTES, device=None) -> torch.Tensor:
    """regions: (address, bytes, expert stride) triples -> the chunk table, each region cut into chunks of at
    most `chunk` bytes. A region's start is rounded down and its end up to 16 bytes (a prefetch of a few bytes
    more than asked is harmless)."""
    if chunk % 16 or chunk <= 0:
        raise ValueError(f"a prefetch chunk must be a positive multiple of 16 bytes, not {chunk}")
    rows = []
    for addr, nbytes, stride in regions:
        if nbytes <= 0:
            continue
        lo, hi = addr & ~15, (addr + nbytes + 15) & ~15
        rows += [(a, min(chunk, hi - a), stride) for a in range(lo, hi, chunk)]
    return torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64).reshape(-1, 3).to(device)


def tensor_region(t: torch.Tensor, stride: int = 0) -> tuple[int, int, int]:
    """(address, bytes, expert stride) of a contiguous tensor (or view)."""
    return t.data_ptr(), t.numel() * t.element_size(), stride


def supported(device) -> bool:
    """The bulk prefetch exists: a Hopper or later GPU, not the interpreter."""
    device = torch.device(device)
    return (not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def l2_prefetch(table: torch.Tensor, logits: torch.Tensor | None = None, top_k: int = 0,
                norm_topk: bool = True, trace: torch.Tensor | None = None, block: int = BLOCK) -> None:
    """Request the table's chunks into L2 (routed: for each of the top_k experts the logits [E+1] choose),
    `block` chunks a program (a power of two; the requests of one SM are issued one after another, so
    small blocks spread them over more SMs). trace: record instead of requesting (int64 [top_k or 1, n, 2]);
    needed under the interpreter."""
    n = table.shape[0]
    routed = logits is not None
    E = logits.numel() - 1 if routed else 1
    if trace is None and not supported(table.device):
        return
    l2_prefetch_kernel[(cdiv(n, block), top_k if routed else 1)](
        table, n, logits if routed else table, trace if trace is not None else table,
        E=E, E_P2=next_power_of_2(E), TOPK=max(top_k, 1), TP2=next_power_of_2(max(top_k, 1) + 1),
        NORM_TOPK=norm_topk, ROUTED=routed, BLOCK=block, TRACE=trace is not None, num_warps=max(1, block // 32))


def l2_prefetch_reference(table: torch.Tensor, logits: torch.Tensor | None = None, top_k: int = 0) -> torch.Tensor:
    """(address, bytes) of every chunk the kernel requests, [slots, n, 2]: slot s's chunks moved to the expert
    of the s-th largest routed logit (torch.topk's order; ties to the lower index)."""
    t = table.cpu()
    if logits is None:
        return t[None, :, :2].clone()
    experts = torch.topk(logits[:-1].float().cpu(), top_k).indices
    return torch.stack([torch.stack([t[:, 0] + e * t[:, 2], t[:, 1]], 1) for e in experts])
