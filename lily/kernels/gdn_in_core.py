"""The Gated DeltaNet's in-projection and its state update in one launch (decode, batch 1).

The launch's first programs run the in-projection GEMV as gemv does (quant_gemv.gemv_program: RMSNorm in,
q|k|v|z|b|a rows, the conv step + SiLU on the q|k|v rows), each adding one to launch_count[0] when its rows are
stored; the HV * (DV / BV) programs after them run gdn_decode's state update (gdn_decode.gdn_head_step), one value
head's BV columns each. An update program loads its state slice first (the previous step's: it waits on nothing),
then waits until every projection program is done, then updates. So no launch boundary sits between the two: the
update programs, resident beside the projection where it leaves room on an SM (GEMV_BLOCK's programs an SM), have
their state in registers when the projection's last rows land.

The update programs spin on a count that other programs of the same launch raise, so every program they wait on
must be running or done: they take the highest program ids (programs start in id order, as decoupled look-back
scans rely on) and the projection's programs wait on nothing of theirs. Under the interpreter programs run one by
one in id order, so the count is complete when an update program first looks. The last update program past its wait
sets both counts back to zero for the next launch.
(A count a key-head group, raised after each block of rows, would let each group go as soon as its own rows are in,
but it puts a release fence (MEMBAR.GPU, SASS) in the projection's loop, where the next block's loads are in flight;
and the projection's programs, one wave, end together anyway.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.kernels import gdn_decode as GD
from lily.kernels.host_math import next_power_of_2
from lily.kernels.pdl import wait_prior
from lily.kernels.quant_gemv import PackedLinear, gemv_launch, gemv_program

# the projection's (rows a block, programs an SM), read at each launch; None: gemv's own choice for the shape
GEMV_BLOCK: tuple[int, int] | None = None


@triton.jit
def gdn_in_core_kernel(out_ptr, res_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr, z_ptr, ss_ptr,
                       conv_w_ptr, conv_state_ptr, pmax_ptr, pidx_ptr, tmask_ptr, out2_ptr, N, eps,
                       launch_count_ptr, state_ptr, a_log_ptr, dt_bias_ptr, norm_ptr, o_ptr, head_ss_ptr, count_ptr,
                       xo_ptr, q_scale,
                       K: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                       X_MODE: tl.constexpr, HEAD_DIM: tl.constexpr, NB: tl.constexpr, PERM_X: tl.constexpr,
                       OUT2_LO: tl.constexpr, OUT2_HI: tl.constexpr,
                       ADD_RES: tl.constexpr, CONV_ROWS: tl.constexpr, CONV_K: tl.constexpr,
                       CONV_KP: tl.constexpr, ARGMAX: tl.constexpr, TOKEN_MASK: tl.constexpr, GDC: tl.constexpr,
                       HALF_DOT: tl.constexpr, ASM: tl.constexpr, SUMS_FROM_CODES: tl.constexpr,
                       EVEN_N: tl.constexpr, GEMV_PROGRAMS: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NBP: tl.constexpr,
                       L2_EPS: tl.constexpr):
    """Programs [0, GEMV_PROGRAMS): the in-projection into out (the projection buffer); the rest: value head j's
    columns [vb * BV, +BV), j, vb = divmod(pid - GEMV_PROGRAMS, DV / BV), gated-normed output to xo (PERM64)."""
    pid = tl.program_id(0)
    if pid < GEMV_PROGRAMS:
        gemv_program(pid, GEMV_PROGRAMS, out_ptr, res_ptr, w_ptr, s_ptr, b_ptr, x_ptr, gain_ptr, z_ptr, ss_ptr,
                     conv_w_ptr, conv_state_ptr, pmax_ptr, pidx_ptr, tmask_ptr, out2_ptr, N, eps, K, BITS, BN,
                     X_MODE, HEAD_DIM, NB, PERM_X, OUT2_LO, OUT2_HI, ADD_RES, CONV_ROWS, CONV_K, CONV_KP, ARGMAX,
                     TOKEN_MASK, GDC, HALF_DOT, ASM, SUMS_FROM_CODES, EVEN_N)
        tl.debug_barrier()               # every thread's stores before the release
        tl.atomic_add(launch_count_ptr, 1, sem="release")
    else:
        NBV: tl.constexpr = DV // BV
        c = pid - GEMV_PROGRAMS
        j = c // NBV
        vb = c % NBV
        sp, S = GD.state_slice(state_ptr, j, vb, DK, DV, BV)      # the previous step's state: before any wait
        wait_prior(GDC)
        seen = tl.atomic_add(launch_count_ptr, 0, sem="acquire")
        while seen < GEMV_PROGRAMS:
            seen = tl.atomic_add(launch_count_ptr, 0, sem="acquire")
        passed = tl.atomic_add(launch_count_ptr + 1, 1, sem="relaxed")
        if passed == HV * NBV - 1:          # the last update program past its wait: reset for the next launch
            tl.atomic_xchg(launch_count_ptr, 0, sem="relaxed")
            tl.atomic_xchg(launch_count_ptr + 1, 0, sem="relaxed")
        GD.gdn_head_step(j, vb, S, sp, out_ptr, a_log_ptr, dt_bias_ptr, norm_ptr, o_ptr, head_ss_ptr, count_ptr,
                         xo_ptr, q_scale, eps, HK, HV, DK, DV, BV, NBP, L2_EPS, True)


def gdn_in_core(lin: PackedLinear, x: torch.Tensor, proj: torch.Tensor, norm_gain: torch.Tensor, eps: float,
                conv: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor, head_norm: torch.Tensor, scratch: GD.GDNScratch, out: torch.Tensor, hk: int,
                perm_x: bool = True, pdl_family: str | None = None) -> None:
    """gemv(lin, x, proj, norm_gain=, conv=, perm_x=) then gdn_decode(proj, state, ...) into out, in one launch:
    the same values bit for bit. lin: the stacked in-projection [q | k | v | z | b | a] (4-bit); state fp32
    [Hv, dk, dv] updated in place; out fp32 [Hv * dv] in PERM64 order."""
    hv, dk, dv = state.shape
    if lin.n != 2 * hk * dk + 2 * hv * dv + 2 * hv or hv % hk:
        raise ValueError(f"gdn_in_core: {lin.n} projection rows for {hk} key heads of {dk} and {hv} value heads of "
                         f"{dv}: expected {2 * hk * dk + 2 * hv * dv + 2 * hv}")
    bv, _ = GD.TILE or (GD.pick_bv(dv), None)
    if dv % bv or dv // bv > scratch.ss.shape[1]:
        raise ValueError(f"gdn_in_core: {bv} value columns a program for dv={dv}")
    programs, args, kw = gemv_launch(lin, x, proj, norm_gain=norm_gain, eps=eps, conv=conv, perm_x=perm_x,
                                     block=GEMV_BLOCK, pdl_family=pdl_family)
    gdn_in_core_kernel[(programs + hv * (dv // bv),)](
        *args, scratch.launch_count, state, a_log, dt_bias, head_norm, scratch.o, scratch.ss, scratch.count, out,
        dk ** -0.5, **kw, GEMV_PROGRAMS=programs, HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, NBP=next_power_of_2(dv // bv),
        L2_EPS=GD.L2_EPS)
