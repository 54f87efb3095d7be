"""Session scopes, the key index and reclaim: the engine's metadata, with no I/O.

A scope groups the pages of one session on one medium: on SSD it owns byte extents of the pool files
(``extents.ExtentAllocator``; many scopes share a file) and appends one layer-major segment per write;
on DRAM it owns pool slots. A write grows the scope's last extent in place when the space after it is
free, else takes a new extent holding the whole write (first-fit), so each write stays one segment
and a restore reads one command per segment-layer, as when a scope owned whole files. Only when no
free run holds the write is it split across runs. Space is reclaimed a whole scope at a time, oldest
(least recently used) unpinned scope first, so a live session never loses part of its prefix; freed
extents merge with free neighbours.

The index (``keyindex.KeyIndex``) maps each page's key digest to its scope, address, stride and crc32;
a scope lists its pages' digests (``keyindex.Pages``): no key object per page (policy/keyindex.py).

Concurrency contract: writers (reserve, publish, abort, reclaim, pin) hold ``self.lock``. Readers call
``lookup``/``hit_prefix`` without a lock: each index slot is read under its sequence number (a
seqlock), entries are inserted only after their bytes are written (publish after write), and an entry
is deleted before its space can be reused (reclaim happens under the lock, and only for unpinned
scopes). A reader that wants to read bytes pins first; ``pin`` re-validates each entry under the lock.

DRAM copies (``placement.mode: copies``): clean DRAM copies of SSD pages, in an index only ``pin`` reads
(``copies.CopyLedger``); never journaled, never the only copy. Whether a session's pages may displace older
copies: ``adaptive.ReuseModel.copy_pays`` (a restore's never displace a written copy not read yet:
``copies.CopyLedger.awaits_first_read``); whether copies are made at all: ``copies.Accuracy``.

Why one module of this size: allocation, publish and reclaim keep one invariant together (a scope's
pages, index entries and space are freed at once, never under a pin); its records, the index, extents
and reclaim's plan are apart (scope.py, keyindex.py, extents.py, reclaim.py).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.errors import PoolFullError
from flatcake.node_agent.constants import ALIGN
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.adaptive import ReuseModel
from flatcake.node_agent.policy.copies import RESTORE, WRITE, CopyLedger
from flatcake.node_agent.policy.extents import Extent, ExtentAllocator
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.keyindex import U64, Digests, Found, KeyIndex, Pages, pack
from flatcake.node_agent.policy.placement import Decision, Key, Reason, overflow
from flatcake.node_agent.policy.reclaim import ReclaimStats, Victim, plan_reclaim
from flatcake.node_agent.policy.scope import (
    Clock,
    CopyReservation,
    CopyStats,
    Location,
    Reservation,
    Scope,
    Segment,
    as_locations,
    continues,
    key_digests,
    other_medium,
    unpack_digest,
)
from flatcake.node_agent.policy.slots import SlotAllocator

GHOSTS = 1 << 14  # adaptive placement: reclaimed-unread DRAM scopes remembered (their last page, 32 bytes)


class ScopeTable:
    def __init__(
        self,
        *,
        node_id: int,
        layers: int,
        page_bytes: int,
        file_bytes: int,
        files: int,
        dram_slots: int,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        adaptive: bool = False,
        copies: bool = False,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"watermarks: need 0 < low ({low_watermark}) <= high ({high_watermark}) <= 1")
        if file_bytes < layers * page_bytes:
            raise ValueError(f"file_bytes: {file_bytes} cannot hold one page of {layers} layers x {page_bytes} bytes")
        if page_bytes % ALIGN:
            raise ValueError(f"page_bytes: {page_bytes} must be a multiple of {ALIGN}")
        self.node_id, self.layers, self.page_bytes = node_id, layers, page_bytes
        self.file_bytes, self.files = file_bytes, files
        self.page_span = layers * page_bytes  # bytes one page takes across all layers
        # Every SSD request is whole pages, so each file is used up to its last whole page: then every
        # free run is a multiple of a page and a put fits whenever enough bytes are free (split if need be).
        self.ssd = ExtentAllocator(files, file_bytes // self.page_span * self.page_span)
        self.high, self.low = high_watermark, low_watermark
        self.index = KeyIndex()
        self.scopes: dict[int, Scope] = {}
        self.lock = threading.RLock()
        self.dram = SlotAllocator(dram_slots)
        self._pending: set[Key] = set()
        self._ids = itertools.count(1)
        self._clock = Clock()
        self.reclaimed = {Medium.DRAM: ReclaimStats(), Medium.SSD: ReclaimStats()}
        self.on_free: Callable[[Scope], None] | None = None  # told of every scope freed (journal)
        self.reuse = ReuseModel() if adaptive or copies else None  # adaptive, copies: learns from leases, reclaim
        self.copies = CopyLedger(dram_slots, self._dram_gva, self._slot_of) if copies else None  # module doc
        self.copy_stats = self.copies.stats if self.copies else CopyStats()
        self._ghosts: OrderedDict[tuple[int, int], int] = OrderedDict()  # see _adapt

    def use_index(self, index: KeyIndex) -> None:
        """Index into ``index`` from now on (the agent's shared-memory one), with what is stored."""
        with self.lock:
            old = self.index.t
            live = np.flatnonzero(old.h1 > np.uint64(1))
            index.put((old.h1[live], old.h2[live]), old.scope[live], old.gva[live], old.stride[live], old.crc[live])
            self.index = index

    # ---- readers (no lock) -------------------------------------------------------------------
    def find(self, keys: Sequence[Key]) -> Found:
        """Each key's entry (``Found`` columns); a key of another type than str/bytes/int is a
        ValueError naming the types."""
        return self.find_digests(key_digests(keys))

    def find_digests(self, d: Digests) -> Found:
        found = self.index.find(d)
        if found is None:  # a slot stayed mid-write (a writer thread died in it): read as the writer
            with self.lock:
                found = self.index.find(d, stable_only=False)
        assert found is not None
        return found

    def lookup(self, key: Key) -> Location | None:
        return self.lookup_many([key])[0]

    def lookup_many(self, keys: Sequence[Key]) -> list[Location | None]:
        """Locations of ``keys`` (None where absent)."""
        return as_locations(self.find(keys))

    def hit_prefix(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        miss = np.flatnonzero(~self.find(keys).hit)
        return int(miss[0]) if miss.size else len(keys)

    def pages(self) -> int:
        return len(self.index)

    def items(self) -> Iterator[tuple[bytes, Location]]:
        """Every stored page as (16-byte key digest, location), scope by scope (tests, tools)."""
        with self.lock:
            for scope in list(self.scopes.values()):
                d = scope.keys.digests()
                locs = as_locations(self.find_digests(d))
                blob = pack(d)
                for i, loc in enumerate(locs):
                    assert loc is not None
                    yield blob[16 * i : 16 * i + 16], loc

    # ---- space accounting --------------------------------------------------------------------
    # Units: bytes on SSD, slots on DRAM.
    def used(self, medium: Medium) -> int:
        if medium is Medium.SSD:
            return self.ssd.used_bytes
        return self.dram.slots - self.dram.free

    def capacity(self, medium: Medium) -> int:
        return self.ssd.capacity if medium is Medium.SSD else self.dram.slots

    def unit_bytes(self, medium: Medium) -> int:
        return 1 if medium is Medium.SSD else self.page_span

    # ---- writers -----------------------------------------------------------------------------
    def new_keys(self, keys: Sequence[Key], digests: Digests | None = None) -> list[int]:
        """Indexes of keys neither stored nor being written by someone else (``digests``: of
        ``keys``, when the caller has them)."""
        with self.lock:
            stored = self.find_digests(key_digests(keys) if digests is None else digests).hit.tolist()
            pending = self._pending
            return [i for i, (k, s) in enumerate(zip(keys, stored, strict=True)) if not s and k not in pending]

    def reserve(
        self, keys: list[Key], parent: Key | None, decision: Decision, *, new: Digests | None = None
    ) -> Reservation:
        """Take space for ``keys`` (all new) and pin their scope; raises PoolFullError with nothing
        changed when even reclaim cannot make room. ``new``: the keys' digests from a ``new_keys``
        call made under this same hold of the lock (so they are known new, and not checked again)."""
        with self.lock:
            digests = new
            if digests is None:
                digests = key_digests(keys)
                stored = self.find_digests(digests).hit.tolist()
                dup = [k for k, s in zip(keys, stored, strict=True) if s or k in self._pending]
                if dup:
                    raise ValueError(f"keys: {dup[:3]!r} already stored or being written")
            pd = key_digests([parent]) if parent is not None else None  # hashed once: found, then compared
            loc = as_locations(self.find_digests(pd))[0] if pd is not None else None
            scope = self.scopes.get(loc.scope) if loc is not None else None
            session: int | None = None
            if self.reuse is not None:
                decision, session = self._adapt(decision, scope, digests)
            if scope is not None and pd is not None and not continues(scope, pd):
                # The parent lies inside another run (a shared prompt stored by another session): these
                # pages do not continue that scope, so they get one of their own, placed by their hints.
                # Joining would scatter every later reader's pages across the other session's segment.
                scope = None
            if scope is not None and other_medium(decision, scope.medium):
                # Peers, not tiers: a turn whose own signals name the other medium (a chat whose turns
                # stay short after a one-shot first turn; a chat grown into a long context) starts a scope
                # there. The earlier turns stay where they are: nothing migrates.
                scope = None
            if scope is not None:
                decision = Decision(scope.medium, Reason.INHERITED)
            if decision.medium is Medium.DRAM:
                res = self._reserve_dram(keys, digests, scope, decision)
                if res is None:
                    decision, scope = overflow(decision), None
            if decision.medium is Medium.SSD:
                res = self._reserve_ssd(keys, digests, scope, decision)
            assert res is not None
            if self.copies is not None and res.scope.medium is Medium.SSD and self.copies.admits(WRITE, len(keys)):
                # New pages get a DRAM copy as they are written (the writer has them in memory) while DRAM
                # has room, or over older copies when the session came back within DRAM's residence.
                res.copy_slots = self._take_copy_slots(len(keys), res.scope, self._copy_pays(session), WRITE)
            res.scope.pins += 1
            res.scope.last_used = res.scope.written = next(self._clock)
            res.scope.reread = False
            self._pending.update(keys)
            return res

    def _reserve_dram(
        self, keys: list[Key], digests: Digests, scope: Scope | None, decision: Decision
    ) -> Reservation | None:
        n = len(keys)
        if n > self.dram.slots - (len(scope.slots) if scope else 0):
            return None  # can never fit: overflow to SSD without evicting anything first
        if self.dram.free < n and decision.reason is not Reason.REUSE_WITHIN_DRAM:
            # A home displaces copies first, just what it needs (they lose nothing), and only then other
            # homes, oldest first. A promotion (adaptive) only takes free slots: evicting for it reclaimed
            # whole scopes that were about to be read (their only copy), which cost more than it gained.
            self._evict_copies(n, keep=None)
            if self.dram.free < n:
                self._reclaim(Medium.DRAM, n, keep=scope)
        if self.dram.free < n:
            return None
        new = scope is None
        if scope is None:
            scope = self._new_scope(Medium.DRAM)
        slots = self.dram.alloc(n)
        scope.slots.extend(slots)
        G.encode(Medium.DRAM, self.node_id, (max(slots) + 1) * self.page_span - 1)  # the last page fits the GVA
        gva, stride = self._dram_gva(slots)
        return Reservation(list(keys), scope, decision, new, digests, slots=slots, gva=gva, stride=stride)

    def _dram_gva(self, slots: Sequence[int]) -> tuple[U64, npt.NDArray[np.int64]]:
        """The layer-0 GVAs and layer strides of pages in DRAM pool ``slots`` (a page keeps its layers back
        to back); ``_slot_of`` is the inverse."""
        base = G.encode(Medium.DRAM, self.node_id, 0)
        gva = np.asarray(slots, np.uint64) * np.uint64(self.page_span) + np.uint64(base)
        return gva, np.full(len(slots), self.page_bytes, np.int64)

    def _reserve_ssd(self, keys: list[Key], digests: Digests, scope: Scope | None, decision: Decision) -> Reservation:
        span = self.page_span
        n = len(keys)
        need = n * span
        owned = scope.units() if scope else 0
        if need > self.ssd.capacity - owned:  # refuse before reclaim touches anything
            raise PoolFullError(
                f"keys: a put of {n} pages needs {need} bytes, but the SSD pool holds {self.ssd.capacity} in all "
                f"({owned} already held by this session); split the put or enlarge ssd.file_count / ssd.file_bytes"
            )
        if self.ssd.free_bytes < need or self._crosses_high(Medium.SSD, need):
            self._reclaim(Medium.SSD, need, keep=scope)
        if self.ssd.free_bytes < need:
            raise PoolFullError(
                f"SSD file pool full: {need} more bytes needed, {self.ssd.free_bytes} free of {self.ssd.capacity} "
                "and every other scope is pinned; enlarge ssd.file_count or release pins"
            )
        new = scope is None
        if scope is None:
            scope = self._new_scope(Medium.SSD)
        res = Reservation(list(keys), scope, decision, new, digests)
        page = 0
        while page < n:
            at, ext, count = self._place(scope, n - page)
            res.segments.append(Segment(ext.file, at, page, count))
            # What the journal records: the extent from its start through this segment (not further, so
            # space a concurrent, later-aborted append took is never claimed by this record).
            res.extents.append(Extent(ext.file, ext.offset, at + count * span - ext.offset))
            page += count
        res.gva, res.stride = np.empty(n, np.uint64), np.empty(n, np.int64)
        for seg in res.segments:
            # A segment's pages are consecutive page_bytes apart within one layer's run; encoding its
            # last byte too refuses a segment whose end does not fit the GVA's offset field.
            first = G.encode(Medium.SSD, self.node_id, seg.file * self.file_bytes + seg.offset)
            G.encode(Medium.SSD, self.node_id, seg.file * self.file_bytes + seg.offset + seg.pages * span - 1)
            run = slice(seg.first_page, seg.first_page + seg.pages)
            res.gva[run] = np.arange(seg.pages, dtype=np.uint64) * np.uint64(self.page_bytes) + np.uint64(first)
            res.stride[run] = seg.pages * self.page_bytes
        scope.segments += len(res.segments)
        return res

    def _place(self, scope: Scope, pages: int) -> tuple[int, Extent, int]:
        """Space for up to ``pages`` pages of ``scope``: ``(offset, extent, pages placed)``. In order of
        preference: after the scope's last extent (one extent, one read run per layer for the session),
        a new extent holding them all (first-fit), then whatever is free right after the last extent or
        the largest free run (the caller has made sure enough bytes are free)."""
        span = self.page_span
        last = scope.extents[-1] if scope.extents else None
        grown = self.ssd.extend(last, pages * span) if last is not None else None
        if last is not None and grown is not None:
            scope.extents[-1] = grown
            return last.end, grown, pages
        ext = self.ssd.alloc(pages * span)
        if ext is not None:
            scope.extents.append(ext)
            return ext.offset, ext, pages
        room = self.ssd.room_after(last) // span if last is not None else 0
        if last is not None and room:
            grown = self.ssd.extend(last, room * span)
            assert grown is not None
            scope.extents[-1] = grown
            return last.end, grown, room
        big = self.ssd.largest()
        assert big is not None and big.length >= span  # free runs are whole pages, and enough are free
        ext = Extent(big.file, big.offset, min(pages, big.length // span) * span)
        self.ssd.take(ext)
        scope.extents.append(ext)
        return ext.offset, ext, ext.length // span

    def _crosses_high(self, medium: Medium, need: int) -> bool:
        return self.used(medium) + need > self.high * self.capacity(medium)

    def publish(self, res: Reservation, checksums: Sequence[int] | None = None) -> None:
        """Make the written pages visible; from here on readers find them."""
        with self.lock:
            d = res.digests
            n = len(res.keys)
            crc = np.zeros(n, np.int64) if checksums is None else np.asarray(checksums, np.int64)
            self.index.put(d, res.scope.id, res.gva, res.stride, crc)
            res.scope.keys.extend(d)
            res.scope.published(res.extents, res.slots)
            if res.copy_slots:
                assert self.copies is not None
                self.copies.add(res.scope, d, res.copy_slots, crc, WRITE)
            self._pending.difference_update(res.keys)
            res.scope.pins -= 1

    def abort(self, res: Reservation) -> None:
        """The write failed: publish nothing and give the space back."""
        with self.lock:
            self._pending.difference_update(res.keys)
            res.scope.pins -= 1
            if res.slots:
                self.dram.release(res.slots)
                drop = set(res.slots)
                res.scope.slots = [s for s in res.scope.slots if s not in drop]
            if res.copy_slots:
                self.dram.release(res.copy_slots)
            for seg in reversed(res.segments):
                self._give_back(res.scope, seg)
            if res.new_scope and not res.scope.keys and res.scope.pins == 0:
                self._free_scope(res.scope, count=False)

    def _give_back(self, scope: Scope, seg: Segment) -> None:
        """Free an aborted segment when it ends its extent. One followed by a concurrent append of the
        same scope stays, a hole freed with the scope: extents stay contiguous."""
        start, end = seg.offset, seg.offset + seg.pages * self.page_span
        for i, ext in enumerate(scope.extents):
            if ext.file == seg.file and ext.offset <= start and ext.end == end:
                self.ssd.release(Extent(seg.file, start, end - start))
                if start == ext.offset:
                    del scope.extents[i]
                else:
                    scope.extents[i] = ext._replace(length=start - ext.offset)
                return

    def pin(self, keys: Sequence[Key], digests: Digests | None = None) -> Found:
        """Find ``keys`` and, when every one is stored, pin their scopes, in one step under the lock
        (a reader about to read their bytes: nothing can reclaim them in between). ``Found`` says which
        were not (nothing is pinned then). A page with a DRAM copy is found at its copy (copies mode);
        its scope, the one pinned, is its home's."""
        d = key_digests(keys) if digests is None else digests
        with self.lock:
            found = self.index.find(d, stable_only=False)
            assert found is not None
            if found.hit.all():
                now = next(self._clock)
                for sid in set(found.scope.tolist()):
                    scope = self.scopes[sid]
                    scope.pins += 1
                    self._came_back(scope, now)
                    scope.last_used = now
                if self.copies:
                    found = self.copies.served(found, d)
            return found

    # ---- DRAM copies (copies mode) -------------------------------------------------------------
    def _copy_pays(self, session: int | None) -> bool:
        assert self.reuse is not None
        if session is None:
            return False
        now = self._clock.now
        if self.reuse.copy_residence is None:  # copies have never been dropped: DRAM keeps what it takes
            return True
        oldest = min((s.last_used for s in self.scopes.values() if s.copy_slots), default=now)
        return self.reuse.copy_pays(session, now - oldest)

    def _take_copy_slots(self, n: int, keep: Scope | None, evidence: bool, origin: int) -> list[int]:
        """DRAM slots for ``n`` copies made at a write or a restore (``origin``): free ones, or, on
        ``evidence`` that they will be read, ones older copies give up (``_evict_copies``); none when they
        cannot fit. A copy never displaces a DRAM home, and a restore's never displaces a copy made at a
        write that no lease has read yet (``copies`` module doc)."""
        if self.dram.free < n and evidence:
            self._evict_copies(n, keep, spare_unread_writes=origin == RESTORE)
        return self.dram.alloc(n) if self.dram.free >= n else []

    def _evict_copies(self, n: int, keep: Scope | None, spare_unread_writes: bool = False) -> None:
        """Drop the least recently used copies (never ``keep``'s or a pinned scope's, nor, when
        ``spare_unread_writes``, a scope's holding a written copy not read yet) until ``n`` slots are free,
        or none when even all of them would not do."""
        if self.dram.free >= n or n > self.dram.slots:
            return
        spared = self.copies.awaits_first_read if self.copies and spare_unread_writes else lambda _: False
        victims = [
            Victim(s.id, s.last_used, len(s.copy_slots), s.pins > 0 or s is keep or spared(s))
            for s in self.scopes.values()
            if s.copy_slots
        ]
        for sid in plan_reclaim(victims, self.used(Medium.DRAM), self.dram.slots, n, 1.0, 1.0):
            self._drop_copies(self.scopes[sid], count=True)

    def _slot_of(self, gva: U64) -> npt.NDArray[np.int64]:
        return ((gva & np.uint64(G.MAX_OFFSET)) // np.uint64(self.page_span)).astype(np.int64)

    def _drop_copies(self, scope: Scope, count: bool) -> None:
        """Free every copy ``scope`` holds (its pages stay served from SSD)."""
        if not scope.copy_slots:
            return
        assert self.copies is not None
        if count and self.reuse is not None:
            self.reuse.copy_evicted(self._clock.now - scope.last_used)
        self.dram.release(self.copies.drop(scope, count))

    def reserve_copies(self, found: Found, d: Digests) -> CopyReservation | None:
        """Copies mode: DRAM slots for copies of the SSD pages of a lease just pinned (``found``, from
        ``pin``), scope by scope while restore copies are read often enough (``copies.Accuracy``): free
        slots, or older copies' when the session came back within DRAM's residence. The reader fills them
        from what it read and hands them to ``publish_copies``; until then no reader finds them."""
        if self.copies is None:
            return None
        with self.lock:
            on_ssd = np.flatnonzero(found.hit & (found.gva >= np.uint64(G.SSD_THRESHOLD)))
            want: list[int] = []
            slots: list[int] = []
            for sid in dict.fromkeys(found.scope[on_ssd].tolist()):  # scope by scope, in lease order
                pages = on_ssd[found.scope[on_ssd] == sid].tolist()
                if not self.copies.admits(RESTORE, len(pages)):
                    continue
                got = self._take_copy_slots(len(pages), None, self._copy_pays(self.scopes[sid].reuse), RESTORE)
                if got:
                    want += pages
                    slots += got
            if not want:
                return None
            at = np.asarray(want, np.int64)
            return CopyReservation(want, (d[0][at], d[1][at]), found.scope[at].tolist(), slots)

    def publish_copies(self, cres: CopyReservation, crc: Sequence[int]) -> int:
        """The reader filled the copies whose ``crc`` is not negative (one per reserved page, the crc32
        of the copy's bytes): serve them from now on; free the rest. Call while the lease still pins
        the scopes. Returns the copies published."""
        assert self.copies is not None
        if len(crc) != len(cres.slots):
            crc = [-1] * len(cres.slots)  # a reader that does not say what it filled filled nothing
        with self.lock:
            known = self.copies.index.find(cres.digests, stable_only=False)
            home = self.index.find(cres.digests, stable_only=False)
            assert known is not None and home is not None
            unused: list[int] = []
            per_scope: dict[int, list[int]] = {}
            for j, (sid, value) in enumerate(zip(cres.scopes, crc, strict=True)):
                ok = value >= 0 and not known.hit[j] and home.hit[j] and int(home.scope[j]) == sid
                if ok and sid in self.scopes:
                    per_scope.setdefault(sid, []).append(j)
                else:
                    unused.append(cres.slots[j])
            self.copy_stats.unfilled += sum(1 for v in crc if v < 0)
            if unused:
                self.dram.release(unused)
            for sid, js in per_scope.items():
                at = np.asarray(js, np.int64)
                sums = np.asarray([crc[j] for j in js], np.int64)
                self.copies.add(self.scopes[sid], (cres.digests[0][at], cres.digests[1][at]),
                                [cres.slots[j] for j in js], sums, RESTORE)  # fmt: skip
            return sum(len(js) for js in per_scope.values())

    def unpin(self, scope_ids: set[int]) -> None:
        with self.lock:
            for sid in scope_ids:
                self.scopes[sid].pins -= 1

    def reclaim(self, medium: Medium) -> list[int]:
        """Bring usage down to the low watermark if it is above the high one."""
        with self.lock:
            return self._reclaim(medium, 0, keep=None)

    def _reclaim(self, medium: Medium, need: int, keep: Scope | None) -> list[int]:
        if medium is Medium.DRAM:  # DRAM homes and copies alike, least recently used first
            victims = [
                Victim(s.id, s.last_used, s.dram_units(), s.pins > 0 or s is keep)
                for s in self.scopes.values()
                if s.dram_units()
            ]
        else:
            victims = [
                Victim(s.id, s.last_used, s.units(), s.pins > 0 or s is keep)
                for s in self.scopes.values()
                if s.medium is medium
            ]
        chosen = plan_reclaim(victims, self.used(medium), self.capacity(medium), need, self.high, self.low)
        for sid in chosen:
            scope = self.scopes[sid]
            if medium is Medium.DRAM and scope.medium is Medium.SSD:
                self._drop_copies(scope, count=True)  # a copy's home stays: nothing is lost
            else:
                self._free_scope(scope, count=True)
        return chosen

    def drop(self, scope_id: int) -> bool:
        """Free one scope whole now (its pages were found damaged); False if a reader pins it."""
        with self.lock:
            scope = self.scopes.get(scope_id)
            if scope is None:
                return True
            if scope.pins:
                return False
            self._free_scope(scope, count=False)
            return True

    def adopt(self, scope: Scope, d: npt.NDArray[np.uint64], taken: bool = False) -> None:
        """Re-create a scope found in the journal at start-up, with its pages' digests (``(pages, 2)``) in
        publish order; its space must be free (or ``taken``: by recovery, all at once), else ValueError with
        nothing kept. Its pages are found once ``load_index`` indexed every adopted scope's."""
        with self.lock:
            mine: list[Extent] = []  # what this call took (an extent overlapping another finds it taken)
            try:
                for ext in [] if taken else scope.extents:
                    self.ssd.take(ext)
                    mine.append(ext)
                if scope.slots:
                    self.dram.take(scope.slots)
            except ValueError as exc:
                for ext in scope.extents if taken else mine:
                    self.ssd.release(ext)
                raise ValueError(f"scope {scope.id}: {exc}") from None
            self.scopes[scope.id] = scope
            scope.published(scope.extents, scope.slots)
            scope.keys = Pages.of(d)
            scope.last_used = next(self._clock)

    def load_index(self, d: npt.NDArray[np.uint64], scope: Any, gva: U64, stride: Any, crc: Any) -> None:
        """Index the adopted pages in one sorted pass (keyindex ``load``); no lock: recovery runs it beside
        ``adopt``, before anything else writes."""
        self.index.load((d[:, 0], d[:, 1]), scope, gva, stride, crc)
        if len(scope):  # new scopes are numbered past every adopted one
            with self.lock:
                self._ids = itertools.count(max(next(self._ids), int(np.max(scope)) + 1))

    def unindex(self, d: npt.NDArray[np.uint64]) -> None:
        """Recovery only: remove these pages' entries (of scopes ``adopt`` refused) from the index."""
        self.index.remove((d[:, 0], d[:, 1]))  # after load_index, before serving: no other writer

    def _adapt(self, decision: Decision, parent: Scope | None, digests: Digests) -> tuple[Decision, int | None]:
        """Adaptive placement: Table 2's ``decision`` corrected by the session's reuse distance. That is
        its parent scope's latest, or, when these pages include the last page of a DRAM scope that
        reclaim freed before anyone read it again (the session came back and had to recompute), the
        ticks since that scope's last write: a distance beyond DRAM's residence, the evidence that
        survivors alone never give. Returns the decision and the session's reuse distance."""
        assert self.reuse is not None
        now = next(self._clock)
        session = None
        if parent is not None:
            self._came_back(parent, now)  # without a read, too: its prefix was still in the engine's HBM
            session = parent.reuse
        if self._ghosts:
            for h in zip(digests[0].tolist(), digests[1].tolist(), strict=True):
                written = self._ghosts.pop(h, None)
                if written is not None:
                    session = now - written
                    self.reuse.reused(session)
        if self.copies is not None:
            # Copies mode keeps Table 2's homes: a short-horizon scope stays DRAM-only (never written), a
            # long-horizon one gets its durable SSD home, and DRAM earns its keep with copies. Turning DRAM
            # choices to SSD by reuse distance too cost the main job 2.9x Table 2's TTFT at 4 QPS (its SSD
            # prefetches, staged in SGLang's small host tier, were declined and recomputed); without, a tie.
            return decision, session
        oldest = now
        if self.reuse.residence is not None:  # the scan matters only once DRAM has reclaimed a home
            oldest = min((s.last_used for s in self.scopes.values() if s.medium is Medium.DRAM), default=now)
        return self.reuse.adjust(decision, session, now - oldest), session

    def _came_back(self, scope: Scope, now: int) -> None:
        """Adaptive placement: the first use of ``scope`` since its last write is its reuse distance."""
        if self.reuse is not None and not scope.reread:
            scope.reread, scope.reuse = True, now - scope.written
            self.reuse.reused(scope.reuse)

    def _new_scope(self, medium: Medium) -> Scope:
        scope = Scope(next(self._ids), medium, next(self._clock))
        self.scopes[scope.id] = scope
        return scope

    def _free_scope(self, scope: Scope, count: bool) -> None:
        if self.on_free is not None and scope.keys:
            self.on_free(scope)
        self._drop_copies(scope, count=False)  # with their home
        if scope.keys:  # entries go before the space can be reused
            self.index.remove(scope.keys.digests())
        if count and self.reuse is not None and scope.medium is Medium.DRAM:
            self.reuse.reclaimed(next(self._clock) - scope.last_used)
            last = scope.keys.last()
            if last is not None and not scope.reread:  # freed unread: remember when it was written
                self._ghosts[last] = scope.written
                if len(self._ghosts) > GHOSTS:
                    self._ghosts.popitem(last=False)
        if count:
            stats = self.reclaimed[scope.medium]
            stats.scopes += 1
            stats.bytes += scope.units() * self.unit_bytes(scope.medium)
        if scope.medium is Medium.SSD:
            for ext in scope.extents:
                self.ssd.release(ext)
        elif scope.slots:
            self.dram.release(scope.slots)
        scope.extents, scope.slots = [], []
        scope.keys.clear()
        del self.scopes[scope.id]

    def drop_page(self, digest: bytes, loc: Location) -> bool:
        """Stop serving one page (its stored bytes are damaged): its entry goes, its space stays with
        its scope until the scope is freed; a scope left with no page is freed. False when the digest
        no longer names that page."""
        with self.lock:
            d = unpack_digest(digest)
            found = self.index.find(d, stable_only=False)
            assert found is not None
            if not found.hit[0] or as_locations(found)[0] != loc:
                return False
            self.index.remove(d)
            scope = self.scopes[loc.scope]
            scope.keys.pop(scope.keys.index(int(d[0][0]), int(d[1][0])))
            slot = self.copies.drop_one(scope, d) if self.copies else None
            if slot is not None:  # its copy was made from the same bytes: it goes too
                self.dram.release([slot])
            if not scope.keys:
                self.drop(scope.id)
            return True

    def usage(self) -> dict[str, dict[str, int]]:
        """Used and total bytes, scopes, published pages and reclaim counts per medium."""
        with self.lock:
            return {
                m.name.lower(): {
                    "used_bytes": self.used(m) * self.unit_bytes(m),
                    "capacity_bytes": self.capacity(m) * self.unit_bytes(m),
                    "scopes": sum(1 for s in self.scopes.values() if s.medium is m),
                    "pages": sum(len(s.keys) for s in self.scopes.values() if s.medium is m),
                    "reclaimed_scopes": self.reclaimed[m].scopes,
                    "reclaimed_bytes": self.reclaimed[m].bytes,
                    **(
                        {"copy_pages": sum(len(s.copy_slots) for s in self.scopes.values())} if m is Medium.DRAM else {}
                    ),
                }
                for m in Medium
            }
