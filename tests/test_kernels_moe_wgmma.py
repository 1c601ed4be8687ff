"""The Hopper grouped expert GEMMs (lily/kernels/moe_wgmma.py).

Gluon does not run under TRITON_INTERPRET, so on the CPU these check the kernel's index arithmetic against
independent oracles: its register layout against the wgmma A fragment of the PTX ISA (m64nNk16, 16-bit A
in registers), its byte-to-code order against MLX's dequantization, its gate/up row interleave against
the epilogue's split. On a Hopper GPU (marked gpu) the kernels themselves run at full shapes against the
plain-torch reference and the Triton kernels.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers_tensors import DEV, new_generator, qt, row_rel
from lily.kernels import moe_grouped_gemm, moe_wgmma
from lily.kernels.moe_grouped_gemm import identity_plan, moe_grouped, moe_grouped_reference, moe_plan
from lily.quant import QuantTensor, quantize


@pytest.fixture
def gen():
    return new_generator()


def _coord(bases, index: int) -> tuple[int, ...]:
    """A linear layout's coordinate of one index: the XOR of the bases of its set bits."""
    c = [0] * len(bases[0]) if bases else []
    for bit, b in enumerate(bases):
        if index >> bit & 1:
            c = [x ^ y for x, y in zip(c, b)]
    return tuple(c)


@pytest.mark.parametrize("bw,warps", [(64, 4), (128, 4), (128, 8), (256, 8)])
def test_words_layout_is_the_ptx_a_fragment(bw, warps):
    """Each thread's (row, word, byte) elements, each giving codes k = 8 word + 2 byte + {0, 1}, are exactly
    the (row, k) the PTX ISA puts in that thread's A-fragment registers: in warp w (of warpgroup G = w // 4),
    lane l = 4g + q holds rows 64 G' + 16 (w % 4) + g + {0, 8} and, in every k16 slab, k = 2q + {0, 1, 8, 9};
    the A tile repeats over the M extent every 16 * warps rows."""
    lay = moe_wgmma._words_layout_3d(bw, warps)
    assert lay.shape == [bw, 8, 4]
    for w, lane in itertools.product(range(warps), range(32)):
        lane_c, warp_c = _coord(lay.lane_bases, lane), _coord(lay.warp_bases, w)
        held = set()
        for reg in range(1 << len(lay.reg_bases)):
            r, j, b = (x ^ y ^ z for x, y, z in zip(_coord(lay.reg_bases, reg), lane_c, warp_c))
            held |= {(r, 8 * j + 2 * b + p) for p in (0, 1)}
        g, q = lane // 4, lane % 4
        spec = {(16 * w + rep * 16 * warps + g + 8 * i, 16 * s + 2 * q + 8 * h + p)
                for rep in range(bw // (16 * warps)) for i in (0, 1) for s in range(4) for h in (0, 1) for p in (0, 1)}
        assert held == spec, (w, lane)


def test_fragment_reference_is_mlx_dequantization(gen):
    """Byte q of word j holds codes 8j + 2q (low nibble) and 8j + 2q + 1: the tile equals the MLX-format
    dequantization of the same rows, rounded to bf16."""
    R = 24
    q = quantize(torch.randn(R, 64, generator=gen).to(torch.bfloat16), bits=4)
    got = moe_wgmma.fragment_reference(q.weight.view(torch.int32), q.scales[:, 0], q.biases[:, 0])
    want = q.dequantize().to(torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bw", [64, 128, 256])
def test_gate_up_rows_pair_in_the_epilogue(gen, bw):
    """A tile row r holds the gate's row n (r % 16 < 8) or the up projection's (r % 16 >= 8); the epilogue's
    split pairs, for each h column, the gate and the up row of that same column."""
    pid_n = int(torch.randint(0, 4, (1,), generator=gen))
    n, is_up = moe_wgmma.tile_rows_reference(pid_n, bw, True)
    assert sorted(n[~is_up].tolist()) == sorted(n[is_up].tolist()) == list(range(pid_n * bw // 2, (pid_n + 1) * bw // 2))
    bt = 16
    code = (n * 2 + is_up.long()).float()[:, None].expand(bw, bt)     # which (column, half) each row holds
    g, u = moe_wgmma.gate_up_epilogue_reference(code)
    cols = pid_n * bw // 2 + torch.arange(bw // 2)
    assert torch.equal(g[:, 0], (cols * 2).float()) and torch.equal(u[:, 0], (cols * 2 + 1).float())
    d_n, d_up = moe_wgmma.tile_rows_reference(pid_n, bw, False)
    assert torch.equal(d_n, pid_n * bw + torch.arange(bw)) and not d_up.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("T", [100, 333, 2100])
def test_wgmma_moe_full_shapes(gen, monkeypatch, T):
    """The full model's expert shapes (fewer experts), routed and shared-expert plans: the warpgroup-MMA
    kernels against the fp32 reference and the Triton kernels (every block size: 2100 tokens skewed onto
    expert 0 fill 128-row blocks and the tails; plans of more than FEW_PAIRS_MAX pairs take these kernels,
    so the shared expert's one-expert plan at 2100 tokens only)."""
    E, k, H, I = 16, 8, 2048, 512
    gate, up, down = qt(gen, E, I, H), qt(gen, E, I, H), qt(gen, E, H, I)
    x = (torch.randn(T, H, generator=gen)).to(DEV, torch.bfloat16)
    logits = torch.randn(T, E, generator=gen).to(DEV)
    logits[:, 0] += 3
    top, idx = logits.softmax(-1).topk(k)
    top = top / top.sum(-1, keepdim=True)
    plans = [(moe_plan(idx, E), idx, top, (gate, up, down)),
             (identity_plan(T, DEV), torch.zeros(T, 1, dtype=torch.long, device=DEV), top[:, :1],
              tuple(QuantTensor(m.weight[:1], m.scales[:1], m.biases[:1], 4) for m in (gate, up, down)))]
    for plan, ids, wts, (g, u, d) in plans:
        ref = moe_grouped_reference(x, ids, wts, g, u, d)
        outs = {}
        for on in (True, False):
            monkeypatch.setattr(moe_grouped_gemm, "WGMMA_MOE", on)
            base = torch.randn(T, H, generator=gen).to(DEV)
            out = base.clone()
            moe_grouped(x, plan, wts.reshape(-1).float().contiguous(), g, u, d, out)
            outs[on] = out - base
        scale = ref.norm(dim=1).median()
        err = float(((outs[True] - ref).norm(dim=1) / scale).max())
        diff = float(((outs[True] - outs[False]).norm(dim=1) / scale).max())
        assert err < 2e-2 and diff < 1e-2, (T, plan.top_k, err, diff, gen.initial_seed())
        assert float(row_rel(outs[True], ref).max()) < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("M", [65, 256, 333])
def test_wgmma_dense_full_shapes(gen, monkeypatch, M):
    """The dense mode (q_gemm's short prompts on Hopper) at the model's projection shapes: bf16 and fp32
    outputs and the in-place accumulate, against the fp32 product with the dequantized weight and against
    the fused Triton kernel; outputs poisoned first, the last partial row block included."""
    from lily.kernels import q4_gemm
    for N, K in [(12288, 2048), (2048, 4096), (64, 2048)]:
        w = qt(gen, N, K)
        x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
        ref = x.float() @ w.dequantize().float().T
        base = torch.randn(M, N, generator=gen).to(DEV)
        outs = {}
        for on in (True, False):
            monkeypatch.setattr(q4_gemm, "WGMMA_DENSE", on)
            assert moe_wgmma.dense_fits(x, w, base) == True  # noqa: E712  (the path under test is taken)
            y16 = q4_gemm.q_gemm(x, w, out=torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16))
            y32 = q4_gemm.q_gemm(x, w, out=torch.full((M, N), float("nan"), device=DEV), out_dtype=torch.float32)
            acc = base.clone()
            q4_gemm.q_gemm(x, w, out=acc, accumulate=True)
            outs[on] = (y16.float(), y32, acc - base)
        for got, other in zip(outs[True], outs[False]):
            assert torch.isfinite(got).all(), (M, N, K)
            assert float(row_rel(got, ref).max()) < 1e-2, (M, N, K, gen.initial_seed())
            assert float(row_rel(got, other).max()) < 1e-2, (M, N, K, gen.initial_seed())
