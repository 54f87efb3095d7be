"""The catalog the agent owns (``LocalCatalog``): allocation, publication, lookup, leases and the journal
over the scope table. It implements ``catalog.interface.Catalog``, as the client's ``RemoteCatalog`` does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from flatcake.errors import FencedError, UnknownHandleError, UnknownKeyError
from flatcake.node_agent.catalog.interface import Allocation, Lease
from flatcake.node_agent.catalog.journal import Journal, publish_record, snapshot_records
from flatcake.node_agent.catalog.shared_index import SharedIndexWriter
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy.extents import Extent
from flatcake.node_agent.policy.keyindex import U64, pack
from flatcake.node_agent.policy.placement import Hints, Key, PlacementCounts, decide
from flatcake.node_agent.policy.scope import CopyReservation, Location, Reservation, Scope, as_locations, key_digests
from flatcake.node_agent.policy.scopes import ScopeTable

log = logging.getLogger(__name__)


class LocalCatalog:
    """``ScopeTable`` plus placement, handles and (optionally) the journal."""

    def __init__(
        self,
        table: ScopeTable,
        placement: PlacementConfig,
        journal: Journal | None = None,
        epoch: int = 0,
        index: SharedIndexWriter | None = None,
    ) -> None:
        self.table = table
        self.epoch = epoch
        self.placement = placement
        self.placements = PlacementCounts()
        self.journal = journal
        self._allocs: dict[int, tuple[Reservation, list[int]]] = {}
        # lease -> its scopes, its copies, each page's scope
        self._leases: dict[int, tuple[set[int], CopyReservation | None, npt.NDArray[np.int64]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # Held from a publish's journal append until its pages are in the table, and by a compaction's
        # snapshot: a snapshot then never holds a record's effect without the record, or the reverse.
        self._commit = threading.Lock()
        # Recovered scopes the background scan has not checked yet (catalog/recovery.py ``Scan``).
        self.unverified: set[int] = set()
        # Called with the scopes a reader found damaged pages in (the agent checks them on a thread of its own).
        self.on_damaged: Callable[[set[int]], None] | None = None
        table.on_free = self._freed
        self.index = index
        if index is not None:  # the shared-memory table is the index itself: no second copy of entries
            table.use_index(index)

    def _freed(self, scope: Scope) -> None:
        # Called before the scope's space is released (and before its entries leave the index); if the
        # record cannot be written this raises and the space stays with the scope, so no later writer
        # overwrites pages a restart would revive.
        if self.journal is not None:
            self.journal.append({"t": "free", "scope": scope.id})

    def allocate(self, keys: Sequence[Key], hints: Hints) -> Allocation | None:
        t = self.table
        with t.lock:
            d = key_digests(keys)
            new = t.new_keys(keys, d)
            if not new:
                return None
            # Pages extending a stored prefix join its scope: the parent is the last stored page before
            # the first new one, or the caller's hint.
            parent = keys[new[0] - 1] if new[0] > 0 else hints.parent_key
            at = np.asarray(new)
            res = t.reserve([keys[i] for i in new], parent, decide(hints, self.placement), new=(d[0][at], d[1][at]))
        alloc_id = next(self._ids)
        with self._lock:
            self._allocs[alloc_id] = (res, new)
        return Allocation(
            alloc_id, new, res.scope.medium, res.decision.reason.value, res.segments, res.slots, self.epoch,
            res.copy_slots,
        )  # fmt: skip

    def _take(self, alloc_id: int) -> Reservation:
        with self._lock:
            entry = self._allocs.pop(alloc_id, None)
        if entry is None:
            raise UnknownHandleError(f"allocation {alloc_id}: unknown (published, aborted or expired)")
        return entry[0]

    def publish(self, alloc_id: int, checksums: Sequence[int], epoch: int | None = None) -> None:
        """Make an allocation's pages visible. ``epoch`` (when given) must be this catalog's: an
        allocation from before an agent restart is refused with ``FencedError``."""
        if epoch is not None and epoch != self.epoch:
            raise FencedError(
                f"epoch: allocation {alloc_id} was made in agent epoch {epoch}, the agent is now in epoch "
                f"{self.epoch} (it restarted); nothing was published, put the pages again"
            )
        res = self._take(alloc_id)
        if len(checksums) != len(res.keys):
            self.table.abort(res)
            raise ValueError(f"checksums: {len(checksums)} given for {len(res.keys)} pages; allocation aborted")
        with self._commit:
            if self.journal is not None:  # durable before visible
                try:
                    self.journal.append(
                        publish_record(
                            res.scope,
                            res.digests,
                            res.gva,
                            res.stride,
                            res.slots,
                            checksums,
                            res.extents,
                        )
                    )
                except BaseException:  # not journaled, so never visible: give the keys and the space back
                    self.table.abort(res)
                    raise
            self.table.publish(res, checksums)
        self.placements.add(res.decision, len(res.keys))

    def abort(self, alloc_id: int) -> None:
        self.table.abort(self._take(alloc_id))

    def exists(self, keys: Sequence[Key]) -> int:
        return self.table.hit_prefix(keys)

    def acquire(self, keys: Sequence[Key], copy: bool = False) -> Lease:
        """Pin ``keys``' pages for a read. ``copy``: the reader can fill DRAM copies of the SSD pages it
        reads (copies mode; ``Lease.copies``), and reports them to ``release``."""
        d = key_digests(keys)
        found = self.table.pin(keys, d)
        if not found.hit.all():
            i = int(np.flatnonzero(~found.hit)[0])
            raise UnknownKeyError(
                f"keys[{i}]: {keys[i]!r} is not stored; restore only the hit prefix that exists() reports "
                "and recompute the rest"
            )
        locs = cast(list[Location], as_locations(found))
        lease_id = next(self._ids)
        scopes = set(found.scope.tolist())
        verify = bool(self.unverified) and not self.unverified.isdisjoint(scopes)
        # Not while the post-restart scan is due: a copy is made only of bytes checked against the home's crc.
        cres = self.table.reserve_copies(found, d) if copy and not verify else None
        with self._lock:
            self._leases[lease_id] = (scopes, cres, found.scope)
        copies: list[int] = []
        if cres is not None:
            copies = [-1] * len(locs)
            for i, slot in zip(cres.at, cres.slots, strict=True):
                copies[i] = slot
        return Lease(lease_id, locs, found.crc.tolist(), verify, copies=copies)

    def release(self, lease_id: int, copied: Sequence[int] | None = None, damaged: Sequence[int] | None = None) -> None:
        """End a lease. ``copied``: for each slot of ``Lease.copies`` that is not -1, in order, the crc32
        of the copy the reader made there, or -1 where it made none; copies are served from now on.
        ``damaged``: indexes of pages the reader found not to match their checksum: their scopes become
        unverified (every reader checks them) and go to ``on_damaged`` (the agent checks them again)."""
        with self._lock:
            entry = self._leases.pop(lease_id, None)
        if entry is None:
            raise UnknownHandleError(f"lease {lease_id}: unknown (released already or expired)")
        scopes, cres, page_scopes = entry
        if damaged:
            suspects = {int(page_scopes[i]) for i in damaged if 0 <= i < len(page_scopes)}
            self.unverified |= suspects
            if self.on_damaged is not None and suspects:
                self.on_damaged(suspects)
        try:
            if cres is not None:  # before the unpin: the scopes cannot be freed under it
                self.table.publish_copies(cres, list(copied or []))
        finally:
            self.table.unpin(scopes)

    def pages_of(self, scope_id: int) -> list[tuple[bytes, Location, int]]:
        """Each stored page of a scope (its 16-byte key digest) with its published crc32 (the
        background scan's work)."""
        t = self.table
        with t.lock:
            scope = t.scopes.get(scope_id)
            if scope is None:
                return []
            d = scope.keys.digests()
            found = t.find_digests(d)
            blob = pack(d)
            pages = zip(as_locations(found), found.crc.tolist(), strict=True)
            return [(blob[16 * i : 16 * i + 16], loc, crc) for i, (loc, crc) in enumerate(pages) if loc is not None]

    def drop_damaged(self, digest: bytes, loc: Location) -> bool:
        """Stop serving a page whose stored bytes failed their checksum, as recovery always did: the
        key goes, its space stays with its scope until the scope is freed, so no reader of the scope
        (it verifies what it reads: the lease says so) races a reuse. A scope left with no page is
        freed. False when the digest (from ``pages_of``) no longer names that page."""
        return self.table.drop_page(digest, loc)

    def warm(self) -> None:
        """Recovery only: fault in the shared index's memory before ``adopted`` fills it."""
        if self.index is not None:
            self.index.warm()

    def take_space(self, extents: list[Extent]) -> bool:
        """Recovery only: every recovered scope's SSD space in one pass (``adopt(..., taken=True)`` then
        skips it); False, nothing taken, when some of it overlaps or lies outside the pool: each scope
        then takes its own, and the later of two claimants is refused."""
        with self.table.lock, contextlib.suppress(ValueError):
            self.table.ssd.take_all(extents)
            return True
        return False

    def adopt(self, scope: Scope, d: npt.NDArray[np.uint64], taken: bool = False) -> None:
        """Serve a recovered scope again (recovery only), with its pages' key digests in publish order;
        none is found until ``adopted``. ``taken``: its SSD space was taken by ``take_space``."""
        self.table.adopt(scope, d, taken)

    def adopted(self, d: npt.NDArray[np.uint64], scope: Any, gva: U64, stride: Any, crc: Any) -> None:
        """Index the recovered pages at once (recovery only, before anything is served: clients find none
        of them until then, a miss, never a wrong page). It may run beside ``adopt``."""
        self.table.load_index(d, scope, gva, stride, crc)

    def unindex(self, d: npt.NDArray[np.uint64]) -> None:
        """Recovery only: take out of the index the pages of scopes ``adopt`` refused."""
        self.table.unindex(d)

    def close(self) -> None:
        """The journal, if any, belongs to whoever opened it (the agent)."""

    def handles(self) -> tuple[int, int]:
        """Open allocations and leases."""
        with self._lock:
            return len(self._allocs), len(self._leases)

    def compact_journal(self, force: bool = False) -> bool:
        """Compact the journal online (when it is due, or ``force``): the live state is snapshotted with
        the journal's end under the commit and table locks, and written while clients go on. False when
        not due."""
        journal = self.journal
        if journal is None or not (force or journal.due()):
            return False
        with self._commit, self.table.lock:
            records = self._snapshot_locked()
            mark = journal.mark()
        journal.compact(records, mark)
        return True

    def snapshot_records(self) -> list[dict[str, Any]]:
        """The live state as journal records, for compaction. The keys are their digests (``kd``: 16
        bytes each): the catalog keeps no key object (policy/keyindex.py)."""
        with self.table.lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> list[dict[str, Any]]:
        # One index probe per 64K pages, not one per scope: the table lock is held throughout, and per
        # scope the probe's fixed cost dominated (1M pages in 64-page scopes: 1.6 s of 1.9 s).
        t = self.table
        scopes = sorted((scope for scope in t.scopes.values() if scope.keys), key=lambda scope: scope.id)
        if not scopes:
            return []
        d = np.concatenate([scope.keys.raw() for scope in scopes])
        step = 1 << 16
        parts = [t.find_digests((d[at : at + step, 0], d[at : at + step, 1])) for at in range(0, len(d), step)]
        gva, stride, crc = (np.concatenate([getattr(f, c) for f in parts]) for c in ("gva", "stride", "crc"))
        return snapshot_records(scopes, d, gva, stride, crc)
