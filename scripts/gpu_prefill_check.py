"""One GPU run that checks and times the prefill path (lily/model/fast_prefill.py and its kernels).

1. every prefill kernel against its plain-torch reference at the real shapes (fresh random inputs,
   outputs poisoned first);
2. chunked prefill (a prompt in two calls, the first split in chunks) against
   lily.model.reference.ReferenceModel on a full-width 4-layer random model: logits of every position,
   beside the reference's own bf16-vs-fp32 spread; the state left behind (conv, recurrent, KV) against
   the reference's; then decode steps of the fast decode path (lily.model.fast) from that state;
3. prefill speed on the full-size random model (40 layers, exact shapes, random QuantTensors made on the
   GPU) at prompts 256, 4K, 32K (and 128K with --long) and the time of each kernel class at 4K, after a
   short sweep of the dense and grouped GEMM tiles at 4K (the fastest is used and reported).
Full log and JSON under $OUT (or ./out); a short table is printed last. `--tiny` runs 1 and 2 at TINY
shapes on the CPU interpreter (a dry run of the script).

Run: PYTHONPATH=$PWD python3 scripts/gpu_prefill_check.py [--long] [--tiny]

An A/B of module settings instead of part 3 (prompts up to 4K eager and as graphs, the profile at 256, then
all variants' graphs replayed in alternating rounds, the median of each: --ab-rounds, 15):
    PYTHONPATH=$PWD python3 scripts/gpu_prefill_check.py --skip kernels,fidelity,tune,tune_small,gdn \
        --prompts 256,4096 --ab-set 'lily.kernels.moe_wgmma.PERMUTED_K_MAX_BLOCK=128' \
        --ab-set 'lily.model.fast_prefill.SHARED_WITH_ROUTED=False'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

import lily.kernels.flash_attention as FA
import lily.kernels.moe_grouped_gemm as MG
import lily.kernels.moe_plan as MP
import lily.kernels.q4_gemm as QG
from lily.checkpoint import expected_tensors
from lily.config import FULL, TINY, ModelConfig, with_layers
from lily.kernels.conv1d_prefill import conv1d_prefill, conv1d_prefill_reference
from lily.kernels.flash_attention import (attention_reference, flash_attention_prefill, norm_rope_reference,
                                          rope_inv_freq, write_kv_prefill)
from lily.kernels.gated_delta import gated_delta_recurrent
from lily.kernels.moe_routing import moe_topk, moe_topk_reference
from lily.kernels.gdn_chunked import (gated_rmsnorm, gated_rmsnorm_reference, gdn_chunked_prefill,
                                      gdn_inputs_reference)
from lily.model.fast_prefill import prefill_forward, with_fused_projections
from lily.model.prefill_graphs import PrefillGraphs
from lily.quant import QuantTensor
from gpu_compare import rel  # noqa: E402  (scripts/ is on sys.path when a script runs)

OUT = os.environ.get("OUT") or "out"
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "prefill_check.log"), "w")
RESULTS: dict = {"checks": {}, "fidelity": {}, "prefill": {}, "classes_4k_ms": {}, "tune": {}}
FAILS: list[str] = []


def log(*a) -> None:
    print(*a, flush=True)
    print(*a, file=LOG, flush=True)


def check(name: str, err: float, tol: float) -> None:
    ok = err == err and err <= tol
    RESULTS["checks"][name] = {"rel_err": err, "tol": tol, "ok": ok}
    log(f"  {'ok ' if ok else 'BAD'} {name:34s} rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILS.append(name)


def section(fn):
    """Run one part; a failure is logged and recorded, the rest still runs."""
    def run(*a, **k):
        log(f"== {fn.__name__}")
        t = time.time()
        try:
            return fn(*a, **k)
        except Exception:
            log(traceback.format_exc())
            FAILS.append(fn.__name__ + " (exception)")
        finally:
            log(f"   ({time.time() - t:.1f} s)")
    return run


def rand_qt(shape, bits: int, dev, std: float) -> QuantTensor:
    """Random codes and scales: w = s*q + b with mean ~0 and std ~std (no quantize pass: fast)."""
    *lead, n, k = shape
    per = 32 // bits
    words = torch.randint(-2**31, 2**31, (*lead, n, k // per), dtype=torch.int64, device=dev)
    words = words.to(torch.int32).view(torch.uint32)
    levels = (1 << bits) - 1
    code_std = (((levels + 1) ** 2 - 1) / 12) ** 0.5
    s = (std / code_std) * (1 + 0.1 * torch.randn(*lead, n, k // 64, device=dev))
    return QuantTensor(words, s.to(torch.bfloat16), (-s * levels / 2).to(torch.bfloat16), bits)


def random_model(config: ModelConfig, dev, seed: int = 0) -> dict:
    """Every weight of `config`, random, on dev (quantized ones as random codes, see rand_qt)."""
    from lily.synthetic import _linear_std, random_tensor
    torch.manual_seed(seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    w = {}
    for spec in expected_tensors(config).values():
        if spec.quantized:
            std = 1.0 if spec.key == "embed_tokens" else _linear_std(spec.key, spec.shape[-1], config.num_hidden_layers)
            w[spec.key] = rand_qt(spec.shape, spec.bits, dev, std)
        else:
            w[spec.key] = random_tensor(spec.key, spec.shape, config, gen, dev).to(spec.dtype)
    return with_fused_projections(config, w)


def new_state(c: ModelConfig, max_seq: int, dev):
    """The decode state layout of docs/internals.md (poisoned KV so unwritten rows would show)."""
    n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
    kv = (n_attn, max_seq, c.num_key_value_heads, c.head_dim)
    return types.SimpleNamespace(
        pos=0,
        k_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=dev),
        v_cache=torch.full(kv, float("nan"), dtype=torch.bfloat16, device=dev),
        conv_state=torch.zeros(n_gdn, c.linear_conv_kernel_dim - 1, c.linear_conv_dim, dtype=torch.bfloat16,
                               device=dev),
        rec_state=torch.zeros(n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                              dtype=torch.float32, device=dev))


def bench_ids(n: int, vocab: int, dev) -> torch.Tensor:
    """The benchmark contract's synthetic prompt: token i = (i * 2654435761 mod 2^32) mod vocab."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 2654435761) % (1 << 32) % vocab).to(dev)


# -- 1. kernels ----------------------------------------------------------------------------------------

@section
def kernel_checks(c: ModelConfig, dev, T: int, groups: set[str]) -> None:
    H = c.hidden_size
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    if "dense" in groups:
        _dense_checks(c, dev, T, x)
    if "moe" in groups:
        _moe_checks(c, dev, T, x)
    if "conv" in groups:
        _conv_checks(c, dev, T)
    if "gdn" in groups:
        _gdn_checks(c, dev, T)
    if "attn" in groups:
        _attn_checks(c, dev, T)


def _dense_checks(c, dev, T, x):
    # dense 4-bit GEMM (GDN in_proj_qkv shape), 8-bit router, residual-accumulate (o_proj shape)
    H = c.hidden_size
    w = QG.QuantTensor(*_q(c.linear_conv_dim, H, 4, dev), 4)
    y = torch.full((T, c.linear_conv_dim), float("nan"), device=dev)
    QG.q_gemm(x, w, out=y)
    check("q_gemm 4-bit", rel(y, QG.q_gemm_reference(x, w)), 5e-3)
    saved = QG.PREDEQUANT_MIN_M
    QG.PREDEQUANT_MIN_M = 1   # the other path: weight dequantized into bf16 scratch, then a bf16 GEMM
    y = torch.full((T, c.linear_conv_dim), float("nan"), device=dev)
    QG.q_gemm(x, w, out=y)
    check("q_gemm 4-bit predequantized", rel(y, QG.q_gemm_reference(x, w)), 5e-3)
    wd = QG.dequantize_bf16(w)
    ref = w.dequantize(torch.float32)
    check("dequantize_bf16 (worst element)", float(((wd.float() - ref).abs() / (ref.abs() + 1e-30)).max()),
          2 ** -7 if QG.UPCAST_DOT else 2 ** -8)  # one bf16 step (the interpreter truncates)
    # the bf16x2 path rounds c * s + b once, torch rounds to fp32 and then to bf16: equal but for ties (not
    # under the interpreter, whose casts truncate)
    if not QG.UPCAST_DOT:
        check(f"dequantize_bf16 == torch (fraction differing, fast path {QG.FAST_DEQUANT.value})",
              float((wd != ref.to(torch.bfloat16)).float().mean()), 1e-4)
    QG.PREDEQUANT_MIN_M = saved
    r = QG.QuantTensor(*_q(c.num_experts, H, 8, dev), 8)
    check("q_gemm 8-bit router", rel(QG.q_gemm(x, r, out_dtype=torch.float32), QG.q_gemm_reference(x, r)), 5e-3)
    o = torch.randn(T, c.num_attention_heads * c.head_dim, device=dev).to(torch.bfloat16)
    wo = QG.QuantTensor(*_q(H, c.num_attention_heads * c.head_dim, 4, dev), 4)
    res = torch.randn(T, H, device=dev)
    acc = res.clone()
    QG.q_gemm(o, wo, out=acc, accumulate=True)
    check("q_gemm accumulate", rel(acc - res, QG.q_gemm_reference(o, wo)), 5e-3)
    hres = torch.randn(T, H, device=dev)
    g = 1 + 0.1 * torch.randn(H, device=dev)
    ref = hres * torch.rsqrt(hres.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    check("rmsnorm_rows", rel(QG.rmsnorm_rows(hres, g, 1e-6), ref), 5e-3)
    # the MoE norm's permuted copy (the Hopper MoE kernels' column order at small blocks): the same bf16 values,
    # position k' of a 64-group holding natural column 16 q + 8 h + 4 e + s (k' = 16 s + 8 h + 2 q + e)
    y, yp = QG.rmsnorm_rows(hres, g, 1e-6, permuted_copy=True)
    kp = torch.arange(H, device=dev) % 64
    natural = torch.arange(H, device=dev) - kp + 16 * ((kp // 2) % 4) + 8 * ((kp // 8) % 2) + 4 * (kp % 2) + kp // 16
    same = torch.equal(yp, y[:, natural]) and torch.equal(y, QG.rmsnorm_rows(hres, g, 1e-6))
    check("rmsnorm_rows permuted copy", 0.0 if same else 1.0, 0.5)


def _moe_checks(c, dev, T, x):
    H = c.hidden_size
    E, k, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    # the prefill's routing with the shared expert as slot k (expert E, weight sigmoid of the last column)
    lg = 2 * torch.randn(T, E + 1, device=dev)
    got_w, got_i = moe_topk(lg, k, c.norm_topk_prob, shared=True)
    want_w, want_i = moe_topk_reference(lg, k, c.norm_topk_prob, shared=True)
    check(f"moe_topk T={T} + shared expert: ids", 0.0 if torch.equal(got_i.long(), want_i) else 1.0, 0.5)
    check(f"moe_topk T={T} + shared expert: weights", rel(got_w, want_w), 1e-5)
    gate, up = (QG.QuantTensor(*_q((E, I), H, 4, dev, 0.02), 4) for _ in range(2))
    down = QG.QuantTensor(*_q((E, H), I, 4, dev, 0.02), 4)
    # T rows, and a 4K prompt's worth (the plan then has blocks of several sizes), with uneven experts
    for rows, skew in ((T, 0.0), (4096 if dev.type == "cuda" else 256, 4.0)):
        xr = x[:rows] if rows <= x.shape[0] else torch.randn(rows, H, device=dev).to(torch.bfloat16)
        logits = torch.randn(rows, E, device=dev) + skew * torch.rand(E, device=dev)
        top, idx = logits.softmax(-1).topk(k)
        top = top / top.sum(-1, keepdim=True)
        plan, ref = MG.moe_plan(idx, E), MP.moe_plan_reference(idx, E)
        same = torch.equal(plan.slots, ref.slots) and all(
            torch.equal(ge, re_) and torch.equal(gs[re_ < E], rs[re_ < E]) and torch.equal(gt[re_ < E], rt[re_ < E])
            for (_, ge, gs, gt), (_, re_, rs, rt) in zip(plan.block_groups(), ref.block_groups()))
        check(f"moe_plan T={rows} (sizes {[g[0] for g in plan.block_groups()]}) == torch", 0.0 if same else 1.0, 0.5)
        want = MG.moe_grouped_reference(xr, idx, top, gate, up, down)
        # on Hopper both column orders of the warpgroup-MMA kernels (moe_wgmma.PERMUTED_K_MAX_BLOCK)
        for permuted in ((False, True) if MG.moe_wgmma is not None and dev.type == "cuda" else (False,)):
            base = torch.randn(rows, H, device=dev)
            out = base.clone()
            with settings(f"lily.kernels.moe_wgmma.PERMUTED_K_MAX_BLOCK={128 if permuted else 0}"):
                MG.moe_grouped(xr, plan, top.reshape(-1).contiguous(), gate, up, down, out)
            check(f"moe_grouped T={rows}" + (" permuted K" if permuted else ""), rel(out - base, want),
                  2e-2 if QG.UPCAST_DOT else 1e-2)   # (the interpreter truncates its bf16 casts)
        # the slot combine that also makes the next layer's input (moe_grouped's next_input)
        gain = 1 + 0.1 * torch.randn(H, device=dev)
        base = torch.randn(rows, H, device=dev)
        out, x_next = MG.moe_grouped(xr, plan, top.reshape(-1).contiguous(), gate, up, down, base.clone(),
                                     next_input=(gain, 1e-6))
        check(f"moe_grouped T={rows} next layer's input", rel(x_next, QG.rmsnorm_rows(out, gain, 1e-6)), 5e-3)


def _conv_checks(c, dev, T):
    C, K = c.linear_conv_dim, c.linear_conv_kernel_dim
    m = torch.randn(T, C, device=dev).to(torch.bfloat16)
    cw = (0.5 * torch.randn(C, K, device=dev)).to(torch.bfloat16)
    st = torch.randn(K - 1, C, device=dev).to(torch.bfloat16)
    ry, rs = conv1d_prefill_reference(m, cw, st)
    y = conv1d_prefill(m, cw, st)
    check("conv1d_prefill", rel(y, ry), 1e-2)
    check("conv1d state", rel(st, rs), 1e-6)


def _gdn_checks(c, dev, T):
    # chunked gated delta rule continuing a state, against the token-by-token recurrence
    C = c.linear_conv_dim
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    yy = torch.randn(T, C, device=dev).to(torch.bfloat16)
    b = torch.randn(T, Hv, device=dev)
    a = torch.randn(T, Hv, device=dev)
    A_log = torch.log(torch.rand(Hv, device=dev) * 15 + 1)
    dtb = (0.1 * torch.randn(Hv, device=dev)).to(torch.bfloat16)
    s0 = 0.1 * torch.randn(Hv, dk, dv, device=dev)
    s = s0.clone()
    o_k = gdn_chunked_prefill(yy, b, a, A_log, dtb, s, Hk)
    q_, k_, v_, g_, be_ = gdn_inputs_reference(yy, b, a, A_log, dtb, Hk, Hv, dk, dv)
    o_r, s_r = gated_delta_recurrent(q_, k_, v_, g_, be_, s0)
    check("gdn_chunked output", rel(o_k, o_r), 5e-3)
    check("gdn_chunked state", rel(s, s_r), 5e-3)
    z = torch.randn(T, Hv * dv, device=dev).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(dv, device=dev)).to(torch.bfloat16)
    check("gated_rmsnorm", rel(gated_rmsnorm(o_r, z, nw), gated_rmsnorm_reference(o_r, z, nw)), 1e-2)


def _attn_inputs(c, dev, T):
    """A T-token chunk after a T/2 cached prefix: (qg, q_norm, inv_freq, k_cache, v_cache, P, K ref)."""
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inv = rope_inv_freq(c.rotary_dim, c.rope_theta, dev)
    P = T // 2
    kc = torch.full((P + T + 8, Hkv, D), float("nan"), device=dev).to(torch.bfloat16)
    vc = kc.clone()
    kn = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16)
    qn = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16)
    kp, vp = (torch.randn(P, Hkv * D, device=dev).to(torch.bfloat16) for _ in range(2))
    write_kv_prefill(kp, vp, kn, inv, kc, vc, 0)
    kx, vx = (torch.randn(T, Hkv * D, device=dev).to(torch.bfloat16) for _ in range(2))
    write_kv_prefill(kx, vx, kn, inv, kc, vc, P)
    pos = torch.arange(P + T, device=dev)
    k_ref = norm_rope_reference(torch.cat([kp, kx]).reshape(-1, Hkv, D), kn, pos, inv)
    qg = torch.randn(T, Hq * 2 * D, device=dev).to(torch.bfloat16)
    return qg, qn, inv, kc, vc, P, k_ref


def _attn_checks(c, dev, T):
    # flash attention after a cached prefix
    qg, qn, inv, kc, vc, P, k_ref = _attn_inputs(c, dev, T)
    check("write_kv_prefill K", rel(kc[:P + T], k_ref), 5e-3)
    o = flash_attention_prefill(qg, qn, inv, kc, vc, P, c.num_attention_heads)
    ref = attention_reference(qg, qn, inv, kc[:P + T], vc[:P + T], P, c.num_attention_heads)
    check("flash_attention_prefill", rel(o, ref), 1e-2)


def _q(n, k, bits, dev, std=None):
    """(weight, scales, biases) of a random [..., n, k] weight (n may be a tuple of leading dims)."""
    shape = (*n, k) if isinstance(n, tuple) else (n, k)
    qt = rand_qt(shape, bits, dev, std if std is not None else k ** -0.5)
    return qt.weight, qt.scales, qt.biases


# -- 2. fidelity -----------------------------------------------------------------------------------------

@section
def fidelity(c: ModelConfig, dev, T1: int, T2: int, chunk: int) -> None:
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights
    w = random_weights(c, seed=7, device=dev)
    wf = with_fused_projections(c, w)
    ids = torch.randint(0, c.vocab_size, (T1 + T2 + 4,), device=dev)
    st = new_state(c, T1 + T2 + 16, dev)
    t = time.time()
    l1 = prefill_forward(c, wf, st, ids[:T1], logits="all", chunk_tokens=chunk)
    l2 = prefill_forward(c, wf, st, ids[T1:T1 + T2], logits="all", chunk_tokens=chunk)
    log(f"   fast prefill {time.time() - t:.1f} s")
    fast = torch.cat([l1, l2])
    ref = ReferenceModel(c, w, device=dev)
    rs = ref.new_state()
    r = torch.cat([ref.forward(ids[:T1], rs), ref.forward(ids[T1:T1 + T2], rs)])
    refb = ReferenceModel(c, w, device=dev, dtype=torch.bfloat16)
    rbs = refb.new_state()
    rb = torch.cat([refb.forward(ids[:T1], rbs), refb.forward(ids[T1:T1 + T2], rbs)])
    err, spread = rel(fast, r), rel(rb, r)
    top2 = r.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.05 * r.std()
    agree = float((fast.argmax(-1) == r.argmax(-1))[decisive].float().mean())
    RESULTS["fidelity"] = {"layers": c.num_hidden_layers, "tokens": [T1, T2], "chunk": chunk,
                           "rel_logit_err": err, "bf16_ref_spread": spread, "top1_agree_decisive": agree}
    log(f"   logits rel err {err:.2e} (bf16 reference spread {spread:.2e}); top-1 agreement {agree:.3f}")
    check("prefill logits vs reference", err, max(1e-2, 2 * spread))
    check("prefill top-1 (decisive)", 1 - agree, 0.02)
    for j, i in enumerate(c.linear_attention_layers):
        check(f"state conv L{i}", rel(st.conv_state[j], rs.conv[i]), max(1e-2, 2 * spread))
        check(f"state recurrent L{i}", rel(st.rec_state[j], rs.recurrent[i]), max(2e-2, 2 * spread))
    n = T1 + T2
    for j, i in enumerate(c.full_attention_layers):
        check(f"state K L{i}", rel(st.k_cache[j, :n], rs.keys[i]), max(1e-2, 2 * spread))
        check(f"state V L{i}", rel(st.v_cache[j, :n], rs.values[i]), max(1e-2, 2 * spread))
    check("state pos", float(st.pos != rs.pos), 0.0)

    # decode from the prefilled state with the fast decode path, against the reference's decode
    try:
        from lily.model.fast import FastModel
    except Exception as e:  # the decode engine is another piece; report, don't fail this one
        log(f"   (fast decode not importable: {e!r})")
        return
    try:
        fm = FastModel(c, w, device=dev, use_graph=False)
        fs = fm.new_state(max_seq=n + 16)
        prefill_forward(c, wf, fs, ids[:n], logits="none", chunk_tokens=chunk)
        errs = []
        for tok in ids[n:n + 4].tolist():
            errs.append(rel(fm.decode(tok, fs), ref.forward([tok], rs)[0]))
    except Exception as e:  # a failure inside the decode engine (another piece) is reported, not fatal
        log(f"   fast decode after prefill did not run: {type(e).__name__}: {str(e)[:300]}")
        RESULTS["fidelity"]["decode_after_prefill"] = f"did not run: {type(e).__name__}"
        return
    RESULTS["fidelity"]["decode_after_prefill_rel_err"] = errs
    log(f"   fast decode after prefill: rel err per step {['%.1e' % e for e in errs]}")
    check("decode after prefill", max(errs), max(2e-2, 3 * spread))


# -- 3. speed --------------------------------------------------------------------------------------------

# kernel name (first match) -> class; _moe_wgmma_kernel (Hopper) runs the expert GEMMs and the dense 4-bit GEMMs of
# 65 .. 1,024 rows (the kernel table below each class names them apart by count)
CLASSES = [("_q_gemm_kernel", "dense 4-bit GEMM"), ("_gemm_nt", "dense bf16 GEMM (predequantized)"),
           ("_dequant_kernel", "dense dequantize to bf16"), ("_moe_gate_up", "MoE gate_up"), ("_moe_down", "MoE down"),
           ("_moe_wgmma", "4-bit wgmma (Hopper: MoE, short dense)"), ("_combine_slots", "MoE combine"),
           ("_plan_", "MoE routing"), ("_moe_topk", "MoE routing"),
           ("_gdn_prep", "GDN prep (WY)"), ("_gdn_scan", "GDN scan"), ("_flash_attn", "flash attention"),
           ("_conv", "conv1d"), ("_write_kv", "RoPE + KV write"), ("_rope_q", "RoPE + KV write"),
           ("rmsnorm", "norms"), ("", "torch (other)")]


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _bench(fn) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=3, rep=20)
    except Exception as e:  # a tile that does not fit (shared memory, registers)
        log(f"   ({type(e).__name__}: {str(e)[:80]})")
        return float("inf")


DENSE_FUSED = [(128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3), (64, 128, 4, 4)]
DENSE_BF16 = [(256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 4, 3), (256, 128, 128, 8, 2),
              (128, 256, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 64, 4, 5)]
MOE_GATE_UP = [(64, 4, 3), (128, 8, 3), (64, 8, 3), (64, 4, 4), (64, 8, 4), (32, 4, 4), (32, 4, 3), (32, 2, 4)]
MOE_DOWN = [(64, 4, 3), (128, 4, 4), (128, 8, 4), (128, 8, 3), (256, 8, 3), (64, 4, 4), (64, 8, 4), (32, 4, 4)]


@section
def tune(dev, tiny: bool = False, dense: bool = True) -> None:
    """Sweep the dense GEMM's two paths (tile dequantized on the way in, or the weight dequantized into bf16
    scratch first) and their tiles, the row count from which the second wins, and the grouped MoE GEMM's
    tiles, at a 4K prompt; keep the fastest (RESULTS["tune"]["chosen"] lists what to make the defaults)."""
    M, H = (256, 256) if tiny else (4096, 2048)
    shapes = [(8192, H), (H, 4096)] if not tiny else [(512, H), (H, 512)]   # in_proj_qkv and out_proj
    xs = {K: torch.randn(M, K, device=dev).to(torch.bfloat16) for _, K in shapes}
    ws = [QG.QuantTensor(*_q(N, K, 4, dev), 4) for N, K in shapes]
    flops = lambda m: sum(2 * m * N * K for N, K in shapes)
    fused_cands, bf16_cands = (DENSE_FUSED[:2], DENSE_BF16[:1]) if tiny else (DENSE_FUSED, DENSE_BF16)
    if tiny:
        bf16_cands = [(32, 64, 64, 4, 1)]

    def dense_ms(m: int) -> float:
        return sum(_time_ms(lambda w=w, K=w.shape[1]: QG.q_gemm(xs[K][:m], w)) for w in ws)

    fused, pre, crossover, deq_ms, cublas_ms = {}, {}, {}, None, None
    if dense:
        QG.PREDEQUANT_MIN_M = 1 << 30
        for cfg in fused_cands:
            QG.DENSE_LARGE = cfg
            fused[str(cfg)] = ms = dense_ms(M)
            log(f"   dense fused {cfg}: {ms:.3f} ms ({flops(M) / ms / 1e9:.0f} TFLOP/s)")
        QG.DENSE_LARGE = min(fused_cands, key=lambda c: fused[str(c)])
        QG.PREDEQUANT_MIN_M = 1
        for cfg in bf16_cands:
            QG.BF16_TILES = cfg
            pre[str(cfg)] = ms = dense_ms(M)
            log(f"   dense predequant {cfg}: {ms:.3f} ms ({flops(M) / ms / 1e9:.0f} TFLOP/s)")
        QG.BF16_TILES = min(bf16_cands, key=lambda c: pre[str(c)])
        deq_ms = sum(_time_ms(lambda w=w: QG.dequantize_bf16(w, QG._scratch(w.shape[0] * w.shape[1], dev).view(w.shape)))
                     for w in ws)
        wb = [w.dequantize(torch.float32).to(torch.bfloat16) for w in ws]
        cublas_ms = sum(_time_ms(lambda w=w, K=w.shape[1]: xs[K] @ w.T) for w in wb)
        log(f"   dequantize alone {deq_ms:.3f} ms; torch bf16 matmul (cuBLAS, for scale) {cublas_ms:.3f} ms "
            f"({flops(M) / cublas_ms / 1e9:.0f} TFLOP/s)")
        crossover = {}
        min_m = 1 << 30
        for m in ([64, 128, 256] if tiny else [256, 512, 1024, 2048, 4096]):
            QG.PREDEQUANT_MIN_M = 1 << 30
            f = dense_ms(m)
            QG.PREDEQUANT_MIN_M = 1
            p = dense_ms(m)
            crossover[m] = {"fused_ms": f, "predequant_ms": p}
            log(f"   M {m:5d}: fused {f:.3f} ms, predequant {p:.3f} ms")
            if p < f and min_m == 1 << 30:
                min_m = m
            elif p >= f:
                min_m = 1 << 30
        QG.PREDEQUANT_MIN_M = min_m

    E, k, I = (16, 8, 64) if tiny else (256, 8, 512)
    x = xs[H]
    gate, up = (QG.QuantTensor(*_q((E, I), H, 4, dev, 0.02), 4) for _ in range(2))
    down = QG.QuantTensor(*_q((E, H), I, 4, dev, 0.02), 4)
    top, idx = torch.randn(M, E, device=dev).softmax(-1).topk(k)
    tw = (top / top.sum(-1, keepdim=True)).reshape(-1).contiguous()
    out = torch.zeros(M, H, device=dev)
    mflops = 2 * M * k * 3 * I * H
    moe = {}

    def run(tail, gu, dn):
        MP.TAIL_CLASSES, MG.GATE_UP_TILES, MG.DOWN_TILES = tail, gu, dn
        plan = MG.moe_plan(idx, E)
        ms = _time_ms(lambda: MG.moe_grouped(x, plan, tw, gate, up, down, out))
        moe[str((tail, gu, dn))] = ms
        sizes = [g[0] for g in plan.block_groups()]
        log(f"   moe blocks {sizes} gate_up {gu} down {dn}: {ms:.3f} ms ({mflops / ms / 1e9:.0f} TFLOP/s)")
        return ms

    gu0, d0 = MG.GATE_UP_TILES, MG.DOWN_TILES
    gus, dns = (MOE_GATE_UP[:1], MOE_DOWN[:1]) if tiny else (MOE_GATE_UP, MOE_DOWN)
    run(False, gu0, d0)  # one block size (the earlier plan), for the comparison
    tail, gu = min([(True, g) for g in gus], key=lambda c: run(c[0], c[1], d0))
    dn = min(dns, key=lambda d: run(tail, gu, d))
    MP.TAIL_CLASSES, MG.GATE_UP_TILES, MG.DOWN_TILES = tail, gu, dn
    plan_ms = _time_ms(lambda: MG.moe_plan(idx, E))
    ref_plan_ms = _time_ms(lambda: MP.moe_plan_reference(idx, E))
    log(f"   routing plan: {plan_ms * 1e3:.1f} us (the same plan in torch: {ref_plan_ms * 1e3:.1f} us)")
    attn = _attn_sweep(dev, tiny)
    RESULTS["tune"] = {"attention_ms": attn, "M": M, "dense_fused_ms": fused, "dense_predequant_ms": pre, "dequantize_ms": deq_ms,
                       "cublas_bf16_ms": cublas_ms, "crossover": crossover, "moe_ms": moe,
                       "moe_plan_ms": plan_ms, "moe_plan_torch_ms": ref_plan_ms, "chosen": {
                           "DENSE_LARGE": QG.DENSE_LARGE, "BF16_TILES": QG.BF16_TILES,
                           "PREDEQUANT_MIN_M": QG.PREDEQUANT_MIN_M, "TAIL_CLASSES": tail, "GATE_UP_TILES": gu,
                           "DOWN_TILES": dn, "ATTN_TILES_WIDE": FA.TILES_WIDE}}
    log(f"   chosen: {RESULTS['tune']['chosen']}")


ATTN_WIDE = [(128, 64, 8, 2, True), (64, 64, 4, 3, True), (64, 64, 8, 3, True), (128, 32, 8, 3, True),
             (64, 32, 4, 3, True)]


def _attn_sweep(dev, tiny: bool) -> dict:
    """Flash attention tiles for a 4K chunk after a 2K prefix (one layer), each checked against the
    reference; the fastest that passes is kept."""
    c = TINY if tiny else FULL
    T = 64 if tiny else 4096
    qg, qn, inv, kc, vc, P, _ = _attn_inputs(c, dev, T)
    Hq = c.num_attention_heads
    ref = attention_reference(qg, qn, inv, kc[:P + T], vc[:P + T], P, Hq)
    res = {}
    for cfg in (ATTN_WIDE[:2] if tiny else ATTN_WIDE):
        FA.TILES_WIDE = cfg
        try:
            err = rel(flash_attention_prefill(qg, qn, inv, kc, vc, P, Hq), ref)
            ms = _time_ms(lambda: flash_attention_prefill(qg, qn, inv, kc, vc, P, Hq)) if err < 1e-2 else float("inf")
        except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
            err, ms = float("nan"), float("inf")
            log(f"   attention {cfg}: {type(e).__name__}: {str(e)[:120]}")
        res[str(cfg)] = {"ms": ms, "rel_err": err}
        log(f"   attention {cfg}: {ms:.3f} ms, rel err {err:.1e}")
    FA.TILES_WIDE = min((ATTN_WIDE[:2] if tiny else ATTN_WIDE), key=lambda cf: res[str(cf)]["ms"])
    return res


DENSE_SMALL = [(64, 64, 4, 4), (64, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 6), (128, 64, 4, 4), (64, 32, 4, 4)]
BF16_SMALL = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 6), (32, 64, 64, 4, 4)]
MOE_SMALL = [(64, 4, 3, 64, 4, 3), (32, 4, 4, 32, 4, 4), (64, 4, 5, 64, 4, 5), (32, 2, 4, 64, 4, 4),
             (64, 8, 4, 128, 8, 4), (128, 4, 3, 64, 4, 3)]


@section
def tune_small(dev, M: int = 256) -> None:
    """A short prompt (M rows): the dense GEMM's small tiles on either path, which path wins there, and the
    grouped MoE's tiles for blocks of under 64 rows; the fastest are kept (RESULTS["tune_small"]["chosen_small"])."""
    H = 2048
    shapes = [(8192, H), (H, 4096), (4096, H)]   # in_proj_qkv, out_proj, in_proj_z
    xs = {K: torch.randn(M, K, device=dev).to(torch.bfloat16) for _, K in shapes}
    ws = [QG.QuantTensor(*_q(N, K, 4, dev), 4) for N, K in shapes]
    dense_ms = lambda: sum(_time_ms(lambda w=w, K=w.shape[1]: QG.q_gemm(xs[K], w)) for w in ws)
    saved = QG.PREDEQUANT_MIN_M, QG.SMALL_M
    QG.SMALL_M = max(QG.SMALL_M, M)
    res: dict = {"M": M, "fused": {}, "predequant": {}, "moe": {}}
    QG.PREDEQUANT_MIN_M = 1 << 30
    for cfg in DENSE_SMALL:
        QG.DENSE_SMALL = cfg
        res["fused"][str(cfg)] = ms = dense_ms()
        log(f"   M {M} dense fused {cfg}: {ms * 1e3:.1f} us")
    QG.DENSE_SMALL = min(DENSE_SMALL, key=lambda c: res["fused"][str(c)])
    QG.PREDEQUANT_MIN_M = 1
    for cfg in BF16_SMALL:
        QG.BF16_SMALL = cfg
        res["predequant"][str(cfg)] = ms = dense_ms()
        log(f"   M {M} dense predequant {cfg}: {ms * 1e3:.1f} us")
    QG.BF16_SMALL = min(BF16_SMALL, key=lambda c: res["predequant"][str(c)])
    best_fused, best_pre = min(res["fused"].values()), min(res["predequant"].values())
    QG.PREDEQUANT_MIN_M = saved[0] if best_fused <= best_pre else min(saved[0], M)
    E, k, I = 256, 8, 512
    gate, up = (QG.QuantTensor(*_q((E, I), H, 4, dev, 0.02), 4) for _ in range(2))
    down = QG.QuantTensor(*_q((E, H), I, 4, dev, 0.02), 4)
    top, idx = torch.randn(M, E, device=dev).softmax(-1).topk(k)
    tw = (top / top.sum(-1, keepdim=True)).reshape(-1).contiguous()
    out = torch.zeros(M, H, device=dev)
    plan = MG.moe_plan(idx, E)
    for cfg in MOE_SMALL:
        MG.SMALL_TILES = cfg
        res["moe"][str(cfg)] = ms = _time_ms(lambda: MG.moe_grouped(xs[H], plan, tw, gate, up, down, out))
        log(f"   M {M} moe (BM {plan.block_m}) tiles {cfg}: {ms * 1e3:.1f} us")
    MG.SMALL_TILES = min(MOE_SMALL, key=lambda c: res["moe"][str(c)])
    QG.SMALL_M = saved[1]
    res["chosen_small"] = {"DENSE_SMALL": QG.DENSE_SMALL, "BF16_SMALL": QG.BF16_SMALL,
                           "PREDEQUANT_MIN_M": QG.PREDEQUANT_MIN_M, "SMALL_TILES": MG.SMALL_TILES}
    RESULTS["tune_small"] = res
    log(f"   chosen: {res['chosen_small']}")


# -- GDN launch sweep ------------------------------------------------------------------------------------

GDN_TOL = {"typical": 5e-3, "coupled": 2e-2}  # rel err bar of output and final state vs the fp32 recurrence
# (algorithm, precision, warps, maxnreg) of the prep kernel (GC.PREP_ALGO, PREP_PRECISION, PREP_WARPS,
# PREP_MAXNREG). The first two (both algorithms) are the --tiny dry run's. ("products", "ieee", 8) is the
# old prep; "tf32" products only for the record (its inverse diverges on the coupled input). ptxas (sm_90)
# gives the blocked kernel ~250 registers at 4 warps without a cap (2 programs an SM): 168 lets 3 run
# (48 bytes of spills), 128 lets 4 (208 bytes).
GDN_PREP = [("blocked", "tf32x3", 4, None), ("products", "tf32x3", 4, None),
            ("blocked", "tf32x3", 8, None), ("blocked", "ieee", 4, None), ("blocked", "ieee", 8, None),
            ("blocked", "tf32x3", 4, 168), ("blocked", "tf32x3", 4, 128),
            ("products", "tf32x3", 8, None), ("products", "ieee", 8, None), ("products", "tf32", 4, None)]
# (split, BV, warps, stages) of the walk; (False, 32, 4, 1) is the old scan. ptxas (sm_90) gives every walk
# kernel ~255 registers a thread, so 8 warps run one program an SM: BV 16 (256 programs) only with 4 warps.
GDN_WALK = [(False, 32, 4, 1), (False, 32, 8, 1), (False, 32, 8, 2), (False, 16, 4, 2),
            (True, 32, 8, 1), (True, 32, 8, 2), (True, 16, 4, 1), (True, 16, 4, 2)]


def _gdn_case(c, dev, T: int, coupled: bool):
    """GDN inputs at the model's statistics (beta = sigmoid(b) in (0, 1), |k| = 1 after the kernel's norm,
    g from the real gate formula with A in [1, 16]) or, `coupled`, a strongly coupled prompt: near-identical
    keys (a repeated token), beta ~ 1, slow decay, where a low-precision triangular inverse diverges.
    Returns (args, s0, o_ref, s_ref) with the fp32 token-by-token recurrence as the reference."""
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    y = torch.randn(T, 2 * Hk * dk + Hv * dv, device=dev)
    b, a = torch.randn(T, Hv, device=dev), torch.randn(T, Hv, device=dev)
    A_log = torch.log(torch.rand(Hv, device=dev) * 15 + 1)
    if coupled:
        y[:, Hk * dk:2 * Hk * dk] = torch.randn(Hk * dk, device=dev) + 0.05 * torch.randn(T, Hk * dk, device=dev)
        b, A_log = b + 6.0, torch.full((Hv,), -6.0, device=dev)
    y = torch.nn.functional.silu(y).to(torch.bfloat16)
    dtb = (0.1 * torch.randn(Hv, device=dev)).to(torch.bfloat16)
    s0 = 0.1 * torch.randn(Hv, dk, dv, device=dev)
    o_r, s_r = gated_delta_recurrent(*gdn_inputs_reference(y, b, a, A_log, dtb, Hk, Hv, dk, dv), s0)
    return (y, b, a, A_log, dtb), s0, o_r, s_r


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        return _bench(fn)
    t = time.perf_counter()  # the --tiny dry run: one call on the interpreter
    fn()
    return (time.perf_counter() - t) * 1e3


@section
def gdn_sweep(c: ModelConfig, dev, T: int, tiny: bool = False) -> None:
    """Time prep + walk of the chunked gated delta rule for a handful of launch variants at a T-token
    prompt; check each against the fp32 recurrence on a typical and a coupled input; keep the fastest
    variant that passes (first over the prep choices with the walk's defaults, then over the walk's)."""
    import lily.kernels.gdn_chunked as GC
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    n_layers = len(c.linear_attention_layers)
    torch.manual_seed(11)
    cases = {name: _gdn_case(c, dev, T, name == "coupled") for name in GDN_TOL}
    typical, s_typ = cases["typical"][0], cases["typical"][1]
    rows: list[dict] = []

    def apply(v: dict) -> None:
        GC.PREP_ALGO, GC.PREP_PRECISION, GC.PREP_WARPS, GC.PREP_MAXNREG = v["prep"]
        GC.SCAN_SPLIT, GC.SCAN_BV, GC.SCAN_WARPS, GC.SCAN_STAGES = v["walk"]

    short_max_t = GC.SCAN_SHORT_MAX_T
    GC.SCAN_SHORT_MAX_T = 0   # every walk variant as it says, at any T (the short-chunk walk is one of them)

    def measure(prep, walk) -> dict:
        v = {"prep": prep, "walk": walk}
        apply(v)
        try:
            for name, (args, s0, o_r, s_r) in cases.items():
                s = s0.clone()
                o = GC.gdn_chunked_prefill(*args, s, Hk)
                v[name] = [rel(o, o_r), rel(s, s_r)]
            s = s_typ.clone()
            v["prep_ms"] = _time_ms(lambda: GC.gdn_prep(*typical, Hk, Hv, dk, dv))
            v["ms"] = _time_ms(lambda: GC.gdn_chunked_prefill(*typical, s, Hk))
        except Exception as e:  # a launch that does not compile or fit: reported, never chosen
            v["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            v["ms"] = v["prep_ms"] = float("inf")
        v["ok"] = "error" not in v and all(e == e and e <= GDN_TOL[n] for n in GDN_TOL for e in v[n])
        split, bv, warps, stages = walk
        desc = (f"prep {prep[0]:8s} {prep[1]:6s} w{prep[2]:<2d} r{prep[3] or '-':<3} | "
                f"{'split' if split else 'scan '} BV{bv} w{warps} s{stages}")
        if "error" in v:
            log(f"   gdn {desc}: {v['error']}")
        else:
            log(f"   gdn {desc}: {v['ms']:7.3f} ms (prep {v['prep_ms']:6.3f}) x{n_layers} = {v['ms'] * n_layers:6.1f} ms;"
                f" err typical {v['typical'][0]:.1e}/{v['typical'][1]:.1e}"
                f" coupled {v['coupled'][0]:.1e}/{v['coupled'][1]:.1e} {'ok' if v['ok'] else 'BAD'}")
        rows.append(v)
        return v

    default = {"prep": (GC.PREP_ALGO, GC.PREP_PRECISION, GC.PREP_WARPS, GC.PREP_MAXNREG),
               "walk": (GC.SCAN_SPLIT, GC.SCAN_BV, GC.SCAN_WARPS, GC.SCAN_STAGES)}
    preps, walks = (GDN_PREP[:2], GDN_WALK[::4]) if tiny else (GDN_PREP, GDN_WALK)
    passing = lambda vs: [v for v in vs if v.get("ok")]
    fastest = lambda vs, fallback: min(passing(vs) or [fallback], key=lambda v: v.get("ms", 0))
    best_prep = fastest([measure(p, default["walk"]) for p in preps], default)
    best = fastest([measure(best_prep["prep"], w) for w in walks if w != default["walk"]] + [best_prep], best_prep)
    if not passing(rows):
        FAILS.append("gdn_sweep: no variant passed")
    chosen = {"PREP_ALGO": best["prep"][0], "PREP_PRECISION": best["prep"][1], "PREP_WARPS": best["prep"][2],
              "PREP_MAXNREG": best["prep"][3], "SCAN_SPLIT": best["walk"][0],
              "SCAN_BV": best["walk"][1], "SCAN_WARPS": best["walk"][2], "SCAN_STAGES": best["walk"][3]}
    # the 4K sweep's choice is applied for the rest of the run (and saved for a later process); another
    # length's is only reported (results under tune.gdn_<T>)
    RESULTS["tune"]["gdn" if T == 4096 else f"gdn_{T}"] = {
        "T": T, "tol": GDN_TOL, "variants": rows, "chosen": chosen, "chosen_ms_per_layer": best.get("ms"),
        "layers": n_layers}
    log(f"   gdn chosen at T={T}: {chosen}")
    apply(best if T == 4096 else default)
    GC.SCAN_SHORT_MAX_T = short_max_t
    if T == 4096:
        with open(os.path.join(OUT, "gdn_chosen.json"), "w") as f:   # for LILY_GDN_TILES in a later process
            json.dump(chosen, f)



@contextlib.contextmanager
def settings(variant: str):
    """Module settings 'package.module.NAME=value; ...' (values as Python literals) for the block, restored after."""
    import ast
    import importlib
    saved = {}
    try:
        for item in filter(None, (x.strip() for x in variant.split(";"))):
            target, value = item.split("=", 1)
            mod_name, attr = target.strip().rsplit(".", 1)
            mod = importlib.import_module(mod_name)
            if not hasattr(mod, attr):
                raise SystemExit(f"--ab-set: {mod_name} has no {attr}")
            saved.setdefault((mod, attr), getattr(mod, attr))
            setattr(mod, attr, ast.literal_eval(value.strip()))
        yield
    finally:
        for (mod, attr), value in saved.items():
            setattr(mod, attr, value)


@section
def speed_variants(dev, prompts: list[int], chunk: int, variants: list[str], rounds: int = 15) -> None:
    """Each --ab-set variant (module settings) against the defaults, on one random model: every prompt of
    at most 4K tokens eagerly and as a graph, and the kernel profile at 256 (RESULTS["prefill"] entries and
    profile keys tagged '@<variant>'); then `interleaved_graphs` (RESULTS["ab_interleaved"])."""
    c = FULL
    w = random_model(c, dev)
    short = [p for p in prompts if p <= 4096]
    for variant in ["", *variants]:
        tag = f"@{variant}" if variant else "@defaults"
        log(f"   -- settings {tag}")
        with settings(variant):
            for T in short:
                _time_prompt(c, w, dev, T, chunk, f"{T}{tag}")
            graph_speed(c, w, dev, short, tag)
            if 256 in short:
                _profile(c, w, dev, 256, chunk, tag=tag)
    if rounds > 0:
        interleaved_graphs(c, w, dev, short, ["", *variants], rounds)


def interleaved_graphs(c, w, dev, prompts: list[int], variants: list[str], rounds: int) -> None:
    """Each variant's prompts as CUDA graphs (captured under its settings), then `rounds` rounds replaying
    every (variant, prompt) once in turn: the median of each, GPU time by CUDA events around the whole
    prefill_forward call. A few-percent difference is below what separate min-of-N timings resolve (the
    GPU's clocks and L2 drift between them); alternating rounds see the same drift."""
    runs = {}
    for variant in variants:
        with settings(variant):
            for T in prompts:
                graphs = PrefillGraphs(c, w, dev)
                if not graphs.bucket(T):
                    continue
                ids = bench_ids(T, c.vocab_size, dev)
                st = new_state(c, graphs.bucket(T), dev)
                prefill_forward(c, w, st, ids, graphs=graphs)   # captures this variant's graph
                runs[(variant or "defaults", T)] = (graphs, st, ids)
    times: dict = {key: [] for key in runs}
    for _ in range(rounds):
        for key, (graphs, st, ids) in runs.items():
            _reset(st)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            prefill_forward(c, w, st, ids, graphs=graphs)
            end.record()
            torch.cuda.synchronize()
            times[key].append(start.elapsed_time(end))
    out = RESULTS.setdefault("ab_interleaved", {})
    log(f"   -- interleaved graph replays, median of {rounds} rounds (ms)")
    for (variant, T), ms in times.items():
        med = float(statistics.median(ms))
        out.setdefault(variant, {})[str(T)] = {"median_ms": med, "min_ms": min(ms), "max_ms": max(ms)}
        log(f"   {T:6d} {variant:60s} {med:8.3f} ms  (min {min(ms):.3f}, max {max(ms):.3f})")


@section
def speed(dev, prompts: list[int], chunk: int, chunks_extra: list[int] = (), ab_paired: bool = False) -> None:
    c = FULL
    t = time.time()
    w = random_model(c, dev)
    torch.cuda.synchronize()
    log(f"   full random model on GPU in {time.time() - t:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    for T in prompts:
        _time_prompt(c, w, dev, T, chunk, str(T))
    graph_speed(c, w, dev, prompts)
    for T in [p for p in (256, 4096, 32768) if p in prompts]:
        _profile(c, w, dev, T, chunk)
    if ab_paired:   # the grouped MoE's gate/up with the other tile arrangement (moe_grouped_gemm.PAIRED_GATE_UP)
        MG.PAIRED_GATE_UP = not MG.PAIRED_GATE_UP
        log(f"   -- moe_grouped_gemm.PAIRED_GATE_UP = {MG.PAIRED_GATE_UP}")
        for T in [p for p in (256, 4096) if p in prompts]:
            _time_prompt(c, w, dev, T, chunk, f"{T}@paired={MG.PAIRED_GATE_UP}")
            _profile(c, w, dev, T, chunk, tag=f"_paired={MG.PAIRED_GATE_UP}")
        MG.PAIRED_GATE_UP = not MG.PAIRED_GATE_UP
    for ch in chunks_extra:
        _time_prompt(c, w, dev, 32768, ch, f"32768@chunk{ch}")


def _time_prompt(c, w, dev, T: int, chunk: int, name: str) -> None:
    """RESULTS["prefill"][name]: a T-token prefill in chunks of `chunk`, timed on a fresh state after a
    warm-up run on another, with the timed run's peak memory."""
    ids = bench_ids(T, c.vocab_size, dev)
    st = new_state(c, T, dev)
    warm = _sync_time(lambda: prefill_forward(c, w, st, ids, chunk_tokens=chunk))
    st = new_state(c, T, dev)
    torch.cuda.reset_peak_memory_stats()
    dt = _sync_time(lambda: prefill_forward(c, w, st, ids, chunk_tokens=chunk))
    peak = torch.cuda.max_memory_allocated() / 2**30
    RESULTS["prefill"][name] = {"seconds": dt, "tok_per_s": T / dt, "warmup_s": warm, "peak_gib": peak}
    log(f"   prompt {name:>18s}: {dt * 1e3:9.1f} ms  {T / dt:9.0f} tok/s  (warm-up {warm:.2f} s, peak {peak:.1f} GiB)")
    st = None   # (freed before the next prompt's states)
    torch.cuda.empty_cache()


def _reset(st) -> None:
    st.pos = 0
    st.conv_state.zero_()
    st.rec_state.zero_()


def graph_speed(c, w, dev, prompts: list[int], tag: str = "") -> None:
    """Prompts that fit a prefill graph bucket (lily.model.prefill_graphs), replayed on a reset state (the
    first call captures); then the full-shape check: a 200-token prompt and a 37-token append through the
    graphs against the eager forward on a state of its own (last-row logits, conv, recurrent and KV state)."""
    graphs = PrefillGraphs(c, w, dev)
    for T in [p for p in prompts if graphs.bucket(p)]:
        ids = bench_ids(T, c.vocab_size, dev)
        st = new_state(c, graphs.bucket(T), dev)
        warm = _sync_time(lambda: prefill_forward(c, w, st, ids, graphs=graphs))
        _reset(st)
        dt = min(_time_reset(lambda: prefill_forward(c, w, st, ids, graphs=graphs), st) for _ in range(7))
        RESULTS["prefill"][f"{T}@graph{tag}"] = {"seconds": dt, "tok_per_s": T / dt, "capture_s": warm,
                                                  "bucket": graphs.bucket(T)}
        log(f"   prompt {T:6d} as a graph (bucket {graphs.bucket(T)}): {dt * 1e3:9.1f} ms  {T / dt:9.0f} tok/s"
            f"  (first call with capture {warm:.2f} s)")
    _graph_check(c, w, dev, graphs, tag)
    # the graphs on a staging state, shared: another state's prompt runs there between the checked one's chunks
    staged = PrefillGraphs(c, w, dev, staging=new_state(c, max(graphs.buckets), dev))
    _graph_check(c, w, dev, staged, f"{tag}, staging state",
                 other=lambda: prefill_forward(c, w, new_state(c, 256, dev), bench_ids(150, c.vocab_size, dev),
                                               graphs=staged))


def _graph_check(c, w, dev, graphs, tag: str, other=None) -> None:
    """A 200-token prompt and a 37-token append through the graphs (captured by a first pass, then replayed;
    other(), if given, between the chunks) against the eager forward on a state of its own."""
    ids = torch.randint(0, c.vocab_size, (237,), device=dev)
    got, want = new_state(c, 256, dev), new_state(c, 256, dev)
    chunks = ((0, 200), (200, 237))
    for s, e in chunks:   # first calls: eager runs that capture the two buckets' graphs
        prefill_forward(c, w, got, ids[s:e], graphs=graphs)
    _reset(got)
    for s, e in chunks:   # replays
        g = prefill_forward(c, w, got, ids[s:e], graphs=graphs)
        r = prefill_forward(c, w, want, ids[s:e])
        check(f"graph prefill logits {s}..{e - 1}{tag}", rel(g, r), 1e-3)
        if other is not None:
            other()
    n = want.pos
    check(f"graph prefill conv state{tag}", rel(got.conv_state.float(), want.conv_state.float()), 1e-6)
    check(f"graph prefill recurrent state{tag}", rel(got.rec_state, want.rec_state), 1e-3)
    check(f"graph prefill K/V rows{tag}", max(rel(got.k_cache[:, :n].float(), want.k_cache[:, :n].float()),
                                        rel(got.v_cache[:, :n].float(), want.v_cache[:, :n].float())), 1e-3)


def _time_reset(fn, st) -> float:
    dt = _sync_time(fn)
    _reset(st)
    return dt


def _profile(c, w, dev, T: int, chunk: int, tag: str = "") -> None:
    """Kernel time by class and the 25 costliest kernels of one T-token prefill (torch.profiler), in RESULTS
    under classes_<T>_ms<tag> and kernels_<T>_ms_count<tag> (4K: classes_4k_ms<tag>)."""
    ids = bench_ids(T, c.vocab_size, dev)
    st = new_state(c, T, dev)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_forward(c, w, st, ids, chunk_tokens=chunk)
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    names: dict[str, list] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not us:
            continue
        cls = next(label for key, label in CLASSES if key in ev.key)
        per[cls] = per.get(cls, 0.0) + us / 1e3
        names[ev.key[:90]] = [round(us / 1e3, 3), ev.count]
    key = ("classes_4k_ms" if T == 4096 else f"classes_{T}_ms") + tag
    kernels = f"kernels_{T}_ms_count{tag}"
    RESULTS[key] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    RESULTS[kernels] = dict(sorted(names.items(), key=lambda kv: -kv[1][0])[:25])
    log(f"   -- prompt {T}{tag}: kernel time by class")
    for cls, ms in RESULTS[key].items():
        log(f"   {cls:34s} {ms:8.2f} ms")
    for name, (ms, n) in list(RESULTS[kernels].items())[:12]:
        log(f"      {ms:8.2f} ms {n:6d}x  {name}")


def env_info() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        info["git_rev"] = os.environ.get("LILY_GIT_REVISION") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="TINY shapes on the CPU interpreter (dry run)")
    ap.add_argument("--long", action="store_true", help="also time a 128K prompt")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,fidelity,tune,tune_dense "
                    "(the dense half of tune),tune_small,gdn,speed")
    ap.add_argument("--gdn-sweep", action="store_true", help="run only the GDN launch sweep (part gdn)")
    ap.add_argument("--gdn-sweep-tokens", default="4096",
                    help="prompt lengths the GDN launch sweep runs at (comma list; e.g. 256,4096: a short "
                         "prompt's 128 prep programs are one partial wave, so its best launch may differ)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--chunk-compare", default="", help="also time a 32K prompt in chunks of these sizes")
    ap.add_argument("--kernels", default="dense,moe,conv,gdn,attn", help="kernel check groups to run")
    ap.add_argument("--prompts", default="256,4096,32768", help="prompt lengths to time (--long adds 131072)")
    ap.add_argument("--ab-set", action="append", default=[], metavar="SETTINGS",
                    help="time the prompts (up to 4K, eager and as graphs) and profile 256 with these module "
                         "settings against the defaults, e.g. 'lily.kernels.moe_wgmma.PERMUTED_K_MAX_BLOCK=128' "
                         "(repeatable; ';' between settings of one variant); only that, after the checks")
    ap.add_argument("--ab-rounds", type=int, default=15,
                    help="with --ab-set: rounds of the interleaved graph replays of every variant (0: none)")
    ap.add_argument("--ab-paired", action="store_true",
                    help="also time 256 and 4K prompts with the grouped MoE's other gate/up tile arrangement")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) if args.skip else set()
    if args.gdn_sweep:
        skip |= {"kernels", "fidelity", "tune", "speed"}
    RESULTS["env"] = env_info()
    log(json.dumps(RESULTS["env"]))
    t0 = time.time()
    if args.tiny:
        dev = torch.device("cpu")
        if "kernels" not in skip:
            kernel_checks(TINY, dev, 70, set(args.kernels.split(",")))
        if "fidelity" not in skip:
            fidelity(TINY, dev, 20, 9, 12)
        if "tune" not in skip:
            tune(dev, tiny=True)
        if "gdn" not in skip:
            gdn_sweep(TINY, dev, 70, tiny=True)
    else:
        dev = torch.device("cuda")
        if "kernels" not in skip:
            kernel_checks(FULL, dev, 333, set(args.kernels.split(",")))
        if "fidelity" not in skip:
            fidelity(with_layers(FULL, 4), dev, 200, 100, 128)
        torch.cuda.empty_cache()
        if "tune" not in skip:
            tune(dev, dense="tune_dense" not in skip)
        if "tune_small" not in skip:
            tune_small(dev)
        if "gdn" not in skip:
            for T in (int(t) for t in args.gdn_sweep_tokens.split(",")):
                gdn_sweep(FULL, dev, T)
        if args.ab_set:
            speed_variants(dev, [int(p) for p in args.prompts.split(",")], args.chunk, args.ab_set, args.ab_rounds)
        elif "speed" not in skip:
            speed(dev, [int(p) for p in args.prompts.split(",")] + ([131072] if args.long else []), args.chunk,
                  [int(ch) for ch in args.chunk_compare.split(",") if ch], args.ab_paired)
    RESULTS["fails"] = FAILS
    RESULTS["wall_s"] = time.time() - t0
    with open(os.path.join(OUT, "prefill-check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    log("\n== summary")
    log(f"checks: {sum(v['ok'] for v in RESULTS['checks'].values())}/{len(RESULTS['checks'])} ok"
        + (f"; FAILED: {', '.join(FAILS)}" if FAILS else ""))
    if RESULTS["fidelity"]:
        f = RESULTS["fidelity"]
        log(f"fidelity ({f['layers']} layers): rel logit err {f['rel_logit_err']:.2e} "
            f"(bf16 spread {f['bf16_ref_spread']:.2e}), top-1 {f['top1_agree_decisive']:.3f}")
    if RESULTS["tune"].get("gdn"):
        g = RESULTS["tune"]["gdn"]
        log(f"gdn (T={g['T']}): {g['chosen']}, {g['chosen_ms_per_layer'] or float('nan'):.3f} ms a layer x{g['layers']}")
    if RESULTS["prefill"]:
        log(f"{'prompt':>8s} {'ms':>10s} {'tok/s':>10s}")
        for T, r in RESULTS["prefill"].items():
            log(f"{T:>8s} {r['seconds'] * 1e3:10.1f} {r['tok_per_s']:10.0f}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
