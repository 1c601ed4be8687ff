"""The shared memory one program may have on a device: some kernels pick their tiles by it.

The tiles were sized on an H200 (227 KiB a program). Ampere and Ada cards other than the A100 (RTX 3090 / 4090,
A10, A40, L4, L40: sm_86 / sm_89) allow 99 KiB, where three kernels would not load as the H200 runs them (Triton's
OutOfResources), compiled for sm_86 / sm_89: the prefill's chunk walk with two stages (112 KiB), the prefill
attention's 128 x 64 tiles (112 KiB) and the decode attention's split-K with three stages (138 KiB). There they
take smaller tiles (`gdn_chunked.scan_shape`, `flash_attention.tiles`, `attention_decode.split_stages`).
scripts/shared_memory_check.py compiles every launch of the prefill, the decode step and the batched step for such
a card on any machine and prints what each asks.

LILY_MAX_SHARED_BYTES pretends the device allows that many bytes (at most what it has): a bigger card then runs
the small card's tiles, so they can be checked and timed there.
"""

from __future__ import annotations

import functools
import os

import torch

SMALL_CARD_BYTES = 101376       # 99 KiB: sm_86 / sm_89 (the A100, sm_80, has 163 KiB; Hopper 227 KiB)
UNLIMITED = 1 << 30             # the CPU (the interpreter has no shared memory to run out of)


@functools.lru_cache(maxsize=None)
def _device_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def max_shared_bytes(device) -> int:
    """Bytes of shared memory one program may use on `device` (LILY_MAX_SHARED_BYTES, if set, caps it)."""
    device = torch.device(device)
    have = _device_bytes(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else UNLIMITED
    cap = os.environ.get("LILY_MAX_SHARED_BYTES")
    if cap:
        try:
            limit = int(cap)
        except ValueError:
            raise ValueError(f"LILY_MAX_SHARED_BYTES={cap!r}: expected a number of bytes") from None
        if limit <= 0:
            raise ValueError(f"LILY_MAX_SHARED_BYTES={cap!r}: expected a positive number of bytes")
        have = min(have, limit)
    return have
