"""Progress of long checkpoint work (loading, converting, writing): a tqdm bar on stderr, drawn only when
stderr is a terminal (lily.progress). tqdm is imported when a bar is asked for, so lily.checkpoint itself
runs where only torch and safetensors are installed (the GPU scripts)."""

from __future__ import annotations

from lily.checkpoint.base import Progress


def stderr_progress(what: str = "loading") -> Progress:
    """A Progress callback drawing one bar in bytes (tensors done shown beside it) and the time left."""
    from lily.progress import bytes_progress

    return bytes_progress(what)
