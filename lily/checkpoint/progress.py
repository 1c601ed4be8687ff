"""Progress of long checkpoint work (loading, converting, writing): a tqdm bar on stderr, drawn only when
stderr is a terminal (lily.progress)."""

from lily.progress import bytes_progress as stderr_progress

__all__ = ["stderr_progress"]
