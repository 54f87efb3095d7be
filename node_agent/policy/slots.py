"""DRAM pool slots: which fixed-size slots are free. Pure bookkeeping; the mapping is the data path's."""

from __future__ import annotations

import threading

from flatcake.errors import PoolFullError


class SlotAllocator:
    """Fixed-size slots with O(1) alloc and free (a free stack plus an in-use bitmap)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._used = bytearray(slots)
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` slots, or PoolFullError leaving the allocator unchanged."""
        with self._lock:
            if n > len(self._free):
                raise PoolFullError(f"DRAM pool: {n} slots wanted, {len(self._free)} free of {self.slots}")
            out = [self._free.pop() for _ in range(n)]
            for s in out:
                self._used[s] = 1
            return out

    def take(self, slots: list[int]) -> None:
        """Mark specific slots used (recovery); refuses slots already in use."""
        with self._lock:
            busy = [s for s in slots if not 0 <= s < self.slots or self._used[s]]
            if busy:
                raise ValueError(f"slots {busy[:5]} are out of range or already allocated")
            for s in slots:
                self._used[s] = 1
            wanted = set(slots)
            self._free = [s for s in self._free if s not in wanted]

    def release(self, slots: list[int]) -> None:
        with self._lock:
            for s in slots:
                if not 0 <= s < self.slots or not self._used[s]:
                    raise ValueError(f"slot {s} is not allocated (double free?)")
                self._used[s] = 0
                self._free.append(s)
