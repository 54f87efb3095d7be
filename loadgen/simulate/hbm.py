"""One serving instance's HBM prefix cache: an LRU of pages, with pins for pages a queued request
holds (prefetched for it, or computed and not yet written back)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from flatcake.loadgen.systems import hicache_rules as hicache


class HbmCache:
    def __init__(self, pages: int) -> None:
        self.capacity = max(1, pages)
        self.lru: OrderedDict[Hashable, None] = OrderedDict()
        self.pins: dict[Hashable, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.lru

    def prefix(self, keys: Sequence[Hashable], start: int = 0) -> int:
        """How many of ``keys[start:]`` lead in HBM."""
        lru, n = self.lru, start
        while n < len(keys) and keys[n] in lru:
            n += 1
        return n - start

    def touch(self, keys: Sequence[Hashable]) -> None:
        # Deepest page first, so a prefix is more recent than its tail: eviction takes tails first,
        # as a radix cache evicts leaves.
        lru = self.lru
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)

    def insert(self, keys: Sequence[Hashable]) -> None:
        self.touch(keys)
        excess = len(self.lru) - self.capacity
        if excess <= 0:
            return
        victims = []
        for key in self.lru:  # oldest first; pinned pages stay
            if key not in self.pins:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            del self.lru[key]

    def pin(self, keys: Iterable[Hashable], delta: int) -> None:
        hicache.lock(self.pins, keys, delta)
