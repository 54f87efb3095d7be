"""Byte extents inside the SSD pool files: first-fit allocation over coalesced free lists. Pure logic.

The pool is ``files`` files of ``file_bytes`` each. Free space is kept per file as a list of free runs
sorted by offset (plus a start -> length map), and an extent never crosses a file boundary: a read
command addresses one file. Every offset and length is a multiple of ``align`` (4 KiB: O_DIRECT and
cuFile DMA need it).

Used space is the complement of the free runs, so the allocator keeps no per-allocation records:
releasing any allocated range (a whole extent, or the tail a failed write gave back) is valid, and
releasing a range that overlaps free space is refused as a double free.

Invariants (checked by the property tests):
- free runs never overlap and never touch: a release merges with a free neighbour on either side, so
  no two free runs are adjacent in the same file;
- ``free_bytes + used_bytes == capacity`` exactly, and ``free_bytes`` is the sum of the free runs.

Fragmentation bound. First-fit (the lowest file, then the lowest offset, whose free run holds the
request) with immediate coalescing never loses space: nothing is rounded beyond ``align`` and free
space is always accounted exactly. An allocation of ``n`` contiguous bytes fails only when no single
free run of at least ``n`` bytes exists. The worst case is external fragmentation: live extents can
pin the free space into many small runs (for example every other page of every file), so a request
larger than the largest run fails although ``free_bytes`` is far larger; first-fit's classic bound
(Robson) is that O(M log(n_max/n_min)) bytes of address space can be needed to serve live data of M
bytes. The scope table avoids that failure for its own requests: they are whole pages of one size,
so every free run is a multiple of a page and a put that finds no run large enough is split across
runs (``largest``, ``room_after``). For the scope table a put therefore fails only when the free
bytes are fewer than the put's bytes; fragmentation costs read commands (more segments), never
capacity.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import NamedTuple

from flatcake.node_agent.constants import ALIGN


class Extent(NamedTuple):
    """A byte range ``[offset, offset + length)`` of pool file ``file``."""

    file: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExtentAllocator:
    """First-fit extents with coalescing free runs over ``files`` files of ``file_bytes`` each."""

    def __init__(self, files: int, file_bytes: int, align: int = ALIGN) -> None:
        if align <= 0:
            raise ValueError(f"align: {align} must be > 0")
        if files <= 0:
            raise ValueError(f"files: {files} must be > 0")
        if file_bytes <= 0 or file_bytes % align:
            raise ValueError(f"file_bytes: {file_bytes} must be a positive multiple of {align}")
        self.files, self.file_bytes, self.align = files, file_bytes, align
        self.capacity = files * file_bytes
        self.free_bytes = self.capacity
        self._starts: list[list[int]] = [[0] for _ in range(files)]  # free run offsets, sorted, per file
        self._runs: list[dict[int, int]] = [{0: file_bytes} for _ in range(files)]  # offset -> length
        self._max = [file_bytes] * files  # largest free run per file: skips full files in one compare
        # Files whose largest run shrank: ``_max`` is an upper bound there until ``_largest`` recomputes it.
        # Recomputing at every cut was quadratic at restart (each take of a fragmented pool's largest run
        # scanned every run: 3.9 s of a 2M-key recovery).
        self._stale: set[int] = set()

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    def round(self, n: int) -> int:
        """``n`` rounded up to the alignment."""
        return -(-n // self.align) * self.align

    # ---- queries -------------------------------------------------------------------------------
    def runs(self) -> Iterator[Extent]:
        """The free runs in (file, offset) order."""
        for f, starts in enumerate(self._starts):
            runs = self._runs[f]
            for s in starts:
                yield Extent(f, s, runs[s])

    def largest(self) -> Extent | None:
        """The largest free run (the lowest one among equals), or None when nothing is free."""
        best = max(range(self.files), key=self._largest)
        if self._max[best] == 0:
            return None
        runs = self._runs[best]
        start = next(s for s in self._starts[best] if runs[s] == self._max[best])
        return Extent(best, start, runs[start])

    def room_after(self, ext: Extent) -> int:
        """Free bytes directly after ``ext`` (0 when its neighbour is in use or it ends the file)."""
        return self._runs[ext.file].get(ext.end, 0)

    def is_free(self, ext: Extent) -> bool:
        """Whether all of ``ext`` lies in one free run."""
        self._check(ext)
        starts = self._starts[ext.file]
        i = bisect.bisect_right(starts, ext.offset) - 1
        return i >= 0 and starts[i] + self._runs[ext.file][starts[i]] >= ext.end

    # ---- changes -------------------------------------------------------------------------------
    def alloc(self, n: int) -> Extent | None:
        """The first (lowest file, then offset) ``n`` bytes, rounded up to the alignment, that fit in
        one free run; None, with nothing changed, when no free run is that large."""
        if n <= 0:
            raise ValueError(f"n: {n} must be > 0")
        n = self.round(n)
        for f in range(self.files):
            if self._largest(f) < n:
                continue
            runs = self._runs[f]
            for s in self._starts[f]:
                if runs[s] >= n:
                    self._cut(f, s, s, n)
                    return Extent(f, s, n)
        return None

    def extend(self, ext: Extent, n: int) -> Extent | None:
        """Grow ``ext`` in place by ``n`` bytes (rounded up) when the space right after it is free;
        returns the grown extent, or None with nothing changed."""
        n = self.round(n)
        if n <= 0 or self.room_after(ext) < n:
            return None
        self._cut(ext.file, ext.end, ext.end, n)
        return Extent(ext.file, ext.offset, ext.length + n)

    def take(self, ext: Extent) -> None:
        """Mark exactly ``ext`` used (recovery rebuilding a journaled allocation); it must be free."""
        if not self.is_free(ext):
            raise ValueError(f"extent {tuple(ext)}: not free (it overlaps space already allocated)")
        starts = self._starts[ext.file]
        s = starts[bisect.bisect_right(starts, ext.offset) - 1]
        self._cut(ext.file, s, ext.offset, ext.length)

    def take_all(self, extents: list[Extent]) -> None:
        """Mark all of ``extents`` used in one pass (recovery of a whole journal): the allocator must be
        wholly free, and the free runs become the complement of the sorted extents. Refuses, with
        nothing changed, extents that are out of range or overlap one another; ``take`` one by one was
        most of a 10M-key restart's scope rebuild (a bisect and a list insert per extent)."""
        if self.free_bytes != self.capacity:
            raise ValueError("take_all: the allocator is not empty; use take")
        for ext in extents:
            self._check(ext)
        ordered = sorted(extents)
        for a, b in itertools.pairwise(ordered):
            if a.file == b.file and a.end > b.offset:
                raise ValueError(f"extents {tuple(a)} and {tuple(b)} overlap")
        starts: list[list[int]] = [[] for _ in range(self.files)]
        runs: list[dict[int, int]] = [{} for _ in range(self.files)]
        cursor = [0] * self.files  # end of the last used byte seen, per file
        for f, off, n in ordered:
            if off > cursor[f]:
                starts[f].append(cursor[f])
                runs[f][cursor[f]] = off - cursor[f]
            cursor[f] = off + n
        for f, end in enumerate(cursor):
            if end < self.file_bytes:
                starts[f].append(end)
                runs[f][end] = self.file_bytes - end
        self._starts, self._runs = starts, runs
        self._max = [max(r.values(), default=0) for r in runs]
        self._stale.clear()
        self.free_bytes = self.capacity - sum(e.length for e in ordered)

    def release(self, ext: Extent) -> None:
        """Free ``ext`` and merge it with free neighbours; refuses a range that is partly free
        already (a double free) and changes nothing then."""
        self._check(ext)
        f, start, end = ext.file, ext.offset, ext.end
        starts, runs = self._starts[f], self._runs[f]
        i = bisect.bisect_left(starts, start)
        prev = starts[i - 1] if i > 0 else None
        nxt = starts[i] if i < len(starts) else None
        if (prev is not None and prev + runs[prev] > start) or (nxt is not None and nxt < end):
            raise ValueError(f"extent {tuple(ext)}: part of it is free already (double free?)")
        self.free_bytes += ext.length
        if nxt == end:  # merge the following run into this one
            end += runs.pop(nxt)
            del starts[i]
        if prev is not None and prev + runs[prev] == start:  # and this one into the preceding run
            runs[prev] = end - prev
            size = runs[prev]
        else:
            starts.insert(i, start)
            runs[start] = size = end - start
        self._max[f] = max(self._max[f], size)

    # ---- internals -----------------------------------------------------------------------------
    def _largest(self, f: int) -> int:
        """File ``f``'s largest free run, recomputed only after it shrank."""
        if f in self._stale:
            self._stale.discard(f)
            self._max[f] = max(self._runs[f].values(), default=0)
        return self._max[f]

    def _check(self, ext: Extent) -> None:
        f, off, n = ext
        if not 0 <= f < self.files:
            raise ValueError(f"extent {tuple(ext)}: file {f} outside 0..{self.files - 1}")
        if n <= 0 or off < 0 or off + n > self.file_bytes or off % self.align or n % self.align:
            raise ValueError(
                f"extent {tuple(ext)}: need 0 <= offset < offset + length <= {self.file_bytes}, both "
                f"multiples of {self.align}"
            )

    def _cut(self, f: int, run: int, start: int, n: int) -> None:
        """Remove ``[start, start + n)`` from the free run at ``run`` (which contains it)."""
        starts, runs = self._starts[f], self._runs[f]
        size = runs[run]
        end, run_end = start + n, run + size
        i = bisect.bisect_left(starts, run)
        if start == run:
            del runs[run]
            del starts[i]
        else:
            runs[run] = start - run
            i += 1
        if end < run_end:
            starts.insert(i, end)
            runs[end] = run_end - end
        self.free_bytes -= n
        if size == self._max[f]:  # the largest run shrank: found again when asked (``_largest``)
            self._stale.add(f)
