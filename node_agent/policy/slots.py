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
        self._stale = False  # ``take`` marked slots used that ``_free`` still lists
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._stack())

    def _stack(self) -> list[int]:
        """The free stack, rebuilt once after ``take`` calls (recovery takes slots of many scopes: one
        rebuild at the end rather than one per scope, which was quadratic in the pool's slots)."""
        if self._stale:
            self._free = [s for s in range(self.slots - 1, -1, -1) if not self._used[s]]
            self._stale = False
        return self._free

    def alloc(self, n: int) -> list[int]:
        """``n`` slots, or PoolFullError leaving the allocator unchanged."""
        with self._lock:
            free = self._stack()
            if n > len(free):
                raise PoolFullError(f"DRAM pool: {n} slots wanted, {len(free)} free of {self.slots}")
            out = [free.pop() for _ in range(n)]
            for s in out:
                self._used[s] = 1
            return out

    def take(self, slots: list[int]) -> None:
        """Mark specific slots used (recovery); refuses, changing nothing, slots out of range, already in
        use or named twice."""
        with self._lock:
            busy = [s for s in slots if not 0 <= s < self.slots or self._used[s]]
            if busy or len(set(slots)) != len(slots):
                raise ValueError(f"slots {(busy or slots)[:5]} are out of range, already allocated or repeated")
            for s in slots:
                self._used[s] = 1
            self._stale = True

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._stack()
            for s in slots:
                if not 0 <= s < self.slots or not self._used[s]:
                    raise ValueError(f"slot {s} is not allocated (double free?)")
                self._used[s] = 0
                self._free.append(s)
