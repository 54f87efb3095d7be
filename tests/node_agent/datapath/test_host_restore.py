"""Host restores: reads straight into aligned destinations, staged into the others, bit-exact either way;
checks as pages land; layers yielded only once their bytes are in; the read queue shared fairly."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flatcake.node_agent.catalog.checksum import crc32
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.host_restore import HostRestore
from flatcake.node_agent.datapath.io_backends import PosixDirectIO
from flatcake.node_agent.datapath.read_queue import ReadQueue, Worker
from flatcake.node_agent.datapath.restore import Restore, StagedVerifier, WindowPool
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.coalesce import plan_restore
from flatcake.node_agent.policy.placement import Hints
from tests.support.engines import pages

pytestmark = pytest.mark.integration

Make = Callable[..., Engine]
LAYERS, PB = 4, 8192


def _unaligned(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed destination whose rows are 512 bytes off a 4 KiB boundary: O_DIRECT cannot land there."""
    raw = aligned_empty(int(np.prod(shape)) + 512)
    out = raw[512:].reshape(shape)
    out[...] = 0
    return out


def _store_interleaved(e: Engine, sessions: int, turns: int, per_turn: int) -> tuple[list[str], np.ndarray]:
    """Sessions written turn by turn in alternation, so their segments interleave in the pool files; some
    pages land in DRAM (a shared prefix)."""
    keys: list[str] = []
    chunks: list[np.ndarray] = []
    shared = pages(LAYERS, 2, PB, 99)
    e.put(["sys/0", "sys/1"], shared, Hints(prefix_refcount=5))
    keys += ["sys/0", "sys/1"]
    chunks.append(shared)
    for t in range(turns):
        for s in range(sessions):
            kv = pages(LAYERS, per_turn, PB, 10 * s + t)
            names = [f"s{s}/{t}/{i}" for i in range(per_turn)]
            parent = f"s{s}/{t - 1}/{per_turn - 1}" if t else None
            e.put(names, kv, Hints(turn=t + 1, parent_key=parent))
            keys += names
            chunks.append(kv)
    return keys, np.concatenate(chunks, axis=1)


def _run(r: HostRestore | Restore) -> set[int]:
    with r:
        assert list(r) == list(range(LAYERS))
        return set(r.missing)


@pytest.mark.parametrize("subset", ["all", "partial"])
def test_direct_and_staged_restores_are_bit_exact(make_engine: Make, subset: str) -> None:
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, io={"verify_reads": "all"})
    keys, kv = _store_interleaved(e, sessions=3, turns=3, per_turn=3)
    rng = np.random.default_rng(1)
    pick = np.arange(len(keys)) if subset == "all" else np.sort(rng.choice(len(keys), len(keys) // 2, replace=False))
    want_keys = [keys[i] for i in pick]
    slots = len(keys) + 5
    dest_pages = rng.permutation(slots)[: len(pick)].tolist()  # scattered, out of order

    direct_dest = aligned_empty((LAYERS, slots, PB))
    direct_dest[...] = 0
    r = e.get(want_keys, direct_dest, dest_pages)
    assert isinstance(r, HostRestore) and r.direct
    assert _run(r) == set()
    staged_dest = _unaligned((LAYERS, slots, PB))
    r = e.get(want_keys, staged_dest, dest_pages)
    assert isinstance(r, HostRestore) and not r.direct
    assert _run(r) == set()
    assert np.array_equal(direct_dest, staged_dest)
    for i, p in zip(pick.tolist(), dest_pages, strict=True):
        assert np.array_equal(direct_dest[:, p], kv[:, i])
    # A host pool keeping each page's layers back to back (page_first), aligned rows: read in place too.
    memory = aligned_empty(slots * LAYERS * PB)
    target = PagedTarget(memory, LAYERS, np.arange(slots) * LAYERS * PB, PB, [0], PB)
    r = e.get(want_keys, target, dest_pages)
    assert isinstance(r, HostRestore) and r.direct and _run(r) == set()
    for p in dest_pages:
        for layer in range(LAYERS):
            assert np.array_equal(target.read(layer, p), direct_dest[layer, p])
    s = e.stats.snapshot()
    assert s["restore_pages_dram"] > 0 and s["read_bytes"] >= s["requested_bytes"]


def test_commands_span_a_segments_layers(make_engine: Make) -> None:
    """One session, one segment: layer 0 in one command, layers 1.. in one more, not one per layer."""
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, dram_bytes=0)
    kv = pages(LAYERS, 8, PB)
    keys = [f"p{i}" for i in range(8)]
    e.put(keys, kv)
    before = e.stats.get("read_commands")
    dest = aligned_empty((LAYERS, 8, PB))
    assert _run(e.get(keys, dest)) == set() and np.array_equal(dest, kv)
    assert e.stats.get("read_commands") - before == 2


def _corrupt(e: Engine, key: str, layer: int) -> None:
    loc = e.table.lookup(key)
    assert loc is not None and loc.gva >= G.SSD_THRESHOLD
    off = int(loc.gva & G.MAX_OFFSET)
    file, base = divmod(off, e.config.ssd.file_bytes)
    path = Path(e.config.ssd.dir) / e.pool.files[file]
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 16, base + layer * loc.layer_stride + 100)
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_corrupted_page_is_a_miss_on_host_paths(make_engine: Make, path: str) -> None:
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, dram_bytes=0)
    kv = pages(LAYERS, 6, PB)
    keys = [f"c{i}" for i in range(6)]
    e.put(keys, kv)
    _corrupt(e, "c3", layer=2)
    dest = aligned_empty((LAYERS, 6, PB)) if path == "direct" else _unaligned((LAYERS, 6, PB))
    r = e.get(keys, dest)
    assert r.direct == (path == "direct")  # type: ignore[union-attr]
    assert _run(r) == {3}
    assert e.stats.get("verify_failures") == 1
    for i in (0, 1, 2, 4, 5):
        assert np.array_equal(dest[:, i], kv[:, i])


def test_a_corrupted_page_is_a_miss_on_the_staged_device_path(make_engine: Make) -> None:
    """The GPU restore's check, with host memory standing in for the device: slots are brought back with
    ``to_host`` (counted) and each page's layers hashed as read. Not the engine's device wiring (no GPU)."""
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, dram_bytes=0)
    kv = pages(LAYERS, 5, PB)
    keys = [f"g{i}" for i in range(5)]
    e.put(keys, kv)
    _corrupt(e, "g1", layer=3)
    locs = [e.table.lookup(k) for k in keys]
    off = np.array([int(loc.gva & G.MAX_OFFSET) for loc in locs if loc is not None], np.int64)
    file, base = np.divmod(off, e.config.ssd.file_bytes)
    stride = np.array([loc.layer_stride for loc in locs if loc is not None], np.int64)
    slot = 2 * PB
    fills = plan_restore(file, base, stride, LAYERS, PB, 0, slot)
    stats, copies = Stats(), []

    def to_host(buf: Any) -> Any:
        copies.append(len(buf))
        return np.array(buf)

    want = np.array(e.catalog.acquire(keys).checksums, np.int64)
    verify = StagedVerifier(np.arange(5), np.arange(5), want, PB, LAYERS, {}, lambda s, layer: None, to_host)
    dest = np.zeros((LAYERS, 5, PB), np.uint8)

    def scatter(layer: int, buf: Any, src: Any, dst: Any, count: Any) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), count.tolist(), strict=True):
            dest[layer, d : d + n] = buf[s : s + n * PB].reshape(n, PB)

    io = PosixDirectIO([str(Path(e.config.ssd.dir) / f) for f in e.pool.files], 2)
    try:
        r = Restore(layers=LAYERS, fills=fills, dest_pages=np.arange(5), request_index=np.arange(5), io=io,
                    windows=WindowPool(1, 2, slot, stats), scatter=scatter, copy_dram=lambda layer: None,
                    stats=stats, on_close=lambda: None, verify=verify)  # fmt: skip
        assert _run(r) == {1}
    finally:
        io.close()
    assert copies and sum(copies) >= 5 * LAYERS * PB  # every byte checked was brought back first
    assert stats.get("verify_failures") == 1 and np.array_equal(dest[:, 0], kv[:, 0])


def test_a_dram_page_is_checked_in_all_mode(make_engine: Make) -> None:
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, io={"verify_reads": "all"})
    kv = pages(LAYERS, 2, PB)
    e.put(["d0", "d1"], kv, Hints(prefix_refcount=4))
    loc = e.table.lookup("d1")
    assert loc is not None and loc.gva < G.SSD_THRESHOLD
    slot = int(loc.gva & G.MAX_OFFSET) // (LAYERS * PB)
    e._dram3[slot, 1, 7] ^= 0xFF  # a bit rot in the pool
    assert _run(e.get(["d0", "d1"], aligned_empty((LAYERS, 2, PB)))) == {1}


class Gate:
    """A ``preadv`` that holds every read until the test lets it go, newest first."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.held: list[threading.Event] = []
        self.done = 0

    def preadv(self, fd: int, iov: Any, offset: int) -> int:
        go = threading.Event()
        with self.cond:
            self.held.append(go)
            self.cond.notify_all()
        go.wait()
        n = os.preadv(fd, iov, offset)
        with self.cond:
            self.done += 1
            self.cond.notify_all()
        return n

    def release_newest(self) -> bool:
        with self.cond:
            if not self.cond.wait_for(lambda: bool(self.held), timeout=30):
                return False
            self.held.pop().set()
            return True


def test_a_layer_is_yielded_only_after_all_its_bytes_landed(make_engine: Make) -> None:
    e = make_engine(page_bytes=PB, layers=LAYERS, file_bytes=1 << 20, dram_bytes=0,
                    io={"read_threads": 3, "command_bytes": 2 * PB, "restore_inflight_bytes": 64 * PB})  # fmt: skip
    keys, kv = _store_interleaved(e, sessions=3, turns=2, per_turn=2)
    gate = Gate()
    e.reads.preadv = gate.preadv
    dest = aligned_empty((LAYERS, len(keys), PB))
    dest[...] = 0
    seen: list[tuple[int, bool]] = []
    r = e.get(keys, dest)

    def consume() -> None:
        for layer in r:
            seen.append((layer, bool(np.array_equal(dest[layer], kv[layer]))))

    t = threading.Thread(target=consume)
    t.start()
    while t.is_alive():
        if not gate.release_newest():
            break
    t.join(30)
    r.close()
    assert [layer for layer, _ in seen] == list(range(LAYERS))
    assert all(ok for _, ok in seen), seen
    assert gate.done > LAYERS  # many commands, completed out of order


def test_two_restores_share_the_queue_and_neither_starves(tmp_path: Path) -> None:
    q = ReadQueue([], threads=2)
    started: list[str] = []
    release = threading.Event()
    cond = threading.Condition()

    def job(name: str) -> Callable[[Worker], None]:
        def run(worker: Worker) -> None:
            with cond:
                started.append(name)
                cond.notify_all()
            release.wait()

        return run

    try:
        a, b = q.stream(cap_bytes=4), q.stream(cap_bytes=4)
        for _ in range(10):
            a.submit(2, job("a"))  # a restore with its commands all queued first
        with cond:
            cond.wait_for(lambda: len(started) == 2, timeout=30)  # both threads are busy with a's
        for _ in range(10):
            b.submit(2, job("b"))
        release.set()
        a.wait_idle()
        with cond:
            assert cond.wait_for(lambda: len(started) == 20, timeout=30)
        b.wait_idle()
    finally:
        release.set()
        q.close()
    # After a's first two, the streams alternate: b never waits for a's whole restore.
    assert started[:2] == ["a", "a"]
    assert "b" in started[2:5] and started.index("b") < started.index("a", 4)
    assert started.count("a") == started.count("b") == 10


def test_a_stream_at_its_cap_leaves_threads_to_others(tmp_path: Path) -> None:
    q = ReadQueue([], threads=3)
    running: dict[str, int] = {"a": 0, "b": 0}
    peak = {"a": 0}
    cond = threading.Condition()
    release = threading.Event()

    def job(name: str) -> Callable[[Worker], None]:
        def run(worker: Worker) -> None:
            with cond:
                running[name] += 1
                peak["a"] = max(peak["a"], running["a"])
                cond.notify_all()
            release.wait()
            with cond:
                running[name] -= 1

        return run

    try:
        a, b = q.stream(cap_bytes=2), q.stream(cap_bytes=8)
        for _ in range(6):
            a.submit(1, job("a"))
        for _ in range(2):
            b.submit(1, job("b"))
        with cond:
            assert cond.wait_for(lambda: running["a"] == 2 and running["b"] == 1, timeout=30)
        release.set()
        a.wait_idle()
        b.wait_idle()
    finally:
        release.set()
        q.close()
    assert peak["a"] == 2  # never more than its cap in flight


def test_readv_finishes_partial_reads_and_splits_long_iovec_lists(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = np.random.default_rng(3).integers(0, 256, 1100 * 4096, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    calls = {"n": 0}

    def stingy(fd: int, iov: Any, offset: int) -> int:  # at most 3 blocks per call, and at most IOV_MAX iovecs
        calls["n"] += 1
        assert len(iov) <= 1024
        total, out = 0, []
        for v in iov:
            take = v[: max(0, 3 * 4096 - total)]
            if len(take):
                out.append(take)
                total += len(take)
        return os.preadv(fd, out, offset)

    q = ReadQueue([str(path)], threads=1, preadv=stingy)
    try:
        dest = aligned_empty(1100 * 4096)
        iov = [memoryview(dest[i * 4096 : (i + 1) * 4096]) for i in range(1100)]
        assert q.readv(0, 0, iov) == len(data)
        assert np.array_equal(dest, data) and calls["n"] >= 1100 // 3
        tail = aligned_empty(8192)
        assert q.readv(0, len(data) - 4096, [memoryview(tail)]) == 4096  # a short read at the end of the file
    finally:
        q.close()


def test_page_checksums_match_the_published_ones(make_engine: Make) -> None:
    e = make_engine(page_bytes=PB, layers=LAYERS)
    kv = pages(LAYERS, 3, PB)
    e.put(["x0", "x1", "x2"], kv)
    lease = e.catalog.acquire(["x0", "x1", "x2"])
    try:
        for j, want in enumerate(lease.checksums):
            assert crc32(np.ascontiguousarray(kv[:, j])) == want
    finally:
        e.catalog.release(lease.id)
