"""lily.kernels.moe_fused (gate_up and down in one launch) against the plain-torch MoE reference and against
moe_decode's two launches, under TRITON_INTERPRET=1 (there as its two phases; the barrier itself runs on the
GPU only: scripts/gpu_decode_check.py). Fresh random inputs each run, outputs poisoned first."""

from __future__ import annotations

import pytest
import torch

from lily.kernels import moe_decode as MD
from lily.kernels import moe_fused as MF
from lily.kernels import quant_gemv as QG

from helpers_tensors import assert_rows_within
from test_kernels_decode import EPS, GEMV, HALF_MOE, gen, half_dot, nan, qt, rn  # noqa: F401 (fixtures)

# fused against the two launches on the same logits: the same dots in the same order but for down's sums over a
# block's layout (its row count differs); fp32 rounding apart, measured ~1e-7
SAME = 1e-5


def moe_case(gen, E, I, H, top_k):
    w = [qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I), qt(gen, I, H), qt(gen, I, H), qt(gen, H, I)]
    router = QG.PackedLinear(qt(gen, E + 1, H, bits=8, std=0.3 * H ** -0.5))
    h, gain = rn(gen, H), rn(gen, H).abs() + 0.5
    return w, MD.PackedExperts(*w), router, h, gain


@pytest.mark.parametrize("top_k,norm_topk,block", [
    (2, True, None),                  # the interpreter's default: 2 programs, several units and blocks each
    (3, False, (16, 8, 1, 4, 0)),     # one program: every unit and every down block of its own
    (2, True, (8, 4, 32, 4, 0)),      # more programs than down blocks (the rest skip down)
])
def test_moe_fused_matches_reference_and_the_two_launches(gen, half_dot, top_k, norm_topk, block):
    E, I, H = 8, 64, 128
    w, ex, router, h, gain = moe_case(gen, E, I, H, top_k)
    p = QG.perm64_index(H)
    sc = MD.MoEScratch(E, top_k, I)
    sc.act.fill_(float("nan"))
    out, out_p = h.clone(), h[p].clone()
    MD.moe_route(router, out, gain, EPS, sc, norm_topk)
    logits = sc.logits.clone()
    MF.moe_fused(ex, out, out_p, gain[p], EPS, sc, norm_topk=norm_topk, block=block)
    x = QG.rmsnorm_reference(h, gain, EPS)
    ref = h + MD.moe_reference(x, logits[:E], logits[E], *w, top_k=top_k, norm_topk=norm_topk)
    assert_rows_within(out - h, ref - h, HALF_MOE if half_dot else GEMV, f"seed {gen.initial_seed()}: fused moe",
                       row_dims=0)
    assert torch.equal(out_p, out[p])
    assert torch.equal(sc.barrier, torch.zeros(2, dtype=torch.int32))
    # moe_decode's gate_up + down on the same logits
    sc2 = MD.MoEScratch(E, top_k, I)
    sc2.logits.copy_(logits)
    two, two_p = h.clone(), h[p].clone()
    MD.moe_gate_up(ex, two_p, gain[p], EPS, sc2, norm_topk=norm_topk)
    MD.moe_down(ex, two, two_p, sc2, norm_topk=norm_topk)
    assert_rows_within(out - h, two - h, SAME, f"seed {gen.initial_seed()}: fused vs two launches", row_dims=0)
    assert torch.equal(sc.act, sc2.act), "gate_up's units compute act as moe_gate_up does"


def test_moe_fused_refuses_what_it_cannot_run(gen):
    E, I, H, top_k = 8, 64, 128, 2
    w, ex, router, h, gain = moe_case(gen, E, I, H, top_k)
    sc = MD.MoEScratch(E, top_k, I)
    with pytest.raises(ValueError, match="must divide"):
        MF.moe_fused(ex, h.clone(), h.clone(), gain, EPS, sc, block=(48, 8, 1, 4, 0))
    with pytest.raises(ValueError, match="must divide"):
        MF.moe_fused(ex, h.clone(), h.clone(), gain, EPS, sc, block=(16, 48, 1, 4, 0))
    ex8 = MD.PackedExperts(qt(gen, E, I, H, bits=8), w[1], w[2], qt(gen, I, H, bits=8), w[4], w[5])
    with pytest.raises(ValueError, match="4-bit experts"):
        MF.moe_fused(ex8, h.clone(), h.clone(), gain, EPS, sc)


@pytest.mark.parametrize("regs,warps,shared,want", [
    (128, 4, 4096, 4),       # the register file holds four programs of 4 warps at 128 a thread
    (168, 4, 4096, 3),       # 168 a thread: 5376 a warp, three programs
    (117, 8, 8192, 2),       # rounded up to 120 a thread: 30720 a program, two
    (32, 4, 100 * 1024, 2),  # shared memory: 101 KB a program with the reserve, two in 228 KB
    (16, 1, 0, 32),          # the block limit
    (32, 32, 0, 2),          # threads: 1024 a program, two in 2048
    (255, 32, 0, 0),         # does not fit at all
])
def test_resident_programs(regs, warps, shared, want):
    assert MF.resident_programs(regs, warps, shared) == want
