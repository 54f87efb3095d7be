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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    verified_pages: int = 0  # pages whose bytes were checked (at recovery, or by the scan)
    total_pages: int = 0  # pages the journal names, known once it is read
    done: bool = False
    scan_pages: int = 0  # pages the background scan checks (those recovered)
    scan_bytes: int = 0
    scan_seconds: float = 0.0
    scan_done: bool = False


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
    last. Surviving scopes get back exactly the extents the journal records, so a restart rebuilds
    the same allocation."""
    out = out if out is not None else Recovered()
    report = ReplayReport()
    table = catalog.table
    scopes: dict[int, dict[str, Any]] = {}
    claims: list[tuple[int, int, int, int, int]] = []  # SSD: (file, start, end, record number, scope)
    slot_claims: dict[int, int] = {}  # DRAM slot -> scope that claimed it last
    owner: dict[bytes, int] = {}  # key digest -> scope that published it last
    for seq, rec in enumerate(replay(journal_path, report)):
        out.records += 1
        try:
            if rec["t"] == "free":
                scopes.pop(rec["scope"], None)
                continue
            sid = rec["scope"]
            ranges = _extents(rec, table.ssd.file_bytes)
            s = scopes.setdefault(sid, {"medium": rec["medium"], "keys": [], "locs": [], "crc": [], "slots": [],
                                        "ext": {}})  # fmt: skip
            locs = [Location(sid, g, st) for g, st in zip(rec["gva"], rec["stride"], strict=True)]
            keys = _digests(rec)
            if len(locs) != len(keys) or len(rec["crc"]) != len(keys):
                raise ValueError("keys, gva and crc differ in length")
        except (KeyError, TypeError, ValueError) as exc:  # checksummed but not a record this agent wrote
            report.skipped_records += 1
            log.error("%s: skipping a malformed record (%s)", journal_path, exc)
            continue
        for e in ranges:  # an extent grows in place: keep its longest journaled length
            at = (e.file, e.offset)
            s["ext"][at] = max(s["ext"].get(at, 0), e.length)
            claims.append((e.file, e.offset, e.end, seq, sid))
        s["slots"].extend(rec["slots"])
        s["keys"].extend(keys)
        s["locs"].extend(locs)
        s["crc"].extend(rec["crc"])
        slot_claims.update(dict.fromkeys(rec["slots"], sid))
        owner.update(dict.fromkeys(keys, sid))
    lost = _lost_space(claims, scopes)
    out.skipped_records, out.torn_bytes = report.skipped_records, report.torn_bytes
    out.total_pages = sum(len(s["keys"]) for s in scopes.values())
    for sid, s in sorted(scopes.items()):
        if sid in lost or any(slot_claims.get(x) != sid for x in s["slots"]):
            out.superseded_pages += len(s["keys"])
            continue
        keep_keys: list[bytes] = []
        entries: dict[bytes, Location] = {}
        checksums: dict[bytes, int] = {}
        for key, loc, crc in zip(s["keys"], s["locs"], s["crc"], strict=True):
            if owner.get(key) != sid or key in entries:
                out.superseded_pages += 1
                continue
            intact = read_page is None or read_page(loc) == crc
            out.verified_pages += read_page is not None
            if not intact:
                out.dropped_pages += 1
                continue
            keep_keys.append(key)
            entries[key] = loc
            checksums[key] = crc
        if not keep_keys:
            continue  # nothing left to serve: its space stays free
        extents = [Extent(f, o, n) for (f, o), n in s["ext"].items()]
        scope = Scope(sid, Medium(s["medium"]), 0, extents=extents, slots=list(s["slots"]))
        try:
            catalog.adopt(scope, entries, checksums)
        except ValueError as exc:  # space outside the pool or taken twice: never serve it
            log.error("%s: dropping scope %d: %s", journal_path, sid, exc)
            out.superseded_pages += len(keep_keys)
            continue
        out.scopes += 1
        out.pages += len(keep_keys)
    catalog.adopted()  # the shared index, in bulk
    if out.dropped_pages:
        log.warning("recovery dropped %d pages whose bytes no longer match their checksum", out.dropped_pages)
    if out.superseded_pages:
        log.warning("recovery dropped %d pages whose space or key a later record took (a damaged record "
                    "hid their release)", out.superseded_pages)  # fmt: skip
    out.done = True
    return out


def _digests(rec: dict[str, Any]) -> list[bytes]:
    """A publish record's keys as 16-byte digests: compacted records carry them (``kd``), others the
    keys themselves (hashed here as the index hashes them)."""
    if "kd" in rec:
        blob = rec["kd"]
        if not isinstance(blob, bytes) or len(blob) % 16:
            raise ValueError("kd: not a whole number of 16-byte digests")
    else:
        d = hash_keys(rec["keys"])
        if d is None:
            raise ValueError("keys: a key is not str, bytes or int")
        blob = pack(d)
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


def _extents(rec: dict[str, Any], file_bytes: int) -> list[Extent]:
    """The SSD space a publish record claims. Records before byte extents name whole pool files: the
    scope held each of them, the last up to ``cursor`` (where its next append would have gone)."""
    if "ext" in rec:
        return [Extent(int(f), int(o), int(n)) for f, o, n in rec["ext"]]
    files = [int(f) for f in rec["files"]]
    cursor = int(rec["cursor"])
    lengths = [file_bytes] * (len(files) - 1) + [min(cursor, file_bytes)]
    return [Extent(f, 0, n) for f, n in zip(files, lengths, strict=False) if n > 0]


def _lost_space(claims: list[tuple[int, int, int, int, int]], live: dict[int, dict[str, Any]]) -> set[int]:
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
