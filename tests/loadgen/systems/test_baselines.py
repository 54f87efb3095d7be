import threading
from pathlib import Path

import numpy as np
import pytest

from flatcake.loadgen.systems.per_block import PerBlockStore
from flatcake.loadgen.systems.tiered import TieredStore
from tests.support.engines import pages
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("reader", "commands"), [("whole_page", 4), ("page_layer", 4 * 3)])
def test_tiered_evicts_in_lru_order_and_restores_with_its_reader(tmp_path: Path, reader: str, commands: int) -> None:
    store = TieredStore(tmp_path, layers=3, page_bytes=4096, dram_pages=2, bucket_bytes=4 * 3 * 4096, buckets=4,
                        reader=reader)  # fmt: skip
    try:
        kv = pages(3, 6, 4096)
        keys = [f"k{i}" for i in range(6)]
        store.put(keys, kv)
        store.drain()
        # Written through: every page is in the log; the host tier keeps two, leaves out first.
        assert list(store.l2) == ["k1", "k0"] and set(store.l3) == set(keys)
        dest = np.zeros((3, 6, 4096), np.uint8)
        assert store.restore(keys, dest) == 0 and np.array_equal(dest, kv)
        assert store.counters.read_commands == commands  # SSD pages only: one per page, or per page-layer
        assert store.counters.bytes_read == store.counters.bytes_requested * 4 // 6
        assert store.counters.staging_peak_bytes == kv.nbytes  # the whole request is staged
        store.flush()
        assert not store.l2 and store.exists(keys) == 6
    finally:
        store.close()


class GatedL3:
    """A real-L3 stand-in whose writes wait for the test, recording the thread each runs on."""

    def __init__(self) -> None:
        self.pages: dict[str, np.ndarray] = {}
        self.writers: set[str] = set()
        self.entered, self.opened = threading.Event(), threading.Event()

    def set(self, key: str, page: np.ndarray) -> bool:
        self.entered.set()
        assert self.opened.wait(60), "the test never opened the gate"
        self.writers.add(threading.current_thread().name)
        self.pages[key] = page.copy()
        return True

    def get(self, key: str, into: np.ndarray) -> bool:
        if key not in self.pages:
            return False
        into[...] = self.pages[key].reshape(into.shape)
        return True

    def exists(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n


def test_pages_are_written_through_on_a_backup_thread_and_held_until_backed_up(tmp_path: Path) -> None:
    """SGLang 0.5.23's default write policy: a put enters the host tier at once and returns; its pages are
    queued for the L3 on a backup thread of their own and held in the host tier until written (its host
    lock), then evicted with no write (the L3 has them). A prefetched page entering the host tier is
    never written again: the prefetch thread does no L3 writes."""
    l3 = GatedL3()
    store = TieredStore(tmp_path, layers=2, page_bytes=4096, dram_pages=2, bucket_bytes=4 * 2 * 4096, buckets=0, l3=l3)
    try:
        kv = pages(2, 5, 4096)
        keys = [f"k{i}" for i in range(5)]
        store.put(keys, kv)  # returns while the backup waits at the gate
        wait_until(l3.entered.is_set, what="the backup to start")
        assert set(store.l2) == set(keys) and not store.l3  # held past the tier's size until backed up
        l3.opened.set()
        store.drain()
        assert l3.writers and all(name.startswith("tiered-backup") for name in l3.writers)
        assert threading.current_thread().name not in l3.writers
        assert set(l3.pages) == set(keys) and set(store.l3) == set(keys)
        assert list(store.l2) == ["k1", "k0"] and store.dropped_pages == 0  # evicted: the L3 holds them
        written = len(l3.pages)
        dest = np.zeros((2, 5, 4096), np.uint8)
        assert store.media(keys) == ["dram", "dram", "ssd", "ssd", "ssd"]
        assert store.restore(keys, dest) == 0 and np.array_equal(dest, kv)
        store.promote(keys[2:], dest[:, 2:])  # a finished prefetch enters the host tier
        assert len(l3.pages) == written and l3.writers <= {n for n in l3.writers if n.startswith("tiered-backup")}
    finally:
        store.close()


def test_a_host_tier_hit_is_a_use_deepest_page_first(tmp_path: Path) -> None:
    """SGLang's host tier is LRU: a restored prefix survives newer puts, its leaf evicted before its root."""
    store = TieredStore(tmp_path, layers=2, page_bytes=4096, dram_pages=3, bucket_bytes=4 * 2 * 4096, buckets=4)
    try:
        kv = pages(2, 5, 4096)
        store.put(["a0", "a1"], kv[:, :2])
        store.put(["b0"], kv[:, 2:3])
        store.drain()
        assert list(store.l2) == ["a1", "a0", "b0"]
        dest = np.zeros((2, 2, 4096), np.uint8)
        assert store.restore(["a0", "a1"], dest) == 0  # both in DRAM: now the most recently used
        assert list(store.l2) == ["b0", "a1", "a0"]
        store.put(["c0"], kv[:, 3:4])
        store.drain()
        assert list(store.l2) == ["a1", "a0", "c0"] and "b0" in store.l3
        store.put(["d0"], kv[:, 4:5])
        store.drain()
        assert "a0" in store.l2 and "a1" not in store.l2 and "a1" in store.l3  # the leaf went first
    finally:
        store.close()


def test_tiered_bucket_reclaim_invalidates_whole_buckets_fifo(tmp_path: Path) -> None:
    store = TieredStore(tmp_path, layers=2, page_bytes=4096, dram_pages=1, bucket_bytes=2 * 2 * 4096, buckets=2)
    try:
        keys = [f"k{i}" for i in range(7)]
        store.put(keys, pages(2, 7, 4096))
        store.flush()
        # 7 pages into 2 buckets of 2 pages: buckets 0 and 1 were each reused once, whole.
        assert (store.reclaimed_buckets, store.invalidated_pages) == (2, 4)
        # Written through in the chain's order, the log lost the prefix k0..k3 first: nothing of it is left.
        assert set(store.l3) == {"k4", "k5", "k6"} and store.exists(keys) == 0
        dest = np.zeros((2, 7, 4096), np.uint8)
        assert store.restore(keys, dest) == 4  # k0..k3 missing: the prefix is recomputed
    finally:
        store.close()


def test_per_block_round_trip_one_file_per_page(tmp_path: Path) -> None:
    store = PerBlockStore(tmp_path, layers=4, page_bytes=4096)
    try:
        kv = pages(4, 5, 4096)
        keys = [f"p{i}" for i in range(5)]
        store.put(keys, kv)
        assert len(list(tmp_path.glob("*.kv"))) == 5 and store.exists(keys) == 5
        dest = np.zeros((4, 5, 4096), np.uint8)
        assert store.restore(keys, dest) == 0 and np.array_equal(dest, kv)
        assert store.counters.read_commands == 5 * 4
        (tmp_path / "p2.kv").unlink()
        assert store.exists(keys) == 2 and store.restore(keys, dest) == 1
    finally:
        store.close()


def test_flatcake_restores_the_stored_prefix_and_counts_the_rest_as_missed(tmp_path: Path) -> None:
    """A page no longer stored (a DRAM scope reclaimed since) is a miss to recompute, never an exception."""
    from flatcake.loadgen.systems.base import SystemSpec
    from flatcake.loadgen.systems.flatcake import FlatCakeSystem
    from flatcake.node_agent import Hints

    spec = SystemSpec(
        layers=2, page_bytes=4096, page_tokens=16, sessions=1, session_bytes=4 * 2 * 4096, dram_fraction=0
    )
    system = FlatCakeSystem(tmp_path, spec)
    try:
        kv = pages(2, 3, 4096)
        system.put(["a", "b", "c"], kv, Hints())
        dest = np.zeros((2, 4, 4096), np.uint8)
        assert system.restore(["a", "b", "c", "gone"], dest) == 1
        assert np.array_equal(dest[:, :3], kv)
    finally:
        system.close()


def test_flatcake_as_a_benchmark_system_runs_the_placement_it_is_given(tmp_path: Path) -> None:
    """bench peers' --placement copies: the written pages get DRAM copies, and a restore reads them there
    while their home stays on SSD."""
    from flatcake.loadgen.systems.base import SystemSpec
    from flatcake.loadgen.systems.flatcake import FlatCakeSystem
    from flatcake.node_agent import Hints

    spec = SystemSpec(layers=2, page_bytes=4096, page_tokens=16, sessions=1, session_bytes=4 * 2 * 4096,
                      dram_fraction=1.0, placement="copies")  # fmt: skip
    system = FlatCakeSystem(tmp_path, spec)
    try:
        assert system.engine.config.placement.mode == "copies"
        kv = pages(2, 3, 4096)
        system.put(["a", "b", "c"], kv, Hints(context_tokens=100_000))  # an agent session: SSD home
        assert system.placement(["a", "b", "c"]) == ["ssd"] * 3
        dest = np.zeros((2, 3, 4096), np.uint8)
        assert system.restore(["a", "b", "c"], dest) == 0 and np.array_equal(dest, kv)  # none missing
        assert system.engine.table.copy_stats.served == 3  # all three read from their DRAM copies
    finally:
        system.close()
