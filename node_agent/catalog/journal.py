"""The agent's append-only journal: what is published and what is reclaimed, to survive a restart.

Record: ``length u32 | crc32 u32 | msgpack payload``. A record is appended (and, by policy, synced)
before the keys it describes become visible, so a restarted agent knows every key any client was
told about. A crash can leave a torn last record: replay stops at the first record whose length or
checksum does not hold and truncates the file there.

fsync policy (``journal_fsync``):
- ``always``: fsync before a publish is acknowledged. Survives power loss; costs a disk flush per put.
- ``interval``: write before acknowledging, fsync every ``journal_fsync_ms`` in the background.
  Survives a killed agent (the kernel has the bytes); power loss can drop the last interval, and the
  per-page checksums verified at recovery then catch any page whose bytes were overwritten.
- ``never``: leave flushing to the kernel; as ``interval`` for a killed process.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

from flatcake.node_agent.constants import JOURNAL_FSYNC_POLICIES as POLICIES
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.policy.scopes import Location, Scope

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
MAX_RECORD = 64 << 20


class Journal:
    def __init__(self, path: str | os.PathLike[str], fsync: str = "interval", fsync_ms: int = 100) -> None:
        if fsync not in POLICIES:
            raise ValueError(f"journal_fsync: {fsync!r} must be one of {POLICIES}")
        self.path = Path(path)
        self.policy = fsync
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._dirty = False
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self.records = 0
        if fsync == "interval":
            self._flusher = threading.Thread(target=self._flush_loop, args=(fsync_ms / 1000,), daemon=True)
            self._flusher.start()

    def append(self, record: dict[str, Any]) -> None:
        payload = msgpack.packb(record, use_bin_type=True)
        frame = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            os.write(self._fd, frame)  # O_APPEND: one write, one record
            self.records += 1
            if self.policy == "always":
                os.fsync(self._fd)
            else:
                self._dirty = True

    def _flush_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            self.sync()

    def sync(self) -> None:
        with self._lock:
            if self._dirty:
                os.fsync(self._fd)
                self._dirty = False

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        self.sync()
        os.close(self._fd)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the journal with ``records`` (a snapshot), atomically."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for record in records:
                payload = msgpack.packb(record, use_bin_type=True)
                f.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.records = len(records)


def replay(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Records in order; a torn or corrupt tail is logged and cut off the file."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if at + _HEADER.size > len(data):
            break
        length, crc = _HEADER.unpack_from(data, at)
        body = data[at + _HEADER.size : at + _HEADER.size + length]
        if length > MAX_RECORD or len(body) != length or zlib.crc32(body) != crc:
            break
        yield msgpack.unpackb(body, raw=False, strict_map_key=False)
        at += _HEADER.size + length
    if at < len(data):
        log.warning("%s: dropping a torn or corrupt tail of %d bytes at offset %d", path, len(data) - at, at)
        with open(path, "r+b") as f:
            f.truncate(at)


def publish_record(
    scope: Scope, keys: Sequence[Key], locs: Sequence[Location], slots: Sequence[int], crc: Sequence[int]
) -> dict[str, Any]:
    """The journal record of published pages (``recover`` reads it back)."""
    return {
        "t": "pub", "scope": scope.id, "medium": int(scope.medium), "keys": list(keys),
        "gva": [loc.gva for loc in locs], "stride": [loc.layer_stride for loc in locs],
        "files": scope.files, "cursor": scope.cursor, "slots": list(slots), "crc": list(crc),
    }  # fmt: skip
