"""A virtual clock: callbacks ordered by (time, sequence). Nothing sleeps; time jumps to the next event."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.processed = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``when`` (never in the past: a late event runs now)."""
        self._seq += 1  # ties run in scheduling order, so a run is deterministic
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.processed += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
