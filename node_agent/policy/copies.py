"""DRAM copies of SSD-homed pages (``placement.mode: copies``): where they are, what they served, and
whether admitting more pays. Pure logic, no I/O; ``scopes.ScopeTable`` owns the slots and the lock.

A copy is a cache entry, not a home: its page stays on SSD, so dropping it loses nothing. But making one
is not free: the writer or the reader copies the page into a DRAM slot (a memcpy of every layer), and
it pays only if a lease reads it before DRAM drops it. Whether a session came back within DRAM's
residence (``adaptive.ReuseModel.copy_pays``) decides whether a copy may displace older ones; it does not
say whether copies are read at all. That is measured instead: every copy remembers how it was made (at a
write, at a restore) and whether a lease read it, and each way's share of copies read before eviction is
a running mean (``Accuracy``). Below ``MIN_READ_SHARE`` that way stops copying, even into free slots,
except one opportunity in ``EXPLORE`` so the share keeps being measured and copying resumes when the
workload changes. In the main job's 97 MB pool, 98% of copies were once dropped unread; at the paper's
scale (the simulator) about half are read overall, and the running shares still dip below it at times.

A restore's copy never displaces a copy made at a write that no lease has read yet: the written copy
waits for its session's next turn, its first read, while a restore's bets on a later return of a session
that has just come back. Under plain LRU a run of restores in another order than the writes (bench peers
restores each session once, after every write) dropped the written copies before their first read:
136 restore copies made, 22 copies read, DRAM 13% of restored pages against the LRU tier's 43%; sparing
them, 54 made, 150 read, 49%. At the paper's scale (the simulator) mean TTFT moved by at most 1.5%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.policy.keyindex import U64, Digests, Found, KeyIndex
from flatcake.node_agent.policy.scope import CopyStats, Scope

WRITE, RESTORE = 1, 2  # how a copy was made
ORIGINS = {WRITE: "write", RESTORE: "restore"}
# A copy costs one page memcpy and saves one SSD page read when it is read. Host memcpy runs at 10+ GB/s,
# an NVMe page read at a few GB/s per queue and longer on the I/O path, so a quarter of copies read pays
# for all of them with room to spare; below that the copying is most of what copies cost.
MIN_READ_SHARE = 0.25
EXPLORE = 8  # while a way is declined, every 8th opportunity is admitted anyway: the share stays measured
ALPHA = 0.125  # weight of each eviction in the running share (about the last 8 count)


@dataclass
class Accuracy:
    """Per way of making copies: a running share of copies read before eviction, weighted by pages
    (decayed read and evicted counts)."""

    read: dict[int, float] = field(default_factory=dict)
    evicted: dict[int, float] = field(default_factory=dict)
    _skipped: dict[int, int] = field(default_factory=dict)

    def evicted_copies(self, origin: int, read: int, unread: int) -> None:
        if read + unread:
            self.read[origin] = (1 - ALPHA) * self.read.get(origin, 0.0) + ALPHA * read
            self.evicted[origin] = (1 - ALPHA) * self.evicted.get(origin, 0.0) + ALPHA * (read + unread)

    def share(self, origin: int) -> float | None:
        """Share of this way's copies read before eviction; None until one was evicted."""
        n = self.evicted.get(origin, 0.0)
        return self.read.get(origin, 0.0) / n if n else None

    def admits(self, origin: int) -> bool:
        share = self.share(origin)
        if share is None or share >= MIN_READ_SHARE:
            self._skipped[origin] = 0
            return True
        self._skipped[origin] = self._skipped.get(origin, 0) + 1
        if self._skipped[origin] >= EXPLORE:
            self._skipped[origin] = 0
            return True
        return False


class CopyLedger:
    """The copy index (digest -> the DRAM slot holding a copy, read only by ``ScopeTable.pin``), per slot
    whether a lease read it and how it was made, the counts, and admission's accuracy."""

    def __init__(self, dram_slots: int, slot_gva: Callable[[Sequence[int]], tuple[U64, npt.NDArray[np.int64]]],
                 slot_of: Callable[[U64], npt.NDArray[np.int64]]) -> None:  # fmt: skip
        self.index = KeyIndex()
        self.stats = CopyStats()
        self.accuracy = Accuracy()
        self._read = np.zeros(dram_slots, bool)
        self._origin = np.zeros(dram_slots, np.int8)
        self._slot_gva, self._slot_of = slot_gva, slot_of

    def admits(self, origin: int, pages: int) -> bool:
        """Whether to copy ``pages`` pages made this way (``Accuracy``); counts those declined."""
        ok = self.accuracy.admits(origin)
        if not ok:
            self.stats.declined += pages
        return ok

    def add(self, scope: Scope, d: Digests, slots: Sequence[int], crc: npt.NDArray[np.int64], origin: int) -> None:
        self.index.put(d, scope.id, *self._slot_gva(slots), crc)
        scope.copy_slots.extend(slots)
        scope.copy_keys.extend(d)
        at = list(slots)
        self._read[at], self._origin[at] = False, origin
        if origin == WRITE:
            self.stats.admitted_write += len(at)
        else:
            self.stats.admitted_restore += len(at)

    def served(self, found: Found, d: Digests) -> Found:
        """``found`` (homes) with each page that has a copy found at its copy instead."""
        c = self.index.find(d, stable_only=False)
        assert c is not None
        if not c.hit.any():
            return found
        hit = c.hit
        self.stats.served += int(hit.sum())
        self._read[self._slot_of(c.gva[hit])] = True
        return found._replace(
            gva=np.where(hit, c.gva, found.gva),
            stride=np.where(hit, c.stride, found.stride),
            crc=np.where(hit, c.crc, found.crc),
        )

    def drop(self, scope: Scope, count: bool) -> list[int]:
        """Forget every copy ``scope`` holds; returns their slots (the caller frees them). ``count``: an
        eviction (counted, and taught to admission), not their home going."""
        slots = scope.copy_slots
        if count:
            read, origin = self._read[slots], self._origin[slots]
            self.stats.evicted += len(slots)
            for o in ORIGINS:  # every copy has one origin: the unread per origin sum to all unread
                mine = origin == o
                hit, missed = int((read & mine).sum()), int((~read & mine).sum())
                self.stats.evicted_unread += missed
                self.accuracy.evicted_copies(o, hit, missed)
                if o == WRITE:
                    self.stats.evicted_write += hit + missed
                    self.stats.evicted_unread_write += missed
        self.index.remove(scope.copy_keys.digests())
        scope.copy_slots = []
        scope.copy_keys.clear()
        return slots

    def awaits_first_read(self, scope: Scope) -> bool:
        """Whether ``scope`` holds a copy made at a write that no lease has read yet."""
        at = scope.copy_slots
        return bool((~self._read[at] & (self._origin[at] == WRITE)).any())

    def drop_one(self, scope: Scope, d: Digests) -> int | None:
        """Forget the copy of one page (its home's bytes were found damaged); its slot, if it had one."""
        at = scope.copy_keys.index(int(d[0][0]), int(d[1][0])) if scope.copy_slots else -1
        if at < 0:
            return None
        self.index.remove(d)
        scope.copy_keys.pop(at)
        return scope.copy_slots.pop(at)
