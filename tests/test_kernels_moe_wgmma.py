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


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("bw,warps", [(64, 4), (128, 4), (128, 8), (256, 8)])
def test_words_layout_is_the_ptx_a_fragment(bw, warps, permuted):
    """Each thread's elements are exactly the (row, k) the PTX ISA puts in that thread's A-fragment
    registers: in warp w (of warpgroup G = w // 4), lane l = 4g + q holds rows 64 G' + 16 (w % 4) + g + {0, 8}
    and, in every k16 slab, k = 2q + {0, 1, 8, 9}; the A tile repeats over the M extent every 16 * warps rows.
    Natural order: element (row, word j, byte b) gives codes k = 8j + 2b + {0, 1}. Permuted: element (row,
    word j, shift s) gives the code pair (nibble s, s + 4) of word j at fragment columns k' = 16 s + 8 (j % 2)
    + 2 (j // 2) + {0, 1}, so lane q holds words 2q and 2q + 1 only."""
    lay = moe_wgmma._words_layout_3d(bw, warps, permuted)
    assert lay.shape == [bw, 8, 4]
    for w, lane in itertools.product(range(warps), range(32)):
        lane_c, warp_c = _coord(lay.lane_bases, lane), _coord(lay.warp_bases, w)
        held = set()
        for reg in range(1 << len(lay.reg_bases)):
            r, j, x = (a ^ b ^ c for a, b, c in zip(_coord(lay.reg_bases, reg), lane_c, warp_c))
            k0 = 16 * x + 8 * (j % 2) + 2 * (j // 2) if permuted else 8 * j + 2 * x
            held |= {(r, k0 + p) for p in (0, 1)}
        g, q = lane // 4, lane % 4
        spec = {(16 * w + rep * 16 * warps + g + 8 * i, 16 * s + 2 * q + 8 * h + p)
                for rep in range(bw // (16 * warps)) for i in (0, 1) for s in range(4) for h in (0, 1) for p in (0, 1)}
        assert held == spec, (w, lane)


def test_permuted_fragment_pairs_with_permuted_activations(gen):
    """The permuted tile is the MLX dequantization with its columns in perm_k_index order, so with x's
    columns gathered by the same index the products are unchanged; gate_up's epilogue writes h's column n
    where that index puts it back (down's input in the same order)."""
    R, T = 24, 5
    q = quantize(torch.randn(R, 64, generator=gen).to(torch.bfloat16), bits=4)
    idx = moe_wgmma.perm_k_index(64, "cpu")
    assert sorted(idx.tolist()) == list(range(64))
    tile = moe_wgmma.fragment_perm_reference(q.weight.view(torch.int32), q.scales[:, 0], q.biases[:, 0])
    natural = q.dequantize().to(torch.bfloat16)
    assert torch.equal(tile, natural[:, idx])
    x = torch.randn(T, 64, generator=gen, dtype=torch.float64)
    assert torch.allclose(x[:, idx] @ tile.double().T, x @ natural.double().T)
    n = torch.arange(2048)
    big = moe_wgmma.perm_k_index(2048, "cpu")
    assert torch.equal(big[moe_wgmma.perm_k_store_reference(n)], n)
    assert torch.equal(big[:64], idx) and torch.equal(big[64:128] - 64, idx)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _from_bf16_bits(b: torch.Tensor) -> torch.Tensor:
    return (b & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()


def _run_pair_asm(text: str, args: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulates the few PTX instructions of the dequantization asm blocks, elementwise on int64 tensors of
    32-bit values ($2, $3: 32-bit registers; $4, $5: bf16 bits): mov, shr, shl, lop3 with 0xEA ((a & b) | c)
    and fma.rn.bf16x2 (exact in float64, one rounding to bf16). Returns ($0, $1) as bf16 bits."""
    regs = {f"${i}": a for i, a in enumerate(args, start=2)}
    val = lambda tok: regs[tok] if tok in regs else torch.full_like(args[0], int(tok, 0))  # noqa: E731
    halves = lambda v: (v & 0xFFFF, (v >> 16) & 0xFFFF)  # noqa: E731
    for line in text.strip().strip("{}").strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        ops = [t.strip() for t in rest.replace("{", "").replace("}", "").split(",")]
        if op == "mov.b32" and rest.startswith("{"):      # unpack: mov.b32 {$0, $1}, x
            regs[ops[0]], regs[ops[1]] = halves(val(ops[2]))
        elif op == "mov.b32" and "{" in rest:            # pack: mov.b32 r, {lo, hi}
            regs[ops[0]] = val(ops[1]) | (val(ops[2]) << 16)
        elif op == "mov.b32":
            regs[ops[0]] = val(ops[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[ops[0]] = (val(ops[1]) & 0xFFFFFFFF) >> val(ops[2])
        elif op == "shl.b32":
            regs[ops[0]] = (val(ops[1]) << val(ops[2])) & 0xFFFFFFFF
        elif op == "lop3.b32":
            assert ops[4] == "0xEA", line
            regs[ops[0]] = (val(ops[1]) & val(ops[2])) | val(ops[3])
        elif op == "fma.rn.bf16x2":
            out = [_bf16_bits(_from_bf16_bits(a) * _from_bf16_bits(b) + _from_bf16_bits(c))
                   for a, b, c in zip(*(halves(val(t)) for t in ops[1:]))]
            regs[ops[0]] = out[0] | (out[1] << 16)
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("permuted", [False, True])
def test_pair_asm_dequantizes_mlx_codes(gen, permuted):
    """The inline PTX of both orders, emulated on random MLX words, scales and biases: byte q's two codes
    (natural), or nibbles s and s + 4 (permuted), come out as MLX's dequantized values in bf16."""
    q = quantize(torch.randn(64, 64, generator=gen).to(torch.bfloat16), bits=4)
    natural = q.dequantize().to(torch.bfloat16)
    words = q.weight.view(torch.int32).to(torch.int64) & 0xFFFFFFFF             # [64 rows, 8 words]
    R = words.shape[0]
    sc, bi = _bf16_bits(q.scales[:, 0])[:, None, None], _bf16_bits(q.biases[:, 0])[:, None, None]
    pos = torch.arange(4)[None, None, :]
    w3 = words[:, :, None].expand(R, 8, 4)
    text = (moe_wgmma._PAIR_PERM_ASM if permuted else moe_wgmma._PAIR_ASM).value
    lo, hi = _run_pair_asm(text, [w3, (4 if permuted else 8) * pos.expand(R, 8, 4), sc.expand(R, 8, 4),
                                  bi.expand(R, 8, 4)])
    j = torch.arange(8)[None, :, None]
    k_lo = 8 * j + (pos if permuted else 2 * pos)                               # the codes each half holds
    k_hi = k_lo + (4 if permuted else 1)
    want = _bf16_bits(natural)
    assert torch.equal(lo, torch.gather(want, 1, k_lo.expand(R, 8, 4).reshape(R, 32)).reshape(R, 8, 4))
    assert torch.equal(hi, torch.gather(want, 1, k_hi.expand(R, 8, 4).reshape(R, 32)).reshape(R, 8, 4))


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
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("T", [100, 333, 2100])
def test_wgmma_moe_full_shapes(gen, monkeypatch, T, permuted):
    """The full model's expert shapes (fewer experts), routed and shared-expert plans: the warpgroup-MMA
    kernels against the fp32 reference and the Triton kernels (every block size: 2100 tokens skewed onto
    expert 0 fill 128-row blocks and the tails; plans of more than FEW_PAIRS_MAX pairs take these kernels,
    so the shared expert's one-expert plan at 2100 tokens only)."""
    E, k, H, I = 16, 8, 2048, 512
    monkeypatch.setattr(moe_wgmma, "PERMUTED_K_MAX_BLOCK", 128 if permuted else 0)
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
        if permuted:   # the caller's permuted copy of x (rmsnorm_rows' permuted_copy) gives the same bits
            monkeypatch.setattr(moe_grouped_gemm, "WGMMA_MOE", True)
            twice = []
            for xp in (None, x[:, moe_wgmma.perm_k_index(H, DEV)].contiguous()):
                out = torch.zeros(T, H, device=DEV)
                moe_grouped(x, plan, wts.reshape(-1).float().contiguous(), g, u, d, out, x_permuted=xp)
                twice.append(out)
            assert torch.equal(*twice)


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


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_dense_splits_share_k_evenly_and_fill_the_gpu(sms):
    """dense_splits: 1 past DENSE_SPLIT_MAX_M rows and where the tiles alone fill DENSE_SPLIT_PROGRAMS_PER_SM
    programs an SM; else a divisor of K's groups leaving each part DENSE_SPLIT_MIN_STEPS groups or more, the
    largest such divisor that does not overshoot the programs wanted (brute force over every divisor)."""
    per_sm, min_steps = moe_wgmma.DENSE_SPLIT_PROGRAMS_PER_SM, moe_wgmma.DENSE_SPLIT_MIN_STEPS
    for m, n, k in itertools.product([1, 3, 8, 16, 17, 32, 33, 64, 128], [64, 2048, 9216, 12352, 248320],
                                     [128, 512, 2048, 4096]):
        s = moe_wgmma.dense_splits(m, n, k, sms)
        groups = k // 64
        assert groups % s == 0 and (s == 1 or groups // s >= min_steps), (m, n, k, s)
        if m > moe_wgmma.DENSE_SPLIT_MAX_M:
            assert s == 1, (m, n, k)
            continue
        tiles = n // 64 * -(-m // moe_wgmma.dense_block_rows(m))
        want = -(-per_sm * sms // tiles)
        ok = [d for d in range(1, groups + 1) if groups % d == 0 and (d == 1 or groups // d >= min_steps) and d <= want]
        assert s == max(ok), (m, n, k, s, ok)


def test_dense_refuses_a_split_it_cannot_share(gen):
    """dense() checks a split before any launch: K's groups in equal parts of two or more, and counts enough."""
    w = qt(gen, 128, 256)                  # 4 groups of 64
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    out = torch.empty(8, 128)
    counts = torch.zeros(16, dtype=torch.int32)
    for split, c in [(3, counts), (4, counts), (2, None), (2, torch.zeros(1, dtype=torch.int32))]:
        with pytest.raises(ValueError, match="parts of K"):
            moe_wgmma.dense(x, w, out, accumulate=False, split=split, counts=c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("M", [1, 8, 13, 32])
def test_wgmma_dense_split_k(gen, M):
    """The dense mode with K split (a decode batch's rows): each split against the fp32 product and the unsplit
    kernel, stored (bf16, fp32) and accumulated; outputs poisoned first; the same bits on a second run (the
    parts summed in order) and the arrival counts back at zero."""
    from lily.kernels import q4_gemm
    counts = q4_gemm._arrival_counts(DEV)
    for N, K in [(12352, 2048), (9216, 2048), (128, 512)]:
        w = qt(gen, N, K)
        x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
        ref = x.float() @ w.dequantize().float().T
        base = torch.randn(M, N, generator=gen).to(DEV)
        unsplit = torch.full((M, N), float("nan"), device=DEV)
        moe_wgmma.dense(x, w, unsplit, accumulate=False)
        for split in [s for s in (2, 4, 8) if (K // 64) % s == 0 and K // 64 // s >= 2]:
            runs = []
            for _ in range(2):
                y32 = torch.full((M, N), float("nan"), device=DEV)
                y16 = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                acc = base.clone()
                moe_wgmma.dense(x, w, y32, accumulate=False, split=split, counts=counts)
                moe_wgmma.dense(x, w, y16, accumulate=False, split=split, counts=counts)
                moe_wgmma.dense(x, w, acc, accumulate=True, split=split, counts=counts)
                runs.append((y32, y16, acc))
            assert int(counts.abs().sum()) == 0, (M, N, K, split)
            for a, b in zip(*runs):
                assert torch.equal(a, b), (M, N, K, split)
            y32, y16, acc = runs[0]
            for got in (y32, y16.float(), acc - base):
                assert torch.isfinite(got).all(), (M, N, K, split)
                assert float(row_rel(got, ref).max()) < 1e-2, (M, N, K, split, gen.initial_seed())
            assert float(row_rel(y32, unsplit).max()) < 1e-5, (M, N, K, split, gen.initial_seed())
