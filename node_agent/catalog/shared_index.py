"""The shared index: key -> location in a shared-memory table that clients read without the agent.

Every ``exists`` used to be a round trip to the agent's single event-loop thread, so lookups from
eight ranks queued behind each other (4,096 keys: P99 25 ms with 8 clients). The agent now also
publishes every entry into an open-addressed hash table in a file next to the DRAM pool; clients map
it read-only and answer lookups themselves. The agent stays the only writer, and leases still come
from the agent (``acquire`` re-checks each key under the catalog's lock), so reclaim cannot race a
read of the bytes: the table only decides what a client *asks for*.

Layout: a 4 KiB header, then ``slots`` records of 32 bytes (``SLOT``): a sequence number, the key's
64-bit hash (``h1``: 0 empty, 1 a deleted entry's tombstone), its address, a second 32-bit hash
(``h2``, so 96 bits tell keys apart) and the page's layer stride. Linear probing from
``h1 & (slots - 1)``; a lookup stops at an empty slot or after the longest displacement any insert
made (``max_probe``, in the header), so it is bounded even when tombstones have used up the empties.

Seqlock: the writer makes a slot's number odd, writes the fields, then makes it even again. A reader
reads the number, the fields, the number again, and retries the slot when the number was odd or
changed, so it never returns a half-written entry. Each step is one numpy pass over the batch; every
pass ends before the next starts, and x86-64 keeps stores in order and loads in order (TSO), which is
all a seqlock needs. (On a weakly ordered CPU this needs fences Python cannot issue; the agent then
runs with ``agent.shared_index`` off.)

Replacing the table (at start, when tombstones pile up, when an insert found no room): the writer
builds a new file, renames it over the old name, and only then marks the old one ``retired``; a
reader checks that flag before each lookup and reopens the path. Until then it reads the old table,
which no longer changes: a lookup that raced the switch returns what was published when it began.
When the table cannot answer (retired with nothing to reopen, an entry the writer could not place, a
slot that stays odd because the writer died mid-write) the reader returns ``None`` and the client
asks the agent.

Keys hash to the same value in every process (Python's own ``hash`` of str/bytes is salted per
process): str as UTF-8, bytes as they are, int as 8 little-endian bytes (more when it does not fit),
each with a type tag and its length, mixed 8 bytes at a time with numpy over the whole batch.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.catalog.files import share_fd
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.policy.scopes import Location

MAGIC = 0x31584449_4B434643  # "FCKCIDX1" little-endian
HEADER_BYTES = 4096
SLOT = np.dtype([("seq", "<u8"), ("h1", "<u8"), ("gva", "<u8"), ("h2", "<u4"), ("stride", "<u4")])
# Header words (u64): what each one means is in the module docstring.
_MAGIC, _SLOTS, _MAX_PROBE, _COMPLETE, _RETIRED, _EPOCH, _LIVE, _TOMBS = range(8)
EMPTY, TOMB = 0, 1
MAX_PROBE = 512  # an insert displaced further than this gives up: the table is rebuilt (larger)
MIN_SLOTS = 1024
SPIN_SECONDS = 0.05  # a slot odd this long: its writer died mid-write; ask the agent instead

_U = np.uint64
_C1, _C2 = _U(0x9E3779B97F4A7C15), _U(0xC2B2AE3D27D4EB4F)
_C3, _C4 = _U(0x165667B19E3779F9), _U(0x27D4EB2F165667C5)
_F1, _F2 = _U(0xFF51AFD7ED558CCD), _U(0xC4CEB9FE1A85EC53)
_TAG_STR, _TAG_BYTES, _TAG_INT = 1, 2, 3
_INT64 = (-(1 << 63), 1 << 63)

U64 = npt.NDArray[np.uint64]


def slots_for(keys: int) -> int:
    """Table size for up to ``keys`` live entries: a power of two, at most half full."""
    return max(MIN_SLOTS, 1 << max(0, 2 * keys - 1).bit_length())


# ---- hashing -----------------------------------------------------------------------------------
def _fmix(h: U64, tmp: U64 | None = None) -> U64:
    """MurmurHash3's finaliser, in place. Temporaries go to ``tmp``: a fresh array per step costs
    more than the arithmetic (an allocation this size is fresh pages from the kernel each time)."""
    tmp = np.empty_like(h) if tmp is None else tmp
    for k in (_F1, _F2, None):
        np.right_shift(h, _U(33), out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        if k is not None:
            np.multiply(h, k, out=h)
    return h


def _mix_words(words: U64, nwords: npt.NDArray[np.int64] | None, init: U64) -> tuple[U64, U64]:
    """Two 64-bit hashes of each row of ``words`` (only the first ``nwords[i]`` words of row i).

    Each word goes through a bijective mixer, then the row is summed with odd weights that differ by
    column and between the two hashes (keys differing in one word can never collide), then each sum
    is finalised: a handful of passes over the whole matrix instead of a dozen per column."""
    with np.errstate(over="ignore"):
        w, tmp = _scratch(words.shape[::-1], 2)
        w[...] = words.T  # column-major: the sums below run along rows of memory
        for k, shift in ((_C1, _U(29)), (_C2, _U(32))):
            np.multiply(w, k, out=w)
            np.right_shift(w, shift, out=tmp)
            np.bitwise_xor(w, tmp, out=w)
        if nwords is not None:
            w[np.arange(w.shape[0])[:, None] >= nwords[None, :]] = 0
        m = w.shape[0]
        out = []
        for which, start in ((0, init), (1, init ^ _C3)):
            np.multiply(w, _weights(m, which)[:, None], out=tmp)
            h = tmp.sum(axis=0, dtype=np.uint64)
            np.add(h, start, out=h)
            out.append(_fmix(h, tmp[0]))
        return out[0], out[1]


_local = threading.local()


def _scratch(shape: tuple[int, ...], count: int) -> list[U64]:
    """``count`` uint64 work arrays of ``shape``, reused by this thread: a fresh array of this size
    is fresh pages from the kernel, and faulting them in cost more than the hashing itself."""
    need = count * math.prod(shape)
    buf: U64 | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < need:
        buf = _local.buf = np.empty(max(need, 1 << 16), np.uint64)
    size = math.prod(shape)
    return [buf[i * size : (i + 1) * size].reshape(shape) for i in range(count)]


_WEIGHTS: dict[tuple[int, int], U64] = {}


def _weights(m: int, which: int) -> U64:
    got = _WEIGHTS.get((m, which))
    if got is None:
        with np.errstate(over="ignore"):
            j = np.arange(1, m + 1, dtype=np.uint64)
            got = _fmix(j * (_C3 if which else _C4) + _U(which)) | _U(1)  # odd: invertible mod 2**64
        _WEIGHTS[(m, which)] = got
    return got


def _init(tag: int, lengths: npt.NDArray[np.int64] | int, n: int) -> U64:
    with np.errstate(over="ignore"):
        return (np.full(n, tag << 56, dtype=np.uint64) ^ np.asarray(lengths, dtype=np.uint64)) * _C2


def _payload(key: Any) -> tuple[int, bytes] | None:
    if isinstance(key, str):
        return _TAG_STR, key.encode()
    if isinstance(key, bytes):
        return _TAG_BYTES, key
    if isinstance(key, int):
        if _INT64[0] <= key < _INT64[1]:
            return _TAG_INT, key.to_bytes(8, "little", signed=True)
        return _TAG_INT, key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
    return None


def hash_keys(keys: Sequence[Key]) -> tuple[U64, npt.NDArray[np.uint32]] | None:
    """``(h1, h2)`` per key, the same in every process; None for a key of another type."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    h: U64 | None = None
    first = type(keys[0])
    if first is str:  # SGLang's hex digests: equal-length ASCII, one buffer for the whole batch
        texts = cast(Sequence[str], keys)
        length = len(texts[0])
        try:
            joined = "".join(texts)
        except TypeError:  # not all str
            joined = ""
        if length >= 8 and len(joined) == n * length and len(set(map(len, texts))) == 1:
            data = joined.encode()
            if len(data) == n * length:
                h, g = _mix_words(_fixed_words(data, n, length), None, _init(_TAG_STR, length, n))
    elif first is int and set(map(type, keys)) == {int}:
        with contextlib.suppress(OverflowError):
            words = np.array(keys, dtype=np.int64).view(np.uint64).reshape(n, 1)
            h, g = _mix_words(words, None, _init(_TAG_INT, 8, n))
    if h is None:
        h, g = _mix_general(keys)  # type: ignore[assignment]
        if h is None:
            return None
    h = np.where(h <= _U(TOMB), h + _U(2), h)  # 0 and 1 mark empty and deleted slots
    return h, (g & _U(0xFFFFFFFF)).astype(np.uint32)


def _fixed_words(data: bytes, n: int, length: int) -> U64:
    """The zero-padded words of ``n`` keys of ``length`` (>= 8) bytes each, back to back in ``data``,
    read in place: full words as an (unaligned) strided view; the partial last word from the key's
    last 8 bytes shifted down, so nothing reads past the buffer or into the next key."""
    full = length // 8
    cols = full + (length % 8 != 0)
    words = np.empty((n, cols), np.uint64)
    words[:, :full] = np.ndarray((n, full), "<u8", buffer=data, strides=(length, 8))
    if cols > full:
        tail = np.ndarray((n,), "<u8", buffer=data, offset=length - 8, strides=(length,))
        np.right_shift(tail, _U(8 * (8 - length % 8)), out=words[:, full])
    return words


def _mix_general(keys: Sequence[Key]) -> tuple[U64 | None, U64 | None]:
    parts = [_payload(k) for k in keys]
    if any(p is None for p in parts):
        return None, None
    tags = np.fromiter((p[0] for p in parts if p), np.int64, len(parts))
    lengths = np.fromiter((len(p[1]) for p in parts if p), np.int64, len(parts))
    width = max(8, -(-int(lengths.max()) // 8) * 8)
    buf = b"".join(p[1].ljust(width, b"\0") for p in parts if p)
    words = np.frombuffer(buf, "<u8").reshape(len(parts), width // 8).astype(np.uint64, copy=False)
    with np.errstate(over="ignore"):
        init = ((tags.astype(np.uint64) << _U(56)) ^ lengths.astype(np.uint64)) * _C2
    return _mix_words(words, -(-lengths // 8), init)


# ---- the table ---------------------------------------------------------------------------------
class _Mapped:
    """One table file, mapped: the header words and the slot columns as numpy views."""

    def __init__(self, mm: mmap.mmap, path: str, writable: bool, ino: int) -> None:
        self.mm, self.path, self.ino = mm, path, ino
        self.header = np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)
        if int(self.header[_MAGIC]) != MAGIC:
            raise ValueError(f"{path}: not a FlatCake shared index (bad magic)")
        n = int(self.header[_SLOTS])
        if n & (n - 1) or len(mm) < HEADER_BYTES + n * SLOT.itemsize:
            raise ValueError(f"{path}: damaged shared index header ({n} slots in {len(mm)} bytes)")
        table = np.frombuffer(mm, dtype=SLOT, count=n, offset=HEADER_BYTES)
        if not writable:
            table.flags.writeable = False
        self.slots, self.mask = n, _U(n - 1)
        self.seq, self.h1, self.h2 = table["seq"], table["h1"], table["h2"]
        self.gva, self.stride = table["gva"], table["stride"]
        self.rows = table.view("<u8").reshape(n, 4)  # whole slots, for one gather per probe round


class SharedIndexWriter:
    """The agent's side. Not thread-safe by itself: the catalog calls it under the scope table's lock
    (``ScopeTable.on_publish`` and the free hook), which also orders inserts and deletes of a key."""

    def __init__(self, path: str | os.PathLike[str], slots: int, *, epoch: int = 0, gid: int = -1) -> None:
        self.path = Path(path)
        self.min_slots = max(MIN_SLOTS, 1 << (max(1, slots) - 1).bit_length())
        self.epoch, self.gid = epoch, gid
        self.rebuilds = 0
        self.dropped = 0  # entries that found no slot since the last rebuild (the table answers None)
        _retire(self.path)  # a previous agent's table, if any: its readers reopen or ask the agent
        self.t = self._create(self.min_slots)
        self._install(self.t)

    # ---- file lifecycle ----------------------------------------------------------------------
    def _create(self, slots: int) -> _Mapped:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        size = HEADER_BYTES + slots * SLOT.itemsize
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            share_fd(fd, self.gid)
            os.ftruncate(fd, size)
            with contextlib.suppress(OSError):  # reserve the tmpfs pages now rather than SIGBUS later
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
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

    def _install(self, new: _Mapped) -> None:
        """Make ``new`` the table at ``path``, then retire the one it replaces (in that order, so a
        reader that sees the old one retired finds the new one when it reopens)."""
        old = getattr(self, "_live", None)
        os.replace(new.path, self.path)
        new.path = str(self.path)
        self._live = new
        self.t = new
        if old is not None and old is not new:
            old.header[_RETIRED] = 1

    def rebuild(self, entries: Mapping[Key, Location]) -> None:
        """A fresh table holding ``entries`` (the catalog's): clears the tombstones, and grows the
        table when an insert found no room. When nothing was dropped the live slots of the current
        table are exactly ``entries``, and are copied over without hashing a key again (numpy only:
        this runs under the catalog's lock)."""
        slots = max(self.min_slots, slots_for(len(entries)))
        if self.dropped:
            slots = max(slots, self.t.slots * 2)
        new = self._create(slots)
        if self.dropped:
            keys = list(entries)
            for at in range(0, len(keys), 65536):
                chunk = keys[at : at + 65536]
                hashed = hash_keys(chunk)
                locs = [entries[k] for k in chunk]
                gva = np.fromiter((loc.gva for loc in locs), np.uint64, len(locs))
                stride = np.fromiter((loc.layer_stride for loc in locs), np.int64, len(locs))
                self._place(new, hashed, gva, stride)
        else:
            old = self.t
            live = np.flatnonzero(old.h1 > _U(TOMB))
            self._place(new, (old.h1[live], old.h2[live]), old.gva[live], old.stride[live].astype(np.int64))
        self.dropped = int(not new.header[_COMPLETE])
        self._install(new)
        self.rebuilds += 1

    def wants_rebuild(self) -> bool:
        h = self.t.header
        return bool(self.dropped) or int(h[_TOMBS]) + int(h[_LIVE]) > self.t.slots * 3 // 4

    def retire(self) -> None:
        """Stop serving this table: readers ask the agent from now on."""
        self.t.header[_RETIRED] = 1

    def close(self) -> None:
        """The agent is stopping: readers must ask (and fail to reach) the agent, not trust the table."""
        self.retire()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.t.ino:
                self.path.unlink()

    # ---- entries -----------------------------------------------------------------------------
    def insert(self, keys: Sequence[Key], locs: Sequence[Location]) -> None:
        self._insert(self.t, keys, locs)

    def _insert(self, t: _Mapped, keys: Sequence[Key], locs: Sequence[Location]) -> None:
        gva = np.fromiter((loc.gva for loc in locs), np.uint64, len(locs))
        stride = np.fromiter((loc.layer_stride for loc in locs), np.int64, len(locs))
        self._place(t, hash_keys(keys), gva, stride)

    def _place(
        self, t: _Mapped, hashed: tuple[U64, npt.NDArray[np.uint32]] | None, gva: U64, stride: npt.NDArray[np.int64]
    ) -> None:
        """Write entries into ``t``, one numpy pass per probe step for the whole batch."""
        if hashed is None or (len(stride) and int(stride.max()) >= 1 << 32):  # not representable here
            self._drop(t, len(gva))
            return
        h1, h2 = hashed
        n = len(h1)
        todo = np.arange(n)
        pos = h1 & t.mask
        dist = np.zeros(n, np.int64)
        while todo.size:
            over = dist[todo] > MAX_PROBE
            if over.any():
                self._drop(t, int(over.sum()))
                todo = todo[~over]
                continue
            p = pos[todo]
            cur = t.h1[p]
            # Free: empty, a tombstone, or this very key (re-published: its entry is replaced).
            free = (cur <= _U(TOMB)) | ((cur == h1[todo]) & (t.h2[p] == h2[todo]))
            cand, cp = todo[free], p[free]
            _, first = np.unique(cp, return_index=True)  # one key per slot per round
            win, wp = cand[first], cp[first]
            if win.size:
                reused = int(np.count_nonzero(t.h1[wp] == _U(TOMB)))
                replaced = int(np.count_nonzero(t.h1[wp] > _U(TOMB)))
                t.header[_MAX_PROBE] = max(int(t.header[_MAX_PROBE]), int(dist[win].max()))
                t.seq[wp] += _U(1)  # odd: readers retry these slots
                t.h1[wp], t.h2[wp], t.gva[wp], t.stride[wp] = h1[win], h2[win], gva[win], stride[win]
                t.seq[wp] += _U(1)  # even: published
                t.header[_TOMBS] -= _U(reused)
                t.header[_LIVE] += _U(win.size - replaced)
            done = np.zeros(n, bool)
            done[win] = True
            # Keys whose slot was taken move on; keys that lost a free slot to a sibling look again.
            moved = todo[~free]
            pos[moved] = (pos[moved] + _U(1)) & t.mask
            dist[moved] += 1
            todo = todo[~done[todo]]

    def _drop(self, t: _Mapped, n: int) -> None:
        if n:
            self.dropped += n
            t.header[_COMPLETE] = 0

    def delete(self, keys: Sequence[Key]) -> None:
        """Tombstone ``keys``' entries (called before their space can be reused)."""
        t = self.t
        hashed = hash_keys(keys)
        if hashed is None or not len(keys):
            return
        slot = _probe(t, *hashed, int(t.header[_MAX_PROBE]), stable_only=False)[0]
        at = slot[slot >= 0]
        if at.size:
            t.seq[at] += _U(1)
            t.h1[at] = _U(TOMB)
            t.seq[at] += _U(1)
            t.header[_LIVE] -= _U(at.size)
            t.header[_TOMBS] += _U(at.size)

    def stats(self) -> dict[str, int]:
        h = self.t.header
        return {"slots": self.t.slots, "entries": int(h[_LIVE]), "tombstones": int(h[_TOMBS]),
                "rebuilds": self.rebuilds, "complete": int(h[_COMPLETE])}  # fmt: skip


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
                if int(header[_MAGIC]) == MAGIC:
                    header[_RETIRED] = 1
                del header
    finally:
        os.close(fd)


def _probe(t: _Mapped, h1: U64, h2: npt.NDArray[np.uint32], max_probe: int, stable_only: bool = True) -> Any:
    """``(slot, gva, stride)`` of each key (slot -1: absent), each slot's fields read under its
    sequence number; None when a slot stayed mid-write for ``SPIN_SECONDS``. The writer calls it with
    ``stable_only=False``: nobody else writes, so the numbers cannot change under it."""
    n = len(h1)
    out = np.full(n, -1, np.int64)
    gva, stride = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    todo = np.arange(n)
    pos = h1 & t.mask
    dist = np.zeros(n, np.int64)
    deadline = 0.0
    while todo.size:
        p = pos[todo]
        s1 = t.seq[p]
        # One gather of whole slots: h1, gva, then h2 and the stride in the low and high halves of a word.
        rows = np.take(t.rows, p, axis=0, out=_scratch((len(p), 4), 1)[0])
        s2 = t.seq[p]
        c1, g = rows[:, 1], rows[:, 2]
        c2, st = rows[:, 3] & _U(0xFFFFFFFF), (rows[:, 3] >> _U(32)).astype(np.int64)
        stable = (s1 == s2) & ((s1 & _U(1)) == _U(0)) if stable_only else np.ones(len(p), bool)
        hit = stable & (c1 == h1[todo]) & (c2 == h2[todo])
        found = todo[hit]
        out[found], gva[found], stride[found] = p[hit], g[hit], st[hit]
        ends = hit | (stable & (c1 == _U(EMPTY)))
        step = stable & ~ends
        nxt = todo[step]
        pos[nxt] = (pos[nxt] + _U(1)) & t.mask
        dist[nxt] += 1
        ends[step] = dist[nxt] > max_probe
        if not stable.all():
            now = time.monotonic()
            deadline = deadline or now + SPIN_SECONDS
            if now > deadline:
                return None
        todo = todo[~ends]
    return out, gva, stride


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
        found = _probe(t, *hashed, int(t.header[_MAX_PROBE]))
        if found is None:
            self.fallbacks += 1
            return None
        at, gva, stride = found
        return at >= 0, gva, stride

    def hit_prefix(self, keys: Sequence[Key]) -> int | None:
        found = self.find(keys)
        if found is None:
            return None
        miss = np.flatnonzero(~found[0])
        return int(miss[0]) if miss.size else len(keys)
