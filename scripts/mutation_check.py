#!/usr/bin/env python3
"""Mutation check: does the test suite catch a wrong row? Each mutation below is a small source edit
(an exact old -> new string in one lily/ file) that a test must catch. For each, the tree's files (git's
tracked files as they are in the working tree) are copied to a temporary directory, the edit is made
there, and each of the mutation's test selections is run with pytest (-x -q -p no:cacheprovider): every
selection must fail, on a failing test (not a collection error). The working tree is never changed.

    scripts/mutation_check.py                 every mutation
    scripts/mutation_check.py --only NAME     one (repeatable)
    scripts/mutation_check.py --list          the mutations and their selections
    scripts/mutation_check.py --baseline      also run each selection unmutated first (it must pass)

Exits non-zero if a mutation survives a selection, a selection fails unmutated (--baseline), or an old
string is not found exactly once in its file (the code moved: update the mutation, never skip it). Each
pytest run gets a fresh LILY_TEST_SEED, printed, so a survivor can be repeated.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200  # per pytest run; a hang counts as not caught


@dataclass
class Mutation:
    name: str
    file: str                       # under the repository root
    edits: list[tuple[str, str]]    # (old, new): each old string must occur exactly once
    selections: list[list[str]]     # pytest arguments; each selection must fail
    what: str = ""
    notes: list[str] = field(default_factory=list)


MUTATIONS = [
    Mutation(
        "flash-attn-drop-last-key", "lily/kernels/flash_attention.py",
        [("hi = tl.minimum(pos0 + tl.minimum(mb * BLOCK_M + BLOCK_M, T), max_seq)",
          "hi = tl.minimum(pos0 + tl.minimum(mb * BLOCK_M + BLOCK_M, T) - 1, max_seq)")],
        [["tests/test_kernels_prefill.py", "-k", "flash_attention"]],
        "each query block stops one key short: its last query misses its own key"),
    Mutation(
        "moe-renorm-prefill", "lily/model/fast_prefill.py",
        [("moe_topk(logits, c.num_experts_per_tok, c.norm_topk_prob, shared=True)",
          "moe_topk(logits, c.num_experts_per_tok, False, shared=True)")],
        [["tests/test_kernels_prefill.py", "-k", "prefill_forward_matches"],
         ["tests/test_state_pool.py", "-k", "back_to_back"]],
        "the prefill kernels' MoE routing without the top-k renormalisation"),
    Mutation(
        "moe-shared-slot-ungated", "lily/kernels/moe_routing.py",
        [("w = tl.where(kk[None, :] == K, tl.sigmoid(gate)[:, None], w)",
          "w = tl.where(kk[None, :] == K, 1.0, w)")],
        [["tests/test_kernels_moe_routing.py", "-k", "matches_softmax_topk"],
         ["tests/test_kernels_prefill.py", "-k", "prefill_forward_matches"]],
        "the prefill's shared expert (routed with the experts) without its sigmoid gate"),
    Mutation(
        "topk-router-parts-first-only", "lily/kernels/moe_routing.py",
        [("    for part in tl.static_range(PARTS):   # (unrolled: every partial's load in flight at once)",
          "    for part in tl.static_range(1):")],
        [["tests/test_kernels_moe_routing.py", "-k", "split_partials"]],
        "the prefill's routing from the router's first K-split partial only (the prefill test's routing follower "
        "sums the partials itself, so the kernel test alone holds this)"),
    Mutation(
        "combine-next-norm-of-the-old-residual", "lily/kernels/moe_grouped_gemm.py",
        [("    y = row * tl.rsqrt(tl.sum(row * row, axis=0) / H + eps)",
          "    y = acc * tl.rsqrt(tl.sum(row * row, axis=0) / H + eps)")],
        [["tests/test_kernels_prefill.py", "-k", "next_input"],
         ["tests/test_kernels_prefill.py", "-k", "prefill_forward_matches"]],
        "the next layer's input normed from the residual before the MoE's output was added"),
    Mutation(
        "moe-renorm-decode", "lily/model/fast.py",
        [("                                                          norm_topk=c.norm_topk_prob)),",
          "                                                          norm_topk=False)),"),
         ("moe_down(moe.experts, self.h, self.h_p, sc, norm_topk=c.norm_topk_prob)",
          "moe_down(moe.experts, self.h, self.h_p, sc, norm_topk=False)")],
        [["tests/test_fast_backend.py", "-k", "decode_steps"]],
        "the decode step's MoE routing (gate_up's, and down's own when it routes itself) without the top-k "
        "renormalisation"),
    Mutation(
        "moe-renorm-reference", "lily/model/reference.py",
        [("        if c.norm_topk_prob:\n            top = top / top.sum(-1, keepdim=True)",
          "        if False:\n            top = top / top.sum(-1, keepdim=True)")],
        [["tests/test_reference_hf.py", "-k", "matches_transformers"],
         ["tests/test_state_pool.py", "-k", "back_to_back"]],
        "the reference model's routing without the top-k renormalisation"),
    Mutation(
        "quant-msb-first", "lily/quant.py",
        [("    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits\n",
          "    shifts = (per - 1 - torch.arange(per, device=packed.device, dtype=torch.int32)) * bits\n"),
         ("    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)\n",
          "    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per).flip(-1)\n")],
        [["tests/test_checkpoint.py"]],
        "4-bit codes packed and unpacked MSB-first (a consistent pair: lily alone reads its own files back)"),
    Mutation(
        "reference-bf16-ignored", "lily/model/reference.py",
        [("        self.dtype = dtype\n", "        self.dtype = torch.float32\n")],
        [["tests/test_generate_cli.py", "-k", "bf16"]],
        "the reference's bf16 rounding of activations skipped (dtype=bf16 runs fp32)"),
    Mutation(
        "generate-dtype-ignored", "lily/generate.py",
        [('DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}',
          'DTYPES = {"fp32": torch.float32, "bf16": torch.float32}')],
        [["tests/test_generate_cli.py", "-k", "bf16"]],
        "lily generate --dtype bf16 runs the reference in fp32"),
    Mutation(
        "bench-fidelity-bf16-is-fp32", "lily/bench/fidelity.py",
        [("ref16 = ReferenceModel(config, weights, device=device, dtype=torch.bfloat16)",
          "ref16 = ReferenceModel(config, weights, device=device, dtype=torch.float32)")],
        [["tests/test_bench.py", "-k", "end_to_end"]],
        "the bench fidelity block's bf16 reference run in fp32"),
    Mutation(
        "gdn-chunk-last-row-decay", "lily/kernels/gdn_chunked.py",
        [("g = tl.where(ok, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)",
          "g = tl.where(ok & (tl.arange(0, C) < C - 1), -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)")],
        [["tests/test_gdn_chunked.py", "-k", "variants"],
         ["tests/test_kernels_prefill.py", "-k", "gdn_chunked_matches"]],
        "the last row of each 64-token chunk does not decay the state (g = 0 there)"),
    Mutation(
        "gdn-scan-last-row-decay", "lily/kernels/gdn_chunked.py",
        [("    gc = tl.where(ok, gc, gc_last)\n    return",
          "    gc = tl.where(ok & (rows < C - 1), gc, gc_last - 0.5)\n    return")],
        [["tests/test_gdn_chunked.py", "-k", "variants"],
         ["tests/test_kernels_prefill.py", "-k", "gdn_chunked_matches"]],
        "the scan's carry of each chunk's last key into the state with a wrong decay (exp(0.5) too much)"),
    Mutation(
        "conv1d-state-off-by-one", "lily/kernels/conv1d_prefill.py",
        [("    src = n + rows                      # row in [state; x]\n",
          "    src = n - 1 + rows\n")],
        [["tests/test_kernels_prefill.py", "-k", "conv1d"]],
        "the conv state handed to the decode step is one row early"),
    Mutation(
        "decode-kv-write-pos-plus-1", "lily/kernels/attention_decode.py",
        [("store_kv(k_cache_ptr, v_cache_ptr, pos.to(tl.int64) * HKV + kvh,",
          "store_kv(k_cache_ptr, v_cache_ptr, (pos + 1).to(tl.int64) * HKV + kvh,")],
        [["tests/test_kernels_decode.py", "-k", "attention_decode"]],
        "the decode step writes this token's K/V at pos + 1"),
    Mutation(
        "decode-attn-long-span-drops-a-key", "lily/kernels/attention_decode.py",
        [("kvh, start, end, HKV, D, GP, BT_LONG, UPCAST, KV8)",
          "kvh, start, end - 1, HKV, D, GP, BT_LONG, UPCAST, KV8)")],
        [["tests/test_kernels_decode.py", "-k", "attention_decode"]],
        "split-K's long-split loop (LONG_SPAN) leaves out each split's last key"),
    Mutation(
        "prefill-kv-write-pos-plus-1", "lily/kernels/flash_attention.py",
        [("    dst = ((pos0 + ts) * HKV + h) * HD\n", "    dst = ((pos0 + 1 + ts) * HKV + h) * HD\n")],
        [["tests/test_kernels_prefill.py", "-k", "flash_attention"]],
        "the prefill writes its K/V rows one position late"),
    Mutation(
        "prefill-rope-sign", "lily/kernels/flash_attention.py",
        [("x1 * cos - x2 * sin, x2 * cos", "x1 * cos + x2 * sin, x2 * cos")],
        [["tests/test_kernels_prefill.py", "-k", "flash_attention"]],
        "the prefill's RoPE rotates its first half the wrong way (queries and keys)"),
    Mutation(
        "decode-kv8-k-scales-dropped", "lily/kernels/attention_decode.py",
        [("s = s * kv8_row_scales(k_cache_ptr, row, tmask, D)[None, :]", "s = s * 1.0")],
        [["tests/test_kv_int8.py", "-k", "attention_decode"]],
        "the decode attention over an int8 cache leaves its K rows' scales off the scores"),
    Mutation(
        "prefill-kv8-scale-from-unrotated-dims", "lily/kernels/flash_attention.py",
        [("tl.max(tl.where((d >= ROT)[None, :], tl.abs(x), 0.0), 1)", "tl.max(tl.abs(x), 1)")],
        [["tests/test_kv_int8.py", "-k", "flash"]],
        "the prefill's int8 K rows take their scale from the dims before RoPE as well"),
    Mutation(
        "flash-attn-values-past-end-kept", "lily/kernels/flash_attention.py",
        [("    if MASK:\n        v = tl.where((kpos < hi)[:, None], v, 0.0)\n", "")],
        [["tests/test_kernels_prefill.py", "-k", "flash_attention"]],
        "cache rows past the prompt (NaN in the tests) reach the attention's value sum"),
    Mutation(
        "gated-rmsnorm-gate-dropped", "lily/kernels/gdn_chunked.py",
        [("* gain[None, :] * (z * tl.sigmoid(z))", "* gain[None, :]")],
        [["tests/test_kernels_prefill.py", "-k", "gated_rmsnorm"]],
        "the prefill's gated RMSNorm without its silu(z) gate"),
    Mutation(
        "decode-gated-norm-gate-dropped", "lily/kernels/quant_gemv.py",
        [("xk = raw * tl.rsqrt(ss / HEAD_DIM + eps) * gn * (z * tl.sigmoid(z))",
          "xk = raw * tl.rsqrt(ss / HEAD_DIM + eps) * gn")],
        [["tests/test_kernels_decode.py", "-k", "gated_norm"]],
        "the decode out-projection's gated-norm prologue without its silu(z) gate"),
    Mutation(
        "decode-attn-last-split-ignored", "lily/kernels/attention_decode.py",
        [("    smask = s < NSPLIT\n", "    smask = s < NSPLIT - 1\n")],
        [["tests/test_kernels_decode.py", "-k", "attention_decode and 70"]],
        "the decode attention's combine leaves out the last split (at 70 positions: caught where that split "
        "holds keys; a single split also gives NaN)"),
    Mutation(
        "batched-attn-last-split-ignored", "lily/kernels/attention_decode_batch.py",
        [("    smask = s < NSPLIT\n", "    smask = s < NSPLIT - 1\n")],
        [["tests/test_kernels_batch.py", "-k", "attention and 3"]],
        "the batched decode attention's merge leaves out the last split"),
    Mutation(
        "decode-attn-split-drops-last-key", "lily/kernels/attention_decode.py",
        [("    end = tl.minimum(start + per, length)\n", "    end = tl.minimum(start + per, length - 1)\n")],
        [["tests/test_kernels_decode.py", "-k", "attention_decode"]],
        "the decode attention misses the newest key (this token's own)"),
    Mutation(
        "tma-gemm-drop-last-k", "lily/kernels/q4_gemm.py",
        [("        for k0 in range(0, K, BLOCK_K):\n            acc = mma_nt(x_desc.load",
          "        for k0 in range(0, K - BLOCK_K, BLOCK_K):\n            acc = mma_nt(x_desc.load")],
        [["tests/test_kernels_dense_gemm.py", "-k", "tma_path"]],
        "the persistent TMA GEMM leaves out the last BLOCK_K columns of K"),
    Mutation(
        "tma-gemm-skip-last-tile", "lily/kernels/q4_gemm.py",
        [("tl.range(tl.program_id(0), num_m * num_n, programs, flatten=True)",
          "tl.range(tl.program_id(0), num_m * num_n - 1, programs, flatten=True)")],
        [["tests/test_kernels_dense_gemm.py", "-k", "tma_path"]],
        "the persistent TMA GEMM's programs stop one output tile short"),
    Mutation(
        "tma-gemm-epilogue-piece-misplaced", "lily/kernels/q4_gemm.py",
        [("_store_tile(y_desc, right, m0, n0 + BLOCK_N // 2, ACCUMULATE)",
          "_store_tile(y_desc, right, m0, n0 + BLOCK_N // 4, ACCUMULATE)")],
        [["tests/test_kernels_dense_gemm.py", "-k", "tma_path"]],
        "the TMA GEMM's epilogue in two pieces writes the right half a quarter tile too far left"),
    Mutation(
        "sampling-temperature-ignored", "lily/kernels/sample.py",
        [("    scores = (logits.float() / pick.temperature).clamp(-LIMIT, LIMIT)",
          "    scores = logits.float().clamp(-LIMIT, LIMIT)")],
        [["tests/test_sampling.py"]],
        "sampling draws at temperature 1 whatever was asked"),
    Mutation(
        "wgmma-moe-words-layout-bytes-swapped", "lily/kernels/moe_wgmma.py",
        [("regs, lanes = [[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [[0, 0, 1], [0, 0, 2]]",
          "regs, lanes = [[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [[0, 0, 2], [0, 0, 1]]")],
        [["tests/test_kernels_moe_wgmma.py", "-k", "ptx_a_fragment"]],
        "the Hopper MoE's lanes take the wrong byte of each word (not the code pair of their A fragment)"),
    Mutation(
        "wgmma-moe-permuted-index-halves-swapped", "lily/kernels/moe_wgmma.py",
        [("return (g + 16 * q + 8 * h + 4 * e + s).to(device)", "return (g + 16 * q + 8 * h + 4 * s + e).to(device)")],
        [["tests/test_kernels_moe_wgmma.py", "-k", "permuted_fragment"]],
        "the permuted-K activation order pairs the wrong codes (not nibbles s and s + 4 of a word)"),
    Mutation(
        "run-ahead-host-token", "lily/engine/worker.py",
        [("                nxt = self._launch(seq, after=step)",
          "                nxt = self._launch(seq, token=seq.next_token)")],
        [["tests/test_worker_run_ahead.py", "-k", "streamed"]],
        "the step run ahead is fed the host's stale token instead of the last step's pick on the device"),
    Mutation(
        "run-ahead-state-cached", "lily/engine/sequence.py",
        [("                and not self.ahead):", "                ):")],
        [["tests/test_worker_run_ahead.py", "-k", "cancel"]],
        "a stream cancelled with a step in flight caches its state, one token past its output"),
    Mutation(
        "overlap-release-before-the-piece", "lily/engine/sequence.py",
        [("            self._in_flight[0].settle()\n", "")],
        [["tests/test_worker_overlap_prefill.py", "-k", "cancelled"]],
        "a sequence cancelled with its prompt piece in flight hands its state back before the piece has run"),
    Mutation(
        "overlap-joiner-steps-alone", "lily/engine/worker.py",
        [("        if not seqs or read_ahead:", "        if not seqs:")],
        [["tests/test_worker_overlap_prefill.py", "-k", "joining"]],
        "a sequence out of its prompt takes a decode step of its own beside the others' step run ahead"),
    Mutation(
        "sample-step-ahead-reuses-the-draw", "lily/engine/worker.py",
        [("pick=seq.row_sampling(ahead=0 if after is None else 1))", "pick=seq.row_sampling(ahead=0))")],
        [["tests/test_worker_sampled_run_ahead.py", "-k", "lone"]],
        "a lone sampled stream's step queued ahead draws with the key of the token before it"),
    Mutation(
        "sample-window-race-ignores-the-kept-set", "lily/kernels/sample.py",
        [("        key = tl.where(keep, s + _gumbel(ids, lo, hi), float(\"-inf\"))",
          "        key = tl.where(wok, s + _gumbel(ids, lo, hi), float(\"-inf\"))")],
        [["tests/test_kernels_sample.py", "-k", "references_tokens or kept_distribution"]],
        "the kernels race over the whole top-k window, not the tokens top-p and min-p keep"),
    Mutation(
        "sample-rejection-keeps-the-first-winner", "lily/kernels/sample.py",
        [("                    if (mass < top_p) & (tl.exp(sc - lse) >= min_p * best):",
          "                    if mass == mass:")],
        [["tests/test_kernels_sample.py", "-k", "flat_nucleus"]],
        "past the window, the row's winner is taken without checking it against the kept set"),
    Mutation(
        "sample-key-half-sign-extended", "lily/kernels/sample.py",
        [("    lo = tl.load(ip_ptr + at + 4).to(tl.int64) & 0xFFFFFFFF", "    lo = tl.load(ip_ptr + at + 4).to(tl.int64)")],
        [["tests/test_kernels_sample.py", "-k", "references_tokens"]],
        "a draw key's low half read back from its int32 word sign-extended: the kernels' noise is not the reference's"),
    Mutation(
        "bench-merge-failed-rerun-replaces-rows", "lily/bench/merge.py",
        [("if not eng.get(\"ok\") and had_rows:", "if False:")],
        [["tests/test_bench.py", "-k", "merge_keeps"]],
        "a peer's failed separate run replaces the rows the earlier run has"),
    Mutation(
        "split-k-last-sums-never-last", "lily/kernels/q4_gemm.py",
        [("            if arrived == splits - 1:", "            if arrived == splits:")],
        [["tests/test_kernels_prefill.py", "-k", "last_split"]],
        "no split of a tile counts itself the last: the partials are never summed into the output"),
    Mutation(
        "split-k-last-sums-counts-kept", "lily/kernels/q4_gemm.py",
        [('                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")', "                pass")],
        [["tests/test_kernels_prefill.py", "-k", "last_split"]],
        "the last split leaves its tile's arrival count up: the next call (a graph's next replay) never sums"),
    Mutation(
        "moe-down-self-routing-unnormalised", "lily/kernels/moe_decode.py",
        [("        sel_e, sel_w = route_topk(logits_ptr, E, E_P2, TOPK, SP2, NORM_TOPK, KEY32, PAIRS,",
          "        sel_e, sel_w = route_topk(logits_ptr, E, E_P2, TOPK, SP2, False, KEY32, PAIRS,")],
        [["tests/test_kernels_decode.py", "-k", "moe_decode"]],
        "the MoE down routing itself (a programmatic launch) without the top-k renormalisation"),
    Mutation(
        "moe-rows-down-self-routing-in-score-order", "lily/kernels/moe_decode.py",
        [("ROUTE_SELF=route_self, ROWS=True, BY_EXPERT=by_expert,", "ROUTE_SELF=route_self, ROWS=True, BY_EXPERT=False,")],
        [["tests/test_kernels_decode.py", "-k", "moe_rows"]],
        "a batch's down routing itself keeps the score order while gate_up stored act in expert order"),
    Mutation(
        "moe-topk-pairs-second-from-the-losers", "lily/kernels/moe_decode.py",
        [("    return tl.maximum(a1, a2), tl.maximum(tl.minimum(a1, a2), tl.maximum(b1, b2))",
          "    return tl.maximum(a1, a2), tl.maximum(b1, b2)")],
        [["tests/test_kernels_decode.py", "-k", "moe_decode or int32_keys"]],
        "the routing's top-2 a round keeps the larger second, dropping a pair's loser that beats it"),
    Mutation(
        "moe-gate-up-two-ahead-skips-a-unit", "lily/kernels/moe_decode.py",
        [("            wg, sg, bg, wu, su, bu = wg1, sg1, bg1, wu1, su1, bu1",
          "            wg, sg, bg, wu, su, bu = wg_n, sg_n, bg_n, wu_n, su_n, bu_n")],
        [["tests/test_kernels_decode.py", "-k", "moe_rows"]],
        "gate_up two units ahead computes each unit on the tiles of the unit two further on"),
    Mutation(
        "half-dot-centre-not-in-bias", "lily/kernels/quant_gemv.py",
        [("            bias += 8.0 * sf             # the dot was of code - 8", "            pass")],
        [["tests/test_kernels_decode.py", "-k", "half-dot and plain_norm"]],
        "the fp16-pair GEMV dots code - 8 but the bias term does not add the 8 back"),
    Mutation(
        "half-dot-scale-not-undone", "lily/kernels/quant_gemv.py",
        [("        unscale = 1.0 / xs", "        unscale = 1.0")],
        [["tests/test_kernels_decode.py", "-k", "half-dot and blocks_cover"]],
        "the fp16-pair GEMV leaves its row sums times the program's power-of-two x scale"),
    Mutation(
        "half-dot-odd-pair-takes-wrong-x", "lily/kernels/half_dot.py",
        [("pack_half2(x1 * hi, x5 * hi)", "pack_half2(x1 * hi, x4 * hi)")],
        [["tests/test_half_dot.py", "-k", "exact"], ["tests/test_kernels_decode.py", "-k", "half-dot and perm64"]],
        "code 5 of each word multiplied by code 4's x"),
    Mutation(
        "half-dot-centre-off-by-eight", "lily/kernels/half_dot.py",
        [("    return (_centred(w & 0x000F000F, 1032.0),", "    return (_centred(w & 0x000F000F, 1024.0),")],
        [["tests/test_half_dot.py", "-k", "exact or rounding"]],
        "codes 0 and 4 of each word not centred (the others are)"),
    Mutation(
        "moe-half-dot-bias-misses-centre", "lily/kernels/moe_decode.py",
        [("        return q, b.to(tl.float32) + 8.0 * s.to(tl.float32)", "        return q, b.to(tl.float32)")],
        [["tests/test_kernels_decode.py", "-k", "moe_decode and half-dot"]],
        "the MoE kernels' fp16-pair dots are of code - 8 but their bias terms do not add the 8 back"),
    Mutation(
        "gemv-sums-from-codes-one-position", "lily/kernels/quant_gemv.py",
        [("        xw += xk\n", "        xw = xk\n")],
        [["tests/test_kernels_decode.py", "-k", "prologue_sums"]],
        "the prologue's per-group sums of x (the bias term) from one code position of each word instead of all 8"),
    Mutation(
        "gemv-even-tiles-prefetch-this-block", "lily/kernels/quant_gemv.py",
        [("            nxt = tl.where(blk + nprog < nblk, blk + nprog, blk)", "            nxt = blk")],
        [["tests/test_kernels_decode.py", "-k", "prologue_sums"], ["tests/test_kernels_decode.py", "-k", "residual"]],
        "the unmasked tiles' prefetch requests this block again: each later block is computed on its program's first"),
    Mutation(
        "gate-up-shared-first-slot-order", "lily/kernels/moe_decode.py",
        [("        return (u // NBI + SLOTS - 1) % SLOTS", "        return u // NBI")],
        [["tests/test_kernels_decode.py", "-k", "shared_expert_first"], ["tests/test_kernels_decode.py", "-k",
                                                                         "test_moe_decode and half-dot"]],
        "gate_up's units in slot order while the programs that start on a shared unit skip their first unit"),
    Mutation(
        "gemv-residual-a-block-behind", "lily/kernels/quant_gemv.py",
        [("        w, s, b, res = w_n, s_n, b_n, res_n\n", "        w, s, b = w_n, s_n, b_n\n")],
        [["tests/test_kernels_decode.py", "-k", "residual"]],
        "the GEMV's residual, requested a block ahead, is not moved on: every block adds its first block's rows"),
    Mutation(
        "gemv-rows-every-row-reads-the-first", "lily/kernels/quant_gemv_rows.py",
        [("_row_input(x_ptr + m * x_stride,", "_row_input(x_ptr + 0 * x_stride,")],
        [["tests/test_kernels_gemv_rows.py", "-k", "plain_and_norm"]],
        "the GEMV over a few rows builds every row's x from the first row"),
    Mutation(
        "gemv-rows-pair-scale-not-undone", "lily/kernels/quant_gemv_rows.py",
        [("        factor = factor / xs\n", "        factor = factor\n")],
        [["tests/test_kernels_gemv_rows.py", "-k", "plain_and_norm and half-dot"]],
        "the GEMV over a few rows keeps each row's power-of-two x scale on its sums"),
    Mutation(
        "moe-down-half-slot-scale-not-undone", "lily/kernels/moe_decode.py",
        [("        wt = wt / xs\n", "        wt = wt\n")],
        [["tests/test_kernels_decode.py", "-k", "moe_decode and half-dot"]],
        "the MoE down's routed slots keep their act's power-of-two scale (the shared expert's is undone)"),
    Mutation(
        "union-half-dot-row-scale-not-undone", "lily/kernels/moe_union.py",
        [("        wt = tl.load(wts_ptr + pair) * unscale", "        wt = tl.load(wts_ptr + pair)")],
        [["tests/test_kernels_moe_union.py", "-k", "matches_each and half-dot"]],
        "the union MoE's down leaves each pair's sums times its act's power-of-two scale"),
    Mutation(
        "union-group-sums-mis-scaled", "lily/kernels/moe_union.py",
        [("(x3 + x7) * 4096.0", "(x3 + x7) * 256.0")],
        [["tests/test_kernels_moe_union.py", "-k", "matches_each"]],
        "the union MoE's bias term sums code positions 3 and 7 of x at the wrong scale"),
    Mutation(
        "union-second-pair-opens-the-list", "lily/kernels/moe_union.py",
        [("        opens = ok & (at == 0)", "        opens = ok & (at == 1)")],
        [["tests/test_kernels_moe_union.py", "-k", "matches_each"]],
        "an expert becomes live at its second pair, so the experts that one row chose are left out"),
    Mutation(
        "union-down-into-another-row", "lily/kernels/moe_union.py",
        [("        hrow = h_ptr + (pair // (TOPK + 1)).to(tl.int64) * H",
          "        hrow = h_ptr + ((pair // (TOPK + 1) + 1) % ROWS).to(tl.int64) * H")],
        [["tests/test_kernels_moe_union.py", "-k", "matches_each"]],
        "down adds a pair's expert output into another row of h"),
    Mutation(
        "union-counters-kept-across-steps", "lily/model/fast_batch.py",
        [("            self.moe_union_scratch.reset()", "            pass")],
        [["tests/test_fast_batch.py", "-k", "moe_paths and union"]],
        "the union MoE's counters are not zeroed at a step's start (the second step appends to the first's lists)"),
    Mutation(
        "prefill-chunk-never-gives-way", "lily/engine/fast_backend.py",
        [("            if left >= per or chunk == chunks[-1]:", "            if True:")],
        [["tests/test_state_pool.py", "-k", "gives_way"]],
        "a full prefill chunk's scratch that leaves no room for one sequence is kept (a 24 GB card: no slot at all)"),
    Mutation(
        "split-stages-ignore-the-card", "lily/kernels/attention_decode.py",
        [("    return SPLIT_STAGES if max_shared_bytes(device) >= SPLIT_THREE_STAGES_BYTES else min(SPLIT_STAGES, 2)",
          "    return SPLIT_STAGES")],
        [["tests/test_shared_memory.py"]],
        "the decode attention keeps its three stages on a 99 KiB card (138 KiB: the decode step would not load)"),
    Mutation(
        "scan-stages-ignore-the-card", "lily/kernels/gdn_chunked.py",
        [("    if stages > 1 and max_shared_bytes(device) < SCAN_TWO_STAGES_BYTES:",
          "    if stages > 1 and max_shared_bytes(device) < 0:")],
        [["tests/test_shared_memory.py", "-k", "every_launch"]],
        "the prefill's chunk walk keeps two stages on a 99 KiB card (112 KiB: Triton refuses it as it loads)"),
    Mutation(
        "genconfig-top-k-not-a-default", "lily/server/generations.py",
        [("    top_k = defaults.top_k if body.top_k is None else body.top_k",
          "    top_k = 0 if body.top_k is None else body.top_k")],
        [["tests/test_server_generation_config.py", "-k", "leaves_sampling_out"]],
        "a request that leaves top_k out samples with top_k off, not the checkpoint's generation_config.json"),
    Mutation(
        "genconfig-request-zero-is-unset", "lily/server/generations.py",
        [("    top_k = defaults.top_k if body.top_k is None else body.top_k",
          "    top_k = body.top_k or defaults.top_k")],
        [["tests/test_server_generation_config.py", "-k", "sets_win"],
         ["tests/test_server_generation_config.py", "-k", "own_zeros"]],
        "a request's top_k 0 (off) reads as unset: the checkpoint's top_k applies"),
]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def copy_tree(dst: Path) -> None:
    """The tracked files as they are in the working tree (uncommitted edits included)."""
    for rel in tracked_files():
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def apply(m: Mutation, root: Path) -> str | None:
    """Makes m's edits under root; returns why not, or None."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    text = path.read_text()
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            return f"old string found {n} times in {m.file} (must be once): {old.strip()[:70]!r}"
        text = text.replace(old, new)
    path.write_text(text)
    return None


def run_pytest(root: Path, args: list[str]) -> tuple[int, float, list[str], str, int]:
    """(returncode, seconds, failed test ids with their one-line reason, output tail, seed)."""
    seed = random.SystemRandom().randrange(2**32)
    env = dict(os.environ, PYTHONPATH=str(root), LILY_TEST_SEED=str(seed), COLUMNS="400")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {TIMEOUT_S} s\n{(e.stdout or b'')[-2000:]!r}"
    failed = [line[len("FAILED "):] for line in out.splitlines() if line.startswith("FAILED ")]
    return rc, time.perf_counter() - t0, failed, out[-3000:], seed


def check(m: Mutation, baseline: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"lily-mut-{m.name}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        if baseline:
            for sel in m.selections:
                rc, secs, failed, tail, seed = run_pytest(root, sel)
                ok = rc == 0
                rows.append(dict(mutation=m.name + " (unmutated)", file=m.file, tests=" ".join(sel), seconds=secs,
                                 ok=ok, caught="passes" if ok else f"FAILS UNMUTATED (rc {rc}, seed {seed})",
                                 detail=None if ok else tail))
        why = apply(m, root)
        if why:
            return rows + [dict(mutation=m.name, file=m.file, tests="-", seconds=0.0, ok=False,
                                caught=f"EDIT NOT APPLIED: {why}", detail=None)]
        for sel in m.selections:
            rc, secs, failed, tail, seed = run_pytest(root, sel)
            caught = rc == 1 and bool(failed)
            if caught:
                test, _, reason = failed[0].partition(" - ")
                label, detail = test, reason
            else:
                label = {0: "SURVIVED", -1: "TIMED OUT"}.get(rc, f"NOT A TEST FAILURE (rc {rc})") + f" (seed {seed})"
                detail = tail
            rows.append(dict(mutation=m.name, file=m.file, tests=" ".join(sel), seconds=secs, ok=caught,
                             caught=label, detail=detail))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME", help="run this mutation only (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true", help="run each selection unmutated first: it must pass")
    args = ap.parse_args()
    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names), "duplicate mutation names"
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:34} {m.file:36} {' | '.join(' '.join(s) for s in m.selections)}\n{'':34} {m.what}")
        return 0
    todo = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            ap.error(f"unknown mutation(s) {unknown}; --list shows them")
        todo = [m for m in MUTATIONS if m.name in args.only]
    rows = []
    for m in todo:
        print(f"-- {m.name}: {m.what}", flush=True)
        for r in check(m, args.baseline):
            print(f"   {'ok ' if r['ok'] else 'BAD'} {r['tests']}: {r['caught']} ({r['seconds']:.0f} s)", flush=True)
            rows.append(r)
    cols = [("mutation", 34), ("file", 34), ("tests run", 52), ("caught by", 0)]
    print()
    print(" | ".join(f"{c:{w}}" for c, w in cols[:-1]) + " | caught by | s")
    print("-+-".join("-" * max(w, 9) for _, w in cols))
    for r in rows:
        print(f"{r['mutation']:34} | {r['file'].removeprefix('lily/'):34} | {r['tests']:52} | {r['caught']} | "
              f"{r['seconds']:.0f}")
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} checks as required "
          f"({len({r['mutation'] for r in rows})} mutations, {sum(r['seconds'] for r in rows):.0f} s of pytest)")
    for r in bad:
        print(f"\n== {r['mutation']} / {r['tests']}: {r['caught']}\n{r['detail'] or ''}")
    reasons = [r for r in rows if r["ok"] and r.get("detail") and "(unmutated)" not in r["mutation"]]
    if reasons:
        print("\nwhy each was caught (the first failure's message):")
        for r in reasons:
            print(f"  {r['mutation']}: {' '.join(r['detail'].split())[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
