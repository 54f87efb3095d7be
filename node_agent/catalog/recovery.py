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
from flatcake.node_agent.policy.keyindex import hash_keys, pack
from flatcake.node_agent.policy.scopes import Location, Scope

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    """Recovery's outcome, updated while it runs (``/readyz`` and the metrics show it live)."""

    scopes: int = 0
    pages: int = 0
    dropped_pages: int = 0  # bytes no longer match their checksum
    superseded_pages: int = 0  # their space or key was taken by a later record (a lost ``free``)
    records: int = 0
    skipped_records: int = 0  # damaged journal records skipped
    torn_bytes: int = 0
    legacy_journal: bool = False  # in the first format: rewritten before anything is appended
    verified_pages: int = 0  # pages whose bytes were checked (at recovery, or by the scan)
    total_pages: int = 0  # pages the journal names, known once it is read
    done: bool = False
    scan_pages: int = 0  # pages the background scan checks (those recovered)
    scan_bytes: int = 0
    scan_seconds: float = 0.0
    scan_done: bool = False


@dataclass
class _Found:
    """One scope as the journal describes it, its pages in columns (one entry per publish record)."""

    medium: int
    blobs: list[bytes] = field(default_factory=list)  # key digests, 16 bytes each
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first page, pages) in the journal's order
    gva: list[int] = field(default_factory=list)
    stride: list[int] = field(default_factory=list)
    crc: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    ext: dict[tuple[int, int], int] = field(default_factory=dict)


def recover(
    catalog: LocalCatalog,
    journal_path: str | os.PathLike[str],
    read_page: Callable[[Location], int] | None,
    out: Recovered | None = None,
) -> Recovered:
    """Rebuild the catalog from the journal. With ``read_page`` (returns a stored page's crc32), pages
    whose bytes no longer match are dropped instead of served.

    A damaged record is skipped (``replay``), so a ``free`` may be missing: the freed scope would then
    come back over space that a later scope was given. Each byte of SSD space and each DRAM slot
    therefore belongs to the scope that claimed it last in the journal, and a scope that lost any of
    its space to a later one is dropped whole; likewise a key belongs to the scope that published it
    last (within one scope, its first page of that key). Surviving scopes get back exactly the extents
    the journal records, so a restart rebuilds the same allocation.

    Pages are handled in columns, per record and per scope, not one Python object per page: restart
    time is what a node with 10M pages waits for (bench agent's ``restart_keys``)."""
    out = out if out is not None else Recovered()
    report = ReplayReport()
    table = catalog.table
    scopes: dict[int, _Found] = {}
    claims: list[tuple[int, int, int, int, int]] = []  # SSD: (file, start, end, record number, scope)
    slot_claims: dict[int, int] = {}  # DRAM slot -> scope that claimed it last
    blobs: list[bytes] = []  # every published page's digest, in the journal's order ...
    owners: list[int] = []  # ... and its record's scope, per record
    counts: list[int] = []
    pages = 0
    for seq, rec in enumerate(replay(journal_path, report)):
        out.records += 1
        try:
            if rec["t"] == "free":
                scopes.pop(rec["scope"], None)
                continue
            sid, medium = rec["scope"], rec["medium"]
            ranges = _extents(rec, table.ssd.file_bytes)
            blob = _digest_blob(rec)
            n = len(blob) // 16
            gva, stride, crc, slots = rec["gva"], rec["stride"], rec["crc"], rec["slots"]
            if not len(gva) == len(stride) == len(crc) == n:
                raise ValueError("keys, gva, stride and crc differ in length")
        except (KeyError, TypeError, ValueError) as exc:  # checksummed but not a record this agent wrote
            report.skipped_records += 1
            log.error("%s: skipping a malformed record (%s)", journal_path, exc)
            continue
        s = scopes.get(sid)
        if s is None:
            s = scopes[sid] = _Found(medium)
        for e in ranges:  # an extent grows in place: keep its longest journaled length
            at = (e.file, e.offset)
            s.ext[at] = max(s.ext.get(at, 0), e.length)
            claims.append((e.file, e.offset, e.end, seq, sid))
        s.blobs.append(blob)
        s.spans.append((pages, n))
        s.gva.extend(gva)
        s.stride.extend(stride)
        s.crc.extend(crc)
        s.slots.extend(slots)
        slot_claims.update(dict.fromkeys(slots, sid))
        blobs.append(blob)
        owners.append(sid)
        counts.append(n)
        pages += n
    lost = _lost_space(claims, scopes)
    out.skipped_records, out.torn_bytes = report.skipped_records, report.torn_bytes
    out.legacy_journal = report.legacy
    out.total_pages = sum(len(s.gva) for s in scopes.values())
    contested, marked = _contested(b"".join(blobs), np.repeat(np.asarray(owners, np.int64), counts))
    del blobs, owners, counts
    for sid, s in sorted(scopes.items()):
        if sid in lost or any(slot_claims.get(x) != sid for x in s.slots):
            out.superseded_pages += len(s.gva)
            continue
        blob = b"".join(s.blobs)
        keep = _owned(sid, blob, s.spans, contested, marked)
        out.superseded_pages += len(keep) - int(np.count_nonzero(keep))
        if read_page is not None:
            for i in np.flatnonzero(keep).tolist():
                out.verified_pages += 1
                if read_page(Location(sid, s.gva[i], s.stride[i])) != s.crc[i]:
                    keep[i] = False
                    out.dropped_pages += 1
        kept = int(np.count_nonzero(keep))
        if not kept:
            continue  # nothing left to serve: its space stays free
        d = np.frombuffer(blob, dtype="<u8").reshape(-1, 2)[keep]
        extents = [Extent(f, o, n) for (f, o), n in s.ext.items()]
        scope = Scope(sid, Medium(s.medium), 0, extents=extents, slots=s.slots)
        try:
            catalog.adopt(scope, (d[:, 0], d[:, 1]), np.asarray(s.gva, np.uint64)[keep],
                          np.asarray(s.stride, np.int64)[keep], np.asarray(s.crc, np.int64)[keep])  # fmt: skip
        except ValueError as exc:  # space outside the pool or taken twice: never serve it
            log.error("%s: dropping scope %d: %s", journal_path, sid, exc)
            out.superseded_pages += kept
            continue
        out.scopes += 1
        out.pages += kept
    catalog.adopted()  # the shared index, in bulk
    if out.dropped_pages:
        log.warning("recovery dropped %d pages whose bytes no longer match their checksum", out.dropped_pages)
    if out.superseded_pages:
        log.warning("recovery dropped %d pages whose space or key a later record took (a damaged record "
                    "hid their release)", out.superseded_pages)  # fmt: skip
    out.done = True
    return out


def _contested(
    blob: bytes, scope_of: npt.NDArray[np.int64]
) -> tuple[dict[bytes, tuple[int, int]], npt.NDArray[np.bool_]]:
    """Digests published more than once, each with the scope that published it last and the journal
    position of that scope's first page of it, and which journal positions hold one: the only pages
    whose owner is not their own record's scope. Found by sorting the digests' first words (rare: a
    key published again, or freed and published again)."""
    d = np.frombuffer(blob, dtype="<u8").reshape(-1, 2)
    h1 = np.sort(d[:, 0])
    repeated = h1[1:][h1[1:] == h1[:-1]]
    if not repeated.size:
        return {}, np.zeros(len(d), bool)
    marked = np.isin(d[:, 0], repeated)
    last: dict[bytes, int] = {}
    first: dict[tuple[bytes, int], int] = {}
    for i in np.flatnonzero(marked).tolist():
        key, sid = blob[16 * i : 16 * i + 16], int(scope_of[i])
        last[key] = sid
        first.setdefault((key, sid), i)
    return {key: (sid, first[key, sid]) for key, sid in last.items()}, marked


def _owned(
    sid: int,
    blob: bytes,
    spans: list[tuple[int, int]],
    contested: dict[bytes, tuple[int, int]],
    marked: npt.NDArray[np.bool_],
) -> npt.NDArray[np.bool_]:
    """Which of a scope's pages (in its records' order) it still owns: all but those of a contested
    digest that another scope published later, or that this scope published earlier. Only the marked
    journal positions are looked at, so a scope with none costs one check per record."""
    keep = np.ones(len(blob) // 16, bool)
    at = 0
    for first, n in spans:
        for j in np.flatnonzero(marked[first : first + n]).tolist():
            if contested[blob[16 * (at + j) : 16 * (at + j) + 16]] != (sid, first + j):
                keep[at + j] = False
        at += n
    return keep


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
        sid, pages = item
        damaged: list[tuple[bytes, Location]] = []
        for i, (key, loc, crc) in enumerate(pages):
            if stop.is_set():
                return sid, i, damaged
            if read_page(loc) != crc:
                damaged.append((key, loc))
        return sid, len(pages), damaged

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="flatcake-scan") as pool:
        for sid, checked, damaged in pool.map(check, work):
            for key, loc in damaged:
                if catalog.drop_damaged(key, loc):  # no longer one of the pages recovery serves
                    out.dropped_pages += 1
                    out.pages -= 1
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
