"""One GPU run that checks and times the fast decode path (scripts/gpu_check.sh calls it).

1. every decode kernel against its plain-torch reference at the real shapes (fresh random inputs,
   outputs poisoned with NaN first);
2. the fast engine against lily.model.reference.ReferenceModel on a full-width 4-layer random model,
   teacher-forced along the fp32 reference's greedy path: max |dlogprob|, top-1 agreement, relative
   logit error, beside the reference's own bf16-vs-fp32 spread; graph-greedy vs step-by-step tokens;
3. decode speed on the full-size random model (40 layers) at several contexts (CUDA graph replays,
   CUDA events), per-kernel-class time and achieved GB/s at 4K, launches per step, GPU memory; with
   --kv-ab, the step on a bf16 and an int8 KV cache (lily.kernels.kv_int8) in alternating rounds.
Writes JSON under $OUT (or ./out) and prints a short table last. `--tiny` runs 1 and 2 on the CPU
interpreter at TINY shapes (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

from lily.config import FULL, TINY, with_layers
from lily.kernels import attention_decode as AD
from lily.kernels import gdn_decode as GD
from lily.kernels import moe_decode as MD
from lily.kernels import pdl
from lily.kernels import quant_gemv as QG
from lily.kernels.embedding import embed, embed_reference
from lily.kernels.greedy import greedy_finish
from lily.kernels.kv_int8 import KV8_PAD, is_kv8, kv8_pack_reference, kv_rows_reference
from lily.quant import QuantTensor
from gpu_compare import rel  # noqa: E402  (scripts/ is on sys.path when a script runs)

RESULTS: dict = {"checks": {}, "fidelity": {}, "decode": {}, "classes": {}}
FAILS: list[str] = []
SKIP: set[str] = set()
PDL_MODES: list[str] = []
CONST_ABS: list[str] = []
KV_AB: list[bool] = []
KV_DTYPE = ["bf16"]


def check(name: str, err: float, tol: float) -> None:
    ok = err == err and err <= tol
    RESULTS["checks"][name] = {"rel_err": err, "tol": tol, "ok": ok}
    print(f"  {'ok ' if ok else 'BAD'} {name:28s} rel err {err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        FAILS.append(name)


def rand_qt(shape, bits, dev, gen, std=None) -> QuantTensor:
    """Random codes and scales; w = s*q + b with mean ~0 and std ~ std (default 1/sqrt(in))."""
    *lead, n, k = shape
    std = std or k ** -0.5
    per = 32 // bits
    words = torch.randint(-2**31, 2**31, (*lead, n, k // per), generator=gen, device=dev, dtype=torch.int64)
    w = words.to(torch.int32).view(torch.uint32) if hasattr(torch, "uint32") else words.to(torch.int32)
    qmax = (1 << bits) - 1
    s = (torch.rand(*lead, n, k // 64, generator=gen, device=dev) + 0.5) * (std / (qmax * 0.29))
    s = s * torch.where(torch.rand(s.shape, generator=gen, device=dev) < 0.5, -1.0, 1.0)
    b = -s * qmax / 2 + torch.randn(s.shape, generator=gen, device=dev) * std * 0.1
    return QuantTensor(w, s.to(torch.bfloat16), b.to(torch.bfloat16), bits)


def poison(*shape, dev, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=dev)


# -- 1. kernels ---------------------------------------------------------------------------------------------

def routing_gap(e: torch.Tensor, ref_e: torch.Tensor, logits: torch.Tensor, n: int) -> float:
    """0.0 if routes e and ref_e pick n distinct experts whose logits agree slot by slot up to near-ties, else 1.0.
    The int32 top-k keys (moe_decode.TOPK_KEY32) count logits within ~2^-15 of each other as tied and take the
    lower index first, where torch.topk or the int64 keys order them exactly: such a pair may swap places."""
    e, ref_e = e[:n].long(), ref_e[:n].long()
    if len(set(e.tolist())) != n:
        return 1.0
    a, b = logits[e].double(), logits[ref_e].double()
    return 0.0 if bool(((a - b).abs() <= 2.0 ** -14 * torch.maximum(a.abs(), b.abs())).all()) else 1.0


def weight_gap(e: torch.Tensor, w: torch.Tensor, ref_e: torch.Tensor, ref_w: torch.Tensor) -> float:
    """The largest relative difference of the routing weights of the experts both routes chose (by expert, so a
    near-tie's swap of places does not count; the weights come from the chosen logits themselves)."""
    mine = dict(zip(e.tolist(), w.tolist()))
    ref = dict(zip(ref_e.tolist(), ref_w.tolist()))
    return max((abs(mine[x] - ref[x]) / max(abs(ref[x]), 1e-30) for x in mine.keys() & ref.keys()), default=1.0)


def check_kernels(c, dev) -> None:
    print("kernels vs plain torch:", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(time.time()))
    H, eps = c.hidden_size, c.rms_norm_eps
    rn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731

    # GDN in-proj: q|k|v|z|b|a stacked, RMSNorm prologue, conv step + SiLU epilogue
    parts = [rand_qt((n, H), 4, dev, gen) for n in (c.linear_conv_dim, c.linear_value_dim,
                                                    c.linear_num_value_heads, c.linear_num_value_heads)]
    lin = QG.prepare_concat(parts)
    h, gain = rn(H), rn(H).abs() + 0.5
    conv_w = rn(c.linear_conv_dim, c.linear_conv_kernel_dim) * 0.5
    conv_state = rn(c.linear_conv_kernel_dim - 1, c.linear_conv_dim).to(torch.bfloat16)
    out = poison(lin.n, dev=dev)
    cs = conv_state.clone()
    ph = QG.perm64_index(H, dev)
    zp = poison(c.linear_value_dim, dev=dev)
    QG.gemv(lin, h[ph], out, norm_gain=gain[ph], eps=eps, conv=(conv_w, cs), perm_x=True, out2=zp,
            out2_rows=(c.linear_conv_dim, c.linear_conv_dim + c.linear_value_dim))
    x = QG.rmsnorm_reference(h, gain, eps)
    m = torch.cat([QG.gemv_reference(p, x) for p in parts])
    y, new_cs = QG.conv_step_reference(m[:c.linear_conv_dim], conv_w, conv_state)
    ref = torch.cat([y, m[c.linear_conv_dim:]])
    # the 4-bit GEMVs' fp16-pair dot (quant_gemv.HALF_DOT) rounds x and its products to fp16: ~4e-4 measured
    g4 = 2e-3 if QG.HALF_DOT else 1e-5
    check("gemv4 gdn_in+norm+conv", rel(out, ref), max(g4, 1e-3))   # the conv state is bf16
    check("conv state shift", rel(cs.float(), new_cs.to(torch.bfloat16).float()), 1e-2)
    check("z out2 (PERM64)", rel(zp, m[c.linear_conv_dim:c.linear_conv_dim + c.linear_value_dim][
        QG.perm64_index(c.linear_value_dim, dev)]), g4)

    # router + shared-expert gate, 8-bit
    parts = [rand_qt((c.num_experts, H), c.router_bits, dev, gen), rand_qt((1, H), c.router_bits, dev, gen)]
    lin = QG.prepare_concat(parts)
    out = poison(lin.n, dev=dev)
    QG.gemv(lin, h, out, norm_gain=gain, eps=eps)
    check("gemv8 router+norm", rel(out, torch.cat([QG.gemv_reference(p, x) for p in parts])), 1e-5)

    # GDN out_proj: gated per-head RMSNorm prologue, residual epilogue
    hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    qt = rand_qt((H, c.linear_value_dim), 4, dev, gen)
    lin = QG.PackedLinear(qt)
    o, z, ng = rn(c.linear_value_dim), rn(c.linear_value_dim), rn(dv).abs() + 0.5
    nb = dv // GD.pick_bv(dv)
    ss = (o.reshape(hv, nb, -1) ** 2).sum(-1)
    res = rn(H)
    out = res.clone()
    pv = QG.perm64_index(c.linear_value_dim, dev)
    QG.gemv(lin, o[pv], out, residual=out, eps=eps, gated_norm=(z[pv], ss, ng, dv), perm_x=True)
    ref = res + QG.gemv_reference(qt, QG.gated_rmsnorm_reference(o, z, ng, dv, eps))
    check("gemv4 out_proj+gnorm+res", rel(out, ref), g4)

    # lm_head + greedy pick
    qt = rand_qt((c.vocab_size, H), 4, dev, gen)
    lin = QG.PackedLinear(qt)
    logits = poison(c.vocab_size, dev=dev)
    npart = QG.gemv_programs(lin)
    pmax, pidx = poison(npart, dev=dev), torch.full((npart,), -1, dtype=torch.int32, device=dev)
    QG.gemv(lin, h[ph], logits, norm_gain=gain[ph], eps=eps, argmax=(pmax, pidx), perm_x=True, pdl_family="lm_head")
    ref = QG.gemv_reference(qt, x)
    check("gemv4 lm_head+norm", rel(logits, ref), 1e-5 if "lm_head" in QG.HALF_DOT_OFF or not QG.HALF_DOT else g4)
    nt, log, step, pos = (torch.full((1,), -1, dtype=torch.int32, device=dev), torch.zeros(8, dtype=torch.int32, device=dev),
                          torch.zeros(1, dtype=torch.int32, device=dev), torch.full((1,), 7, dtype=torch.int32, device=dev))
    greedy_finish(pmax, pidx, c.vocab_size, nt, log, step, pos)
    ok = int(nt) == int(torch.argmax(logits)) and int(log[0]) == int(nt) and int(step) == 1 and int(pos) == 8
    check("greedy pick == argmax", 0.0 if ok else 1.0, 0.0)

    # embedding row
    tok = int(torch.randint(0, c.vocab_size, (1,), generator=gen, device=dev))
    e, ep = poison(H, dev=dev), poison(H, dev=dev)
    embed(lin, torch.tensor([tok], dtype=torch.int32, device=dev), e, ep)
    check("embed row", rel(e, embed_reference(qt, tok)), 1e-6)

    # MoE: experts + shared expert
    E, I, k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
    w = [rand_qt((E, I, H), 4, dev, gen), rand_qt((E, I, H), 4, dev, gen), rand_qt((E, H, I), 4, dev, gen),
         rand_qt((I, H), 4, dev, gen), rand_qt((I, H), 4, dev, gen), rand_qt((H, I), 4, dev, gen)]
    ex = MD.PackedExperts(*w)
    rq = rand_qt((E + 1, H), 8, dev, gen, std=2.0 / H ** 0.5)
    router = QG.PackedLinear(rq)
    sc = MD.MoEScratch(E, k, I, dev)
    sc.act.copy_(poison(k + 1, I, dev=dev))
    sc.logits.copy_(poison(E + 1, dev=dev))
    ph = QG.perm64_index(H, dev)
    h2, h2p = h.clone(), h[ph].clone()
    MD.moe_decode(ex, router, h2, h2p, gain, gain[ph], eps, sc)
    rl = QG.gemv_reference(rq, x)
    check("moe router logits", rel(sc.logits, rl), 1e-5)
    top = torch.topk(sc.logits[:E], k).indices
    check("moe routing == topk", routing_gap(sc.route_e, top, sc.logits, k), 0.0)
    ref = h + MD.moe_reference(x, sc.logits[:E], sc.logits[E], *w, top_k=k)
    # its own output (h2 - h): gate_up and down dot their codes in fp16 pairs with HALF_DOT
    check("moe gate_up+down+shared", rel(h2 - h, ref - h), 4e-3 if QG.HALF_DOT else 1e-5)
    # the top-k's other keys (MD.TOPK_KEY32: int32 or int64; MD.TOPK_PAIRS: two a round) route as the default's
    keep_e, keep_w = sc.route_e.clone(), sc.route_w.clone()
    keep = MD.TOPK_KEY32, MD.TOPK_PAIRS
    for key32, pairs in ((False, False), (True, False), (True, True)):
        MD.TOPK_KEY32, MD.TOPK_PAIRS = key32, pairs
        sc.route_e.fill_(-1)
        MD.moe_gate_up(ex, h[ph].clone(), gain[ph], eps, sc)
        what = f"moe top-k keys {'int32' if key32 else 'int64'}{' pairs' if pairs else ''} == default's"
        check(f"{what} (experts)", routing_gap(sc.route_e, keep_e, sc.logits, k + 1), 0.0)
        check(f"{what} (weights)", weight_gap(sc.route_e, sc.route_w, keep_e, keep_w), 0.0)
    MD.TOPK_KEY32, MD.TOPK_PAIRS = keep

    # GDN core
    hk, dk = c.linear_num_key_heads, c.linear_key_head_dim
    proj = rn(c.linear_conv_dim + c.linear_value_dim + 2 * hv)
    state = rn(hv, dk, dv) * 0.1
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen, device=dev) * 15 + 1), rn(hv) * 0.1
    st = state.clone()
    scratch = GD.GDNScratch(hv, dv, dev)
    o = poison(c.linear_value_dim, dev=dev)
    GD.gdn_decode(proj, st, a_log, dt_bias, ng, eps, scratch, o, hk)
    o = o[QG.perm64_index(c.linear_value_dim, dev)]
    zz = proj[c.linear_conv_dim:c.linear_conv_dim + c.linear_value_dim]
    bb = proj[c.linear_conv_dim + c.linear_value_dim:][:hv]
    aa = proj[c.linear_conv_dim + c.linear_value_dim:][hv:]
    ref_o, ref_s = GD.gdn_decode_reference(proj[:c.linear_conv_dim], zz, bb, aa, state, a_log, dt_bias, hk, ng, eps)
    check("gdn state update", rel(st, ref_s), 1e-5)
    check("gdn out + gated norm", rel(o, ref_o), 1e-5)
    check("gdn head counters reset", float(scratch.count.abs().sum()), 0.0)

    # attention at a random position
    hq, hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    L = 64 if dev.type == "cpu" else 3001
    p0 = int(torch.randint(L // 2, L, (1,), generator=gen, device=dev))
    kc = (rn(L, hkv, D)).to(torch.bfloat16)
    vc = (rn(L, hkv, D)).to(torch.bfloat16)
    proj = rn(c.attn_q_dim + 2 * c.attn_kv_dim)
    qn, kn = rn(D).abs() + 0.5, rn(D).abs() + 0.5
    inv = AD.rope_inv_freq(c.rotary_dim, c.rope_theta, dev)
    scratch = AD.AttentionScratch(hq, D, 4 if dev.type == "cpu" else 64, dev)
    o = poison(hq * D, dev=dev)
    kc2, vc2 = kc.clone(), vc.clone()
    AD.attention_decode(proj, kc2, vc2, torch.tensor([p0], dtype=torch.int32, device=dev), qn, kn, inv, eps, hq,
                        scratch, o)
    qg = proj[:c.attn_q_dim].reshape(hq, 2 * D)
    q = AD.rmsnorm_rope_reference(qg[:, :D], qn, p0, inv, eps)
    kr = AD.rmsnorm_rope_reference(proj[c.attn_q_dim:c.attn_q_dim + c.attn_kv_dim].reshape(hkv, D), kn, p0, inv, eps)
    vr = proj[c.attn_q_dim + c.attn_kv_dim:].reshape(hkv, D)
    check("attn K append (norm+rope)", rel(kc2[p0].float(), kr.to(torch.bfloat16).float()), 1e-2)
    check("attn V append", rel(vc2[p0].float(), vr.to(torch.bfloat16).float()), 1e-2)
    ref = AD.attention_decode_reference(q, qg[:, D:], kc2[:p0 + 1], vc2[:p0 + 1])
    check("attn split-K + combine", rel(o[QG.perm64_index(hq * D, dev)], ref), 2e-2)

    # the same on an int8 cache (rows of different magnitudes; rows past p0 poisoned: NaN scales)
    kc8 = kv8_pack_reference(rn(L, hkv, D) * (torch.rand(L, hkv, 1, generator=gen, device=dev) * 4))
    vc8 = kv8_pack_reference(rn(L, hkv, D) * (torch.rand(L, hkv, 1, generator=gen, device=dev) * 4))
    kc8[p0:], vc8[p0:] = 0xFF, 0xFF
    o = poison(hq * D, dev=dev)
    AD.attention_decode(proj, kc8, vc8, torch.tensor([p0], dtype=torch.int32, device=dev), qn, kn, inv, eps, hq,
                        scratch, o)
    check("attn int8 K append", rel(kv_rows_reference(kc8[p0]), kr), 1.5e-2)
    check("attn int8 V append", rel(kv_rows_reference(vc8[p0]), vr), 1.5e-2)
    check("attn int8 rows past pos", float((kc8[p0 + 1:] != 0xFF).sum()), 0.0)
    ref = AD.attention_decode_reference(q, qg[:, D:], kv_rows_reference(kc8[:p0 + 1]), kv_rows_reference(vc8[:p0 + 1]))
    check("attn int8 split-K + combine", rel(o[QG.perm64_index(hq * D, dev)], ref), 4e-3)
    check_prefill_attention_int8(c, dev, gen)


def check_prefill_attention_int8(c, dev, gen) -> None:
    """The prefill's KV write and flash attention on an int8 cache at full head shapes: a chunk after a prefix."""
    from lily.kernels.flash_attention import (attention_reference, flash_attention_prefill, norm_rope_reference,
                                              rope_inv_freq, write_kv_prefill)
    from lily.kernels.kv_int8 import kv_cache_zeros
    hq, hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    p0, T = (20, 13) if dev.type == "cpu" else (1500, 700)
    inv = rope_inv_freq(c.rotary_dim, c.rope_theta, dev)
    kc, vc = kv_cache_zeros((p0 + T + 64,), hkv, D, "int8", dev), kv_cache_zeros((p0 + T + 64,), hkv, D, "int8", dev)
    kc[:], vc[:] = 0xFF, 0xFF
    kn, qn = (1 + 0.1 * torch.randn(D, generator=gen, device=dev)), (1 + 0.1 * torch.randn(D, generator=gen, device=dev))
    for pos, n in ((0, p0), (p0, T)):
        k = torch.randn(n, hkv * D, generator=gen, device=dev).to(torch.bfloat16)
        v = (torch.randn(n, hkv * D, generator=gen, device=dev) * 3).to(torch.bfloat16)
        qg = torch.randn(n, hq * 2 * D, generator=gen, device=dev).to(torch.bfloat16)
        write_kv_prefill(k, v, kn, inv, kc, vc, pos)
        o = flash_attention_prefill(qg, qn, inv, kc, vc, pos, hq)
    keys = norm_rope_reference(k.reshape(T, hkv, D), kn, torch.arange(p0, p0 + T, device=dev), inv)   # the last chunk's
    check("prefill int8 K rows", rel(kv_rows_reference(kc[p0:p0 + T]), keys), 1.5e-2)
    check("prefill int8 V rows", rel(kv_rows_reference(vc[p0:p0 + T]), v.float().reshape(T, hkv, D)), 1.5e-2)
    ref = attention_reference(qg, qn, inv, kv_rows_reference(kc[:p0 + T]), kv_rows_reference(vc[:p0 + T]), p0, hq)
    check("prefill int8 attention", rel(o.float(), ref), 2e-2 if dev.type == "cpu" else 8e-3)   # (bf16 casts truncate on the CPU)


# -- 2. fidelity --------------------------------------------------------------------------------------------

def check_fidelity(c, dev, n_prompt: int, n_steps: int, n_greedy: int = 8, seed: int | None = None) -> None:
    """The fast path against the fp32 and bf16 references on a random model (seed: its weights', default drawn
    from the clock)."""
    from lily.model.fast import FastModel
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    print(f"fast vs reference ({c.num_hidden_layers} layers, hidden {c.hidden_size}):", flush=True)
    seed = int(time.time()) % 1000 if seed is None else seed
    RESULTS["fidelity_seed"] = seed
    w = random_weights(c, seed=seed, device=dev)
    ref32 = ReferenceModel(c, w, device=dev, dtype=torch.float32)
    ref16 = ReferenceModel(c, w, device=dev, dtype=torch.bfloat16)
    fast = FastModel(c, w, device=dev)
    fast_d = FastModel(c, w, device=dev, prefill_mode="decode")
    ids = [(i * 2654435761 % 2**32) % c.vocab_size for i in range(1, n_prompt + 1)]
    s32, s16 = ref32.new_state(), ref16.new_state()
    sf, sd = fast.new_state(max_seq=n_prompt + n_steps + 16), fast_d.new_state(max_seq=n_prompt + n_steps + 16)
    l32 = ref32.forward(ids, s32, logits_for="last")[0]
    l16 = ref16.forward(ids, s16, logits_for="last")[0]
    lf = fast.prefill(ids, sf)
    ld = fast_d.prefill(ids, sd)
    diag = {"prefill_logits_rel_err_vs_ref32": rel(lf, l32), "decode_path_prefill_rel_err": rel(ld, l32)}
    n = len(ids)
    for name, x, y in (("k_cache", sf.k_cache[:, :n], sd.k_cache[:, :n]), ("v_cache", sf.v_cache[:, :n], sd.v_cache[:, :n]),
                       ("conv_state", sf.conv_state, sd.conv_state), ("rec_state", sf.rec_state, sd.rec_state)):
        diag[f"state_{name}_rel_diff"] = rel(x.float(), y.float())
    diag["pos"] = [sf.pos, sd.pos, int(sf.pos_dev), int(sd.pos_dev)]
    if c.full_attention_layers:
        a0 = c.full_attention_layers[0]
        for nm, st_ in (("kernels", sf), ("decode", sd)):
            diag[f"{nm}_k_vs_ref32"] = rel(st_.k_cache[0, :n].float(), s32.keys[a0][:n].float())
            diag[f"{nm}_v_vs_ref32"] = rel(st_.v_cache[0, :n].float(), s32.values[a0][:n].float())
        per_pos = [rel(sf.v_cache[0, t].float(), s32.values[a0][t].float()) for t in range(n)]
        diag["kernels_v_vs_ref32_worst_positions"] = sorted(range(n), key=lambda t: -per_pos[t])[:4]
        diag["kernels_v_vs_ref32_worst"] = max(per_pos)
    RESULTS["prefill_handoff"] = diag
    print("  prefill kernels vs decode path:", {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in diag.items()},
          flush=True)
    rows = []
    for _ in range(n_steps):
        rows.append((l32.float(), l16.float(), lf.float(), ld.float()))
        t = int(torch.argmax(l32))
        l32 = ref32.forward([t], s32, logits_for="last")[0]
        l16 = ref16.forward([t], s16, logits_for="last")[0]
        lf = fast.decode(t, sf)
        ld = fast_d.decode(t, sd)
    lp = lambda x: torch.log_softmax(x.double(), -1)  # noqa: E731
    out = {}
    for name, j in (("fast", 2), ("fast_decode_only", 3), ("ref_bf16", 1)):
        dl = max(float((lp(r[j]) - lp(r[0])).abs().max()) for r in rows)
        top1 = sum(int(torch.argmax(r[j]) == torch.argmax(r[0])) for r in rows) / len(rows)
        # agreement where the fp32 reference's top-2 margin is clear of the error
        clear = [r for r in rows if float(torch.topk(r[0], 2).values.diff().abs()) > 0.05 * float(r[0].std())]
        top1c = sum(int(torch.argmax(r[j]) == torch.argmax(r[0])) for r in clear) / max(1, len(clear))
        re_ = max(rel(r[j], r[0]) for r in rows)
        out[name] = {"max_abs_dlogprob": dl, "top1_agreement": top1, "top1_agreement_clear_margin": top1c,
                     "max_rel_logit_err": re_, "positions": len(rows)}
        print(f"  {name:16s} max|dlogprob| {dl:.3e}  top-1 {top1:.3f} (clear margin {top1c:.3f})  "
              f"rel logit err {re_:.2e}", flush=True)
    RESULTS["fidelity"] = out
    for name in ("fast", "fast_decode_only"):
        if not (out[name]["max_rel_logit_err"] <= max(1e-2, 2 * out["ref_bf16"]["max_rel_logit_err"])
                and out[name]["top1_agreement_clear_margin"] == 1.0):
            FAILS.append(f"fidelity {name}")
    # device-side greedy (graph) == host argmax stepping from the same state
    a, b = sf.clone(), sf.clone()
    t0 = int(torch.argmax(lf))
    g = fast.decode_greedy(t0, a, n_greedy)
    s, t = [], t0
    for _ in range(n_greedy):
        t = int(torch.argmax(fast.decode(t, b)))
        s.append(t)
    check("graph greedy == stepwise", 0.0 if g == s else 1.0, 0.0)
    if a.pos != b.pos:
        FAILS.append("greedy pos")
    # the engine's run-ahead steps (launch_greedy: each fed the last one's pick on the device, read back by
    # an event) == the same greedy chain
    d = sf.clone()
    step, chained = fast.launch_greedy(d, t0), []
    for i in range(n_greedy):
        nxt = fast.launch_greedy(d, after=step) if i + 1 < n_greedy else None
        token, finite = step.result()
        chained.append(token if finite else -1)
        step = nxt
    check("run-ahead greedy steps == graph greedy", 0.0 if chained == g else 1.0, 0.0)
    del ref32, ref16, fast, fast_d, w


# -- 3. speed -----------------------------------------------------------------------------------------------

def time_replays(fn, n: int, rounds: int = 3) -> list[float]:
    out = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / 1e3 / n)
    return out


def fill_state(st, pos: int, gen) -> None:
    for cache in (st.k_cache, st.v_cache):
        if is_kv8(cache):   # random rows quantized, a layer at a time
            for layer in cache:
                layer.copy_(kv8_pack_reference(torch.randn(*layer.shape[:-1], layer.shape[-1] - KV8_PAD, generator=gen,
                                                           device=layer.device)))
        else:
            cache.normal_(generator=gen)
    st.conv_state.normal_(generator=gen)
    st.rec_state.normal_(generator=gen).mul_(0.05)
    st.pos = pos
    st.pos_dev.fill_(pos)


def profile_step(st, results: dict) -> None:
    """Kernel time inside the step's graph (CUPTI) against the replay's wall time: the difference is the
    gaps between kernels (launch latency, ramp-up and drain), which fusing launches would remove."""
    from torch.profiler import ProfilerActivity, profile
    n = 8
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            st.graph.replay()
        torch.cuda.synchronize()
    per: dict = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time > 0:
            d = per.setdefault(ev.name, [0, 0.0])
            d[0] += 1
            d[1] += ev.device_time
    kernel_us = sum(v[1] for v in per.values()) / n
    wall_us = min(time_replays(st.graph.replay, 32)) * 1e6
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:12]
    results["profile_4096"] = {"kernel_us_per_step": kernel_us, "wall_us_per_step": wall_us,
                               "gap_us_per_step": wall_us - kernel_us,
                               "kernels": {k: {"calls_per_step": v[0] / n, "us_per_step": v[1] / n} for k, v in top}}
    print(f"  profile @4096: kernels {kernel_us:.0f} us of {wall_us:.0f} us a step (gaps {wall_us - kernel_us:.0f} us)",
          flush=True)
    for k, v in top:
        print(f"    {k[:60]:60s} x{v[0] / n:5.1f} {v[1] / n:8.1f} us", flush=True)


def copy_bandwidth(dev, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy, bytes read + written: the yardstick for the GEMVs' GB/s."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = min(time_replays(lambda: dst.copy_(src), 10))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e9


def bench(contexts, dev) -> None:
    from lily.model.fast import FastModel
    from lily.synthetic import random_weights

    t0 = time.time()
    w = random_weights(FULL, seed=1, device=dev)
    t1 = time.time()
    fast = FastModel(FULL, w, device=dev, kv_dtype=KV_DTYPE[0])
    del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t2 = time.time()
    print(f"full model: random weights {t1 - t0:.1f} s, FastModel {t2 - t1:.1f} s, "
          f"weights on GPU {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
    RESULTS["launches_per_step"] = fast.launches_per_step()
    RESULTS["copy_GBps"] = copy_bandwidth(dev)
    print(f"device copy bandwidth (read + write, 1 GiB): {RESULTS['copy_GBps']:.0f} GB/s", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for ctx in contexts:
        st = fast.new_state(max_seq=ctx + 256)
        fill_state(st, ctx, gen)
        fast.next_tok.fill_(123)
        torch.cuda.reset_peak_memory_stats()
        fast._run_step(st)  # captures the graph
        for _ in range(4):
            fast._run_step(st)
        torch.cuda.synchronize()
        per = time_replays(st.graph.replay, 64)
        st.pos += 64 * 3
        t = min(per)
        spread = (max(per) - min(per)) / min(per)
        plan = fast.step_plan(st)
        step_bytes = sum(b for _, _, b, _ in plan)
        row = {"ms_per_token": t * 1e3, "tok_per_s": 1 / t, "round_spread": spread, "step_bytes": step_bytes,
               "achieved_GBps": step_bytes / t / 1e9, "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30,
               "state_GiB": st.nbytes() / 2**30}
        RESULTS["decode"][str(ctx)] = row
        print(f"  ctx {ctx:6d}: {1 / t:7.1f} tok/s ({t * 1e3:.3f} ms, spread {spread * 100:.1f} %), "
              f"{step_bytes / t / 1e9:.0f} GB/s, peak {row['peak_mem_GiB']:.2f} GiB", flush=True)
        if ctx == 4096:
            profile_step(st, RESULTS)
            classes: dict = {}
            for name, n, b, fn in plan:
                cl = classes.setdefault(name, {"launches": 0, "bytes": 0, "fns": []})
                cl["launches"] += n
                cl["bytes"] += b
                cl["fns"].append(fn)
            for name, cl in classes.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for fn in cl["fns"]:
                        fn()
                for _ in range(3):
                    g.replay()
                tc = min(time_replays(g.replay, 20))
                RESULTS["classes"][name] = {"launches": cl["launches"], "bytes": cl["bytes"], "us": tc * 1e6,
                                            "GBps": cl["bytes"] / tc / 1e9,
                                            "us_per_launch": tc * 1e6 / cl["launches"]}
                RESULTS["classes"][name]["of_copy_bandwidth"] = cl["bytes"] / tc / 1e9 / RESULTS["copy_GBps"]
                print(f"    {name:12s} {cl['launches']:4d} launches {tc * 1e6:8.1f} us  "
                      f"{cl['bytes'] / 1e6:8.1f} MB  {cl['bytes'] / tc / 1e9:7.0f} GB/s "
                      f"({RESULTS['classes'][name]['of_copy_bandwidth'] * 100:.0f} % of copy)", flush=True)
        del st
        torch.cuda.empty_cache()
    # asked for (--pdl-modes): 4K and 128K; else only the default against none at 4K, as a check run always had
    pdl_ab(fast, PDL_MODES or ["0", pdl.describe()],
           [c for c in ((4096, 131072) if PDL_MODES else (4096,)) if c in contexts], gen)
    if "half_dot_ab" not in SKIP:
        half_dot_ab(fast, [c for c in (4096, 131072) if c in contexts], gen)
    if "moe_before_ab" not in SKIP:
        moe_before_ab(fast, [c for c in (4096, 131072) if c in contexts], gen)
    if "topk_key_ab" not in SKIP:
        topk_key_ab(fast, [c for c in (4096, 131072) if c in contexts], gen)
    if KV_AB:
        kv_dtype_ab(fast, contexts, gen)
    for spec in CONST_ABS:
        const_ab(fast, spec, [c for c in (4096, 131072) if c in contexts], gen)


def pdl_ab(fast, modes: list[str], contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step with each set of programmatic kernel families (lily.kernels.pdl, LILY_PDL's spellings)."""
    RESULTS["pdl"] = {"supported": pdl.supported(), "default": pdl.describe(), "rounds": rounds, "rows": {}}
    if not pdl.supported():
        return
    keep = pdl.MODE

    def apply(mode: str) -> str:
        pdl.set_mode(mode)
        return pdl.describe()
    try:
        RESULTS["pdl"]["rows"] = mode_ab(fast, apply, modes, contexts, gen, rounds, "pdl")
    finally:
        pdl.MODE = keep


# the half dot's A/B also runs it with these call sites kept on the fp32 dot (comma lists of call sites): the
# lm_head (the MoE kernels on the fp32 dot: moe_before_ab, with their block before). The GDN out-projection alone
# on it: benchmarks/results/decode-h200-20261202-half-dot-off.json (587.3 against 588.8 tok/s).
HALF_DOT_OFF_MODES = ["lm_head"]
# the MoE and lm_head as they were before they took the pair dot (28e3986): fp32 dots (and with them down's
# blocks of 2 rows, four programs an SM: moe_decode.DOWN_BLOCK_FP32)
MOE_BEFORE = "gate_up,down,lm_head"


def half_dot_ab(fast, contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step with the 4-bit GEMVs' codes dot in fp32 (LILY_HALF_DOT=0), in fp16 pairs everywhere (=1,
    LILY_HALF_DOT_OFF empty), and in fp16 pairs but for the call sites of each HALF_DOT_OFF_MODES entry."""
    keep = QG.HALF_DOT, QG.HALF_DOT_OFF

    def apply(mode: str) -> str:
        QG.HALF_DOT = mode != "0"
        QG.HALF_DOT_OFF = frozenset(mode.split(",")) if mode not in ("0", "1") else frozenset()
        return f"LILY_HALF_DOT={int(QG.HALF_DOT)}" + (f" LILY_HALF_DOT_OFF={mode}" if QG.HALF_DOT_OFF else "")
    try:
        RESULTS["half_dot"] = {"default": keep[0], "default_off": sorted(keep[1]), "rounds": rounds,
                               "rows": mode_ab(fast, apply, ["0", "1", *HALF_DOT_OFF_MODES], contexts, gen, rounds,
                                               "half dot")}
    finally:
        QG.HALF_DOT, QG.HALF_DOT_OFF = keep



def moe_before_ab(fast, contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step as it is against MOE_BEFORE (the MoE's and lm_head's dots and down's block before)."""
    keep = QG.HALF_DOT_OFF

    def apply(mode: str) -> str:
        if mode == "before":
            QG.HALF_DOT_OFF = QG.parse_half_dot_off(MOE_BEFORE)
            return f"LILY_HALF_DOT_OFF={MOE_BEFORE}, down block {MD.DOWN_BLOCK_FP32}"
        QG.HALF_DOT_OFF = keep
        return f"default (LILY_HALF_DOT_OFF={','.join(sorted(keep))}, down block {MD.DOWN_BLOCK})"
    try:
        RESULTS["moe_before"] = {"before": {"half_dot_off": MOE_BEFORE}, "rounds": rounds,
                                 "rows": mode_ab(fast, apply, ["before", "default"], contexts, gen, rounds, "moe")}
    finally:
        QG.HALF_DOT_OFF = keep


def topk_key_ab(fast, contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step with the MoE routing's top-k on int64 keys, int32 keys (MD.TOPK_KEY32, LILY_TOPK_KEY), and
    int32 keys two a round (MD.TOPK_PAIRS, LILY_TOPK_PAIRS)."""
    keep = MD.TOPK_KEY32, MD.TOPK_PAIRS

    def apply(mode: str) -> str:
        MD.TOPK_KEY32, MD.TOPK_PAIRS = mode != "64", mode == "32 pairs"
        return f"LILY_TOPK_KEY={mode[:2]} LILY_TOPK_PAIRS={int(MD.TOPK_PAIRS)}"
    try:
        RESULTS["topk_key"] = {"default": f"key32 {keep[0]}, pairs {keep[1]}", "rounds": rounds,
                               "rows": mode_ab(fast, apply, ["64", "32", "32 pairs"], contexts, gen, rounds,
                                               "top-k keys")}
    finally:
        MD.TOPK_KEY32, MD.TOPK_PAIRS = keep


def kv_dtype_ab(fast, contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step on a bf16 and on an int8 KV cache (each state made with the model's kv_dtype), at every
    context, in alternating rounds."""
    keep = fast.kv_dtype

    def apply(mode: str) -> str:
        fast.kv_dtype = mode
        return f"kv cache {mode}"
    try:
        RESULTS["kv_dtype_ab"] = {"rounds": rounds,
                                  "rows": mode_ab(fast, apply, ["bf16", "int8"], contexts, gen, rounds, "kv")}
    finally:
        fast.kv_dtype = keep


def parse_const_ab(spec: str):
    """'moe_decode.GATE_UP_BLOCK=(4, 4);(4, 6)' -> (the module under lily.kernels or lily.model, the constant's name,
    its values as Python literals), checked against the module: the constant must exist."""
    import ast
    import importlib
    target, _, values = spec.partition("=")
    mod_name, _, const = target.strip().rpartition(".")
    for pkg in ("lily.kernels", "lily.model"):
        try:
            mod = importlib.import_module(f"{pkg}.{mod_name}")
            break
        except ModuleNotFoundError:
            mod = None
    if mod is None or not hasattr(mod, const):
        raise SystemExit(f"--const-ab {spec!r}: no constant {const!r} in lily.kernels / lily.model .{mod_name}")
    vals = [ast.literal_eval(v.strip()) for v in values.split(";") if v.strip()]
    if len(vals) < 2:
        raise SystemExit(f"--const-ab {spec!r}: give two or more ';'-separated values")
    return mod, const, vals


def const_ab(fast, spec: str, contexts: list[int], gen, rounds: int = 9) -> None:
    """The decode step with a module constant the launchers read at each launch (a block shape, a switch) set to
    each of the values of `spec` (parse_const_ab) in turn, alternating rounds; the constant is put back after."""
    mod, const, vals = parse_const_ab(spec)
    keep = getattr(mod, const)

    def apply(mode: str) -> str:
        setattr(mod, const, vals[int(mode)])
        return f"{const}={vals[int(mode)]!r}"
    try:
        RESULTS.setdefault("const_ab", {})[spec] = {
            "module": mod.__name__, "default": repr(keep), "rounds": rounds,
            "rows": mode_ab(fast, apply, [str(i) for i in range(len(vals))], contexts, gen, rounds, const)}
    finally:
        setattr(mod, const, keep)


def mode_ab(fast, apply, modes: list[str], contexts: list[int], gen, rounds: int, what: str) -> dict:
    """The decode step under each mode (apply(mode) switches it and returns its label), one graph each against
    its own state at each context, replayed in alternating rounds (64 steps a round, the median of `rounds`),
    so drift between them cannot pass for a difference."""
    out = {}
    try:
        for ctx in contexts:
            graphs = {}
            for mode in modes:
                label = apply(mode)
                fast._warm = False                 # compile this mode's variants before capturing
                st = fast.new_state(max_seq=ctx + 64 * (rounds + 2))
                fill_state(st, ctx, gen)
                fast.next_tok.fill_(123)
                fast._run_step(st)
                graphs[label] = st
            torch.cuda.synchronize()
            times: dict = {m: [] for m in graphs}
            for _ in range(rounds):
                for m, st in graphs.items():
                    times[m].append(min(time_replays(st.graph.replay, 64, rounds=1)))
            row = {m: {"tok_per_s": 1 / sorted(t)[len(t) // 2], "rounds_tok_per_s": [1 / x for x in t]}
                   for m, t in times.items()}
            out[str(ctx)] = row
            for m, r in row.items():
                print(f"  {what} {m:45s} ctx {ctx:6d}: {r['tok_per_s']:7.1f} tok/s (median of {rounds})", flush=True)
            del graphs, st
            torch.cuda.empty_cache()
    finally:
        fast._warm = False
    return out


# persistent GEMV: (rows per block, programs per SM, warps)
GEMV_CONFIGS = {2048: [(8, 4, 4), (4, 4, 4), (8, 2, 4), (8, 8, 4), (16, 4, 8), (4, 8, 4), (2, 8, 4), (8, 4, 8),
                       (16, 2, 4), (4, 6, 4)],
                4096: [(4, 4, 8), (2, 4, 4), (4, 4, 4), (4, 8, 8), (2, 8, 8), (8, 4, 8), (2, 8, 4), (4, 8, 4),
                       (8, 2, 4), (1, 8, 4)]}
# (router, gate_up, down (rows, programs an SM), warps of the expert kernels): the default (moe_decode's
# GATE_UP_BLOCK / DOWN_BLOCK, router (2, 4)) first, the one before it second, then neighbours of the default
MOE_CONFIGS = [((2, 4), (4, 4), (8, 2), 4), ((2, 4), (4, 4), (2, 4), 4),
               ((2, 4), (4, 4), (8, 3), 4), ((2, 4), (4, 4), (8, 1), 4), ((2, 4), (4, 4), (4, 2), 4),
               ((2, 4), (4, 4), (16, 2), 4), ((2, 4), (4, 4), (16, 1), 4), ((2, 4), (4, 4), (32, 1), 4),
               ((2, 4), (4, 4), (16, 1), 8), ((2, 4), (4, 4), (8, 2), 8),
               ((2, 4), (8, 4), (8, 2), 4), ((2, 4), (8, 2), (8, 2), 4), ((2, 4), (16, 2), (8, 2), 4),
               ((2, 4), (2, 4), (8, 2), 4), ((2, 4), (4, 3), (8, 2), 4), ((2, 2), (4, 4), (8, 2), 4)]


def tune(dev) -> None:
    """Time GEMV tilings (rows per program, groups per tile, warps) on the decode shapes, over 8 rotating
    weight copies (so L2 cannot hold them), 8 launches a graph replay; and the MoE kernels' row blocks."""
    c = FULL
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    H = c.hidden_size
    shapes = {"gdn_in": (c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads, H, 4),
              "attn_qkv": (c.attn_q_dim + 2 * c.attn_kv_dim, H, 4),
              "out_proj": (H, c.linear_value_dim, 4), "lm_head": (c.vocab_size, H, 4)}
    RESULTS["tune"] = {}
    x, gain = torch.randn(16384, device=dev), torch.rand(16384, device=dev) + 0.5
    for name, (n, k, bits) in shapes.items():
        if "tune_gemv" in SKIP:
            break
        copies = 1 if name == "lm_head" else 8
        lins = [QG.PackedLinear(rand_qt((n, k), bits, dev, gen)) for _ in range(copies)]
        out = torch.empty(n, device=dev)
        rows = {}
        for cfg in GEMV_CONFIGS[k]:
            bn, bg, nw = cfg
            try:
                run = lambda: [QG.gemv(l, x, out, norm_gain=gain, block=(bn, bg), num_warps=nw,  # noqa
                                       perm_x=bits == 4) for l in lins]
                run()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                g.replay()
                t = min(time_replays(g.replay, 10)) / copies
                rows[str(cfg)] = {"us": t * 1e6, "GBps": lins[0].nbytes / t / 1e9}
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is just skipped
                rows[str(cfg)] = {"error": str(e)[:200]}
        RESULTS["tune"][name] = rows
        best = min([(r["us"], cfg) for cfg, r in rows.items() if "us" in r] or [(float("nan"), "none")])
        print(f"  tune {name:9s} {n}x{k} {bits}b: " + "  ".join(
            f"{cfg}:{r['GBps']:.0f}" if "us" in r else f"{cfg}:ERR" for cfg, r in rows.items())
            + f"  best {best[1]} {best[0]:.1f} us", flush=True)
        del lins
    # MoE: router, gate_up and down rows per program, warps of the expert kernels
    E, I, k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
    exs = [MD.PackedExperts(rand_qt((E, I, H), 4, dev, gen), rand_qt((E, I, H), 4, dev, gen),
                            rand_qt((E, H, I), 4, dev, gen), rand_qt((I, H), 4, dev, gen),
                            rand_qt((I, H), 4, dev, gen), rand_qt((H, I), 4, dev, gen)) for _ in range(2)]
    routers = [QG.PackedLinear(rand_qt((E + 1, H), 8, dev, gen, std=2.0 / H ** 0.5)) for _ in range(8)]
    sc = MD.MoEScratch(E, k, I, dev)
    hs = [torch.randn(H, device=dev) for _ in range(8)]
    hps = [h_.clone() for h_ in hs]
    per_expert = (exs[0].gate.nbytes + exs[0].up.nbytes + exs[0].down.nbytes) / (E + 1) * (k + 1)
    RESULTS["tune"]["moe"] = {}
    for cfg in MOE_CONFIGS:
        rbn, gu_bn, dn_bn, nw = cfg
        try:
            def run():
                for i in range(len(routers)):
                    MD.moe_decode(exs[i % 2], routers[i], hs[i], hps[i], gain[:H], gain[:H], 1e-6, sc,
                                  num_warps=nw, blocks=(rbn, gu_bn, dn_bn))
            run()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            g.replay()
            t = min(time_replays(g.replay, 10)) / len(routers)
            RESULTS["tune"]["moe"][str(cfg)] = {"us": t * 1e6, "GBps": per_expert / t / 1e9}
            print(f"  tune moe router BN {rbn} gate_up BN {gu_bn} down BN {dn_bn} warps {nw}: {t * 1e6:.1f} us "
                  f"{per_expert / t / 1e9:.0f} GB/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  tune moe {cfg}: {str(e)[:200]}")


def git_rev() -> str:
    for name in ("LILY_GIT_REVISION", "LILY_GIT_REV"):   # (the bench's name, and this script's older one)
        if os.environ.get(name):
            return os.environ[name]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter dry run at TINY shapes")
    ap.add_argument("--contexts", default="256,4096,32768,131072")
    ap.add_argument("--skip", default="", help="comma list of kernels,fidelity,bench,tune (tune_gemv: its GEMV part), "
                                               "half_dot_ab, moe_before_ab, topk_key_ab to skip")
    ap.add_argument("--pdl-modes", default="",
                    help="';'-separated LILY_PDL values to compare in alternating rounds at 4K and 128K "
                         "(default: none against the current one)")
    ap.add_argument("--const-ab", action="append", default=[],
                    help="MODULE.CONSTANT=V1;V2;... (a module of lily.kernels or lily.model, Python literals): the "
                         "decode step with each value in alternating rounds at 4K and 128K; repeatable")
    ap.add_argument("--kv-dtype", choices=("bf16", "int8"), default="bf16",
                    help="the KV cache of the decode timings and their A/Bs (--const-ab, --pdl-modes)")
    ap.add_argument("--kv-ab", action="store_true",
                    help="the decode step on a bf16 and an int8 KV cache in alternating rounds at every context")
    ap.add_argument("--fidelity-seed", type=int, default=None,
                    help="the fidelity section's random model (default: drawn from the clock), to compare two "
                         "settings on the same model")
    args = ap.parse_args()
    for spec in args.const_ab:
        parse_const_ab(spec)              # a typo fails here, before the GPU work
    CONST_ABS.extend(args.const_ab)
    KV_AB.extend([True] if args.kv_ab else [])
    KV_DTYPE[0] = args.kv_dtype
    PDL_MODES.extend(m for m in args.pdl_modes.split(";") if m.strip())
    skip = set(filter(None, args.skip.split(",")))
    SKIP.update(skip)
    dev = torch.device("cpu" if args.tiny else "cuda")
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                      "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                      "git_rev": git_rev(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(RESULTS["env"], flush=True)
    c = TINY if args.tiny else FULL
    def section(name, fn, *a):
        if name in skip:
            return
        t = time.time()
        try:
            fn(*a)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others' results
            import traceback
            traceback.print_exc()
            FAILS.append(f"{name} crashed")
        RESULTS[f"t_{name}_s"] = time.time() - t
        print(f"[{name}: {time.time() - t:.1f} s]", flush=True)

    section("kernels", check_kernels, c, dev)
    section("fidelity", check_fidelity, TINY if args.tiny else with_layers(FULL, 4), dev,
            *((3, 2, 2) if args.tiny else (24, 32, 8)), args.fidelity_seed)
    if not args.tiny:
        section("bench", bench, [int(x) for x in args.contexts.split(",") if x], dev)
        section("tune", tune, dev)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    RESULTS["fails"] = FAILS
    with open(os.path.join(out_dir, "decode-h200.json" if not args.tiny else "decode-tiny.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print("\n== summary ==")
    print(f"checks: {sum(v['ok'] for v in RESULTS['checks'].values())}/{len(RESULTS['checks'])} ok; fails: {FAILS or 'none'}")
    if RESULTS["fidelity"]:
        f_ = RESULTS["fidelity"]
        print(f"fidelity: fast dlogprob {f_['fast']['max_abs_dlogprob']:.3e} top1 {f_['fast']['top1_agreement']:.3f} | "
              f"bf16 ref dlogprob {f_['ref_bf16']['max_abs_dlogprob']:.3e} top1 {f_['ref_bf16']['top1_agreement']:.3f}")
    if RESULTS["decode"]:
        print(f"launches/step {RESULTS['launches_per_step']}")
        print(f"{'ctx':>7} {'tok/s':>8} {'ms':>7} {'GB/s':>6} {'peakGiB':>8}")
        for ctx, r in RESULTS["decode"].items():
            print(f"{ctx:>7} {r['tok_per_s']:8.1f} {r['ms_per_token']:7.3f} {r['achieved_GBps']:6.0f} {r['peak_mem_GiB']:8.2f}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    raise SystemExit(main())
