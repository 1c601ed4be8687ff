"""Progress bars for long work (loading, writing and converting checkpoints, the benchmark), through tqdm.

Bars go to stderr and only when stderr is a terminal. Elsewhere (CI logs, nohup, `2>&1 | tee`) a bar's
carriage returns would garble the log, so checkpoint work writes a plain line instead, at most every
LILY_PROGRESS_EVERY seconds (10): work that ends sooner writes nothing, longer work shows it is alive.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

# (tensors done, tensors total, bytes done, bytes total): what checkpoint readers and writers report
Progress = Callable[[int, int, int, int], None]
EVERY_ENV, EVERY_S = "LILY_PROGRESS_EVERY", 10.0


def quiet() -> bool:
    return not sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A tqdm bar on stderr (disabled when stderr is not a terminal); use it as a context manager."""
    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet(), dynamic_ncols=True,
                leave=True, **scaled, **kwargs)


def line_every() -> float:
    """Seconds between plain progress lines: LILY_PROGRESS_EVERY, or 10 when it is unset or not a number >= 0."""
    try:
        every = float(os.environ.get(EVERY_ENV, EVERY_S))
    except ValueError:
        return EVERY_S
    return every if every >= 0 else EVERY_S


def _size(n: int) -> str:
    return tqdm.format_sizeof(n, "B", 1024)  # as the bar writes sizes (1.18MB, 18.2GB)


class PlainProgress:
    """A Progress callback for a stream that is not a terminal: a line such as `writing weights: 1.12GB of 18.2GB
    (6%), 57/1013 tensors, 12s` when `every` seconds have passed since the start or the last line, and a closing
    line once the last tensor is done if any line was written. Driven by the work's own calls (no thread), so
    each line reports real progress; `clock` is there for tests."""

    def __init__(self, what: str, every: float, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.every, self.clock = what, every, clock
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.last = clock()
        self.written = False

    def __call__(self, done: int, total: int, nbytes: int, total_bytes: int) -> None:
        now = self.clock()
        if done >= total:
            if self.written or now - self.start >= self.every:
                self._line(f"{self.what} weights: done, {_size(nbytes)}, {total} tensors in {now - self.start:.0f}s")
        elif now - self.last >= self.every:
            share = f" ({100 * nbytes / total_bytes:.0f}%)" if total_bytes else ""
            self._line(f"{self.what} weights: {_size(nbytes)} of {_size(total_bytes)}{share}, {done}/{total} tensors, "
                       f"{now - self.start:.0f}s")
        else:
            return
        self.last = now

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self.written = True


def bytes_progress(what: str, plain: bool = True) -> Progress:
    """A Progress callback drawing one bar in bytes, e.g. `load_checkpoint(d, progress=bytes_progress("loading"))`.
    The bar opens on the first call and closes when the last tensor is done. Where stderr is not a terminal:
    plain lines (PlainProgress), unless `plain` is False (a caller that says it is alive its own way)."""
    if quiet():
        return PlainProgress(what, line_every()) if plain else (lambda *_: None)
    state: dict = {}

    def show(done: int, total: int, nbytes: int, total_bytes: int) -> None:
        b = state.get("bar")
        if b is None:
            b = state["bar"] = bar(total_bytes, f"{what} weights", unit="B")
        b.set_postfix_str(f"{done}/{total} tensors", refresh=False)
        b.update(nbytes - b.n)
        if done >= total:
            b.close()

    return show
