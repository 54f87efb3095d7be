"""The key index: each stored page's key, as a 128-bit digest, to its scope, address, layer stride and
crc32, in numpy arrays. Pure logic (the agent maps the shared part into a file: catalog/shared_index.py).

Why digests and arrays: a Python dict of key strings to location tuples cost about 330 bytes per key
(the 64-character SGLang key alone is 113), so 1M keys took 330 MB. Here a key is two 64-bit hashes
in an open-addressed table of 40-byte slots, at most half full, plus 16 bytes in its scope's page
list: about 100 bytes per key at 1M keys. The original keys are not kept; the journal's compacted
records carry the digests (catalog/recovery.py reads both forms).

Collisions: two keys with equal digests would be one key, so one could be served the other's page.
SGLang's keys are SHA-256 hex digests of token chains (plus a rank suffix), effectively random to
this 128-bit mix; among n keys the chance of any collision is about n² / 2^129: 1.5e-21 at 10^9 keys.
The mix is not cryptographic: a process that crafts keys could make collisions on purpose, but such a
process already shares the node's pool files (clients write them directly), so it gains nothing.

Slots (32 bytes, what clients read): ``seq`` u32, the page's layer ``stride`` u32, ``h1`` u64 (0 an
empty slot, 1 a deleted entry's tombstone), ``h2`` u64, ``gva`` u64. The agent's own columns beside
them: ``scope`` and ``crc`` (u32 each). Linear probing from ``h1 & (slots - 1)``; a lookup stops at an
empty slot or after the longest displacement any insert made (``max_probe``, in the header).

Seqlock: the writer makes a slot's number odd, writes the fields, then makes it even again. A reader
reads the number, the fields, the number again, and retries the slot when the number was odd or
changed, so it never returns a half-written entry. Each step is one numpy pass over the batch; x86-64
keeps stores in order and loads in order (TSO), which is all a seqlock needs there. A full table is
replaced (``_rebuild``), never changed in place, so a reader holding the old one sees what was
published when it began.

Keys hash to the same value in every process (Python's own ``hash`` of str/bytes is salted per
process): str as UTF-8, bytes as they are, int as 8 little-endian bytes (more when it does not fit),
each with a type tag and its length, mixed 8 bytes at a time with numpy over the whole batch.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.policy.placement import Key

HEADER_BYTES = 4096
SLOT = np.dtype([("seq", "<u4"), ("stride", "<u4"), ("h1", "<u8"), ("h2", "<u8"), ("gva", "<u8")])
# Header words (u64).
_MAGIC, _SLOTS, _MAX_PROBE, _COMPLETE, _RETIRED, _EPOCH, _LIVE, _TOMBS = range(8)
EMPTY, TOMB = 0, 1
SCALAR_TAIL = 16  # keys left in a batch below which _place walks each alone
MAX_PROBE = 512  # an insert displaced further than this: the table is rebuilt twice as large
MIN_SLOTS = 1024
SPIN_SECONDS = 0.05  # a slot odd this long: its writer died mid-write

_U = np.uint64
_C1, _C2 = _U(0x9E3779B97F4A7C15), _U(0xC2B2AE3D27D4EB4F)
_C3, _C4 = _U(0x165667B19E3779F9), _U(0x27D4EB2F165667C5)
_F1, _F2 = _U(0xFF51AFD7ED558CCD), _U(0xC4CEB9FE1A85EC53)
_TAG_STR, _TAG_BYTES, _TAG_INT = 1, 2, 3
_INT64 = (-(1 << 63), 1 << 63)

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
Digests = tuple[U64, U64]


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


def hash_keys(keys: Sequence[Key]) -> Digests | None:
    """``(h1, h2)`` per key, the same in every process; None for a key of another type."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
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
    return h, g.copy()


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


def pack(d: Digests) -> bytes:
    """Digests as 16 bytes each (h1, h2 little-endian): the journal's form."""
    return np.stack([d[0], d[1]], axis=1).astype("<u8").tobytes()


def unpack(blob: bytes) -> Digests:
    if len(blob) % 16:
        raise ValueError(f"digests: {len(blob)} bytes is not a whole number of 16-byte digests")
    a = np.frombuffer(blob, "<u8").reshape(-1, 2)
    return a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64)


# ---- one table -----------------------------------------------------------------------------------
class Table:
    """One table's arrays: the header words, the slots clients read, the agent's own columns."""

    def __init__(self, header: U64, slots: npt.NDArray[Any], scope: U32 | None, crc: U32 | None) -> None:
        n = len(slots)
        if n & (n - 1):
            raise ValueError(f"slots: {n} is not a power of two")
        self.header, self.slots, self.mask = header, n, _U(n - 1)
        self.seq, self.h1, self.h2 = slots["seq"], slots["h1"], slots["h2"]
        self.gva, self.stride = slots["gva"], slots["stride"]
        self.rows = slots.view("<u8").reshape(n, 4)  # whole slots, for one gather per probe round
        self.scope = scope if scope is not None else np.zeros(0, np.uint32)
        self.crc = crc if crc is not None else np.zeros(0, np.uint32)

    @classmethod
    def private(cls, slots: int) -> Table:
        header = np.zeros(HEADER_BYTES // 8, np.uint64)
        header[_SLOTS], header[_COMPLETE] = slots, 1
        return cls(header, np.zeros(slots, SLOT), np.zeros(slots, np.uint32), np.zeros(slots, np.uint32))

    def nbytes(self) -> int:
        return HEADER_BYTES + self.slots * (SLOT.itemsize + 8)


class Found(NamedTuple):
    """Per key: found, and where (scope, address, layer stride, crc32); zeros where not found."""

    hit: npt.NDArray[np.bool_]
    scope: npt.NDArray[np.int64]
    gva: U64
    stride: npt.NDArray[np.int64]
    crc: npt.NDArray[np.int64]
    slot: npt.NDArray[np.int64]


def probe(t: Table, h1: U64, h2: U64, stable_only: bool = True) -> Found | None:
    """Each key's entry, each slot's fields read under its sequence number; None when a slot stayed
    mid-write for ``SPIN_SECONDS``. The writer passes ``stable_only=False``: nobody else writes."""
    n = len(h1)
    slot = np.full(n, -1, np.int64)
    gva, stride = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    todo = np.arange(n)
    pos = h1 & t.mask
    dist = np.zeros(n, np.int64)
    max_probe = int(t.header[_MAX_PROBE])
    deadline = 0.0
    while todo.size:
        p = pos[todo]
        s1 = t.seq[p]
        # One gather of whole slots: seq | stride << 32, h1, h2, gva.
        rows = np.take(t.rows, p, axis=0, out=_scratch((len(p), 4), 1)[0])
        s2 = t.seq[p]
        c1, c2, g, st = rows[:, 1], rows[:, 2], rows[:, 3], (rows[:, 0] >> _U(32)).astype(np.int64)
        stable = (s1 == s2) & ((s1 & np.uint32(1)) == 0) if stable_only else np.ones(len(p), bool)
        hit = stable & (c1 == h1[todo]) & (c2 == h2[todo])
        found = todo[hit]
        slot[found], gva[found], stride[found] = p[hit], g[hit], st[hit]
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
    hit = slot >= 0
    at = np.where(hit, slot, 0)
    scope = t.scope[at].astype(np.int64) if len(t.scope) else np.zeros(n, np.int64)
    crc = t.crc[at].astype(np.int64) if len(t.crc) else np.zeros(n, np.int64)
    return Found(hit, np.where(hit, scope, 0), gva, stride, np.where(hit, crc, 0), slot)


class KeyIndex:
    """The writer's side: one writer (callers serialise inserts and deletes, as ``ScopeTable``'s lock
    does); readers may probe concurrently. Subclasses put the tables elsewhere (``_new_table``) and
    learn of each replacement (``_install``)."""

    def __init__(self, slots: int = MIN_SLOTS) -> None:
        self.min_slots = max(MIN_SLOTS, 1 << (max(1, slots) - 1).bit_length())
        self.rebuilds = 0
        self.t = self._new_table(self.min_slots)
        self._install(self.t)

    def _new_table(self, slots: int) -> Table:
        return Table.private(slots)

    def _install(self, new: Table) -> None:
        self.t = new

    def __len__(self) -> int:
        return int(self.t.header[_LIVE])

    def nbytes(self) -> int:
        return self.t.nbytes()

    def find(self, d: Digests, stable_only: bool = True) -> Found | None:
        return probe(self.t, d[0], d[1], stable_only)

    def put(self, d: Digests, scope: int | npt.NDArray[Any], gva: U64, stride: Any, crc: Any) -> None:
        """Insert or replace entries; grows the table rather than ever leaving one out."""
        n = len(d[0])
        if not n:
            return
        sc, g, st, cr = _entry_columns(n, scope, gva, stride, crc)
        h = self.t.header
        if int(h[_LIVE]) + int(h[_TOMBS]) + n > self.t.slots * 3 // 4:
            self._rebuild(extra=n)
        left = _place(self.t, d[0], d[1], sc, g, st, cr)
        while left.size:  # displaced too far: a larger table
            self._rebuild(extra=len(left), grow=True)
            left = left[_place(self.t, d[0][left], d[1][left], sc[left], g[left], st[left], cr[left])]

    def load(self, d: Digests, scope: npt.NDArray[Any], gva: U64, stride: Any, crc: Any) -> None:
        """Distinct entries into an empty index (recovery), in one sorted pass instead of ``put``'s
        probe rounds: 10M entries in about a second rather than several. Readers may map the table
        meanwhile: they find an entry whole or not at all (``_fill`` writes ``h1`` last)."""
        h = self.t.header
        if int(h[_LIVE]) or int(h[_TOMBS]):
            raise ValueError("load: the index is not empty; use put")
        n = len(d[0])
        if not n:
            return
        cols = _entry_columns(n, scope, gva, stride, crc)
        if n > self.t.slots * 3 // 4:
            self._rebuild(extra=n)
        left = _fill(self.t, d[0], d[1], *cols)
        if left.size:  # cannot happen in a table at most 3/4 full; say so rather than lose entries
            raise RuntimeError(f"key index load: {left.size} entries found no slot in {self.t.slots}")

    def remove(self, d: Digests) -> int:
        """Tombstone these entries (before their space can be reused); how many were there."""
        t = self.t
        found = probe(t, d[0], d[1], stable_only=False)
        assert found is not None
        at = found.slot[found.hit]
        if at.size:
            t.seq[at] += np.uint32(1)
            t.h1[at] = _U(TOMB)
            t.seq[at] += np.uint32(1)
            t.header[_LIVE] -= _U(at.size)
            t.header[_TOMBS] += _U(at.size)
        return int(at.size)

    def _rebuild(self, extra: int = 0, grow: bool = False) -> None:
        """A fresh table with the live entries (tombstones cleared), sized for ``extra`` more."""
        old = self.t
        live = np.flatnonzero(old.h1 > _U(TOMB))
        slots = max(self.min_slots, slots_for(len(live) + extra))
        if grow:
            slots = max(slots, old.slots * 2)
        new = self._new_table(slots)
        scope = old.scope[live] if len(old.scope) else np.zeros(len(live), np.uint32)
        crc = old.crc[live] if len(old.crc) else np.zeros(len(live), np.uint32)
        left = _fill(new, old.h1[live], old.h2[live], scope, old.gva[live], old.stride[live], crc)
        if left.size:  # cannot happen in a table at most half full; say so rather than lose entries
            raise RuntimeError(f"key index rebuild: {left.size} entries found no slot in {slots}")
        self._install(new)
        self.rebuilds += 1

    def stats(self) -> dict[str, int]:
        h = self.t.header
        return {"slots": self.t.slots, "entries": int(h[_LIVE]), "tombstones": int(h[_TOMBS]),
                "rebuilds": self.rebuilds, "complete": int(h[_COMPLETE])}  # fmt: skip


def _entry_columns(n: int, scope: Any, gva: Any, stride: Any, crc: Any) -> tuple[U32, U64, U32, U32]:
    """Entries' fields as the table stores them (``scope`` may be one id for all ``n``); a stride that
    does not fit the slot's 32 bits is refused."""
    if len(stride) and int(np.max(stride)) >= 1 << 32:
        raise ValueError(f"stride: {int(np.max(stride))} does not fit the index's 32 bits")
    return (
        np.broadcast_to(np.asarray(scope, np.uint32), (n,)),
        np.asarray(gva, np.uint64),
        np.asarray(stride, np.uint32),
        np.asarray(crc, np.int64).astype(np.uint32),
    )


def _place(t: Table, h1: U64, h2: U64, scope: U32, gva: U64, stride: U32, crc: U32) -> npt.NDArray[np.int64]:
    """Write entries into ``t``, one numpy pass per probe step for the whole batch; returns the
    positions of those displaced more than ``MAX_PROBE`` (not written). The last few keys of a batch,
    those in long probe runs, are walked one by one: a numpy pass per step for a handful of keys cost
    more than the rest of the batch."""
    n = len(h1)
    todo = np.arange(n)
    pos = h1 & t.mask
    dist = np.zeros(n, np.int64)
    over: list[npt.NDArray[np.int64]] = []
    cols = (h1, h2, scope, gva, stride, crc)
    while todo.size > SCALAR_TAIL:
        far = dist[todo] > MAX_PROBE
        if far.any():
            over.append(todo[far])
            todo = todo[~far]
            continue
        p = pos[todo]
        cur = t.h1[p]
        # Free: empty, a tombstone, or this very key (re-published: its entry is replaced).
        free = (cur <= _U(TOMB)) | ((cur == h1[todo]) & (t.h2[p] == h2[todo]))
        cand, cp = todo[free], p[free]
        _, first = np.unique(cp, return_index=True)  # one key per slot per round
        win, wp = cand[first], cp[first]
        if win.size:
            _write(t, wp, win, dist, cols)
        done = np.zeros(n, bool)
        done[win] = True
        # Keys whose slot was taken move on; keys that lost a free slot to a sibling look again.
        moved = todo[~free]
        pos[moved] = (pos[moved] + _U(1)) & t.mask
        dist[moved] += 1
        todo = todo[~done[todo]]
    mask, tomb = int(t.mask), _U(TOMB)
    for i in todo.tolist():
        at, d, a, b = int(pos[i]), int(dist[i]), h1[i], h2[i]
        while d <= MAX_PROBE:
            cur = t.h1[at]
            if cur <= tomb or (cur == a and t.h2[at] == b):
                _write_one(t, at, i, d, cols)
                break
            at, d = (at + 1) & mask, d + 1
        else:
            over.append(np.array([i]))
    return np.concatenate(over) if over else np.zeros(0, np.int64)


def _fill(t: Table, h1: U64, h2: U64, scope: U32, gva: U64, stride: U32, crc: U32) -> npt.NDArray[np.int64]:
    """Distinct entries into an empty table no reader sees yet, in one pass: in order of home slot,
    each entry takes the first free slot from its home, which is ``max(home, previous + 1)``, a running
    maximum (the table inserting them one by one in that order). Entries that would run past the end
    (the last cluster wrapping) go through ``_place``, and all of them do when one would land farther than
    ``MAX_PROBE``; returns those it could not place, as ``_place`` does."""
    n = len(h1)
    # Home slots as u32 where they fit: the sort is most of the pass, and sorts 4-byte keys faster. Any
    # order among equal homes will do, so quicksort, about twice as fast as a stable sort.
    home = (h1 & t.mask).astype(np.uint32 if t.slots <= 1 << 32 else np.int64)
    order = np.argsort(home)
    sorted_home = home[order].astype(np.int64)
    del home
    steps = np.arange(n, dtype=np.int64)
    at = np.maximum.accumulate(sorted_home - steps)
    at += steps  # each after the one before, never before its home
    dist = at - sorted_home
    del steps, sorted_home
    if n and int(dist.max()) > MAX_PROBE:  # skipping one would leave a hole in a run: no
        return _place(t, h1, h2, scope, gva, stride, crc)
    ok = at < t.slots  # only the last run can pass the end: what follows the first such entry does too
    whole = bool(ok.all())
    put, where = (order, at) if whole else (order[ok], at[ok])
    if len(t.scope):
        t.scope[where], t.crc[where] = scope[put], crc[put]
    # h1 last: a reader matches an entry only once its other fields are in place (stores stay in order
    # on x86-64, as the seqlock assumes), so ``load`` can fill a table readers already map.
    t.h2[where], t.gva[where], t.stride[where] = h2[put], gva[put], stride[put]
    t.h1[where] = h1[put]
    t.header[_LIVE] += _U(put.size)
    if put.size:
        t.header[_MAX_PROBE] = max(int(t.header[_MAX_PROBE]), int((dist if whole else dist[ok]).max()))
    if whole:
        return np.zeros(0, np.int64)
    rest = order[~ok]
    if not rest.size:
        return rest
    left = _place(t, h1[rest], h2[rest], scope[rest], gva[rest], stride[rest], crc[rest])
    return rest[left]


def _write_one(t: Table, at: int, i: int, dist: int, cols: tuple[Any, ...]) -> None:
    """``_write`` for one entry, element by element (a fancy-indexed pass per field costs far more)."""
    h1, h2, scope, gva, stride, crc = cols
    cur = t.h1[at]
    if dist > int(t.header[_MAX_PROBE]):
        t.header[_MAX_PROBE] = dist
    t.seq[at] += np.uint32(1)  # odd: readers retry this slot
    t.h1[at], t.h2[at], t.gva[at], t.stride[at] = h1[i], h2[i], gva[i], stride[i]
    t.seq[at] += np.uint32(1)  # even: published
    if len(t.scope):
        t.scope[at], t.crc[at] = scope[i], crc[i]
    if cur == _U(TOMB):
        t.header[_TOMBS] -= _U(1)
    if cur <= _U(TOMB):
        t.header[_LIVE] += _U(1)


def _write(
    t: Table, wp: npt.NDArray[Any], win: npt.NDArray[Any], dist: npt.NDArray[np.int64], cols: tuple[Any, ...]
) -> None:
    """Entries ``win`` into free slots ``wp``, each under its slot's sequence number."""
    h1, h2, scope, gva, stride, crc = cols
    reused = int(np.count_nonzero(t.h1[wp] == _U(TOMB)))
    replaced = int(np.count_nonzero(t.h1[wp] > _U(TOMB)))
    t.header[_MAX_PROBE] = max(int(t.header[_MAX_PROBE]), int(dist[win].max()))
    t.seq[wp] += np.uint32(1)  # odd: readers retry these slots
    t.h1[wp], t.h2[wp], t.gva[wp], t.stride[wp] = h1[win], h2[win], gva[win], stride[win]
    t.seq[wp] += np.uint32(1)  # even: published
    if len(t.scope):
        t.scope[wp], t.crc[wp] = scope[win], crc[win]
    t.header[_TOMBS] -= _U(reused)
    t.header[_LIVE] += _U(win.size - replaced)


# ---- a scope's pages -------------------------------------------------------------------------------
class Pages:
    """A scope's pages in publish order, as key digests (16 bytes each, grown by half when full)."""

    __slots__ = ("_d", "_n")

    def __init__(self) -> None:
        self._d = np.zeros((0, 2), np.uint64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def digests(self) -> Digests:
        d = self._d[: self._n]
        return d[:, 0], d[:, 1]

    def raw(self) -> npt.NDArray[np.uint64]:
        """The digests as one ``(pages, 2)`` array (a view)."""
        return self._d[: self._n]

    @classmethod
    def of(cls, d: npt.NDArray[np.uint64]) -> Pages:
        """Pages holding ``d`` (``(pages, 2)``), taken as they are: recovery's one copy, not another."""
        pages = cls()
        pages._d, pages._n = d, len(d)
        return pages

    def extend(self, d: Digests) -> None:
        k = len(d[0])
        if self._n + k > len(self._d):
            grown = np.zeros((max(self._n + k, self._n + self._n // 2), 2), np.uint64)
            grown[: self._n] = self._d[: self._n]
            self._d = grown
        self._d[self._n : self._n + k, 0], self._d[self._n : self._n + k, 1] = d
        self._n += k

    def last(self) -> tuple[int, int] | None:
        """The digest of the page published last (the scope's tail), or None when empty."""
        if not self._n:
            return None
        return int(self._d[self._n - 1, 0]), int(self._d[self._n - 1, 1])

    def index(self, h1: int, h2: int) -> int:
        """Position of a digest, or -1."""
        d = self._d[: self._n]
        at = np.flatnonzero((d[:, 0] == _U(h1)) & (d[:, 1] == _U(h2)))
        return int(at[0]) if at.size else -1

    def __contains__(self, digest: object) -> bool:
        if not isinstance(digest, bytes):
            return False
        h1, h2 = unpack(digest)
        return self.index(int(h1[0]), int(h2[0])) >= 0

    def pop(self, i: int) -> None:
        self._d[i : self._n - 1] = self._d[i + 1 : self._n]
        self._n -= 1

    def clear(self) -> None:
        self._d = np.zeros((0, 2), np.uint64)
        self._n = 0
