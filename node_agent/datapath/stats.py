"""Engine counters. Plain, thread-safe and cheap; the agent exports them as Prometheus metrics."""

from __future__ import annotations

import threading
from collections import Counter


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._peaks: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def peak(self, name: str, value: int) -> None:
        with self._lock:
            if value > self._peaks.get(name, 0):
                self._peaks[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name] if name in self._counts else self._peaks.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted({**self._counts, **self._peaks}.items()))
