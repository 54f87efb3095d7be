"""One scope and what the scope table hands out about it, with no I/O: a page's ``Location``, the
``Scope`` (a session's pages on one medium: SSD extents or DRAM slots), a write's ``Reservation`` and
its ``Segment``s, a restore's ``CopyReservation``, the copy counters, the table's ``Clock``, and the key
digest helpers. The table itself (``scopes.ScopeTable``) keeps them consistent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.policy.extents import Extent
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.keyindex import Digests, Found, Pages, hash_keys
from flatcake.node_agent.policy.placement import Decision, Key, Reason


class Location(NamedTuple):
    """Where a page lives: its layer-0 address and the distance between its layers."""

    scope: int
    gva: int
    layer_stride: int


@dataclass(eq=False, slots=True)
class Scope:
    id: int
    medium: Medium
    last_used: int
    extents: list[Extent] = field(default_factory=list)  # SSD, in creation order; appends go to the last
    slots: list[int] = field(default_factory=list)
    keys: Pages = field(default_factory=Pages)  # the pages' key digests, in publish order
    pins: int = 0
    segments: int = 0
    # Adaptive placement: the tick of the last write into it, whether a reader has leased it since,
    # and the ticks from its latest write to the first lease after it (its reuse distance).
    written: int = 0
    reread: bool = False
    reuse: int | None = None
    # Copies mode, SSD scopes: DRAM slots holding clean copies of some pages, and those pages' digests.
    copy_slots: list[int] = field(default_factory=list)
    copy_keys: Pages = field(default_factory=Pages)
    # The space its published pages hold, as the journal has it: SSD extents (file, offset) -> length through
    # the last published segment, and DRAM slots in publish order. ``extents``/``slots`` also hold what a
    # write in flight reserved; a snapshot (compaction) records only this, or a restart would adopt space
    # no page was ever published in (leaked, or taken from the scope a later record gave it to).
    journaled: dict[tuple[int, int], int] = field(default_factory=dict)
    journaled_slots: list[int] = field(default_factory=list)

    def published(self, extents: Sequence[Extent], slots: Sequence[int]) -> None:
        """Record what a publish's journal record claims (an extent grown in place claims it longer)."""
        for e in extents:
            key = (e.file, e.offset)
            self.journaled[key] = max(self.journaled.get(key, 0), e.length)
        self.journaled_slots.extend(slots)

    def journaled_extents(self) -> list[Extent]:
        return [Extent(f, o, n) for (f, o), n in self.journaled.items()]

    def units(self) -> int:
        """Space held: bytes on SSD, slots on DRAM."""
        return sum(e.length for e in self.extents) if self.medium is Medium.SSD else len(self.slots)

    def dram_units(self) -> int:
        """DRAM slots held: a DRAM scope's pages, an SSD scope's copies."""
        return len(self.slots) + len(self.copy_slots)


# Reasons that are evidence for a medium; ONE_SHOT (turn 1, or no hints at all) is the absence of any.
_EVIDENCE = {
    Reason.SHARED_PROMPT,
    Reason.SHORT_CHAT,
    Reason.AGENT_SESSION,
    Reason.REUSE_WITHIN_DRAM,
    Reason.REUSE_BEYOND_DRAM,
}


def other_medium(decision: Decision, medium: Medium) -> bool:
    """Whether a continuation's own Table 2 decision positively names the medium its scope is not on."""
    return decision.medium is not medium and decision.reason in _EVIDENCE


def continues(scope: Scope, parent: Digests) -> bool:
    """Whether the parent (its digest) is ``scope``'s last published page: new pages after it extend the run."""
    h1, h2 = parent
    return scope.keys.last() == (int(h1[0]), int(h2[0]))


@dataclass(frozen=True)
class Segment:
    """One layer-major segment: ``pages`` consecutive pages of the run, starting at ``first_page``."""

    file: int
    offset: int
    first_page: int
    pages: int


@dataclass
class Reservation:
    """Space taken for a run of new pages, not yet visible to readers."""

    keys: list[Key]
    scope: Scope
    decision: Decision
    new_scope: bool
    digests: Digests  # of ``keys``
    segments: list[Segment] = field(default_factory=list)  # SSD
    extents: list[Extent] = field(default_factory=list)  # SSD: each touched extent, through its last segment
    slots: list[int] = field(default_factory=list)  # DRAM
    # Each page's GVA and layer stride, in ``keys`` order (columns: the index takes them as they are).
    gva: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, np.uint64))
    stride: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    copy_slots: list[int] = field(default_factory=list)  # SSD, copies mode: a DRAM copy of each page too


@dataclass
class CopyReservation:
    """DRAM slots taken for copies of a lease's SSD pages, filled by the reader from what it read."""

    at: list[int]  # the pages' positions in the lease
    digests: Digests
    scopes: list[int]
    slots: list[int]


@dataclass
class CopyStats:
    """Copies mode, in pages: admitted (at write, at restore), served by leases, evicted (and of
    those, evicted before any lease read them: admission's misses; ``_write``: those made at a write).
    ``declined``: pages not copied (at a write, at a restore) because too few of that way's copies were
    read before eviction (``copies.Accuracy``)."""

    admitted_write: int = 0
    admitted_restore: int = 0
    served: int = 0
    evicted: int = 0
    evicted_unread: int = 0
    evicted_write: int = 0
    evicted_unread_write: int = 0
    declined: int = 0
    unfilled: int = 0  # reserved at a restore, not filled by the reader (it failed or stopped early)

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class Clock:
    """The table's logical clock: one tick per allocation and per lease (``next``); ``now`` reads it."""

    def __init__(self) -> None:
        self.now = 0

    def __next__(self) -> int:
        self.now += 1
        return self.now


def key_digests(keys: Sequence[Key]) -> Digests:
    d = hash_keys(keys)
    if d is None:
        bad = next(k for k in keys if not isinstance(k, str | bytes | int))
        raise ValueError(f"keys: {bad!r} is a {type(bad).__name__}; a key is str, bytes or int")
    return d


def unpack_digest(digest: bytes) -> Digests:
    a = np.frombuffer(digest, "<u8", count=2)
    return a[:1].astype(np.uint64), a[1:].astype(np.uint64)


def as_locations(found: Found) -> list[Location | None]:
    """``Found`` columns as ``Location``s (None where not found)."""
    out: list[Location | None] = list(map(Location, found.scope.tolist(), found.gva.tolist(), found.stride.tolist()))
    for i in np.flatnonzero(~found.hit).tolist():
        out[i] = None
    return out
