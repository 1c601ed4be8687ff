"""Fidelity: does the backend compute the same function as the fp32 reference on the same weights?

Teacher-forced over a fixed prompt (the contract's synthetic prompt, 192 positions by default): the
reference (fp32, quantized weights dequantized on use, so the full model fits one GPU) gives logits at
every position in one forward; the backend under test gives its prefill logits for the first position,
then its decode logits for each next prompt token (the decode path is what generation runs). Reported
beside the same measures for the reference run in bf16: the spread any bf16 engine should expect.
"""

from __future__ import annotations

import torch

from lily.bench.contract import synthetic_prompt

DEFAULT_POSITIONS = 192


def compare_logits(test: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-position measures of `test` against `ref` (both [T, V], compared in fp32).

    rel_err: ||test - ref|| / ||ref|| per position; KL(ref || test) of the softmaxes; top-1 agreement;
    `top1_agree_decisive`: agreement only where the reference's top-2 margin exceeds the largest
    absolute logit error at that position (there a bf16 engine has no excuse to flip)."""
    t, r = test.float(), ref.float()
    rel = (t - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    lr, lt = torch.log_softmax(r, -1), torch.log_softmax(t, -1)
    kl = (lr.exp() * (lr - lt)).sum(-1).clamp_min(0)
    agree = t.argmax(-1) == r.argmax(-1)
    top2 = r.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    decisive = margin > (t - r).abs().amax(-1)
    n_dec = int(decisive.sum())
    return {
        "rel_err_mean": float(rel.mean()), "rel_err_max": float(rel.max()),
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
        "top1_agree": float(agree.float().mean()),
        "decisive_positions": n_dec,
        "top1_agree_decisive": float(agree[decisive].float().mean()) if n_dec else None,
        "first_disagreement": int(torch.nonzero(~agree)[0]) if not bool(agree.all()) else None,
    }


def _release(backend, state) -> None:
    """Give a state back (the fast backend's comes from its slot pool: kept, it would hold the slot and a
    later state of the same size would be a second allocation, in the bench's peak memory)."""
    release = getattr(backend, "release_state", None)
    if release is not None:
        release(state)


def teacher_forced_logits(backend, ids: list[int]) -> torch.Tensor:
    """[T, V] fp32: the backend's prefill logits after ids[0], then decode logits after each ids[t]."""
    state = backend.new_state()
    try:
        rows = [backend.prefill(ids[:1], state).reshape(-1).float()]
        for tok in ids[1:]:
            rows.append(backend.decode(tok, state).reshape(-1).float())
        return torch.stack(rows)
    finally:
        _release(backend, state)


def prefill_last_logits(backend, ids: list[int]) -> torch.Tensor:
    state = backend.new_state()
    try:
        return backend.prefill(ids, state).reshape(1, -1).float().clone()
    finally:
        _release(backend, state)


def run(backend, config, weights, positions: int = DEFAULT_POSITIONS, device=None) -> dict:
    """Fidelity of `backend` against lily.model.reference on `weights` (the same dict the backend
    was built from). `device` defaults to the backend's."""
    from lily.model.reference import ReferenceModel

    device = torch.device(device or getattr(backend, "device", "cpu"))
    ids = synthetic_prompt(positions, config.vocab_size)
    ref32 = ReferenceModel(config, weights, device=device, dtype=torch.float32)
    ref_logits = ref32.forward(ids, ref32.new_state()).float()
    del ref32
    ref16 = ReferenceModel(config, weights, device=device, dtype=torch.bfloat16)
    bf16_logits = ref16.forward(ids, ref16.new_state()).float()
    del ref16
    tf = teacher_forced_logits(backend, ids).to(ref_logits.device)
    last = prefill_last_logits(backend, ids).to(ref_logits.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "positions": positions,
        "prompt": "contract synthetic prompt",
        "backend_vs_fp32": compare_logits(tf, ref_logits),
        "backend_prefill_last_vs_fp32": compare_logits(last, ref_logits[-1:]),
        "bf16_reference_vs_fp32": compare_logits(bf16_logits, ref_logits),
    }
