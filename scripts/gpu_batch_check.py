"""One GPU run that checks and times the batched decode step (lily.model.fast_batch over the slot pool).

1. each batched kernel against its plain-torch reference at the real shapes: rows in scattered slots at
   ragged positions, padding rows past n_valid (fresh random inputs, outputs poisoned first), and the
   skinny 4-bit GEMMs at every bucket's row count (1 ... 64);
2. fidelity on a full-width 4-layer random model: 8 sequences at ragged contexts decoded together, teacher-
   forced along the fp32 reference's tokens: relative logit error, max |dlogprob|, top-1 agreement against
   the fp32 ReferenceModel, beside the batch-1 step's own numbers on the same histories;
3. on the full-size random model (40 layers, built once):
   a. solo vs batched: 16 distinct prompts of ragged lengths, greedy, each alone (the batch-1 step) and all
      together (the batched step): where the tokens part, and the solo run's top-2 margin there; the
      batched logits' distance from the solo ones while the histories agree;
   b. speed: every slot filled to a context, then each batch-size bucket's CUDA graph (1, 2, 4, ..., 64)
      replayed back to back (CUDA events): ms a step, aggregate and per-stream tok/s, the batch-1 graph
      beside it, the host's own cost a step (decode_batch end to end), GPU memory.
Writes $OUT/batch-h200.json (or ./out) and prints a short table last. `--tiny` runs all of it on the CPU
interpreter at the tiny shapes (graphs replayed eagerly, wall-clock timing): a dry run of the script itself.

    python3 scripts/gpu_batch_check.py [--contexts 256,4096] [--max-batch 64] [--skip kernels,fidelity,solo,speed]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout's lily

import torch

from lily.config import FULL, TINY, with_layers
from lily.kernels import attention_decode_batch as AB
from lily.kernels import gdn_decode_batch as GB
from lily.kernels import quant_gemv
from lily.kernels.attention_decode import rope_inv_freq
from lily.kernels.embedding import embed_reference, embed_rows
from lily.kernels.gdn_chunked import gated_rmsnorm_reference
from lily.kernels.moe_decode import MoERowsScratch, PackedExperts, moe_rows
from lily.kernels.moe_union import UnionScratch, moe_union
from lily.kernels.moe_grouped_gemm import gate_up_splits, moe_grouped, moe_grouped_reference
from lily.kernels.moe_route_batch import moe_route_rows, moe_route_rows_reference
from lily.kernels.q4_gemm import q_gemm, q_gemm_reference, rmsnorm_rows
from lily.kernels.quant_gemv import PackedLinear, rmsnorm_reference
from lily.kernels.quant_gemv_rows import MAX_ROWS as GEMV_MAX_ROWS, gemv_rows
from lily.quant import QuantTensor
from gpu_compare import rel  # noqa: E402  (scripts/ is on sys.path when a script runs)
from gpu_decode_check import (FAILS, RESULTS, check, copy_bandwidth, fill_state, rand_qt,  # noqa: E402
                              time_replays)

RESULTS.setdefault("speed", {})   # (one results dict and check() with gpu_decode_check.py; written here)
I32 = torch.int32


def scattered_rows(n_slots: int, n_valid: int, pad: int, gen, dev):
    perm = torch.randperm(n_slots, generator=gen, device="cpu")[:n_valid]
    slots = torch.cat([perm, torch.zeros(pad, dtype=perm.dtype)]).to(dev, I32)
    return slots, torch.tensor([n_valid], dtype=I32, device=dev)


# -- 1. kernels ---------------------------------------------------------------------------------------------

def check_kernels(c, dev, n_slots: int, max_seq: int) -> None:
    print("batched kernels vs plain torch:", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(time.time()))
    cpu_gen = torch.Generator().manual_seed(int(time.time()))
    rn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    eps, H = c.rms_norm_eps, c.hidden_size
    n_valid, pad = max(1, n_slots - 3), 3

    table = rand_qt((c.vocab_size, H), 4, dev, gen)
    tokens = torch.randint(0, c.vocab_size, (n_valid,), generator=gen, device=dev, dtype=I32)
    out = embed_rows(PackedLinear(table), tokens)
    check("embed_rows", rel(out, torch.stack([embed_reference(table, int(t)) for t in tokens])), 1e-6)

    # GDN: conv step + gated delta step, each row on its own slot
    hk, hv, dk, dv, K = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, c.linear_conv_kernel_dim)
    C, vd = c.linear_conv_dim, c.linear_value_dim
    slots, nv = scattered_rows(n_slots, n_valid, pad, cpu_gen, dev)
    live = slots[:n_valid].tolist()
    conv = rn(n_slots, K - 1, C).to(torch.bfloat16)
    conv_before = conv.clone()
    conv_w = rn(C, K) * 0.5
    proj = rn(n_valid + pad, C + vd + 2 * hv)
    m = proj.clone()
    GB.conv_step_rows(proj, conv_w, conv, slots, nv)
    want_y, want_c = GB.conv_step_rows_reference(m[:n_valid, :C], conv_w, [conv_before[s].float() for s in live])
    check("conv_step_rows y", rel(proj[:n_valid, :C], want_y), 1e-5)
    check("conv_step_rows state", max(rel(conv[s].float(), w) for s, w in zip(live, want_c)), 1e-2)
    rec = rn(n_slots, hv, dk, dv) * 0.05
    rec_before = rec.clone()
    a_log, dt_bias = torch.log(torch.rand(hv, generator=gen, device=dev) * 15 + 1), rn(hv) * 0.1
    o = torch.full((n_valid + pad, hv, dv), float("nan"), device=dev)
    GB.gdn_step_rows(proj, rec, a_log, dt_bias, slots, nv, hk, out=o)
    want_o, want_s = GB.gdn_step_rows_reference(proj[:n_valid, :C], proj[:n_valid, C + vd:C + vd + hv],
                                                proj[:n_valid, C + vd + hv:], [rec_before[s] for s in live],
                                                a_log, dt_bias, hk)
    check("gdn_step_rows out", rel(o[:n_valid], want_o), 1e-4)
    # the state update with the gated RMSNorm in its launch, twice (its counters back at zero), from the same state
    gain = rn(dv).abs() + 0.5
    want_x = gated_rmsnorm_reference(want_o.reshape(n_valid, hv, dv), proj[:n_valid, C:C + vd], gain, c.rms_norm_eps)
    norm_scratch = GB.StepNormScratch(n_valid + pad, hv, dv, dev)
    for call in range(2):
        rec2 = rec_before.clone()
        x = GB.gdn_step_norm_rows(proj, rec2, a_log, dt_bias, slots, nv, hk, gain, c.rms_norm_eps, norm_scratch)
        check(f"gdn_step_norm_rows x (call {call})", rel(x[:n_valid].float(), want_x), 1e-2)
        check(f"gdn_step_norm_rows state (call {call})", max(rel(rec2[s], w) for s, w in zip(live, want_s)), 1e-4)
        check(f"gdn_step_norm_rows counters reset (call {call})", float(norm_scratch.count.abs().sum()), 0)
    check("gdn_step_rows state", max(rel(rec[s], w) for s, w in zip(live, want_s)), 1e-4)
    untouched = [s for s in range(n_slots) if s not in live]
    check("gdn rows: other slots untouched", 0.0 if torch.equal(rec[untouched], rec_before[untouched]) else 1.0, 0)
    # a bf16 recurrent state (--recurrent-state-dtype bf16): read exactly, updated in fp32, stored rounded once
    rec16 = rec_before.to(torch.bfloat16)
    from16 = [rec16[s].float() for s in live]
    o16 = torch.full((n_valid + pad, hv, dv), float("nan"), device=dev)
    GB.gdn_step_rows(proj, rec16, a_log, dt_bias, slots, nv, hk, out=o16)
    want_o16, want_s16 = GB.gdn_step_rows_reference(proj[:n_valid, :C], proj[:n_valid, C + vd:C + vd + hv],
                                                    proj[:n_valid, C + vd + hv:], from16, a_log, dt_bias, hk)
    check("gdn_step_rows out, bf16 state", rel(o16[:n_valid], want_o16), 1e-4)
    check("gdn_step_rows state, bf16 (one rounding)", max(rel(rec16[s].float(), w) for s, w in zip(live, want_s16)),
          8e-3)

    # attention: each row at its own (ragged) position in its own slot
    hq, hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    kc = rn(n_slots, max_seq, hkv, D).to(torch.bfloat16)
    vc = rn(n_slots, max_seq, hkv, D).to(torch.bfloat16)
    pos = torch.randint(0, max_seq, (n_slots,), generator=gen, device=dev, dtype=I32)
    pos[slots[0]] = 0
    pos[slots[1]] = max_seq - 1
    proj = rn(n_valid + pad, hq * 2 * D + 2 * hkv * D)
    qn, kn = rn(D).abs() + 0.5, rn(D).abs() + 0.5
    inv = rope_inv_freq(c.rotary_dim, c.rope_theta, dev)
    out = AB.attention_decode_rows(proj, kc, vc, pos, slots, nv, qn, kn, inv, eps, hq)
    positions = [int(pos[s]) for s in live]
    want, k_new, _ = AB.attention_decode_rows_reference(proj[:n_valid], [kc[s] for s in live], [vc[s] for s in live],
                                                        positions, qn, kn, inv, eps, hq)
    check("attention_decode_rows (ragged)", rel(out[:n_valid], want), 2e-2)
    check("attention rows: K appended", max(rel(kc[s, p].float(), k_new[i]) for i, (s, p) in
                                            enumerate(zip(live, positions))), 1e-2)

    # MoE: routing + plan, then the grouped expert GEMMs over the stacked experts (shared expert last)
    E, k, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    gate, up = rand_qt((E + 1, I, H), 4, dev, gen), rand_qt((E + 1, I, H), 4, dev, gen)
    down = rand_qt((E + 1, H, I), 4, dev, gen)
    for nv_moe in sorted({min(2, n_valid), n_valid}):   # 2 rows: the gate/up GEMMs split K
        logits = rn(nv_moe + pad, E + 1) * 2
        nvt = torch.tensor([nv_moe], dtype=I32, device=dev)
        plan, w = moe_route_rows(logits, nvt, k, c.norm_topk_prob)
        ids, want_w = moe_route_rows_reference(logits[:nv_moe], k, c.norm_topk_prob)
        check(f"moe_route_rows weights ({nv_moe} rows)", rel(w.view(-1, k + 1)[:nv_moe], want_w), 1e-5)
        x = rn(nv_moe + pad, H).to(torch.bfloat16)
        got = torch.zeros(nv_moe + pad, H, device=dev)
        moe_grouped(x, plan, w, gate, up, down, out=got)
        check(f"moe_grouped over the plan ({nv_moe} rows, {gate_up_splits(plan, I, H, dev)} K splits)",
              rel(got[:nv_moe], moe_grouped_reference(x[:nv_moe], ids, want_w, gate, up, down)), 2e-2)

    # the batch-1 MoE kernels a row (fast_batch.MOE_PATH "rows"): RMSNorm, routing and experts of each valid row
    ex = PackedExperts(*(QuantTensor(t.weight[:E], t.scales[:E], t.biases[:E], 4) for t in (gate, up, down)),
                       *(QuantTensor(t.weight[E], t.scales[E], t.biases[E], 4) for t in (gate, up, down)))
    h0, gain = rn(n_valid + pad, H), rn(H).abs() + 0.5
    logits = rn(n_valid + pad, E + 1) * 2
    sc = MoERowsScratch(E, k, I, n_valid + pad, dev)
    got = h0.clone()
    moe_rows(ex, got, gain, eps, logits, nv, sc, c.norm_topk_prob)

    def moe_delta_reference(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts chosen, the plain-torch MoE) of h0's first `rows` rows, routed from their logits: the MoE is
        what moe_rows adds to them."""
        ids, want_w = moe_route_rows_reference(logits[:rows], k, c.norm_topk_prob)
        xr = h0[:rows] * torch.rsqrt((h0[:rows] ** 2).mean(-1, keepdim=True) + eps) * gain
        return ids, moe_grouped_reference(xr, ids, want_w, gate, up, down)
    # their own outputs (got - h0): the experts dot their codes in fp16 pairs with quant_gemv.HALF_DOT
    moe_tol = 4e-3 if quant_gemv.HALF_DOT else 1e-4
    ids, want_delta = moe_delta_reference(n_valid)
    check("moe_rows (batch-1 MoE kernels a row)", rel(got[:n_valid] - h0[:n_valid], want_delta), moe_tol)
    for small in (2, 4):   # the small buckets' blocks (moe_decode.ROWS_BLOCKS or the defaults), all rows valid
        got_s = h0[:small].clone()
        moe_rows(ex, got_s, gain, eps, logits[:small].contiguous(), torch.tensor([small], dtype=I32, device=dev), sc,
                 c.norm_topk_prob)
        check(f"moe_rows at {small} rows", rel(got_s - h0[:small], moe_delta_reference(small)[1]), moe_tol)
    check("moe_rows: padding rows untouched", 0.0 if torch.equal(got[n_valid:], h0[n_valid:]) else 1.0, 0)
    # the union of the rows' experts, each read once (fast_batch.MOE_PATH "union"), from the same inputs
    usc = UnionScratch(E, k, I, n_valid + pad, 1, dev)
    usc.act.fill_(float("nan"))
    got = h0.clone()
    moe_union(ex, got, rmsnorm_rows(h0, gain, eps, perm64_copy=True)[1], logits, nv, usc, 0, c.norm_topk_prob)
    check("moe_union (each chosen expert once)", rel(got[:n_valid] - h0[:n_valid], want_delta), moe_tol)
    check("moe_union: padding rows untouched", 0.0 if torch.equal(got[n_valid:], h0[n_valid:]) else 1.0, 0)
    check("moe_union: live experts = distinct chosen", abs(int(usc.counters[0, E + 1]) - int(ids.unique().numel())), 0)

    # the skinny GEMMs at each bucket's row count (the stacked GDN in-projection, the 8-bit router, the
    # out-projection)
    w_in = rand_qt((C + vd + 2 * hv, H), 4, dev, gen)
    w_r = rand_qt((E + 1, H), 8, dev, gen)
    w_out = rand_qt((H, vd), 4, dev, gen)
    rows = 1
    while rows <= n_slots:
        xr = rn(rows, H)
        check(f"q_gemm 4-bit M={rows}", rel(q_gemm(xr, w_in, out_dtype=torch.float32),
                                            q_gemm_reference(xr.to(torch.bfloat16), w_in)), 1e-2)
        check(f"q_gemm 8-bit M={rows}", rel(q_gemm(xr, w_r, out_dtype=torch.float32),
                                            q_gemm_reference(xr.to(torch.bfloat16), w_r)), 1e-2)
        # the GDN out-projection's shape added into the residual (on Hopper split over K on the dense mode)
        xo, res = rn(rows, vd).to(torch.bfloat16), rn(rows, H)
        check(f"q_gemm 4-bit out-projection += M={rows}",
              rel(q_gemm(xo, w_out, out=res.clone(), accumulate=True) - res, q_gemm_reference(xo, w_out)), 1e-2)
        rows *= 2
    # a split GEMM summed by each tile's last split (q4_gemm.SPLIT_K_LAST_SUMS) against the sum kernel, bit for
    # bit, twice (the arrival counts back at zero), added into a residual: the GDN out-projection's shape on the
    # Triton split-K path (kept off the Hopper dense mode for this)
    import lily.kernels.q4_gemm as QG
    xo, res = rn(min(8, n_slots), vd).to(torch.bfloat16), rn(min(8, n_slots), H)
    keep = QG.SPLIT_K_LAST_SUMS, QG.WGMMA_DENSE_SKINNY_SPLIT
    QG.WGMMA_DENSE_SKINNY_SPLIT = False
    outs = []
    for last in (False, True, True):
        QG.SPLIT_K_LAST_SUMS = last
        outs.append(q_gemm(xo, w_out, out=res.clone(), accumulate=True))
    QG.SPLIT_K_LAST_SUMS, QG.WGMMA_DENSE_SKINNY_SPLIT = keep
    check("q_gemm split-K summed by the last split == sum kernel",
          0.0 if torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0]) else 1.0, 0)

    # the GEMV over a few rows (fast_batch's dense path up to GEMV_MAX_ROWS rows) at the step's shapes: the norm
    # in its prologue (in-projection, router, lm_head), the residual added in place (out-projection, bf16 input)
    w_head = rand_qt((c.vocab_size, H), 4, dev, gen)
    gain_h = torch.rand(H, generator=gen, device=dev) + 0.5
    half_tol = 1e-2 if quant_gemv.HALF_DOT else 1e-4
    for rows in range(1, GEMV_MAX_ROWS + 1):
        hr = rn(rows, H) * (1 + 3 * torch.rand(rows, 1, generator=gen, device=dev))
        xr = rmsnorm_reference(hr, gain_h, eps)
        for name, w, tol in (("in-projection", w_in, half_tol), ("router 8-bit", w_r, 1e-4),
                             ("lm_head", w_head, half_tol)):
            out = torch.full((rows, w.shape[0]), float("nan"), device=dev)
            gemv_rows(PackedLinear(w), hr, out, norm_gain=gain_h, eps=eps)
            check(f"gemv_rows {name} M={rows}", rel(out, xr @ w.dequantize(torch.float32).T), tol)
        xo, res = rn(rows, vd).to(torch.bfloat16), rn(rows, H)
        out = res.clone()
        gemv_rows(PackedLinear(w_out), xo, out, accumulate=True)
        check(f"gemv_rows out-projection += M={rows}", rel(out - res, xo.float() @ w_out.dequantize(torch.float32).T),
              half_tol)
    del w_head


# -- 2. fidelity ------------------------------------------------------------------------------------------

def check_fidelity(c, dev, n_seq: int, steps: int, max_prompt: int, tol: float = 5e-3, label: str = "batched") -> None:
    from lily.engine.fast_backend import FastBackend
    from lily.model.reference import ReferenceModel
    from lily.synthetic import random_weights

    print(f"batched step vs fp32 reference ({c.num_hidden_layers} layers, hidden {c.hidden_size}):", flush=True)
    w = random_weights(c, seed=int(time.time()) % 1000, device=dev)
    ref = ReferenceModel(c, w, device=dev)
    fast = FastBackend(c, w, device=dev, max_seq=max_prompt + steps + 2, max_batch=n_seq)
    del w
    gen = torch.Generator().manual_seed(int(time.time()))
    lengths = torch.randint(1, max_prompt, (n_seq,), generator=gen).tolist()
    states = [fast.new_state() for _ in range(n_seq)]
    alone = [fast.model.new_state(max_prompt + steps + 2) for _ in range(n_seq)]
    refs = [ref.new_state() for _ in range(n_seq)]
    toks = []
    for n, st, a, rs in zip(lengths, states, alone, refs):
        prompt = torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
        fast.prefill(prompt, st)
        fast.prefill(prompt, a)
        toks.append(int(ref.forward(prompt, rs, logits_for="last")[0].argmax()))
    stats = {label: [], "batch1": []}
    for _ in range(steps):
        got = fast.decode_batch(toks, states)
        one = torch.stack([fast.decode(t, s) for t, s in zip(toks, alone)])
        want = torch.stack([ref.forward([t], rs, logits_for="last")[0] for t, rs in zip(toks, refs)])
        for name, x in ((label, got), ("batch1", one)):
            for i in range(n_seq):
                dl = float((torch.log_softmax(x[i].double(), -1) - torch.log_softmax(want[i].double(), -1)).abs().max())
                stats[name].append((rel(x[i], want[i]), dl, int(x[i].argmax()) == int(want[i].argmax())))
        toks = [int(r.argmax()) for r in want]
    for name, rows in stats.items():
        r = {"rel_logit_err": sum(a for a, _, _ in rows) / len(rows), "max_abs_dlogprob": max(b for _, b, _ in rows),
             "top1_agreement": sum(t for _, _, t in rows) / len(rows), "rows": len(rows), "contexts": lengths}
        RESULTS["fidelity"][name if name != "batch1" or label == "batched" else f"batch1 ({label})"] = r
        print(f"  {name:8s} rel logit err {r['rel_logit_err']:.2e}  max|dlogprob| {r['max_abs_dlogprob']:.3e}  "
              f"top-1 {r['top1_agreement']:.3f} ({r['rows']} rows)", flush=True)
    check(f"fidelity: {label} rel logit err", RESULTS["fidelity"][label]["rel_logit_err"], tol)
    del ref, fast
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# -- 3. the full-size model: solo vs batched, speed --------------------------------------------------------

def build_full(c, dev, max_seq: int, max_batch: int, kv_dtype: str = "bf16"):
    """The fast backend on a random model of config c with max_batch slots of max_seq tokens and a kv_dtype KV
    cache. On the CPU (--tiny) the graph path runs too, its graphs replayed eagerly."""
    from lily.engine.fast_backend import FastBackend
    from lily.synthetic import random_weights

    t0 = time.time()
    w = random_weights(c, seed=1, device=dev)
    backend = FastBackend(c, w, device=dev, max_seq=max_seq, max_batch=max_batch, use_graph=True, kv_dtype=kv_dtype)
    del w
    if dev.type != "cuda":
        eager = lambda step: type("Replay", (), {"replay": staticmethod(step)})()  # noqa: E731
        backend.model._record = eager
        backend.batch._record = eager
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    RESULTS["build_s"] = time.time() - t0
    print(f"model ({c.num_hidden_layers} layers) + {backend.pool.n_slots} slots of {backend.max_seq}: "
          f"{RESULTS['build_s']:.1f} s" + (f", GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
                                             if dev.type == "cuda" else ""), flush=True)
    return backend


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_solo_vs_batched(backend, n_seq: int, steps: int, max_prompt: int) -> None:
    """Greedy tokens of n_seq distinct prompts, each alone (the batch-1 step: what a lone request runs) and all
    together (the batched step). Where they part, the solo logits' top-2 margin says how near a tie it was;
    while the histories agree, the batched logits' relative distance from the solo ones is the step's error."""
    c, dev = backend.config, backend.device
    n_seq = min(n_seq, backend.pool.n_slots)
    seed = int(time.time())
    print(f"solo vs batched greedy ({n_seq} sequences, {steps} tokens each, seed {seed}):", flush=True)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_prompt // 8), max_prompt + 1, (n_seq,), generator=gen).tolist()
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def top2(x):
        v = torch.topk(x.float(), 2).values
        return float(v[0] - v[1])

    solo = []   # per sequence: tokens, logits of each step (the one that chose the token), margins
    for p in prompts:
        st = backend.new_state()
        logits = [backend.prefill(p, st).float().clone()]
        toks = [int(logits[0].argmax())]
        for _ in range(steps - 1):
            logits.append(backend.decode(toks[-1], st).float().clone())
            toks.append(int(logits[-1].argmax()))
        backend.release_state(st)
        solo.append((toks, torch.stack(logits)))
    states = [backend.new_state() for _ in prompts]
    toks = [[int(backend.prefill(p, st).argmax())] for p, st in zip(prompts, states)]
    agree = [True] * n_seq
    dists, parted = [], []
    for t in range(1, steps):
        out = backend.decode_batch([x[-1] for x in toks], states)
        for i in range(n_seq):
            toks[i].append(int(out[i].argmax()))
            if not agree[i]:
                continue
            want = solo[i][1][t]
            dists.append(rel(out[i].float(), want))
            if toks[i][t] != solo[i][0][t]:
                agree[i] = False
                parted.append({"seq": i, "step": t, "solo_margin": top2(want), "batched_margin": top2(out[i])})
    for st in states:
        backend.release_state(st)
    # the same batch run ahead (the engine's greedy batches): each step queued, its inputs the previous step's
    # picks on the device, before the previous one is read; the same kernels and rows, so the same tokens
    states = [backend.new_state() for _ in prompts]
    firsts = [int(backend.prefill(p, st).argmax()) for p, st in zip(prompts, states)]
    step = backend.launch_batch_greedy(states, firsts)
    ahead = [[t] for t in firsts]
    for t in range(1, steps):
        nxt = backend.launch_batch_greedy(states, after=(step, list(range(n_seq)))) if t + 1 < steps else None
        for i, tok in enumerate(step.result()[0]):
            ahead[i].append(tok)
        step = nxt
    for st in states:
        backend.release_state(st)
    check("batched run ahead: tokens of the batched steps", float(sum(a != b for a, b in zip(ahead, toks))), 0)
    first = [i for i in range(n_seq) if toks[i][0] != solo[i][0][0]]   # (the same prefill: never)
    dists.sort()
    r = {"seed": seed, "sequences": n_seq, "steps": steps, "prompt_lengths": lengths, "parted": parted,
         "same_tokens": sum(a for a in agree), "rel_logit_dist_mean": sum(dists) / len(dists),
         "rel_logit_dist_p90": dists[int(0.9 * (len(dists) - 1))], "rel_logit_dist_max": dists[-1],
         "compared_steps": len(dists), "first_token_differs": first}
    RESULTS["solo_vs_batched"] = r
    print(f"  {r['same_tokens']}/{n_seq} sequences identical over {steps} tokens; parted: "
          + (", ".join(f"seq {d['seq']} at {d['step']} (solo top-2 margin {d['solo_margin']:.3f})" for d in parted)
             or "none"), flush=True)
    print(f"  batched vs solo logits while in step ({len(dists)} steps): rel dist mean {r['rel_logit_dist_mean']:.2e}, "
          f"p90 {r['rel_logit_dist_p90']:.2e}, max {r['rel_logit_dist_max']:.2e}", flush=True)
    check("solo vs batched: same prefill", float(len(first)), 0)
    # (the mean: a rare step where bf16 rounding flips a near-tied expert choice costs more, and is in the max)
    check("solo vs batched: rel logit dist", r["rel_logit_dist_mean"], 2e-2)


def timed(fn, n: int, dev) -> float:
    """Seconds a call: the best of 3 rounds of n calls back to back (CUDA events; on the CPU one round, by
    the wall clock)."""
    if dev.type == "cuda":
        return min(time_replays(fn, n))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def time_buckets(backend, ctx: int, buckets: list[int], gen, replays: int) -> dict:
    """ms a step of each bucket at context ctx: the batch-1 graph for 1 row, the bucket's graph above."""
    pool, batch, dev = backend.pool, backend.batch, backend.device
    rows_out = {}
    for rows in buckets:
        pool.pos.fill_(ctx)
        toks = torch.randint(0, backend.config.vocab_size, (rows,), generator=gen, device=dev).tolist()
        if rows == 1:  # the lone request: slot 0's batch-1 graph
            backend.model.next_tok.fill_(toks[0])
            t = timed(pool.states[0].graph.replay, replays, dev)
        else:
            batch.load_inputs(toks, list(range(rows)))
            t = timed(batch.graph(rows).replay, replays, dev)
        rows_out[rows] = {"ms_per_step": t * 1e3, "aggregate_tok_s": rows / t, "per_stream_tok_s": 1 / t}
        print(f"  ctx {ctx:6d} rows {rows:3d}: {t * 1e3:7.3f} ms a step, {rows / t:8.0f} tok/s in all, "
              f"{1 / t:6.0f} per stream", flush=True)
    return rows_out


# kernel name prefix -> class, for the per-class profile of the batched step
STEP_CLASSES = [("moe_union_route", "MoE routing (union)"), ("moe_union_gate_up", "MoE gate_up (union)"),
                ("moe_union_down", "MoE down (union)"), ("_q_gemm_kernel", "skinny 4-bit GEMM"),
                ("_split_k_sum", "split-K sums"),
                ("_moe_gate_up", "MoE gate_up"), ("_gate_up_sum", "MoE gate_up split sums"), ("_moe_down", "MoE down"),
                ("_combine_slots", "MoE combine"), ("moe_route", "MoE routing"),
                ("moe_gate_up_kernel", "MoE gate_up (moe_rows)"), ("moe_down_kernel", "MoE down (moe_rows)"),
                ("_moe_wgmma_kernel", "dense 4-bit GEMM (wgmma)"),
                ("q_gemv_rows", "GEMV over the rows"), ("attn_", "attention"),
                ("gdn_step", "GDN step"), ("conv_step", "conv step"), ("gated_rmsnorm", "gated norm"),
                ("rmsnorm", "norms"), ("embed", "embedding"),
                ("", "other")]


def alternate_settings(backend, ctx: int, buckets: list[int], gen, replays: int, module, settings: dict,
                       profile_rows: tuple = (), rounds: int = 2) -> dict:
    """The buckets timed under each labelled setting of module's attributes ({label: {name: value}}), the
    settings in turn, `rounds` times over, graphs captured again each time; the first round of each also
    profiled at profile_rows (into RESULTS["classes"]). The last setting stays. Returns {label: [timings]}."""
    out: dict = {}
    for _ in range(rounds):
        for label, values in settings.items():
            for name, v in values.items():
                setattr(module, name, v)
            backend.batch.graphs.clear()
            print(f"{module.__name__} {values} ({label}, ctx {ctx}):", flush=True)
            out.setdefault(label, []).append(time_buckets(backend, ctx, buckets, gen, replays))
            if len(out[label]) == 1:
                for rows in [r for r in profile_rows if r in buckets]:
                    RESULTS["classes"][f"{rows} rows, {label}"] = profile_step(backend, rows, ctx, gen)
    backend.batch.graphs.clear()
    return out


def alternate_rec_dtype(backend, ctx: int, buckets: list[int], gen, replays: int, rounds: int = 2) -> dict:
    """The buckets on the backend's slots (fp32 recurrent state) and on as many slots whose state is bf16, in
    turn, `rounds` times over; each pool keeps its own graphs, the bf16 one profiled at 8 and 32 rows. The
    backend's own slots are back in place after. Returns {label: [timings]}."""
    from lily.model.fast_batch import BatchedDecode
    from lily.model.slots import SlotPool

    pool, batch = backend.pool, backend.batch
    p16 = SlotPool(backend.config, pool.n_slots, pool.max_seq, backend.device, backend.model.kv_dtype, "bf16")
    b16 = BatchedDecode(backend.model, p16)
    if "_record" in vars(batch):   # (--tiny: build_full's eager stand-in for graphs)
        b16._record = batch._record
    pools = {"fp32 state": (pool, batch), "bf16 state": (p16, b16)}
    for st in p16.states:
        fill_state(st, ctx, gen)
    backend.prepare_state(p16.states[0], prefill=False)
    out: dict = {}
    try:
        for _ in range(rounds):
            for label, slots_and_step in pools.items():
                backend._pool, backend._batch = slots_and_step
                print(f"slots with a {label} (ctx {ctx}):", flush=True)
                out.setdefault(label, []).append(time_buckets(backend, ctx, buckets, gen, replays))
        for rows in [r for r in (8, 32) if r in buckets]:
            RESULTS["classes"][f"{rows} rows, bf16 state"] = profile_step(backend, rows, ctx, gen)
    finally:
        backend._pool, backend._batch = pool, batch
    RESULTS["slots_bf16_state_GiB"] = p16.nbytes() / 2**30
    return out


def profile_step(backend, rows: int, ctx: int, gen) -> dict:
    """GPU ms of each kernel class in one eager batched step of `rows` rows (the graph replays the same
    launches), the classes sorted by time."""
    from torch.profiler import ProfilerActivity, profile

    pool, batch, dev = backend.pool, backend.batch, backend.device
    pool.pos.fill_(ctx)
    toks = torch.randint(0, backend.config.vocab_size, (rows,), generator=gen, device=dev).tolist()
    batch.load_inputs(toks, list(range(rows)))
    batch._step(rows)
    sync(dev)
    cuda = dev.type == "cuda"   # (on the CPU, --tiny: the torch operations' CPU time, to run the code)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        batch._step(rows)
        sync(dev)
    classes: dict = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if cuda else ev.self_cpu_time_total
        if (cuda and ev.device_type.name != "CUDA") or us <= 0:
            continue
        name = next(label for prefix, label in STEP_CLASSES if prefix in ev.key)
        ms, n = classes.get(name, (0.0, 0))
        classes[name] = (ms + us / 1e3, n + ev.count)
    out = {k: {"ms": round(v[0], 4), "launches": v[1]} for k, v in sorted(classes.items(), key=lambda kv: -kv[1][0])}
    total = sum(v["ms"] for v in out.values())
    print(f"  step of {rows} rows at ctx {ctx}: {total:.3f} ms of kernels: " +
          ", ".join(f"{k} {v['ms']:.3f} ({v['launches']})" for k, v in out.items()), flush=True)
    return out


# launch tiles of the batched step's skinny GEMMs, swept by --sweep-tiles (the first of each list is the default)
FEW_PAIRS_CANDIDATES = [(64, 4, 3, 64, 4, 3), (32, 4, 3, 32, 4, 3), (128, 4, 3, 128, 4, 3), (64, 2, 3, 64, 2, 3),
                        (64, 4, 5, 64, 4, 5), (128, 8, 3, 128, 8, 3), (32, 2, 4, 32, 2, 4)]
SKINNY_CANDIDATES = [(16, 64, 4, 4), (16, 32, 4, 4), (16, 128, 4, 4), (16, 64, 2, 4), (16, 64, 4, 6), (16, 128, 8, 4)]
MID_CANDIDATES = [(64, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4)]
# the 8-bit router's own (q4_gemm.SKINNY_TILES_8BIT, MID_TILES_8BIT, SPLIT_K_MIN_GROUPS_8BIT), swept by --sweep-tiles router
SKINNY_8BIT_CANDIDATES = [(16, 64, 4, 4), (16, 32, 4, 4), (16, 16, 4, 4), (16, 32, 2, 4), (16, 128, 4, 4)]
MID_8BIT_CANDIDATES = [(64, 128, 4, 4), (32, 64, 4, 4), (32, 32, 4, 4), (16, 32, 4, 4), (64, 64, 4, 4), (16, 64, 4, 4)]
MIN_GROUPS_8BIT_CANDIDATES = [4, 2, 1]
# moe_union (fast_batch.MOE_PATH "union"): gate_up's and down's (rows a block, rows a unit, programs an SM, warps)
UNION_GATE_UP_CANDIDATES = [(4, 64, 4, 4), (4, 128, 4, 4), (4, 32, 4, 4), (8, 64, 2, 8), (2, 64, 4, 4), (4, 64, 2, 4)]
UNION_DOWN_CANDIDATES = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 4), (8, 256, 4, 4), (32, 256, 2, 8)]
# moe_rows (fast_batch.MOE_PATH "rows"): gate_up's and down's (rows, programs an SM), gate_up's units requested ahead
ROWS_GATE_UP_CANDIDATES = [(8, 4), (4, 4), (4, 2), (8, 2), (2, 8), (4, 3)]
ROWS_DOWN_CANDIDATES = [(8, 2), (2, 4), (4, 4), (8, 4), (1, 8), (2, 2), (2, 3)]
ROWS_AHEAD_CANDIDATES = [1, 2]


def sweep_step_tiles(backend, ctx: int, buckets: list[int], gen, replays: int, moe_only: bool = False,
                     router_only: bool = False) -> dict:
    """ms a step per bucket for each candidate of the MoE's launches (the grouped GEMMs' few-pairs tiles,
    moe_rows' blocks and prefetch depth, moe_union's tiles: whichever fast_batch.MOE_PATH takes, "auto" both
    of its paths at their buckets), the dense tiles at <= 16 rows and at <= 64 rows (one knob at a time, the
    others at their best so far; graphs captured again each time; moe_only: the MoE's knobs alone; router_only:
    the 8-bit router's tiles and split alone). A candidate that does not compile or run counts as infinitely slow."""
    from lily.kernels import moe_decode as MD
    from lily.kernels import moe_grouped_gemm as MG
    from lily.kernels import q4_gemm as QG
    from lily.model import fast_batch as FB

    from lily.kernels import moe_union as MU

    auto = FB.MOE_PATH == "auto"
    if auto:   # each path at the buckets "auto" sends it
        rows_at = [r for r in (8, 16, 32) if FB.moe_path(r) == "rows"]
        union_at = [r for r in (32, 64) if FB.moe_path(r) == "union"]
    else:
        rows_at, union_at = [8, 32], [8, 32]
    moe_knobs = {"rows": [(MD, "ROWS_GATE_UP_BLOCK", ROWS_GATE_UP_CANDIDATES, rows_at),
                          (MD, "ROWS_DOWN_BLOCK", ROWS_DOWN_CANDIDATES, rows_at),
                          (MD, "ROWS_AHEAD", ROWS_AHEAD_CANDIDATES, rows_at)],
                 "union": [(MU, "GATE_UP_TILE", UNION_GATE_UP_CANDIDATES, union_at),
                           (MU, "DOWN_TILE", UNION_DOWN_CANDIDATES, union_at)],
                 "grouped": [(MG, "FEW_PAIRS_TILES", FEW_PAIRS_CANDIDATES, [2, 8, 32])]}
    moe_knobs = ((moe_knobs["rows"] if rows_at else []) + (moe_knobs["union"] if union_at else []) if auto
                 else moe_knobs[FB.MOE_PATH])
    dense_knobs = [] if moe_only else [(QG, "SKINNY_TILES", SKINNY_CANDIDATES, [2, 8]),
                                       (QG, "MID_TILES", MID_CANDIDATES, [32])]
    if router_only:
        moe_knobs, dense_knobs = [], [(QG, "SKINNY_TILES_8BIT", SKINNY_8BIT_CANDIDATES, [8, 16]),
                                      (QG, "MID_TILES_8BIT", MID_8BIT_CANDIDATES, [32]),
                                      (QG, "SPLIT_K_MIN_GROUPS_8BIT", MIN_GROUPS_8BIT_CANDIDATES, [8, 16, 32])]
    out = {}
    for module, name, cands, rows in moe_knobs + dense_knobs:
        rows = [r for r in rows if r in buckets]
        res = {}
        for cfg in cands:
            setattr(module, name, cfg)
            backend.batch.graphs.clear()
            try:
                t = time_buckets(backend, ctx, rows, gen, replays)
                res[str(cfg)] = {r: v["ms_per_step"] for r, v in t.items()}
            except Exception as e:  # noqa: BLE001 - a tile that does not fit: record and go on
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                res[str(cfg)] = {r: float("inf") for r in rows}
        best = min(cands, key=lambda c: sum(res[str(c)].values()))
        setattr(module, name, best)
        out[name] = {"ms_per_step": res, "best": best}
        print(f"{name}: best {best} ({res[str(best)]}; default {res[str(cands[0])]})", flush=True)
    backend.batch.graphs.clear()
    return out


# gemv_rows' (weight rows a block, programs an SM, warps) candidates, swept by --sweep-gemv-rows
GEMV_ROWS_CANDIDATES = [(8, 4, 4), (8, 3, 4), (8, 2, 4), (16, 2, 4), (4, 4, 4), (2, 4, 4), (4, 8, 4), (8, 2, 8),
                        (8, 1, 8), (16, 1, 8), (16, 2, 8), (32, 1, 8), (32, 2, 8), (64, 1, 8), (32, 1, 4), (16, 1, 4),
                        (64, 1, 16)]


def graphed_us(fn, replays: int, launches: int = 20) -> float:
    """us a call of fn inside a CUDA graph of `launches` calls back to back (the host's launch cost left out, as
    in the step's graph): the best of time_replays' rounds."""
    fn()                                   # compiled outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    return 1e6 * min(time_replays(g.replay, replays)) / launches


def sweep_gemv_rows(c, dev, replays: int) -> dict:
    """us a launch of each of the step's dense projections at 2 and 4 rows: gemv_rows with each candidate block
    (the best written into quant_gemv_rows.BLOCKS for the rest of the run), q_gemm (with its norm kernel where
    the step has one), and the batch-1 GEMV on one row, each in a CUDA graph (graphed_us). A candidate that does
    not compile or fit counts as infinitely slow."""
    from lily.kernels import quant_gemv_rows as QR
    from lily.kernels.quant_gemv import gemv
    gen = torch.Generator(device=dev)
    gen.manual_seed(5)
    H, E = c.hidden_size, c.num_experts
    n_in = c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads
    n_attn, n_gdn = c.layer_types.count("full_attention"), c.layer_types.count("linear_attention")
    # (name, N, K, bits, norm prologue (else a residual added), launches a step)
    shapes = [("gdn in-projection", n_in, H, 4, True, n_gdn),
              ("attn q|k|v", c.attn_q_dim + 2 * c.attn_kv_dim, H, 4, True, n_attn),
              ("gdn out-projection", H, c.linear_value_dim, 4, False, n_gdn),
              ("attn o", H, c.num_attention_heads * c.head_dim, 4, False, n_attn),
              ("router", E + 1, H, 8, True, c.num_hidden_layers), ("lm_head", c.vocab_size, H, 4, True, 1)]
    out: dict = {}
    step_us: dict = {}   # (rows, family) -> {candidate: us a step over the family's launches}
    for name, n, k, bits, norm, per_step in shapes:
        qt = rand_qt((n, k), bits, dev, gen)
        lin = PackedLinear(qt)
        gain = torch.rand(k, generator=gen, device=dev) + 0.5
        one = torch.empty(n, device=dev)
        x1 = torch.randn(k, generator=gen, device=dev)
        t1 = graphed_us(lambda: gemv(lin, x1, one, norm_gain=gain if norm else None), replays)
        row = out.setdefault(name, {"batch1_gemv_us": t1})
        for m in (2, 4):
            h = torch.randn(m, k, generator=gen, device=dev)
            x = h if norm else h.to(torch.bfloat16)
            y = torch.empty(m, n, device=dev)
            if norm:
                tg = graphed_us(lambda: q_gemm(rmsnorm_rows(h, gain, 1e-6), qt, out=y), replays)
            else:
                tg = graphed_us(lambda: q_gemm(x, qt, out=y, accumulate=True), replays)
            res = {}
            default = QR.BLOCKS[(m, QR.family(n, k, bits))]
            cands = [default] + [cc for cc in GEMV_ROWS_CANDIDATES if cc != default]
            for cand in cands:
                try:
                    res[str(cand)] = graphed_us(
                        lambda: gemv_rows(lin, x, y, norm_gain=gain if norm else None, accumulate=not norm,
                                          block=cand[:2], num_warps=cand[2]), replays)
                except Exception as e:  # noqa: BLE001 - does not fit: record and go on
                    print(f"  {name} M={m} {cand}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    res[str(cand)] = float("inf")
            best = min(cands, key=lambda cc: res[str(cc)])
            fam = step_us.setdefault((m, QR.family(n, k, bits)), {})
            for cc in cands:
                fam[cc] = fam.get(cc, 0.0) + per_step * res[str(cc)]
            row[f"M={m}"] = {"q_gemm_us": tg, "gemv_rows_us": res, "best": best, "default": default}
            print(f"  {name:20s} M={m}: gemv_rows {res[str(best)]:7.1f} us {best} (default "
                  f"{res[str(default)]:.1f}) | q_gemm{' + norm' if norm else ''} "
                  f"{tg:7.1f} us | batch-1 GEMV {t1:6.1f} us", flush=True)
        del qt, lin
    for key, by_cand in step_us.items():   # each family's block: the least time over its launches in a step
        QR.BLOCKS[key] = min(by_cand, key=by_cand.get)
        print(f"  BLOCKS[{key}] = {QR.BLOCKS[key]}: {by_cand[QR.BLOCKS[key]]:.0f} us a step", flush=True)
    out["blocks_chosen"] = {f"{m} {f}": v for (m, f), v in QR.BLOCKS.items()}
    return out


def sweep_moe_rows(backend, ctx: int, gen, replays: int, rows_list: list[int]) -> dict:
    """ms a step at each of rows_list with each gate_up block of moe_rows (ROWS_GATE_UP_CANDIDATES, the bucket's
    current block first; down at its current block), then each down block (ROWS_DOWN_CANDIDATES; gate_up at its
    best): moe_decode.ROWS_BLOCKS[rows] set to the best for the rest of the run (--sweep-moe-rows)."""
    from lily.kernels import moe_decode as MD
    out = {}
    for rows in [r for r in rows_list if r <= backend.pool.n_slots]:
        res = {}
        now_gu, now_dn = MD.ROWS_BLOCKS.get(rows, (MD.ROWS_GATE_UP_BLOCK, MD.ROWS_DOWN_BLOCK))
        best_gu, best_dn = now_gu, now_dn
        for knob, cands in (("gate_up", [now_gu] + [c for c in ROWS_GATE_UP_CANDIDATES if c != now_gu]),
                            ("down", [now_dn] + [c for c in ROWS_DOWN_CANDIDATES if c != now_dn])):
            times = {}
            for cand in cands:
                MD.ROWS_BLOCKS[rows] = (cand, best_dn) if knob == "gate_up" else (best_gu, cand)
                backend.batch.graphs.clear()
                times[cand] = time_buckets(backend, ctx, [rows], gen, replays)[rows]["ms_per_step"]
            best = min(cands, key=times.get)
            best_gu, best_dn = (best, best_dn) if knob == "gate_up" else (best_gu, best)
            res[knob] = {str(k): v for k, v in times.items()}
        MD.ROWS_BLOCKS[rows] = (best_gu, best_dn)
        out[rows] = {"ms_per_step": res, "best": MD.ROWS_BLOCKS[rows], "before": (now_gu, now_dn)}
        print(f"moe_rows at {rows} rows: best {MD.ROWS_BLOCKS[rows]} ({min(res['down'].values()):.3f} ms a step; "
              f"before {(now_gu, now_dn)}: {res['gate_up'][str(now_gu)]:.3f})", flush=True)
    backend.batch.graphs.clear()
    return out


def bench(backend, contexts: list[int], replays: int, ab_splits: bool = False, sweep_tiles: str = "",
          ab_moe: tuple = (), ab_last_sums: bool = False, ab_skinny_wgmma: bool = False, ab_dense: bool = False,
          sweep_moe: tuple = (), ab_dense_split: bool = False, ab_rec_dtype: bool = False,
          ab_flags: tuple = (), ab_pdl: tuple = ()) -> None:
    from lily.kernels import moe_grouped_gemm as MG
    from lily.kernels import q4_gemm as QG
    from lily.model.slots import reset_state

    dev = backend.device
    if dev.type == "cuda":
        RESULTS["copy_GBps"] = copy_bandwidth(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(3)
    pool, batch = backend.pool, backend.batch
    t0 = time.time()
    buckets = [1] + backend.prepare_batches()
    RESULTS["capture_s"] = time.time() - t0
    print(f"graphs for {buckets[1:]} rows captured in {RESULTS['capture_s']:.1f} s", flush=True)
    backend.prepare_state(pool.states[0])   # slot 0's batch-1 graph: what a lone request replays
    for ctx in contexts:
        for st in pool.states:
            fill_state(st, ctx, gen)
        rows_out = time_buckets(backend, ctx, buckets, gen, replays)
        # the host's share: decode_batch end to end (input copy, replay, logits gathered, positions kept)
        for rows in [r for r in (2, 3, 4, 8, 32) if r <= pool.n_slots] or buckets[-1:]:
            states = pool.states[:rows]
            for st in states:
                st.pos = ctx
            pool.pos.fill_(ctx)
            toks = torch.randint(0, backend.config.vocab_size, (rows,), generator=gen, device=dev).tolist()
            backend.decode_batch(toks, states)
            sync(dev)
            n = max(1, replays // 2)
            t0 = time.perf_counter()
            for _ in range(n):
                backend.decode_batch(toks, states).sum().item()
            wall = (time.perf_counter() - t0) / n
            r = rows_out.setdefault(rows, {})   # (3 rows: no bucket of its own)
            r["decode_batch_wall_ms"] = wall * 1e3
            r["decode_batch_tok_s"] = rows / wall
            print(f"  ctx {ctx:6d} rows {rows:3d}: decode_batch end to end {wall * 1e3:.3f} ms, "
                  f"{rows / wall:.0f} tok/s "
                  f"(the bucket's graph alone {r.get('ms_per_step', float('nan')):.3f})", flush=True)
        RESULTS["speed"][ctx] = rows_out
    ctx = contexts[-1]
    for rows in [r for r in (2, 8, 32) if r in buckets]:
        RESULTS["classes"][rows] = profile_step(backend, rows, ctx, gen)
    if ab_splits:  # the same buckets with other split-K targets (0: off), graphs captured again each time
        keep = QG.SPLIT_K_PROGRAMS_PER_SM, MG.GATE_UP_PROGRAMS_PER_SM
        RESULTS["split_k_sweep"] = {}
        for dense, moe in [(0, 0), (8, 4), (4, 8), (4, 16), (8, 16), (16, 16), (8, 32), (8, 64)]:
            QG.SPLIT_K_PROGRAMS_PER_SM, MG.GATE_UP_PROGRAMS_PER_SM = dense, moe
            batch.graphs.clear()
            print(f"split-K targets: dense {dense}, MoE gate/up {moe} programs an SM (ctx {ctx}):", flush=True)
            RESULTS["split_k_sweep"][f"dense {dense}, moe {moe}"] = time_buckets(backend, ctx, buckets[1:], gen,
                                                                                 replays)
        QG.SPLIT_K_PROGRAMS_PER_SM, MG.GATE_UP_PROGRAMS_PER_SM = keep
        batch.graphs.clear()
    if ab_moe:  # the step's MoE through each other path (fast_batch.MOE_PATH), graphs captured again
        from lily.model import fast_batch as FB
        keep = FB.MOE_PATH
        for path in [p for p in ab_moe if p != keep] + [keep]:
            FB.MOE_PATH = path
            batch.graphs.clear()
            print(f"fast_batch.MOE_PATH = {path!r} (ctx {ctx}):", flush=True)
            RESULTS.setdefault("speed_moe_path", {})[path] = {ctx: time_buckets(backend, ctx, buckets[1:], gen,
                                                                                replays)}
            if path != keep:
                for rows in [r for r in (8, 32) if r in buckets]:
                    RESULTS["classes"][f"{rows} rows, MOE_PATH={path}"] = profile_step(backend, rows, ctx, gen)
        FB.MOE_PATH = keep
        batch.graphs.clear()
    if sweep_moe:
        RESULTS["moe_rows_sweep"] = sweep_moe_rows(backend, ctx, gen, replays, list(sweep_moe))
        from lily.kernels import moe_decode as MD
        for r, res in RESULTS["moe_rows_sweep"].items():   # the chosen blocks against the ones before, alternating
            if r not in buckets:
                continue
            chosen, before = MD.ROWS_BLOCKS[r], res["before"]
            for label, cfg in (("before", before), ("chosen", chosen), ("before", before), ("chosen", chosen)):
                MD.ROWS_BLOCKS[r] = cfg
                batch.graphs.clear()
                res.setdefault(f"ab_{label}", []).append(time_buckets(backend, ctx, [r], gen, replays)[r]["ms_per_step"])
            MD.ROWS_BLOCKS[r] = chosen
        batch.graphs.clear()
    if ab_dense:  # the small buckets' dense projections on the other path (fast_batch.DENSE_PATH), then again
        from lily.model import fast_batch as FB
        keep = FB.DENSE_PATH
        small = [r for r in buckets[1:] if r <= 2 * GEMV_MAX_ROWS]
        for path in ("gemm", "gemv", "gemm", "gemv"):
            FB.DENSE_PATH = path
            batch.graphs.clear()
            print(f"fast_batch.DENSE_PATH = {path!r} (ctx {ctx}):", flush=True)
            RESULTS.setdefault("speed_dense_path", {}).setdefault(path, []).append(
                time_buckets(backend, ctx, small, gen, replays))
            if len(RESULTS["speed_dense_path"][path]) == 1:
                RESULTS["classes"][f"2 rows, DENSE_PATH={path}"] = profile_step(backend, 2, ctx, gen)
        FB.DENSE_PATH = keep
        batch.graphs.clear()
    if sweep_tiles:
        router_knobs = ("SKINNY_TILES_8BIT", "MID_TILES_8BIT", "SPLIT_K_MIN_GROUPS_8BIT")
        keep = {n: getattr(QG, n) for n in router_knobs}
        RESULTS["tile_sweep"] = sweep_step_tiles(backend, ctx, buckets, gen, replays, sweep_tiles == "moe",
                                                 sweep_tiles == "router")
        if sweep_tiles == "router":   # the router's best against its tiles before, alternating, every bucket
            best = {n: getattr(QG, n) for n in router_knobs}
            c = backend.config
            w_r = rand_qt((c.num_experts + 1, c.hidden_size), 8, dev, gen)
            for rows in (8, 16, 32):   # the best tiles' product against the reference
                xr = torch.randn(rows, c.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
                check(f"q_gemm 8-bit, the router's best tiles, M={rows}",
                      rel(q_gemm(xr, w_r, out_dtype=torch.float32), q_gemm_reference(xr, w_r)), 1e-2)
            RESULTS["router_ab"] = alternate_settings(backend, ctx, buckets[1:], gen, replays, QG,
                                                      {"before": keep, "router best": best}, profile_rows=(8,))
            RESULTS["router_ab"]["configs"] = {"before": keep, "best": best}
    if ab_last_sums:  # the skinny GEMMs' split-K partials summed by each tile's last split, graphs captured again
        keep = QG.SPLIT_K_LAST_SUMS
        QG.SPLIT_K_LAST_SUMS = not keep
        batch.graphs.clear()
        print(f"q4_gemm.SPLIT_K_LAST_SUMS = {QG.SPLIT_K_LAST_SUMS} (ctx {ctx}):", flush=True)
        RESULTS[f"speed_last_sums_{QG.SPLIT_K_LAST_SUMS}"] = {ctx: time_buckets(backend, ctx, buckets[1:], gen,
                                                                                replays)}
        QG.SPLIT_K_LAST_SUMS = keep
        batch.graphs.clear()
    if ab_dense_split:   # the Hopper dense mode's skinny GEMMs unsplit, graphs captured again
        QG.WGMMA_DENSE_SPLIT = False
        batch.graphs.clear()
        print(f"q4_gemm: the Hopper dense mode unsplit (ctx {ctx}):", flush=True)
        RESULTS["speed_dense_unsplit"] = {ctx: time_buckets(backend, ctx, buckets[1:], gen, replays)}
        QG.WGMMA_DENSE_SPLIT = True
        batch.graphs.clear()
        print(f"q4_gemm: the Hopper dense mode split again (ctx {ctx}):", flush=True)
        RESULTS["speed_dense_split_again"] = {ctx: time_buckets(backend, ctx, buckets[1:], gen, replays)}
    for flag in ab_flags:  # a module's boolean switch flipped, then back, twice (e.g. moe_decode.ROWS_BY_EXPERT)
        module_name, name = flag.rsplit(".", 1)
        module = importlib.import_module(f"lily.{module_name}")
        on = getattr(module, name)
        RESULTS.setdefault("speed_flags", {})[flag] = alternate_settings(
            backend, ctx, buckets[1:], gen, replays, module, {f"{name}={v}": {name: v} for v in (not on, on)},
            profile_rows=(8, 32))
    if ab_pdl:  # lily.kernels.pdl's families (LILY_PDL spellings) in turn, the current set last, twice
        from lily.kernels import pdl
        now = pdl.describe()
        specs = [sp for sp in ab_pdl if pdl.parse(sp) != pdl.MODE] + [now]
        RESULTS["speed_pdl"] = alternate_settings(backend, ctx, buckets[1:], gen, replays, pdl,
                                                  {sp: {"MODE": pdl.parse(sp)} for sp in specs}, profile_rows=(8, 32))
    if ab_rec_dtype:
        RESULTS["speed_rec_dtype"] = alternate_rec_dtype(backend, ctx, buckets, gen, replays)
    if ab_skinny_wgmma:  # fewer than WGMMA_DENSE_MIN_M rows on the split-K path only, graphs captured again
        keep = QG.WGMMA_DENSE_SKINNY_PROGRAMS_PER_SM
        QG.WGMMA_DENSE_SKINNY_PROGRAMS_PER_SM = 1 << 30
        batch.graphs.clear()
        print(f"q4_gemm: skinny GEMMs off the Hopper dense mode (ctx {ctx}):", flush=True)
        RESULTS["speed_skinny_wgmma_off"] = {ctx: time_buckets(backend, ctx, buckets[1:], gen, replays)}
        QG.WGMMA_DENSE_SKINNY_PROGRAMS_PER_SM = keep
        batch.graphs.clear()
    for st in pool.states:   # (filled with noise above: empty again)
        reset_state(st)
    if dev.type == "cuda":
        RESULTS["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    RESULTS["slots"] = {"n": pool.n_slots, "max_seq": pool.max_seq, "GiB": pool.nbytes() / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter dry run at the tiny shapes")
    ap.add_argument("--contexts", default="256,4096")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma list of kernels,fidelity,solo,speed to skip")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8"],
                    help="the slots' KV cache (lily serve --kv-cache-dtype) for the build, speed and A/B sections")
    ap.add_argument("--ab-splits", action="store_true",
                    help="time the buckets again with other split-K targets of the skinny GEMMs (and off)")
    ap.add_argument("--sweep-tiles", nargs="?", const="all", default="", choices=["all", "moe", "router"],
                    help="sweep the launch tiles of the step's MoE and skinny GEMMs (moe: the MoE's alone; router: "
                         "the 8-bit router's tiles and split, then its best against before, alternating)")
    ap.add_argument("--ab-moe", default="",
                    help="comma list of fast_batch.MOE_PATHS (union, rows, grouped): time the buckets again through "
                         "each, and the default once more after them")
    ap.add_argument("--ab-last-sums", action="store_true",
                    help="time the buckets again with q4_gemm.SPLIT_K_LAST_SUMS flipped")
    ap.add_argument("--sweep-gemv-rows", action="store_true",
                    help="time gemv_rows' blocks, q_gemm and the batch-1 GEMV at the step's dense shapes (2 and 4 "
                         "rows) and keep the best blocks for the rest of the run")
    ap.add_argument("--sweep-moe-rows", default="",
                    help="comma list of batch rows at which to sweep moe_rows' gate_up and down blocks "
                         "(moe_decode.ROWS_BLOCKS), then time the chosen against the ones before, alternating")
    ap.add_argument("--sweep-moe-rows-small", action="store_true", help="--sweep-moe-rows 2,4")
    ap.add_argument("--ab-dense", action="store_true",
                    help="time the buckets up to 2 * GEMV_MAX_ROWS with the dense projections on each path, twice")
    ap.add_argument("--ab-dense-split", action="store_true",
                    help="time the buckets again with the Hopper dense mode's skinny GEMMs unsplit "
                         "(q4_gemm.WGMMA_DENSE_SPLIT), then split again")
    ap.add_argument("--ab-flag", action="append", default=[], metavar="MODULE.NAME",
                    help="time the buckets with a boolean switch of lily.MODULE flipped, then back, twice (e.g. "
                         "kernels.moe_decode.ROWS_BLOCK_MAJOR, model.fast_batch.FUSED_GATED_NORM, "
                         "kernels.q4_gemm.WGMMA_DENSE_SKINNY_SPLIT); may be given more than once")
    ap.add_argument("--ab-pdl", default="", metavar="SPEC;SPEC",
                    help="time the buckets under each set of programmatic launch families (LILY_PDL spellings, "
                         "e.g. 'attn,gdn,gdn_out,gate_up,down;all'; the current set after them), twice")
    ap.add_argument("--ab-rec-dtype", action="store_true",
                    help="time the buckets on slots with a bf16 recurrent state against the fp32 slots, twice")
    ap.add_argument("--ab-skinny-wgmma", action="store_true",
                    help="time the buckets again with the skinny GEMMs kept off the Hopper dense mode")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    dev = torch.device("cpu" if args.tiny else "cuda")
    import triton
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                      "git": os.environ.get("LILY_GIT_REVISION", "")}
    print(RESULTS["env"], flush=True)
    t_start = time.time()

    def section(name, fn, *a):
        if name in skip:
            return None
        t = time.time()
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 - report and carry on with the other sections
            import traceback
            traceback.print_exc()
            FAILS.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            return None
        finally:
            print(f"[{name}: {time.time() - t:.1f} s, {time.time() - t_start:.0f} s in all]", flush=True)

    contexts = [int(x) for x in args.contexts.split(",")]
    if args.tiny:
        c_kern, c_fid, c_full = TINY, with_layers(TINY, 4), TINY
        kern = (6, 40)
        fid = (3, 2, 12, 3e-2)      # (tiny: larger errors)
        solo, replays, max_batch, contexts = (3, 3, 12), 1, min(args.max_batch, 4), [24]
    else:
        c_kern, c_fid, c_full = FULL, with_layers(FULL, 4), FULL
        kern = (args.max_batch, 4096)
        fid = (8, 16, 600)
        solo, replays, max_batch = (16, 32, 1024), 32, args.max_batch
    section("kernels", check_kernels, c_kern, dev, *kern)
    if args.sweep_gemv_rows:
        RESULTS["gemv_rows_sweep"] = section("gemv_rows_sweep", sweep_gemv_rows, c_kern, dev, replays)
    section("fidelity", check_fidelity, c_fid, dev, *fid)
    # a bucket of GEMV_MAX_ROWS rows or fewer: the dense projections on gemv_rows (fast_batch.DENSE_PATH "auto")
    section("fidelity_gemv", functools.partial(check_fidelity, label="batched (3 rows)"), c_fid, dev, 3, *fid[1:])
    if not {"solo", "speed"} <= skip:
        # room for the timed replays, each a step further (3 rounds of `replays`, then decode_batch's)
        max_seq = max(max(contexts) + 5 * replays, solo[2] + solo[1]) + 8
        backend = section("build", build_full, c_full, dev, max_seq, max_batch, args.kv_dtype)
        if backend is not None:
            section("solo", check_solo_vs_batched, backend, *solo)
            section("speed", bench, backend, contexts, replays, args.ab_splits, args.sweep_tiles,
                    tuple(filter(None, args.ab_moe.split(","))), args.ab_last_sums, args.ab_skinny_wgmma,
                    args.ab_dense, (2, 4) if args.sweep_moe_rows_small else
                    tuple(int(r) for r in args.sweep_moe_rows.split(",") if r), args.ab_dense_split,
                    args.ab_rec_dtype, tuple(args.ab_flag), tuple(filter(None, args.ab_pdl.split(";"))))
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "batch-tiny.json" if args.tiny else "batch-h200.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"\n== summary ({path}, {time.time() - t_start:.0f} s) ==")
    print(f"checks: {sum(v['ok'] for v in RESULTS['checks'].values())}/{len(RESULTS['checks'])} ok; "
          f"fails: {FAILS or 'none'}")
    for name, r in RESULTS["fidelity"].items():
        print(f"fidelity {name:8s}: rel logit err {r['rel_logit_err']:.2e}, top-1 {r['top1_agreement']:.3f}")
    if "solo_vs_batched" in RESULTS:
        r = RESULTS["solo_vs_batched"]
        print(f"solo vs batched: {r['same_tokens']}/{r['sequences']} identical over {r['steps']} tokens, "
              f"rel logit dist max {r['rel_logit_dist_max']:.2e}")
    for name, table in [(f"speed ctx {c}", r) for c, r in RESULTS["speed"].items()] + \
            [(f"split-K {k}", r) for k, r in RESULTS.get("split_k_sweep", {}).items()] + \
            [(f"MOE_PATH {p} ctx {k}", r) for p, by_ctx in RESULTS.get("speed_moe_path", {}).items()
             for k, r in by_ctx.items()]:
        print(f"{name}: " + "  ".join(f"B={b}: {r['aggregate_tok_s']:.0f} tok/s ({r['per_stream_tok_s']:.0f}/stream)"
                                      for b, r in table.items() if "aggregate_tok_s" in r))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
