"""The shared index: the agent's key index (policy/keyindex.py) in a shared-memory file clients read
without the agent.

Every ``exists`` used to be a round trip to the agent's single event-loop thread, so lookups from
eight ranks queued behind each other (4,096 keys: P99 25 ms with 8 clients). The agent's key index
keeps the slots clients need (digest, address, stride, sequence number) in a file next to the DRAM
pool; clients map it read-only and answer lookups themselves. It is the agent's only index (no second
copy of the entries: that copy cost more memory than the table). The agent stays the only writer,
and leases still come from the agent (``acquire`` re-checks each key under the catalog's lock), so
reclaim cannot race a read of the bytes: the table only decides what a client *asks for*.

Layout: a 4 KiB header, then ``slots`` records of 32 bytes (``keyindex.SLOT``); the layout, the
probing and the seqlock are in policy/keyindex.py. (On a weakly ordered CPU the seqlock needs fences
Python cannot issue; there the agent keeps the table private whatever ``agent.shared_index`` says:
``seqlock_safe``.)

Replacing the table (when tombstones pile up or it fills): the writer builds a new file, renames it
over the old name, and only then marks the old one ``retired``; a reader checks that flag before each
lookup and reopens the path. Until then it reads the old table, which no longer changes: a lookup that
raced the switch returns what was published when it began. When the table cannot answer (retired
with nothing to reopen, a slot that stays odd because the writer died mid-write) the reader returns
``None`` and the client asks the agent. If a new file cannot be made (the tmpfs is full), the agent
keeps indexing in private memory and retires the file: clients ask over the socket from then on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.catalog.files import share_fd
from flatcake.node_agent.policy.keyindex import (
    _COMPLETE,
    _EPOCH,
    _LIVE,
    _MAGIC,
    _RETIRED,
    _SLOTS,
    _TOMBS,
    HEADER_BYTES,
    SLOT,
    U64,
    KeyIndex,
    Table,
    hash_keys,
    probe,
    slots_for,
)
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.policy.scope import Location

log = logging.getLogger(__name__)

# CPUs with total store order: another core sees a core's stores in the order it made them, and loads are
# not reordered with older loads, so the seqlock's plain stores and loads (odd sequence, entry, even
# sequence; a reader re-reads the sequence) are enough. Arm, POWER and RISC-V reorder them; there the
# seqlock needs barriers, which neither Python nor numpy issue between two stores.
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})


def seqlock_safe(machine: str | None = None) -> bool:
    """Whether clients may read the index while the agent writes it, on this CPU (``platform.machine()``)."""
    return (platform.machine() if machine is None else machine).lower() in TSO_MACHINES


__all__ = ["TSO_MACHINES", "SharedIndexReader", "SharedIndexWriter", "seqlock_safe"]

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in for writing, in one call


def populate(a: npt.NDArray[Any]) -> None:
    """Fault every page of ``a`` in for writing without changing its bytes: one ``madvise`` (through
    ctypes, which lets other threads run meanwhile), else, on an older kernel, a no-op store per page."""
    if not a.nbytes:
        return
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    length = a.ctypes.data + a.nbytes - start
    if _libc() is not None and _libc().madvise(start, length, MADV_POPULATE_WRITE) == 0:
        return
    raw = a.reshape(-1).view(np.uint8) if a.flags.c_contiguous else None
    if raw is not None:
        step = raw[::page]
        np.bitwise_or(step, 0, out=step)  # a store of the same byte: the page is faulted, nothing changes


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


MAGIC = 0x32584449_4B434643  # "FCKCIDX2" little-endian (2: 128-bit digests, 32-bit sequence numbers)


class _Mapped(Table):
    """One table file, mapped: the header words and the slot columns as numpy views (the agent's own
    columns, scope and crc, stay in its private memory)."""

    def __init__(self, mm: mmap.mmap, path: str, writable: bool, ino: int) -> None:
        self.mm, self.path, self.ino = mm, path, ino
        header = np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)
        if int(header[_MAGIC]) != MAGIC:
            raise ValueError(f"{path}: not a FlatCake shared index of this version (bad magic)")
        n = int(header[_SLOTS])
        if n & (n - 1) or len(mm) < HEADER_BYTES + n * SLOT.itemsize:
            raise ValueError(f"{path}: damaged shared index header ({n} slots in {len(mm)} bytes)")
        slots = np.frombuffer(mm, dtype=SLOT, count=n, offset=HEADER_BYTES)
        if not writable:
            slots.flags.writeable = False
        private = (np.zeros(n, np.uint32), np.zeros(n, np.uint32)) if writable else (None, None)
        super().__init__(header, slots, *private)


class SharedIndexWriter(KeyIndex):
    """The agent's key index, in a file clients map. Not thread-safe by itself: the catalog calls it
    under the scope table's lock, which also orders inserts and deletes of a key."""

    def __init__(self, path: str | os.PathLike[str], slots: int, *, epoch: int = 0, gid: int = -1) -> None:
        self.path = Path(path)
        self.epoch, self.gid = epoch, gid
        self.shared = True  # False once a file could not be made: private memory, clients ask the agent
        self._live: Table | None = None
        _retire(self.path)  # a previous agent's table, if any: its readers reopen or ask the agent
        super().__init__(slots)

    # ---- file lifecycle ----------------------------------------------------------------------
    def _new_table(self, slots: int) -> Table:
        if not self.shared:
            return Table.private(slots)
        try:
            return self._create(slots)
        except OSError as exc:  # a full tmpfs: keep indexing, in private memory
            if self._live is None:
                raise  # at start: the agent runs without a shared index (clients ask it)
            log.error(
                "shared index %s: cannot make a larger table (%s); clients look keys up over the socket from now on",
                self.path, exc,
            )  # fmt: skip
            self.retire()
            self.shared = False
            return Table.private(slots)

    def _create(self, slots: int) -> _Mapped:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        size = HEADER_BYTES + slots * SLOT.itemsize
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            share_fd(fd, self.gid)
            os.ftruncate(fd, size)
            with contextlib.suppress(OSError):  # reserve the tmpfs pages now rather than SIGBUS later
                os.posix_fallocate(fd, 0, size)
            # Mapped in one go: faulting the pages in one by one as a restart's bulk load writes them cost
            # 3 s for a 1 GiB table (10M keys) against 0.4 s populated. The first table is populated by
            # ``warm`` instead, on the other core while recovery reads the journal.
            now = getattr(mmap, "MAP_POPULATE", 0) if self._live is not None else 0
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | now)
            ino = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        header = np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)
        header[_MAGIC], header[_SLOTS], header[_COMPLETE], header[_EPOCH] = MAGIC, slots, 1, self.epoch
        del header
        return _Mapped(mm, str(tmp), writable=True, ino=ino)

    def warm(self) -> None:
        """Fault in the table's memory (the mapping and the agent's own columns) before a bulk load writes
        it: recovery runs this beside reading the journal. On this project's VMs a first touch of 1 GiB
        took 0.4 to 7 s, all of it on a 10M-key restart's path before."""
        for column in (self.t.rows, self.t.scope, self.t.crc):
            populate(column)

    def _install(self, new: Table) -> None:
        """Make ``new`` the table at ``path``, then retire the one it replaces (in that order, so a
        reader that sees the old one retired finds the new one when it reopens)."""
        old = self._live
        if isinstance(new, _Mapped):
            os.replace(new.path, self.path)
            new.path = str(self.path)
        self._live = self.t = new
        if old is not None and old is not new:
            old.header[_RETIRED] = 1

    def retire(self) -> None:
        """Stop serving this table: readers ask the agent from now on."""
        self.t.header[_RETIRED] = 1

    def close(self) -> None:
        """The agent is stopping: readers must ask (and fail to reach) the agent, not trust the table."""
        self.retire()
        if isinstance(self.t, _Mapped):
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self.t.ino:
                    self.path.unlink()

    def shared_bytes(self) -> int:
        """Bytes of the table file clients map (0 once private)."""
        return len(self.t.mm) if isinstance(self.t, _Mapped) else 0

    # ---- entries by key (tests and tools; the scope table passes digests) ----------------------
    def insert(self, keys: Sequence[Key], locs: Sequence[Location], crc: Sequence[int] | None = None) -> None:
        d = _hashed(keys)
        scope = np.fromiter((loc.scope for loc in locs), np.int64, len(locs))
        gva = np.fromiter((loc.gva for loc in locs), np.uint64, len(locs))
        stride = np.fromiter((loc.layer_stride for loc in locs), np.int64, len(locs))
        self.put(d, scope, gva, stride, np.zeros(len(locs), np.int64) if crc is None else np.asarray(crc))

    def delete(self, keys: Sequence[Key]) -> None:
        if len(keys):
            self.remove(_hashed(keys))

    def rebuild(self, entries: Mapping[Key, Location] | None = None) -> None:
        """A fresh table (tombstones cleared); with ``entries``, holding exactly those."""
        if entries is None:
            self._rebuild()
            return
        self._install(self._new_table(max(self.min_slots, slots_for(len(entries)))))
        self.rebuilds += 1
        self.insert(list(entries), list(entries.values()))

    def wants_rebuild(self) -> bool:
        h = self.t.header
        return int(h[_LIVE]) + int(h[_TOMBS]) > self.t.slots * 3 // 4


def _hashed(keys: Sequence[Key]) -> tuple[U64, U64]:
    d = hash_keys(keys)
    if d is None:
        raise ValueError("keys: each must be str, bytes or int")
    return d


def _retire(path: Path) -> None:
    """Mark the table at ``path`` (a dead or stopped agent's) retired, if there is one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        if os.fstat(fd).st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES) as mm:
                header = np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)
                if int(header[_MAGIC]) in (MAGIC, 0x31584449_4B434643):  # this version's, or version 1's
                    header[_RETIRED] = 1
                del header
    finally:
        os.close(fd)


class SharedIndexReader:
    """A client's read-only view. ``find``/``hit_prefix`` return None when the table cannot answer
    (the caller then asks the agent): never a location that was not published for that key."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.t = self._open()
        self.fallbacks = 0

    def _open(self) -> _Mapped:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        return _Mapped(mm, self.path, writable=False, ino=ino)

    def _current(self) -> _Mapped | None:
        t = self.t
        if t.header[_RETIRED]:
            try:  # the agent replaced it (or restarted): the one at the path now is its successor
                t = self._open()
            except (OSError, ValueError):
                return None
            if t.header[_RETIRED]:
                return None
            self.t = t  # the old mapping goes with its last reference (another thread may still read it)
        return t if t.header[_COMPLETE] else None

    def find(self, keys: Sequence[Key]) -> tuple[npt.NDArray[np.bool_], U64, npt.NDArray[np.int64]] | None:
        """Per key: found, GVA, layer stride; or None (ask the agent)."""
        t = self._current()
        hashed = hash_keys(keys) if t is not None else None
        if t is None or hashed is None:
            self.fallbacks += 1
            return None
        found = probe(t, *hashed)
        if found is None:
            self.fallbacks += 1
            return None
        return found.hit, found.gva, found.stride

    def hit_prefix(self, keys: Sequence[Key]) -> int | None:
        found = self.find(keys)
        if found is None:
            return None
        miss = np.flatnonzero(~found[0])
        return int(miss[0]) if miss.size else len(keys)
