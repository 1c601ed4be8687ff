"""The benchmark contract (docs/design.md), shared by lily and every peer so all are measured alike.

Batch 1. The prompt is synthetic: token i = (i * 2654435761 mod 2^32) mod vocab. For each context L:
a warm-up at the exact shape (an L-token prefill plus a few decode steps), then per round one timed
prefill through the first generated token (on the host) and `decode_steps` timed greedy decode steps.
Rounds run the contexts in alternating order (ascending, descending, ...). A row is refused - kept in
the results but marked - when its rounds drift more than 3 % apart or its token digest changes.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

GOLDEN = 2654435761
MAX_DRIFT = 0.03
DEFAULT_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    """The contract's prompt: n token ids, a multiplicative hash of the position."""
    return [((i * GOLDEN) % (1 << 32)) % vocab for i in range(n)]


def token_digest(tokens: list[int]) -> str:
    """A short, stable fingerprint of generated token ids: equal digests mean identical greedy output."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def parse_contexts(text: str, option: str = "--contexts") -> list[int]:
    """'256,4K,128k' -> [256, 4096, 131072]; one clear error naming `option` for anything else."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1024 if p.endswith("k") else 1
        digits = p[:-1] if p.endswith("k") else p
        if not digits.isdigit() or int(digits) <= 0:
            raise ValueError(f"{option}: {part.strip()!r} is not a positive token count (e.g. 256,4K,131072)")
        out.append(int(digits) * mult)
    if not out:
        raise ValueError(f"{option}: no context given (e.g. 256,4096)")
    return sorted(set(out))


def round_orders(contexts: list[int], rounds: int) -> list[list[int]]:
    """Round r runs the contexts ascending when r is even, descending when odd."""
    asc = sorted(contexts)
    return [asc if r % 2 == 0 else asc[::-1] for r in range(rounds)]


class Engine(Protocol):
    """What the timing protocol drives. All ids are host ints; each call returns only when its
    result is on the host, so wall-clock time around it is the engine's true latency."""

    name: str

    def reset(self, max_seq: int) -> None: ...          # a fresh sequence with room for max_seq tokens
    def prefill(self, ids: list[int]) -> int: ...       # the first greedy token after the prompt
    def decode_greedy(self, token: int, steps: int) -> list[int]: ...  # `steps` more greedy tokens
    # optional: peak_mem_bytes: dict[int, int], the peak device memory seen at each context


@dataclass
class Round:
    prefill_s: float
    decode_s: float
    tokens: list[int]

    @property
    def digest(self) -> str:
        return token_digest(self.tokens)


def time_generation(engine: Engine, ids: list[int], steps: int, clock: Callable[[], float] = time.perf_counter) -> Round:
    """One timed run: prefill through the first token, then `steps` decode steps."""
    engine.reset(len(ids) + steps + 1)
    t0 = clock()
    first = engine.prefill(ids)
    t1 = clock()
    rest = engine.decode_greedy(first, steps) if steps > 0 else []
    t2 = clock()
    if len(rest) != steps:
        raise RuntimeError(f"{engine.name}: decode_greedy returned {len(rest)} tokens, expected {steps}")
    return Round(t1 - t0, t2 - t1, [int(first), *map(int, rest)])


def drift(values: list[float]) -> float:
    """Relative spread of repeated timings: (max - min) / min."""
    lo = min(values)
    return (max(values) - lo) / lo if lo > 0 else float("inf")


@dataclass
class Row:
    engine: str
    context: int
    decode_steps: int
    rounds: list[dict] = field(default_factory=list)   # {"prefill_s", "decode_s", "digest"}
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    prefill_drift: float | None = None
    decode_drift: float | None = None
    digest: str | None = None
    tokens: list[int] | None = None
    refused: str | None = None       # why the row must not be trusted; None when accepted
    peak_mem_bytes: int | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def judge(engine: str, context: int, steps: int, rounds: list[Round], max_drift: float = MAX_DRIFT) -> Row:
    """Fold repeated rounds into one row: median times, drift, digest check, refusal reason."""
    row = Row(engine, context, steps,
              rounds=[{"prefill_s": r.prefill_s, "decode_s": r.decode_s, "digest": r.digest} for r in rounds])
    if not rounds:
        row.refused = "no rounds ran"
        return row
    pre = [r.prefill_s for r in rounds]
    dec = [r.decode_s for r in rounds]
    row.prefill_tok_s = context / statistics.median(pre)
    row.decode_tok_s = steps / statistics.median(dec) if steps > 0 else None
    row.prefill_drift = drift(pre)
    row.decode_drift = drift(dec) if steps > 0 else 0.0
    row.digest = rounds[0].digest
    row.tokens = rounds[0].tokens
    reasons = []
    if len(rounds) < 2:
        reasons.append("fewer than 2 rounds")
    digests = sorted({r.digest for r in rounds})
    if len(digests) > 1:
        reasons.append(f"token digest changed between rounds ({', '.join(digests)})")
    if row.prefill_drift > max_drift:
        reasons.append(f"prefill rounds drift {100 * row.prefill_drift:.1f} % > {100 * max_drift:.0f} %")
    if row.decode_drift > max_drift:
        reasons.append(f"decode rounds drift {100 * row.decode_drift:.1f} % > {100 * max_drift:.0f} %")
    row.refused = "; ".join(reasons) or None
    return row


def log(msg: str) -> None:
    """A line on stderr, above the progress bar when one is drawn."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
    sys.stderr.flush()


def measure_matrix(engine: Engine, contexts: list[int], steps: int, rounds: int, vocab: int,
                   warmup_steps: int = 4, retries: int = 1, time_budget_s: float | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> list[Row]:
    """The whole protocol for one engine. Contexts predicted to overrun `time_budget_s` are skipped and
    marked (never silently dropped). A row refused for drift alone is re-measured `retries` times with
    fresh rounds; the last attempt's verdict stands and `extra.attempts` says how many there were."""
    start = clock()
    contexts = sorted(contexts)
    per_ctx: dict[int, list[Round]] = {c: [] for c in contexts}
    skipped: dict[int, str] = {}
    warmed: set[int] = set()
    seen: dict[int, tuple[float, float]] = {}       # context -> (prefill s, decode s) of its last round

    def predicted(c: int, timed_runs: int, warm: bool) -> float:
        """Seconds for `timed_runs` rounds of context c (+ its warm-up), from the nearest smaller context
        measured: prefill grows a little faster than linearly (attention), decode barely grows."""
        known = [k for k in seen if k <= c] or list(seen)
        if not known:
            return 0.0
        k = max(known)
        pre, dec = seen[k]
        pre, dec = pre * (c / k) ** 1.1, dec * max(c / k, 1.0) ** 0.1
        return timed_runs * (pre + dec) + (pre + dec * warmup_steps / max(steps, 1) if warm else 0.0)

    def over_budget(c: int, timed_runs: int, warm: bool) -> bool:
        if time_budget_s is None:
            return False
        return clock() - start + predicted(c, timed_runs, warm) > time_budget_s

    def run_round(c: int) -> Round:
        ids = synthetic_prompt(c, vocab)
        if c not in warmed:                          # warm-up at the exact shape
            engine.reset(c + warmup_steps + 1)
            engine.decode_greedy(engine.prefill(ids), warmup_steps)
            warmed.add(c)
        r = time_generation(engine, ids, steps, clock)
        seen[c] = (r.prefill_s, r.decode_s)
        return r

    from lily.progress import bar

    progress = bar(len(contexts) * rounds, f"[{engine.name}] timed rounds", unit="round")
    for order in round_orders(contexts, rounds):
        for c in order:
            progress.update(1)
            if c in skipped:
                continue
            if over_budget(c, rounds - len(per_ctx[c]), c not in warmed):   # all its runs must fit
                skipped[c] = f"skipped: predicted to overrun the {time_budget_s:.0f} s time budget"
                log(f"[{engine.name}] ctx {c}: {skipped[c]}")
                continue
            try:
                r = run_round(c)
            except Exception as e:   # e.g. out of memory at a long context: mark the row, keep the others
                skipped[c] = f"failed: {type(e).__name__}: {e}".splitlines()[0][:300]
                log(f"[{engine.name}] ctx {c}: {skipped[c]}")
                continue
            per_ctx[c].append(r)
            log(f"[{engine.name}] ctx {c}: prefill {c / r.prefill_s:,.0f} tok/s, decode "
                f"{steps / r.decode_s if steps else 0:,.1f} tok/s, digest {r.digest}")

    rows = []
    for c in contexts:
        if c in skipped:
            row = judge(engine.name, c, steps, per_ctx[c])
            row.refused = skipped[c]
            rows.append(row)
            continue
        row = judge(engine.name, c, steps, per_ctx[c])
        attempts = 1
        while (row.refused and "drift" in row.refused and "digest" not in row.refused
               and attempts <= retries and not over_budget(c, rounds, False)):
            attempts += 1
            log(f"[{engine.name}] ctx {c}: re-measuring ({row.refused})")
            progress.total += rounds
            progress.update(rounds)
            try:
                row = judge(engine.name, c, steps, [run_round(c) for _ in range(rounds)])
            except Exception as e:
                row.refused += f"; re-measuring failed: {type(e).__name__}: {e}".splitlines()[0][:300]
                break
        row.extra["attempts"] = attempts
        peaks = getattr(engine, "peak_mem_bytes", None)   # optional: {context: bytes}, filled by the engine
        if peaks and c in peaks:
            row.peak_mem_bytes = int(peaks[c])
        rows.append(row)
    progress.close()
    return rows
