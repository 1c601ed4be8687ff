"""Progress of long checkpoint work (loading, converting, writing) on stderr."""

from __future__ import annotations

import sys
import time

from lily.checkpoint.base import Progress


def stderr_progress(what: str = "loading") -> Progress:
    """A progress callback that rewrites one stderr line, at most ~5 times a second."""
    last = [0.0]

    def show(done, total, nbytes, total_bytes):
        now = time.monotonic()
        if done != total and now - last[0] < 0.2:
            return
        last[0] = now
        end = "\n" if done == total else ""
        sys.stderr.write(f"\r{what} weights: {done}/{total} tensors, "
                         f"{nbytes / 1e9:.2f}/{total_bytes / 1e9:.2f} GB{end}")
        sys.stderr.flush()

    return show

