"""The batch-1 decode MoE's gate_up and down in one launch, across a grid-wide barrier.

moe_decode runs routing + gate_up + SwiGLU and down + combine as two launches; down's launch then starts from
nothing: it waits for gate_up's last program, reads the routing, and only then requests its 5.3 MB of weight
tiles. Here every program routes, runs its gate_up units (moe_decode.gate_up_units), requests the tiles of its
first block of down rows (the routed experts are known once it has routed), and only then waits at the barrier
for every program's act: down's weights stream while the slowest program finishes gate_up, and after the
barrier only act's loads and the arithmetic remain.

A spin barrier needs every program resident at once, so the grid is never more than the compiled kernel's
occupancy (its registers, shared memory and warps) times the SMs (`resident_programs`). The counters
(MoEScratch.barrier, [2] int32: arrivals, departures) are zero between launches: the last program to leave
zeroes them. Under the interpreter, whose programs run one after another, the same kernel runs as two launches
(PHASE 1: gate_up, PHASE 2: down, routing again from the logits, bit for bit the same) with no barrier.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lily.kernels import pdl
from lily.kernels.host_math import cdiv, next_power_of_2
from lily.kernels.moe_decode import (MoEScratch, PackedExperts, add_rows, down_input, down_slots, down_sums, down_tiles,
                                     gate_up_input, gate_up_units, half_dot, route_topk)
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import INTERPRET, sm_count


# thread 0 of the program polls the arrivals with acquire loads until they reach the target (one request a
# program a round, not one a warp: 2,000+ warps polling one L2 line also delay the arrivals queued behind them)
_SPIN_PTX = tl.constexpr("""{
 .reg .pred p;
 .reg .u32 t, v;
 mov.u32 t, %tid.x;
 setp.ne.u32 p, t, 0;
 @p bra DONE${:uid};
 SPIN${:uid}:
 ld.acquire.gpu.global.u32 v, [$1];
 setp.lt.u32 p, v, $2;
 @p bra SPIN${:uid};
 DONE${:uid}:
 mov.u32 $0, 0;
}""")


@triton.jit
def grid_barrier(count_ptr, nprog):
    """Wait until all nprog programs of the grid have arrived (every one resident). count_ptr[0] counts arrivals,
    count_ptr[1] departures; the last to leave zeroes both, so each launch finds them zero. As a cooperative
    grid sync: the block's stores, then one release-add; thread 0 spins on acquire loads, the block waits for it."""
    tl.debug_barrier()                   # every thread's stores issued before the release
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    tl.inline_asm_elementwise(_SPIN_PTX, "=r,l,r", [count_ptr, nprog], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + 1, 1, sem="relaxed", scope="gpu") == nprog - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def moe_fused_kernel(h_ptr, hp_ptr, act_ptr, logits_ptr, gain_p_ptr, eps, gw, gs, gb, uw, us, ub, dw, ds, db,
                     count_ptr, E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr,
                     H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, DBN: tl.constexpr,
                     GDC: tl.constexpr, PHASE: tl.constexpr, HALF_DOT: tl.constexpr = False,
                     ASM: tl.constexpr = False):
    """h += MoE(RMSNorm(h) * gain) for one token, h in both orders (h natural, h_p PERM64; gain_p PERM64), in place.
    Units (slot, BN intermediate rows) of gate_up, then blocks of DBN hidden rows of down, both over pid, pid +
    nprog, ... PHASE 0: both, the barrier between (the GPU); 1: gate_up only; 2: down only."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    TP2: tl.constexpr = triton.next_power_of_2(TOPK + 1)
    if PHASE != 2:
        g = tl.arange(0, H // 64)
        word = tl.arange(0, H // (32 // BITS))[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7, xsum, rstd = gate_up_input(hp_ptr, gain_p_ptr, eps, word, g, True, H, BITS,
                                                                   HALF_DOT)
    wait_prior(GDC)                      # the router logits come from the previous kernel
    sel_e, sel_w = route_topk(logits_ptr, E, E_P2, TOPK, TP2, NORM_TOPK)
    if PHASE != 2:
        gate_up_units(pid, nprog, act_ptr, sel_e, tl.arange(0, TP2), gw, gs, gb, uw, us, ub,
                      x0, x1, x2, x3, x4, x5, x6, x7, xsum, rstd, word, g, TOPK + 1, H, I, BITS, BN, 1, HALF_DOT, ASM)
    if PHASE != 1:
        sl = tl.arange(0, triton.next_power_of_2(TOPK))
        smask = sl < TOPK
        e, wt, e_sh, w_sh = down_slots(sel_e, sel_w, sl, TOPK, TP2)
        g = tl.arange(0, I // 64)
        word = tl.arange(0, I // (32 // BITS))
        w4, s4, b4, ws, ss_, bs = down_tiles(dw, ds, db, e, e_sh, pid * DBN + tl.arange(0, DBN), smask, word, g,
                                             H, I, BITS)
        if PHASE == 0:
            grid_barrier(count_ptr, nprog)   # every program's act is written
        y0, y1, y2, y3, y4, y5, y6, y7, z0, z1, z2, z3, z4, z5, z6, z7, xsum, xsum_sh, wt, w_sh = down_input(
            act_ptr, sl, smask, word, g, wt, w_sh, TOPK, I, BITS, HALF_DOT)
        # one block a program where the grid allows (nothing then held for a next block's tiles)
        for blk in range(pid, H // DBN, nprog):
            rows = blk * DBN + tl.arange(0, DBN)
            if blk != pid:
                w4, s4, b4, ws, ss_, bs = down_tiles(dw, ds, db, e, e_sh, rows, smask, word, g, H, I, BITS)
            acc = down_sums(w4, s4, b4, ws, ss_, bs, y0, y1, y2, y3, y4, y5, y6, y7, z0, z1, z2, z3, z4, z5, z6, z7,
                            xsum, xsum_sh, wt, w_sh, I, BITS, HALF_DOT, ASM)
            add_rows(h_ptr, hp_ptr, rows, acc, True)


def resident_programs(regs: int, warps: int, shared: int, sm_regs: int = 65536, sm_shared: int = 228 * 1024,
                      sm_threads: int = 2048, sm_blocks: int = 32) -> int:
    """How many programs of a kernel (registers a thread, warps, shared bytes) one SM holds at once: registers are
    allocated 256 a warp, and the runtime reserves 1 KB of shared memory a block."""
    regs_warp = -(-regs * 32 // 256) * 256
    return max(0, min(sm_regs // (regs_warp * warps), sm_shared // (shared + 1024), sm_threads // (warps * 32),
                      sm_blocks))


def device_resident_programs(kernel, device: torch.device) -> int:
    """resident_programs of a compiled kernel on a CUDA device."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    return resident_programs(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared,
                             getattr(props, "regs_per_multiprocessor", 65536),
                             getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
                             props.max_threads_per_multi_processor)


# (gate_up rows a unit, down rows a block, programs an SM at most, warps, register cap or 0); the grid is also capped
# by the compiled kernel's occupancy. 8 warps: 4 of 4 would need down's 160+ registers a thread (three an SM).
FUSED_BLOCK = (8, 8, 2, 8, 128)
# the decode step launches gate_up + down as moe_fused (LILY_MOE_FUSED=1) or as moe_decode's two launches (0)
FUSED = os.environ.get("LILY_MOE_FUSED", "0") == "1"
_GRID: dict = {}


def moe_fused(ex: PackedExperts, h: torch.Tensor, h_p: torch.Tensor, gain_p: torch.Tensor, eps: float,
              sc: MoEScratch, norm_topk: bool = True, block: tuple | None = None) -> None:
    """h += MoE(RMSNorm(h) * gain) from the router logits in sc.logits (moe_decode.moe_route's launch before it),
    h_p rewritten: gate_up and down in one launch. block: as FUSED_BLOCK; sc.barrier's counters must be zero
    (MoEScratch makes them so and every launch leaves them so)."""
    if ex.gate.bits != 4 or ex.down.bits != 4:
        raise ValueError("the MoE decode kernels expect 4-bit experts")
    I, H = ex.inter, ex.hidden
    bn, dbn, per_sm, warps, regs = block or ((min(64, next_power_of_2(I)), max(1, H // 2), 2, 4, 0) if INTERPRET
                                             else FUSED_BLOCK)
    if I % bn or H % dbn:
        raise ValueError(f"moe_fused: {bn} rows a unit must divide {I}, {dbn} rows a block must divide {H}")
    E = sc.logits.numel() - 1
    # one dot for both halves: the fp16 pairs unless LILY_HALF_DOT_OFF names either
    dot = half_dot("gate_up") if half_dot("down")["HALF_DOT"] else half_dot("down")
    args = (h, h_p, sc.act, sc.logits, gain_p, eps, ex.gate.w, ex.gate.s, ex.gate.b, ex.up.w, ex.up.s, ex.up.b,
            ex.down.w, ex.down.s, ex.down.b, sc.barrier)
    kw = dict(E=E, E_P2=next_power_of_2(E), TOPK=sc.top_k, NORM_TOPK=norm_topk, H=H, I=I, BITS=ex.gate.bits, BN=bn,
              DBN=dbn, GDC=pdl.gdc(h), **dot, num_warps=warps, **({"maxnreg": regs} if regs and not INTERPRET else {}),
              **pdl.launch_opts(h, "gate_up"))
    units = cdiv(I, bn) * (sc.top_k + 1)
    if INTERPRET:
        grid = (min(units, per_sm * sm_count(h.device)),)
        moe_fused_kernel[grid](*args, PHASE=1, **kw)
        moe_fused_kernel[grid](*args, PHASE=2, **kw)
        return
    key = (h.device, tuple(sorted(kw.items())), per_sm)
    if key not in _GRID:
        compiled = moe_fused_kernel.warmup(*args, PHASE=0, **kw, grid=(1,))
        resident = min(per_sm, device_resident_programs(compiled, h.device))
        if resident < 1:
            raise RuntimeError("moe_fused: the kernel does not fit an SM")
        _GRID[key] = (min(units, resident * sm_count(h.device)),)
    moe_fused_kernel[_GRID[key]](*args, PHASE=0, **kw)
