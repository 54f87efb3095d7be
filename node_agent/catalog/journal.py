"""The agent's append-only journal: what is published and what is reclaimed, to survive a restart.

Record: ``magic u32 | length u32 | crc32(payload) u32 | crc32(first 12 bytes) u32 | msgpack payload``.
Every record is framed and checksummed on its own: replay skips a damaged record (and counts it)
by searching for the next magic whose header checksum holds, so one bad byte costs one record, not
everything after it. A record is appended (and, by policy, synced) before the keys it describes
become visible, so a restarted agent knows every key any client was told about.

An append is one ``write``; a short or failed write (a full disk, EIO) is cut back off the file and
raises ``StorageWriteError``, so the put fails and the journal stays a sequence of whole records.

fsync policy (``journal_fsync``):
- ``always``: fsync before a publish is acknowledged. Survives power loss; costs a disk flush per put.
- ``interval``: write before acknowledging, fsync every ``journal_fsync_ms`` in the background.
  Survives a killed agent (the kernel has the bytes); power loss can drop the last interval, and the
  per-page checksums verified at recovery then catch any page whose bytes were overwritten.
- ``never``: leave flushing to the kernel; as ``interval`` for a killed process.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from flatcake.errors import StorageWriteError
from flatcake.node_agent.catalog.files import fsync_dir, share_fd
from flatcake.node_agent.constants import JOURNAL_FSYNC_POLICIES as POLICIES
from flatcake.node_agent.policy.extents import Extent
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.keyindex import Digests, pack
from flatcake.node_agent.policy.scope import Scope

log = logging.getLogger(__name__)

MAGIC = b"FCJ2"
_HEADER = struct.Struct("<4sIII")  # magic, length, payload crc, header crc (of the first 12 bytes)
_V1_HEADER = struct.Struct("<II")  # the first format: length, crc; read for upgrades only
MAX_RECORD = 64 << 20


def encode(record: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(record, use_bin_type=True)
    head = struct.pack("<4sII", MAGIC, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@dataclass
class ReplayReport:
    """What replay found besides whole records: damage it skipped."""

    records: int = 0
    skipped_records: int = 0  # damaged spans in the middle, each skipped
    skipped_bytes: int = 0
    torn_bytes: int = 0  # an incomplete last record, cut off the file
    legacy: bool = False  # the first format: rewrite it before appending (``Journal.rewrite``)


class Journal:
    def __init__(
        self,
        path: str | os.PathLike[str],
        fsync: str = "interval",
        fsync_ms: int = 100,
        *,
        gid: int = -1,
        write: Callable[[int, bytes], int] = os.write,
        compact_min_bytes: int = 64 << 10,
        compact_ratio: float = 2.0,
        compact_records: int = 1 << 16,
        records: tuple[int, int] = (0, 0),
    ) -> None:
        if fsync not in POLICIES:
            raise ValueError(f"journal_fsync: {fsync!r} must be one of {POLICIES}")
        self.path = Path(path)
        self.policy = fsync
        self._gid = gid
        self._write = write  # os.write; tests inject short writes and errors here
        self._lock = threading.Lock()
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        self._dirty = False
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        # Records in the file now, and of those the compacted state's (``records``: what recovery read).
        self.records, self._compacted_records = records
        self.appended = 0  # by this process, ever (compaction does not lower it)
        self.append_errors = 0
        self.sync_errors = 0
        # Online compaction is due once the file reaches ``compact_ratio`` times its size after the last
        # one (and at least ``compact_min_bytes``): its size stays proportional to the live records. Or
        # once ``compact_records`` were appended since: a restart decodes those one at a time.
        self.compact_min_bytes = compact_min_bytes
        self.compact_ratio = compact_ratio
        self.compact_records = compact_records
        self._compact_at = self._next_compaction()
        self.compactions = 0
        self.compact_errors = 0
        self.due_event = threading.Event()  # set by an append that makes compaction due
        if fsync == "interval":
            self._flusher = threading.Thread(target=self._flush_loop, args=(fsync_ms / 1000,), daemon=True)
            self._flusher.start()

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o660)
        share_fd(fd, self._gid)
        return fd

    def append(self, record: dict[str, Any]) -> None:
        """Append one record; raises ``StorageWriteError`` with the journal unchanged if it cannot."""
        frame = encode(record)
        with self._lock:
            start = self._size
            try:
                n = self._write(self._fd, frame)  # O_APPEND: one write, one record
                if n != len(frame):
                    raise OSError(errno.ENOSPC, f"short write: {n} of {len(frame)} bytes (disk full?)")
                if self.policy == "always":
                    os.fsync(self._fd)
            except OSError as exc:
                self.append_errors += 1
                self._cut(start)
                raise StorageWriteError(
                    exc.errno, f"journal {self.path}: append failed ({exc.strerror or exc}); nothing was published. "
                    "Free space on the journal's filesystem (agent.state_dir, else ssd.dir) or replace the failing "
                    "device",
                ) from exc  # fmt: skip
            self._size = start + n
            self.records += 1
            self.appended += 1
            self._dirty = self.policy != "always"
            if self.due():
                self.due_event.set()

    def _cut(self, size: int) -> None:
        """Remove a partly written record so the next append follows a whole one. Should even this
        fail, replay still skips the fragment by its framing."""
        try:
            os.ftruncate(self._fd, size)
            if self.policy == "always":
                os.fsync(self._fd)
        except OSError as exc:
            log.error("journal %s: could not cut a failed append back to %d bytes: %s", self.path, size, exc)
            self._size = os.fstat(self._fd).st_size

    def _flush_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.sync()
            except OSError as exc:  # counted and logged; the next period tries again
                self.sync_errors += 1
                log.error("journal %s: background fsync failed: %s", self.path, exc)

    def sync(self) -> None:
        with self._lock:
            if self._dirty:
                os.fsync(self._fd)
                self._dirty = False

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        try:
            self.sync()
        finally:
            os.close(self._fd)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the journal with ``records`` (a snapshot), atomically and durably: the new file is
        synced, renamed over the old one, and the directory synced so the rename survives power loss.
        Nothing may append meanwhile (the agent calls it before serving); ``compact`` is the online form."""
        self._replace(records, None)

    def mark(self) -> tuple[int, int]:
        """Where the journal ends now (bytes, records): taken with a snapshot of the state it describes."""
        with self._lock:
            return self._size, self.records

    @property
    def size(self) -> int:
        return self._size

    def due(self) -> bool:
        """Whether the journal has outgrown its last compacted size by the configured ratio, or holds
        ``compact_records`` records appended since."""
        return self._size >= self._compact_at or self.records - self._compacted_records >= self.compact_records

    def _next_compaction(self) -> int:
        return max(self.compact_min_bytes, int(self._size * self.compact_ratio))

    def compact(self, records: list[dict[str, Any]], mark: tuple[int, int]) -> None:
        """Online compaction: replace the journal by ``records`` (the live state as of ``mark``) followed by
        every record appended since ``mark``, while appends go on. Appends wait only while that tail is
        copied and the new file renamed into place; a failure leaves the old journal in use."""
        self._replace(records, mark)

    def _replace(self, records: list[dict[str, Any]], mark: tuple[int, int] | None) -> None:
        try:
            self._swap(records, mark)
        except BaseException:
            with contextlib.suppress(OSError):
                self.path.with_suffix(".tmp").unlink(missing_ok=True)
            with self._lock:  # do not retry at once: wait for as much growth again
                self._compact_at = self._next_compaction()
            raise
        try:  # the rename is done; until the directory is synced only a power loss could undo it
            fsync_dir(self.path.parent)
        except OSError as exc:
            log.error("journal %s: could not sync its directory after compaction: %s", self.path, exc)

    def _swap(self, records: list[dict[str, Any]], mark: tuple[int, int] | None) -> None:
        tmp = self.path.with_suffix(".tmp")
        # O_APPEND: after the rename this descriptor is the journal's, so nothing is reopened once the
        # old file is gone (a failed reopen would leave appends going to an unlinked file).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o660)
        try:
            share_fd(fd, self._gid)
            _write_all(fd, b"".join(map(encode, records)))
            os.fsync(fd)  # the bulk, outside the append lock
            with self._lock:
                tail = b"" if mark is None else _read_range(self.path, mark[0], self._size)
                if tail:
                    _write_all(fd, tail)
                    os.fsync(fd)
                os.replace(tmp, self.path)
                old, self._fd = self._fd, fd
                with contextlib.suppress(OSError):  # the old file is already replaced
                    os.close(old)
                self._size = os.fstat(fd).st_size
                self.records = len(records) + (0 if mark is None else self.records - mark[1])
                self._compacted_records = len(records)
                self._dirty = False
                self._compact_at = self._next_compaction()
                self.compactions += 1
        except BaseException:
            if self._fd != fd:
                os.close(fd)
            raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # os.write may write less than asked
        n = os.write(fd, view)
        if n == 0:
            raise OSError(errno.ENOSPC, "no progress writing the compacted journal")
        view = view[n:]


def _read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise OSError(errno.EIO, f"journal {path}: read {len(data)} of {end - start} bytes of its tail")
    return data


def _frame_at(data: bytes, at: int) -> tuple[bytes, int] | None:
    """The payload of a whole, intact record at ``at`` and where the next begins, or None."""
    end = at + _HEADER.size
    if end > len(data):
        return None
    magic, length, crc, hcrc = _HEADER.unpack_from(data, at)
    if magic != MAGIC or zlib.crc32(data[at : at + 12]) != hcrc or length > MAX_RECORD:
        return None
    body = data[end : end + length]
    if len(body) != length or zlib.crc32(body) != crc:
        return None
    return body, end + length


def _decode(body: bytes) -> dict[str, Any] | None:
    try:
        record = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types; the checksum held, so a writer bug
        return None
    return record if isinstance(record, dict) else None


def replay(path: str | os.PathLike[str], report: ReplayReport | None = None) -> Iterator[dict[str, Any]]:
    """Records in order. A damaged record in the middle is skipped and counted in ``report``; an
    incomplete last record (a crash mid-append) is cut off the file."""
    path = Path(path)
    report = report if report is not None else ReplayReport()
    if not path.exists():
        return
    data = path.read_bytes()
    if _is_v1(data):
        report.legacy = True
        yield from _replay_v1(path, data, report)
        return
    at, good_end = 0, 0
    while at < len(data):
        frame = _frame_at(data, at)
        record = _decode(frame[0]) if frame is not None else None
        if frame is not None and record is not None:
            report.records += 1
            yield record
            at = good_end = frame[1]
            continue
        nxt = data.find(MAGIC, at + 1)
        while nxt >= 0 and _frame_at(data, nxt) is None:  # the magic may occur inside a payload
            nxt = data.find(MAGIC, nxt + 1)
        if nxt < 0:
            break
        report.skipped_records += 1
        report.skipped_bytes += nxt - at
        log.error("%s: skipping a damaged record of %d bytes at offset %d", path, nxt - at, at)
        at = nxt
    if good_end < len(data):
        report.torn_bytes = len(data) - good_end
        log.warning("%s: dropping a torn or corrupt tail of %d bytes at offset %d", path, report.torn_bytes, good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)


def _is_v1(data: bytes) -> bool:
    """A journal of the first format begins with a whole v1 record (a v2 one with a damaged magic
    does not pass the v1 checksum, so it is still read as v2 and only that record is lost)."""
    if len(data) < _V1_HEADER.size or data.startswith(MAGIC):
        return False
    length, crc = _V1_HEADER.unpack_from(data)
    body = data[_V1_HEADER.size : _V1_HEADER.size + length]
    return len(body) == length and zlib.crc32(body) == int(crc)


def _replay_v1(path: Path, data: bytes, report: ReplayReport) -> Iterator[dict[str, Any]]:
    """The first format (no magic, no header checksum): read once, rewritten by compaction."""
    at = 0
    while at + _V1_HEADER.size <= len(data):
        length, crc = _V1_HEADER.unpack_from(data, at)
        body = data[at + _V1_HEADER.size : at + _V1_HEADER.size + length]
        record = _decode(body) if length <= MAX_RECORD and len(body) == length and zlib.crc32(body) == crc else None
        if record is None:
            break
        report.records += 1
        yield record
        at += _V1_HEADER.size + length
    if at < len(data):
        report.torn_bytes = len(data) - at
        log.warning("%s: dropping a torn or corrupt tail of %d bytes at offset %d", path, len(data) - at, at)
        with open(path, "r+b") as f:
            f.truncate(at)


def _ints(column: Sequence[int] | npt.NDArray[Any]) -> list[int]:
    return column.tolist() if isinstance(column, np.ndarray) else list(column)


def publish_record(
    scope: Scope,
    digests: Digests,
    gva: Sequence[int] | npt.NDArray[np.uint64],
    stride: Sequence[int] | npt.NDArray[np.int64],
    slots: Sequence[int],
    crc: Sequence[int],
    extents: Sequence[Extent] = (),
) -> dict[str, Any]:
    """The journal record of published pages (``recover`` reads it back). Keys are their 16-byte
    digests (``kd``), all the catalog keeps of them; records of earlier versions carried the keys
    themselves (``keys``), which recovery hashes.

    SSD space is ``ext``: ``[file, offset, length]`` of each extent the pages lie in, from the
    extent's start through these pages (a later record of a grown extent repeats it, longer). Records
    of earlier versions carried ``files`` (whole pool files) and ``cursor`` instead; recovery still
    reads them. ``files``/``cursor`` stay on DRAM records (empty), so an older agent still reads those,
    while it skips an SSD record as malformed rather than misread its space."""
    record = {
        "t": "pub", "scope": scope.id, "medium": int(scope.medium), "kd": pack(digests),
        "gva": _ints(gva), "stride": _ints(stride),
        "slots": list(slots), "crc": list(crc),
    }  # fmt: skip
    if scope.medium is Medium.SSD:
        record["ext"] = [list(e) for e in extents]
    else:
        record["files"], record["cursor"] = [], 0
    return record


SNAPSHOT_PAGES = 1 << 16  # pages per snapshot record: a damaged one loses at most these


def snapshot_records(
    scopes: Sequence[Scope],
    digests: npt.NDArray[np.uint64],
    gva: npt.NDArray[np.uint64],
    stride: npt.NDArray[Any],
    crc: npt.NDArray[Any],
    max_pages: int = SNAPSHOT_PAGES,
) -> list[dict[str, Any]]:
    """The live state as compaction writes it: ``snap`` records, each holding whole scopes (up to
    ``max_pages`` pages, or one larger scope alone) in little-endian columns that recovery reads with
    ``np.frombuffer`` instead of decoding a record per scope (catalog/recovery.py): at 10M keys that
    was most of a restart. ``digests`` is every scope's pages in order (``(pages, 2)`` u64), and the
    other columns are aligned with it.

    Columns: per scope ``scopes`` (u64 id), ``media`` (u8), ``counts`` (u32 pages), ``ext_counts`` and
    ``slot_counts`` (u32); then ``exts`` (u64 file, offset, length per extent), ``slot_list`` (u32)
    and per page ``kd`` (16-byte digests), ``gvas`` (u64), ``strides`` and ``crcs`` (u32). The names
    differ from ``pub`` records' on purpose: an older agent skips a ``snap`` record as malformed (a
    miss for its pages) rather than misreading it."""
    if not scopes:
        return []
    counts = np.fromiter((len(s.keys) for s in scopes), np.int64, len(scopes))
    if int(counts.sum()) != len(digests):
        raise ValueError(f"snapshot: {len(digests)} digests for {int(counts.sum())} pages")
    if len(stride) and int(np.max(stride)) >= 1 << 32:
        raise ValueError(f"snapshot: stride {int(np.max(stride))} does not fit 32 bits")
    ends = np.cumsum(counts)
    out: list[dict[str, Any]] = []
    first = 0
    while first < len(scopes):
        base = int(ends[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(ends, base + max_pages, side="right")))
        group, end = scopes[first:last], int(ends[last - 1])
        exts = [e for s in group for e in s.journaled_extents()]  # what published pages hold, not writes in flight
        out.append({
            "t": "snap",
            "scopes": np.fromiter((s.id for s in group), "<u8", len(group)).tobytes(),
            "media": np.fromiter((int(s.medium) for s in group), "u1", len(group)).tobytes(),
            "counts": counts[first:last].astype("<u4").tobytes(),
            "ext_counts": np.fromiter((len(s.journaled) for s in group), "<u4", len(group)).tobytes(),
            "slot_counts": np.fromiter((len(s.journaled_slots) for s in group), "<u4", len(group)).tobytes(),
            "exts": np.asarray(exts, "<u8").reshape(-1, 3).tobytes(),
            "slot_list": np.fromiter((x for s in group for x in s.journaled_slots), "<u4").tobytes(),
            "kd": np.ascontiguousarray(digests[base:end], "<u8").tobytes(),
            "gvas": np.asarray(gva[base:end], "<u8").tobytes(),
            "strides": np.asarray(stride[base:end]).astype("<u4").tobytes(),
            "crcs": np.asarray(crc[base:end]).astype("<u4").tobytes(),
        })  # fmt: skip
        first = last
    return out
