"""Progress bars for long work (loading, writing and converting checkpoints, the benchmark), through tqdm.

Bars go to stderr and only when stderr is a terminal: logs and pipes stay clean.
"""

from __future__ import annotations

import sys
from typing import Callable

from tqdm import tqdm

# (tensors done, tensors total, bytes done, bytes total): what checkpoint readers and writers report
Progress = Callable[[int, int, int, int], None]


def quiet() -> bool:
    return not sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A tqdm bar on stderr (disabled when stderr is not a terminal); use it as a context manager."""
    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet(), dynamic_ncols=True,
                leave=True, **scaled, **kwargs)


def bytes_progress(what: str) -> Progress:
    """A Progress callback drawing one bar in bytes, e.g. `load_checkpoint(d, progress=bytes_progress("loading"))`.
    The bar opens on the first call and closes when the last tensor is done."""
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
