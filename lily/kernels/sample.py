"""Each row's next token chosen on the device, with nothing read back: the argmax, or a draw from
softmax(logits / T) restricted by top-k, top-p and min-p. A sampled stream can then run a step ahead as a
greedy one does (lily.engine.worker), and a batch's rows draw in two launches, not a host sync a row.

The draw is a Gumbel race keyed by the token id: the token is the argmax, over the kept set, of s_i + G_i with
s = clamp(logits / T) and G_i = -log(-log(u_i)), u_i a hash of (the draw's 64-bit key, i): a sample of softmax(s)
restricted to the kept set, exact but for the noise's resolution (u has 23 bits, so G stays below ~16.6: a token
more than ~16 below the best score is drawn less often than its probability, below e^-16 each, and one ~19.4
below never). A request's n-th draw has the key `draw_key(seed, n)`, so its tokens
depend on its logits and seed only: alone or in a batch, run ahead or not, here or in the torch reference
(`sample_rows_reference`, what lily.engine.sampling runs on the CPU).

The kept set (lily.engine.sampling's): the top-k by rank; then, over the softmax of that set, a token stays while
the mass of the tokens above it is below top_p and its probability is at least min_p times the best's; the best
always stays. It is an upper set of the row's scores (exact ties at its edge are all kept here).

  partials: grid (B, cdiv(V, SLICE)): each slice's max and sum of exp(s - max) (the row's log-sum-exp, for
            top-p over the whole vocabulary) and its race winner over every token (greedy rows: the largest
            logit; ties to the lowest id).
  finish:   grid (B,): greedy and unfiltered rows take the slices' winner. A filtered row reads its window (the
            caller's torch.topk of the logits: their order is that of logits / T) and keeps its prefix as above;
            the race over the window decides, unless every window token is kept and more may be (top-p or min-p
            alone over a flat distribution). Then the row's winner is checked against the kept set (the mass of
            the tokens above it; its probability against the best's) and, while it is not kept, the race's winner
            among the tokens above it (from the same pass) is: the kept set lies above any token not kept, so the
            first winner kept is its winner. Each round is a pass over the row in one program, rare on a trained
            model.
top_k between WINDOW and V is not handled here (`handles`): lily.engine.sampling draws such rows in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from lily.kernels.host_math import cdiv, next_power_of_2

GREEDY_BELOW = 1e-5   # temperatures this small are argmax in all but name
LIMIT = 1e30          # finite bound for scaled scores (a tiny temperature must not overflow into inf)
WINDOW = 1024         # the best tokens a filtered row's kept set is looked for in first
SLICE = 4096          # tokens a partials program covers
PASS_BLOCK = 4096     # tokens a step of the finishing program's passes over a row
MAX_ROUNDS = 64       # races above a winner not kept (each keeps a random share of the tokens above it)
PARAMS = 6            # int32 words of a row's draw parameters (_row_params)
PARAMS_JIT = tl.constexpr(PARAMS)   # (the same, as jitted code may read a global)
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class RowSampling:
    """One row's draw: temperature < GREEDY_BELOW is the argmax; top_k <= 0 or >= V is off; key: draw_key()."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    key: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def allowed(self, vocab: int) -> int:
        return self.top_k if 0 < self.top_k < vocab else vocab

    def filters(self, vocab: int) -> bool:
        return not self.greedy and (self.allowed(vocab) < vocab or self.top_p < 1.0 or self.min_p > 0.0)


def handles(top_k: int, vocab: int) -> bool:
    """Whether the kernels draw a row with this top_k (its top-k set within the window, or all tokens)."""
    return top_k <= WINDOW or top_k >= vocab


def draw_key(seed: int, n: int) -> int:
    """The 64-bit key of the n-th draw of a request seeded `seed` (splitmix64 of the n-th step from it)."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


# -- the race's noise: the same integer steps in Triton and torch (int64 lanes, 32-bit products split in
#    16-bit halves so nothing overflows), so kernel and reference draw the same token ------------------
@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel(tok, lo, hi):
    """G for token ids `tok` under the key (lo, hi): u in (0, 1) from 23 hashed bits, -log(-log(u))."""
    h = _mix32(tok.to(tl.int64) ^ lo)
    h = _mix32(h ^ hi)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return -tl.log(-tl.log(u))


def _mix32_reference(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & _M32
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & _M32
    return x ^ (x >> 16)


def gumbel_reference(ids: torch.Tensor, key: int) -> torch.Tensor:
    """The race's noise for token ids `ids` under a draw key (fp32, on ids' device)."""
    h = _mix32_reference(ids.to(torch.int64) ^ (key & _M32))
    h = _mix32_reference(h ^ (key >> 32))
    u = ((h >> 9).to(torch.float32) + 0.5) * 1.1920928955078125e-07
    return -torch.log(-torch.log(u))


# -- the kernels ----------------------------------------------------------------------------------------
@triton.jit
def _scores(row_ptr, offs, V, T):
    """s = clamp(logits / T) at offs, -inf past the row."""
    ok = offs < V
    s = tl.load(row_ptr + offs, mask=ok, other=0.0) / T
    return tl.where(ok, tl.minimum(tl.maximum(s, -1e30), 1e30), float("-inf"))


@triton.jit
def _row_draw(fp_ptr, ip_ptr, row):
    """A row's parameters (_row_params: one int32 row of PARAMS words, the first three fp32 bits):
    temperature, top_p, min_p, top_k and the key's low and high 32 bits (as non-negative int64)."""
    at = row * PARAMS_JIT
    lo = tl.load(ip_ptr + at + 4).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(ip_ptr + at + 5).to(tl.int64) & 0xFFFFFFFF
    return (tl.load(fp_ptr + at), tl.load(fp_ptr + at + 1), tl.load(fp_ptr + at + 2), tl.load(ip_ptr + at + 3),
            lo, hi)


@triton.jit
def _race_block(key, start, best_k, best_i):
    """The race's leader after a block of keys for the tokens start, start + 1, ... (ties to the lower id)."""
    kb = tl.max(key, 0)
    ib = (tl.argmax(key, 0) + start).to(tl.int32)
    better = kb > best_k
    return tl.where(better, kb, best_k), tl.where(better, ib, best_i)


@triton.jit
def _sample_partials_kernel(logits_ptr, stride, V, fp_ptr, ip_ptr, pm_ptr, pse_ptr, pk_ptr, pi_ptr, n_parts,
                            SLICE: tl.constexpr, BLOCK: tl.constexpr, GREEDY_BELOW: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    T, top_p, min_p, k, lo, hi = _row_draw(fp_ptr, ip_ptr, row)
    greedy = T < GREEDY_BELOW
    Ts = tl.where(greedy, 1.0, T)
    race = (T >= GREEDY_BELOW) & ((k <= 0) | (k >= V))   # (a row with top-k draws in its window)
    m = tl.full([], float("-inf"), tl.float32)
    se = tl.zeros([], tl.float32)
    best_k = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for i in range(0, SLICE, BLOCK):
        offs = part * SLICE + i + tl.arange(0, BLOCK)
        s = _scores(row_ptr, offs, V, Ts)
        nm = tl.maximum(m, tl.max(s, 0))
        se = se * tl.exp(m - nm) + tl.sum(tl.exp(s - nm), 0)
        m = nm
        key = s
        if race:
            key = tl.where(offs < V, s + _gumbel(offs, lo, hi), float("-inf"))
        best_k, best_i = _race_block(key, part * SLICE + i, best_k, best_i)
    at = row * n_parts + part
    tl.store(pm_ptr + at, m)
    tl.store(pse_ptr + at, se)
    tl.store(pk_ptr + at, best_k)
    tl.store(pi_ptr + at, best_i)


@triton.jit
def _above(row_ptr, V, T, sc, lse, lo, hi, BLOCK: tl.constexpr):
    """Over the row's tokens scoring above sc: their probability mass (softmax with log-sum-exp lse) and the
    race's winner among them."""
    mass = tl.zeros([], tl.float32)
    best_k = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        s = _scores(row_ptr, offs, V, T)
        above = s > sc
        mass += tl.sum(tl.where(above, tl.exp(s - lse), 0.0), 0)
        key = tl.where(above, s + _gumbel(offs, lo, hi), float("-inf"))
        best_k, best_i = _race_block(key, start, best_k, best_i)
    return mass, best_i


@triton.jit
def _sample_finish_kernel(logits_ptr, stride, V, fp_ptr, ip_ptr, pm_ptr, pse_ptr, pk_ptr, pi_ptr, n_parts,
                          vals_ptr, idx_ptr, W, out_ptr, PARTS: tl.constexpr, WBLOCK: tl.constexpr,
                          PASS_BLOCK: tl.constexpr, GREEDY_BELOW: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    T, top_p, min_p, k, lo, hi = _row_draw(fp_ptr, ip_ptr, row)
    q = tl.arange(0, PARTS)
    qok = q < n_parts
    pk = tl.load(pk_ptr + row * n_parts + q, mask=qok, other=float("-inf"))
    pi = tl.load(pi_ptr + row * n_parts + q, mask=qok, other=0)
    tok = tl.sum(tl.where(q == tl.argmax(pk, 0), pi, 0), 0)   # the row's winner (the lowest slice on ties)
    allowed = tl.where((k > 0) & (k < V), k, V)
    filtering = (allowed < V) | (top_p < 1.0) | (min_p > 0.0)
    if (T >= GREEDY_BELOW) & filtering:
        pm = tl.load(pm_ptr + row * n_parts + q, mask=qok, other=float("-inf"))
        pse = tl.load(pse_ptr + row * n_parts + q, mask=qok, other=0.0)
        big = tl.max(pm, 0)
        lse_all = big + tl.log(tl.sum(pse * tl.exp(pm - big), 0))
        j = tl.arange(0, WBLOCK)
        wok = j < W
        v = tl.load(vals_ptr + row * W + j, mask=wok, other=0.0) / T
        s = tl.where(wok, tl.minimum(tl.maximum(v, -1e30), 1e30), float("-inf"))
        ids = tl.load(idx_ptr + row * W + j, mask=wok, other=0)
        in_k = wok & (j < allowed)
        top = tl.max(s, 0)
        lse_k = top + tl.log(tl.sum(tl.where(in_k, tl.exp(s - top), 0.0), 0))
        lse = tl.where(allowed < V, lse_k, lse_all)
        probs = tl.where(in_k, tl.exp(s - lse), 0.0)
        best = tl.max(probs, 0)
        before = tl.cumsum(probs, 0) - probs
        keep = in_k & (((before < top_p) & (probs >= min_p * best)) | (j == 0))
        last = tl.sum(tl.where(j == W - 1, keep.to(tl.int32), 0), 0) > 0
        key = tl.where(keep, s + _gumbel(ids, lo, hi), float("-inf"))
        wtok = tl.sum(tl.where(j == tl.argmax(key, 0), ids, 0), 0).to(tl.int32)   # the window's winner
        if (allowed > W) & last:
            # every window token kept, and maybe more: check the row's winner, race above it while not kept
            s_last = tl.min(tl.where(wok, s, float("inf")), 0)
            sc = _scores(row_ptr, tok, V, T)
            done = (sc >= s_last).to(tl.int32)
            for _ in range(MAX_ROUNDS):
                if done == 0:
                    mass, above = _above(row_ptr, V, T, sc, lse, lo, hi, PASS_BLOCK)   # (one pass a round)
                    if (mass < top_p) & (tl.exp(sc - lse) >= min_p * best):
                        done = done + 1
                    else:
                        tok = above
                        sc = _scores(row_ptr, tok, V, T)
                        done = (sc >= s_last).to(tl.int32)
            # (rounds run out only on non-finite logits, whose row fails anyway: the window's winner then)
            tok = tl.where(done != 0, tok, wtok)
        else:
            tok = wtok
    tl.store(out_ptr + row, tok.to(tl.int32))


def _row_params(picks: list[RowSampling], device: torch.device) -> torch.Tensor:
    """int32 [B, PARAMS] on the device: a row's temperature, top_p and min_p (fp32 bits), top_k, and its key's
    low and high 32 bits; one pinned buffer and one copy, no sync."""
    rows = np.empty((len(picks), PARAMS), dtype=np.int32)
    rows.view(np.float32)[:, :3] = [[pk.temperature, pk.top_p, pk.min_p] for pk in picks]
    rows.view(np.uint32)[:, 3:] = [[min(max(pk.top_k, 0), 2**31 - 1), pk.key & _M32, (pk.key >> 32) & _M32]
                                   for pk in picks]
    host = torch.from_numpy(rows)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def sample_rows(logits: torch.Tensor, picks: list[RowSampling], use_kernel: bool | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token: int32 [B] on logits' device (into `out` if given), queued (nothing is read back).
    logits fp32 [B, V]. use_kernel: the Triton kernels (default on CUDA) or the torch reference."""
    if use_kernel is None:
        use_kernel = logits.is_cuda
    if not use_kernel:
        tokens = sample_rows_reference(logits, picks).to(device=logits.device)
        return tokens if out is None else out.copy_(tokens)
    logits = logits.float().contiguous()
    rows, vocab = logits.shape
    if len(picks) != rows:
        raise ValueError(f"{len(picks)} samplings for {rows} rows")
    for pk in picks:
        if not pk.greedy and not handles(pk.top_k, vocab):
            raise ValueError(f"top_k {pk.top_k} is drawn in torch (lily.engine.sampling), not here")
    dev = logits.device
    ip = _row_params(picks, dev)
    fp = ip.view(torch.float32)
    window = max((min(pk.allowed(vocab), WINDOW) for pk in picks if pk.filters(vocab)), default=0)
    if window:
        vals, idx = torch.topk(logits, window, dim=-1)
    else:
        vals = torch.empty(1, dtype=torch.float32, device=dev)
        idx = torch.empty(1, dtype=torch.int64, device=dev)
    slice_ = min(SLICE, next_power_of_2(vocab))   # (a power of two: whole blocks)
    n_parts = cdiv(vocab, slice_)
    pm = torch.empty(rows, n_parts, dtype=torch.float32, device=dev)
    pse, pk_, pi = torch.empty_like(pm), torch.empty_like(pm), torch.empty(rows, n_parts, dtype=torch.int32, device=dev)
    block = min(1024, next_power_of_2(vocab))
    _sample_partials_kernel[(rows, n_parts)](logits, logits.stride(0), vocab, fp, ip, pm, pse, pk_, pi, n_parts,
                                             SLICE=slice_, BLOCK=block, GREEDY_BELOW=GREEDY_BELOW, num_warps=4)
    out = torch.empty(rows, dtype=torch.int32, device=dev) if out is None else out
    _sample_finish_kernel[(rows,)](logits, logits.stride(0), vocab, fp, ip, pm, pse, pk_, pi, n_parts, vals, idx,
                                   window, out, PARTS=max(2, next_power_of_2(n_parts)),
                                   WBLOCK=max(2, next_power_of_2(window)),
                                   PASS_BLOCK=min(PASS_BLOCK, next_power_of_2(vocab)), GREEDY_BELOW=GREEDY_BELOW,
                                   MAX_ROUNDS=MAX_ROUNDS, num_warps=8)
    return out


# -- the reference ---------------------------------------------------------------------------------------
def kept_tokens(scores: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The ids a draw may choose from, scores = clamp(logits / T) [V]: best first. Each filter keeps a prefix
    of the tokens sorted by score, so only that prefix is sorted: a window of the best tokens, widened until
    the kept prefix ends inside it (no full-vocabulary sort)."""
    vocab = scores.shape[-1]
    allowed = top_k if 0 < top_k < vocab else vocab
    if allowed == vocab and top_p >= 1.0 and min_p <= 0.0:
        return torch.arange(vocab, device=scores.device)
    lse = torch.logsumexp(torch.topk(scores, allowed).values if allowed < vocab else scores, -1)
    window = min(allowed, WINDOW)
    while True:
        vals, idx = torch.topk(scores, window)          # best first
        probs = torch.exp(vals - lse)                     # normalised over the top-k set
        keep = (torch.cumsum(probs, -1) - probs < top_p) & (probs >= min_p * probs[0])
        keep[0] = True  # the best token always stays (a tiny top_p rounds to 0 in fp32)
        if window == allowed or not bool(keep[-1]):
            return idx[keep]
        window = min(allowed, window * 8)


def sample_row_reference(logits: torch.Tensor, pick: RowSampling) -> int:
    """One row's token in plain torch (fp32 logits [V])."""
    if pick.greedy:
        return int(torch.argmax(logits))
    scores = (logits.float() / pick.temperature).clamp(-LIMIT, LIMIT)
    ids = kept_tokens(scores, pick.top_k, pick.top_p, pick.min_p)
    return int(ids[torch.argmax(scores[ids] + gumbel_reference(ids, pick.key))])


def sample_rows_reference(logits: torch.Tensor, picks: list[RowSampling]) -> torch.Tensor:
    """sample_rows in plain torch: int32 [B] on the CPU."""
    return torch.tensor([sample_row_reference(row, pk) for row, pk in zip(logits, picks)], dtype=torch.int32)
