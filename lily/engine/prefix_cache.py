"""An LRU cache of whole decode states, keyed by the tokens they have consumed.

A hybrid model's state is not only a KV cache: the GDN recurrent and conv states summarise the whole
prefix and cannot be cut back to a shorter one. So an entry is a complete snapshot
(backend.clone_state) after exactly its tokens, and it is reusable when those tokens are a strict
prefix of a new prompt (the rest of the prompt runs from it), or the whole prompt when the entry also
holds the logits after its last token (a prompt sent again starts decoding at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    key: str | None = None
    logits: Any = None  # the next token's logits after `tokens` (a tensor), when stored


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0


class PrefixCache:
    """At most `max_entries` snapshots within `max_bytes`; least recently used goes first."""

    def __init__(self, max_entries: int, max_bytes: int,
                 clone: Callable[[Any], Any], nbytes: Callable[[Any], int]):
        self.max_entries = max(0, int(max_entries))
        self.max_bytes = int(max_bytes)
        self._clone = clone
        self._nbytes = nbytes
        self._entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def lookup(self, prompt: list[int], key: str | None = None) -> tuple[int, Any, Any]:
        """(number of reused tokens, a private copy of the state, a copy of its logits when the entry is the
        whole prompt, else None) for the best entry, or (0, None, None).

        Best = an entry whose tokens are a strict prefix of `prompt`, or the whole prompt with its logits:
        one with the same prompt_cache_key first, then the longest.
        """
        if not self.enabled:
            return 0, None, None
        prompt_t = tuple(prompt)
        with self._lock:
            best = None
            for entry in self._entries.values():
                n = len(entry.tokens)
                whole = n == len(prompt_t) and entry.logits is not None
                if (n >= len(prompt_t) and not whole) or prompt_t[:n] != entry.tokens:
                    continue
                rank = (key is not None and entry.key == key, n)
                if best is None or rank > best[0]:
                    best = (rank, entry)
            if best is None:
                self.stats.misses += 1
                return 0, None, None
            entry = best[1]
            self._entries.move_to_end(entry.tokens)
            self.stats.hits += 1
            self.stats.cached_tokens += len(entry.tokens)
            logits = entry.logits.clone() if len(entry.tokens) == len(prompt_t) else None
            return len(entry.tokens), self._clone(entry.state), logits

    def insert(self, tokens: list[int], state: Any, key: str | None = None, logits: Any = None) -> bool:
        """Store a snapshot of `state` (which has consumed exactly `tokens`), and a copy of `logits` (the next
        token's, after them) when given. False when it cannot fit."""
        if not self.enabled or not tokens:
            return False
        tokens_t = tuple(tokens)
        logits_bytes = logits.numel() * logits.element_size() if logits is not None else 0
        with self._lock:
            entry = self._entries.get(tokens_t)
            if entry is not None:
                entry.key = key if key is not None else entry.key
                self._entries.move_to_end(tokens_t)
                if entry.logits is None and logits is not None:  # the same state, now with its logits: no new copy
                    entry.logits, entry.nbytes = logits.detach().clone(), entry.nbytes + logits_bytes
                    self._evict()
                return True
        size = self._nbytes(state) + logits_bytes
        if size > self.max_bytes:
            return False
        snapshot = self._clone(state)
        kept = logits.detach().clone() if logits is not None else None
        with self._lock:
            self._entries[tokens_t] = CacheEntry(tokens_t, snapshot, size, key, kept)
            self._evict()
        return True

    def _evict(self) -> None:
        """Least recently used first, until the entries fit (the caller holds the lock)."""
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def __contains__(self, tokens) -> bool:
        return tuple(tokens) in self._entries

    def discard(self, tokens) -> None:
        """Drop the entry for exactly these tokens, if any (a snapshot that turned out corrupt)."""
        with self._lock:
            self._entries.pop(tuple(tokens), None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
