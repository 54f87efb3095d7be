"""Recovery: rebuild a catalog from its journal at start-up, and check stored bytes against the
per-page checksums so that a page overwritten or torn on disk is dropped, never served.

Rebuilding is O(journal records): no page is read before the agent serves. The bytes are checked
afterwards by ``scan`` (a background pass over every recovered page, several reads in flight) and,
until the scan has passed a scope, by every reader of it (its leases say ``verify``: the client checks
each page it reads against its crc32 and treats a mismatch as a miss). A damaged page found by the
scan stops being served at once: a miss, never served."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.catalog.checksum import crc32
from flatcake.node_agent.catalog.journal import ReplayReport, replay
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.extents import Extent
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.keyindex import U64, hash_keys, pack
from flatcake.node_agent.policy.scope import Location, Scope

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    """Recovery's outcome, updated while it runs (``/readyz`` and the metrics show it live)."""

    scopes: int = 0
    pages: int = 0
    dropped_pages: int = 0  # bytes no longer match their checksum
    superseded_pages: int = 0  # their space or key was taken by a later record (a lost ``free``)
    records: int = 0
    snapshot_records: int = 0  # of those, the compacted state's (in columns); the rest were appended since
    skipped_records: int = 0  # damaged journal records skipped
    torn_bytes: int = 0
    legacy_journal: bool = False  # in the first format: rewritten before anything is appended
    verified_pages: int = 0  # pages whose bytes were checked (at recovery, or by the scan)
    total_pages: int = 0  # pages the journal names, known once it is read
    done: bool = False
    # Where a restart's time goes: reading the journal, re-creating the scopes, filling the index.
    collect_seconds: float = 0.0
    adopt_seconds: float = 0.0
    index_seconds: float = 0.0
    scan_pages: int = 0  # pages the background scan checks (those recovered)
    scan_bytes: int = 0
    scan_seconds: float = 0.0
    scan_done: bool = False


@dataclass
class _Found:
    """One scope as the journal describes it: its pages as spans of the journal's page columns."""

    medium: Medium
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first page, pages) in the journal's order
    slots: list[int] = field(default_factory=list)
    ext: dict[tuple[int, int], int] = field(default_factory=dict)

    def positions(self) -> npt.NDArray[np.int64]:
        if len(self.spans) == 1:
            first, n = self.spans[0]
            return np.arange(first, first + n)
        return np.concatenate([np.arange(first, first + n) for first, n in self.spans])


# One scope's share of a record: id, medium, pages, the extents it claims, its DRAM slots.
_Entry = tuple[int, Medium, int, list[Extent], list[int]]


@dataclass
class _Journaled:
    """What ``collect`` read: the live scopes, what each record claimed, and every published page in
    the journal's order, in columns (a scope's pages are spans of them)."""

    scopes: dict[int, _Found] = field(default_factory=dict)
    claims: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # SSD: file, start, end, record, scope
    slot_claims: dict[int, int] = field(default_factory=dict)  # DRAM slot -> scope that claimed it last
    pages: int = 0
    parts: list[tuple[bytes, Any, Any, Any]] = field(default_factory=list)  # kd, gva, stride, crc
    # Each entry's scope and page count, in the journal's order: the owner column, built once at the end
    # (a numpy call or three per record was a third of decoding an agentic tail).
    owner_ids: list[int] = field(default_factory=list)
    owner_pages: list[int] = field(default_factory=list)

    def add(self, seq: int, cols: tuple[bytes, Any, Any, Any], entries: list[_Entry]) -> None:
        at = self.pages
        for sid, medium, n, extents, slots in entries:
            s = self.scopes.get(sid)
            if s is None:
                s = self.scopes[sid] = _Found(medium)
            for e in extents:  # an extent grows in place: keep its longest journaled length
                key = (e.file, e.offset)
                s.ext[key] = max(s.ext.get(key, 0), e.length)
                self.claims.append((e.file, e.offset, e.end, seq, sid))
            s.spans.append((at, n))
            if slots:
                s.slots.extend(slots)
                self.slot_claims.update(dict.fromkeys(slots, sid))
            self.owner_ids.append(sid)
            self.owner_pages.append(n)
            at += n
        self.parts.append(cols)
        self.pages = at

    def columns(self) -> tuple[npt.NDArray[np.uint64], U64, npt.NDArray[np.int64], npt.NDArray[np.int64],
                               npt.NDArray[np.int64]]:  # fmt: skip
        """Digests ``(pages, 2)``, addresses, layer strides, crc32s and owning scopes of every page."""
        parts, self.parts = self.parts, []
        if not parts:
            e = np.zeros(0, np.int64)
            return np.zeros((0, 2), np.uint64), e.astype(np.uint64), e, e, e
        kd, gva, stride, crc = zip(*parts, strict=True)
        owner = np.repeat(np.asarray(self.owner_ids, np.int64), np.asarray(self.owner_pages, np.int64))
        self.owner_ids, self.owner_pages = [], []
        buf, at = bytearray(sum(map(len, kd))), 0  # writable: scopes keep views of it as their page lists
        for blob in kd:
            buf[at : at + len(blob)] = blob
            at += len(blob)
        d = np.frombuffer(buf, "<u8").reshape(-1, 2)
        return (d, np.concatenate(gva).astype(np.uint64), np.concatenate(stride).astype(np.int64),
                np.concatenate(crc).astype(np.int64), owner)  # fmt: skip


def recover(
    catalog: LocalCatalog,
    journal_path: str | os.PathLike[str],
    read_page: Callable[[Location], int] | None,
    out: Recovered | None = None,
) -> Recovered:
    """Rebuild the catalog from the journal (``collect``, then ``adopt``). With ``read_page`` (returns a
    stored page's crc32), pages whose bytes no longer match are dropped instead of served.

    Restart time is what a node with 10M pages waits for (bench agent's ``restart_keys``): pages are
    handled in columns, never one Python object per page; compaction writes the live state as columns
    too (``snap`` records, journal.py ``snapshot_records``), so only the records appended since the last
    compaction are decoded one by one; the index is filled in one pass at the end."""
    out = out if out is not None else Recovered()
    started = time.monotonic()
    # The index's memory is faulted in on the other core meanwhile (reading the journal holds the GIL,
    # faulting does not): at 10M keys a first touch of the table was seconds on the restart's path.
    warming = threading.Thread(target=catalog.warm, name="flatcake-recovery-warm")
    warming.start()
    found = collect(journal_path, catalog.table.ssd.file_bytes, out)
    out.collect_seconds = time.monotonic() - started
    adopt(catalog, found, read_page, out, str(journal_path), warming)
    out.done = True
    return out


def collect(journal_path: str | os.PathLike[str], file_bytes: int, out: Recovered) -> _Journaled:
    """Read the journal: the scopes it leaves live (a ``free`` ends a scope), what each record claimed,
    and every published page in columns. A record that is checksummed but not one this agent wrote is
    skipped and counted, as a damaged one is."""
    report = ReplayReport()
    found = _Journaled()
    for seq, rec in enumerate(replay(journal_path, report)):
        out.records += 1
        try:
            kind = rec["t"]
            if kind == "free":
                found.scopes.pop(rec["scope"], None)
                continue
            if kind == "snap":
                cols, entries = _snap(rec)
                out.snapshot_records += 1
            else:
                cols, entries = _pub(rec, file_bytes)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            report.skipped_records += 1
            log.error("%s: skipping a malformed record (%s)", journal_path, exc)
            continue
        found.add(seq, cols, entries)
    out.skipped_records, out.torn_bytes = report.skipped_records, report.torn_bytes
    out.legacy_journal = report.legacy
    out.total_pages = sum(n for s in found.scopes.values() for _, n in s.spans)
    return found


def adopt(
    catalog: LocalCatalog,
    found: _Journaled,
    read_page: Callable[[Location], int] | None,
    out: Recovered,
    where: str,
    warming: threading.Thread | None = None,
) -> None:
    """Serve what ``collect`` found again. The journal may have lost a record (skipped as damaged), so a
    ``free`` may be missing and the freed scope come back over space a later scope was given: each byte
    of SSD space and each DRAM slot belongs to the scope that claimed it last in the journal, and a scope
    that lost any of its space is dropped whole; likewise a key belongs to the scope that published it
    last (within one scope, its first page of that key). Surviving scopes get back exactly the extents
    the journal records, so a restart rebuilds the same allocation."""
    started = time.monotonic()
    lost = _lost_space(found.claims, found.scopes)
    d, gva, stride, crc, owner = found.columns()
    owned = _owned(d, owner)
    every = read_page is None and bool(owned.all())  # the common case: each scope keeps all its pages
    served = np.zeros(len(d), bool)  # the journal positions of the pages served again
    kept: list[tuple[int, _Found, Any, int]] = []
    for sid, s in sorted(found.scopes.items()):
        if sid in lost or (s.slots and any(found.slot_claims.get(x) != sid for x in s.slots)):
            out.superseded_pages += sum(n for _, n in s.spans)
            continue
        if every and len(s.spans) == 1:  # one run of the columns: a view, no index arrays
            first, n = s.spans[0]
            rows: Any = slice(first, first + n)
        else:
            rows = _kept(sid, s, owned, gva, stride, crc, read_page, out)
            n = len(rows)
            if not n:
                continue  # nothing left to serve: its space stays free
        served[rows] = True
        kept.append((sid, s, rows, n))
    cols = (d, owner, gva, stride, crc)
    if not served.all():  # pages of freed or dropped scopes: left out (a copy of the columns)
        cols = tuple(c[served] for c in cols)  # type: ignore[assignment]

    # The index is filled on the other core while the scopes are re-created (numpy releases the GIL): no
    # client is served before both end, and a scope whose space turns out taken loses its entries after.
    def index() -> None:
        if warming is not None:
            warming.join()
        catalog.adopted(*cols)

    indexing = threading.Thread(target=index, name="flatcake-recovery-index")
    index_started = time.monotonic()
    indexing.start()
    refused = []
    space = [[Extent(f, o, e) for (f, o), e in s.ext.items()] for _, s, _, _ in kept]
    taken = catalog.take_space([e for extents in space for e in extents])  # else each scope takes its own
    for (sid, s, rows, n), extents in zip(kept, space, strict=True):
        scope = Scope(sid, s.medium, 0, extents=extents, slots=s.slots)
        try:
            catalog.adopt(scope, d[rows], taken)
        except ValueError as exc:  # space outside the pool or taken twice: never serve it
            log.error("%s: dropping scope %d: %s", where, sid, exc)
            out.superseded_pages += n
            refused.append(rows)
            continue
        out.scopes += 1
        out.pages += n
    out.adopt_seconds = time.monotonic() - started
    indexing.join()
    out.index_seconds = time.monotonic() - index_started
    if refused:
        catalog.unindex(np.concatenate([d[rows] for rows in refused]))
    if out.dropped_pages:
        log.warning("recovery dropped %d pages whose bytes no longer match their checksum", out.dropped_pages)
    if out.superseded_pages:
        log.warning("recovery dropped %d pages whose space or key a later record took (a damaged record "
                    "hid their release)", out.superseded_pages)  # fmt: skip


def _kept(
    sid: int,
    s: _Found,
    owned: npt.NDArray[np.bool_],
    gva: U64,
    stride: npt.NDArray[np.int64],
    crc: npt.NDArray[np.int64],
    read_page: Callable[[Location], int] | None,
    out: Recovered,
) -> npt.NDArray[np.int64]:
    """The journal positions of the pages scope ``sid`` still serves: those it owns (``_owned``) and,
    with ``read_page``, whose bytes still match their checksum; the rest are counted."""
    at = s.positions()
    keep = owned[at]
    out.superseded_pages += len(keep) - int(np.count_nonzero(keep))
    if read_page is not None:
        for i in np.flatnonzero(keep).tolist():
            out.verified_pages += 1
            if read_page(Location(sid, int(gva[at[i]]), int(stride[at[i]]))) != crc[at[i]]:
                keep[i] = False
                out.dropped_pages += 1
    return at[keep]


def _pub(rec: dict[str, Any], file_bytes: int) -> tuple[tuple[bytes, Any, Any, Any], list[_Entry]]:
    """A publish record (one scope's new pages) as columns and its scope's entry."""
    sid, medium = int(rec["scope"]), Medium(rec["medium"])
    extents = _extents(rec, file_bytes)
    blob = _digest_blob(rec)
    n = len(blob) // 16
    gva, stride, crc, slots = rec["gva"], rec["stride"], rec["crc"], rec["slots"]
    if not len(gva) == len(stride) == len(crc) == n:
        raise ValueError("keys, gva, stride and crc differ in length")
    cols = (blob, np.asarray(gva, np.uint64), np.asarray(stride, np.int64), np.asarray(crc, np.int64))
    return cols, [(sid, medium, n, extents, [int(x) for x in slots])]


def _snap(rec: dict[str, Any]) -> tuple[tuple[bytes, Any, Any, Any], list[_Entry]]:
    """A snapshot record (whole scopes, in columns: journal.py ``snapshot_records``), checked for
    consistent lengths before any of it is used."""

    def col(name: str, dtype: str, width: int = 1) -> npt.NDArray[Any]:
        raw = rec[name]
        if not isinstance(raw, bytes) or len(raw) % (np.dtype(dtype).itemsize * width):
            raise ValueError(f"{name}: not a whole number of {dtype} x {width}")
        return np.frombuffer(raw, dtype)

    sids, media, counts = col("scopes", "<u8"), col("media", "u1"), col("counts", "<u4")
    ext_counts, slot_counts = col("ext_counts", "<u4"), col("slot_counts", "<u4")
    exts, slots = col("exts", "<u8", 3).reshape(-1, 3), col("slot_list", "<u4")
    kd, gva, stride, crc = col("kd", "<u8", 2), col("gvas", "<u8"), col("strides", "<u4"), col("crcs", "<u4")
    n = len(gva)
    if not len(media) == len(counts) == len(ext_counts) == len(slot_counts) == len(sids):
        raise ValueError("per-scope columns differ in length")
    if int(counts.sum()) != n or len(kd) != 2 * n or len(stride) != n or len(crc) != n:
        raise ValueError("pages: counts, digests, gva, stride and crc differ")
    if int(ext_counts.sum()) != len(exts) or int(slot_counts.sum()) != len(slots):
        raise ValueError("extents or slots: counts differ from the lists")
    ext_list = [Extent(f, o, length) for f, o, length in exts.tolist()]
    slot_list = slots.tolist()
    entries: list[_Entry] = []
    e = x = 0
    for sid, m, c, ne, ns in zip(sids.tolist(), media.tolist(), counts.tolist(), ext_counts.tolist(),
                                 slot_counts.tolist(), strict=True):  # fmt: skip
        entries.append((sid, Medium(m), c, ext_list[e : e + ne], slot_list[x : x + ns]))
        e, x = e + ne, x + ns
    return (rec["kd"], gva, stride, crc), entries


def _owned(d: npt.NDArray[np.uint64], owner: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which journal positions hold a page their scope still owns: all but those of a digest published
    more than once whose last publisher is another scope, or which that scope published earlier. Found
    by sorting the digests' first words: repeats are rare (a key published again, or freed and
    published again), so only those few are looked at one by one."""
    owned = np.ones(len(d), bool)
    h1 = np.sort(d[:, 0])
    repeated = h1[1:][h1[1:] == h1[:-1]]
    if not repeated.size:
        return owned
    marked = np.flatnonzero(np.isin(d[:, 0], repeated)).tolist()
    last: dict[bytes, int] = {}
    first: dict[tuple[bytes, int], int] = {}
    for i in marked:
        key, sid = d[i].tobytes(), int(owner[i])
        last[key] = sid
        first.setdefault((key, sid), i)
    for i in marked:
        key, sid = d[i].tobytes(), int(owner[i])
        owned[i] = last[key] == sid and first[key, sid] == i
    return owned


def _digest_blob(rec: dict[str, Any]) -> bytes:
    """A publish record's keys as 16-byte digests, joined: compacted records carry them (``kd``),
    others the keys themselves (hashed here as the index hashes them)."""
    if "kd" in rec:
        blob = rec["kd"]
        if not isinstance(blob, bytes) or len(blob) % 16:
            raise ValueError("kd: not a whole number of 16-byte digests")
        return blob
    d = hash_keys(rec["keys"])
    if d is None:
        raise ValueError("keys: a key is not str, bytes or int")
    return pack(d)


def _extents(rec: dict[str, Any], file_bytes: int) -> list[Extent]:
    """The SSD space a publish record claims. Records before byte extents name whole pool files: the
    scope held each of them, the last up to ``cursor`` (where its next append would have gone)."""
    if "ext" in rec:
        return [Extent(int(f), int(o), int(n)) for f, o, n in rec["ext"]]
    files = [int(f) for f in rec["files"]]
    cursor = int(rec["cursor"])
    lengths = [file_bytes] * (len(files) - 1) + [min(cursor, file_bytes)]
    return [Extent(f, 0, n) for f, n in zip(files, lengths, strict=False) if n > 0]


def _lost_space(claims: list[tuple[int, int, int, int, int]], live: dict[int, _Found]) -> set[int]:
    """Live scopes whose space a later record claimed for another scope (freed or not): the record of
    their release was lost, and the later owner may have overwritten their bytes. A sweep over the
    claims in address order compares each with the earlier-starting claims that still overlap it."""
    lost: set[int] = set()
    active: list[tuple[int, int, int, int, int]] = []
    for claim in sorted(claims):
        file, start, _, seq, sid = claim
        active = [a for a in active if a[0] == file and a[2] > start]
        for a in active:
            if a[4] != sid:
                loser = a[4] if a[3] < seq else sid
                if loser in live:
                    lost.add(loser)
        active.append(claim)
    return lost


def scan(
    catalog: LocalCatalog,
    read_page: Callable[[Location], int],
    out: Recovered,
    stop: threading.Event,
    workers: int = 4,
    page_bytes: int = 0,
) -> None:
    """Check every page of the scopes in ``catalog.unverified`` against its checksum, ``workers``
    scopes at a time (reads and crc32 release the GIL). A damaged page stops being served at once
    (``drop_damaged``) and is counted in ``dropped_pages``. A scope passes when all its pages were
    checked; from then on its leases stop asking readers to check."""
    started = time.monotonic()
    work = [(sid, catalog.pages_of(sid)) for sid in sorted(catalog.unverified)]
    out.scan_pages = sum(len(pages) for _, pages in work)

    def check(item: tuple[int, list[tuple[bytes, Location, int]]]) -> tuple[int, int, list[tuple[bytes, Location]]]:
        return (item[0], *check_pages(item[1], read_page, stop))

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="flatcake-scan") as pool:
        for sid, checked, damaged in pool.map(check, work):
            dropped = drop_pages(catalog, damaged)  # no longer pages recovery serves
            out.dropped_pages += dropped
            out.pages -= dropped
            if damaged:
                log.warning("recovery scan: %d pages of scope %d no longer match their checksum; dropped",
                            len(damaged), sid)  # fmt: skip
            out.verified_pages += checked
            out.scan_bytes += checked * page_bytes
            if not stop.is_set():  # stopped: the agent is closing; the scope was not checked whole
                catalog.unverified.discard(sid)
    out.scan_seconds = time.monotonic() - started
    out.scan_done = not stop.is_set()
    log.info("recovery scan: %d pages (%d bytes) checked in %.2fs, %d dropped", out.verified_pages,
             out.scan_bytes, out.scan_seconds, out.dropped_pages)  # fmt: skip


def check_pages(
    pages: list[tuple[bytes, Location, int]], read_page: Callable[[Location], int], stop: threading.Event
) -> tuple[int, list[tuple[bytes, Location]]]:
    """Read each of a scope's ``pages`` (``pages_of``) and compare it with its crc32: how many were checked
    (fewer when ``stop`` was set) and the damaged ones."""
    damaged: list[tuple[bytes, Location]] = []
    for i, (key, loc, crc) in enumerate(pages):
        if stop.is_set():
            return i, damaged
        if read_page(loc) != crc:
            damaged.append((key, loc))
    return len(pages), damaged


def drop_pages(catalog: LocalCatalog, damaged: list[tuple[bytes, Location]]) -> int:
    """Stop serving ``damaged`` pages (those still what ``pages_of`` named); how many were dropped."""
    return sum(1 for key, loc in damaged if catalog.drop_damaged(key, loc))


def page_crc_reader(
    c: EngineConfig, dram: Any, pool_files: Sequence[Path], fds: dict[int, int] | None = None
) -> Callable[[Location], int]:
    """A function giving the crc32 of a stored page (all layers, layer 0 first) as it is now on its
    medium: ``dram`` is the DRAM pool's byte view, ``pool_files`` the SSD pool's files by index."""

    fds = {} if fds is None else fds  # the caller closes them (``close_fds``) when it passes its own

    def crc_of(loc: Location) -> int:
        medium, _, offset = G.decode(loc.gva)
        crc = 0
        if medium is Medium.DRAM:
            for layer in range(c.layers):
                at = offset + layer * loc.layer_stride
                crc = crc32(dram[at : at + c.page_bytes].data, crc)
            return crc
        file, at = divmod(offset, c.ssd.file_bytes)
        fd = fds.get(file)
        if fd is None:  # one descriptor per file for the reader's life: pread is positional, thread-safe
            fd = fds.setdefault(file, os.open(pool_files[file], os.O_RDONLY))
        for layer in range(c.layers):
            crc = crc32(os.pread(fd, c.page_bytes, at + layer * loc.layer_stride), crc)
        return crc

    return crc_of


def close_fds(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
