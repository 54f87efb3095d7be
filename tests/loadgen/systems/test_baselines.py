from pathlib import Path

import numpy as np
import pytest

from flatcake.loadgen.systems.per_block import PerBlockStore
from flatcake.loadgen.systems.tiered import TieredStore
from tests.support.engines import pages

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("reader", "commands"), [("whole_page", 4), ("page_layer", 4 * 3)])
def test_tiered_evicts_in_lru_order_and_restores_with_its_reader(tmp_path: Path, reader: str, commands: int) -> None:
    store = TieredStore(tmp_path, layers=3, page_bytes=4096, dram_pages=2, bucket_bytes=4 * 3 * 4096, buckets=4,
                        reader=reader)  # fmt: skip
    try:
        kv = pages(3, 6, 4096)
        keys = [f"k{i}" for i in range(6)]
        store.put(keys, kv)
        assert list(store.l2) == ["k1", "k0"] and set(store.l3) == {"k2", "k3", "k4", "k5"}  # leaves out first
        dest = np.zeros((3, 6, 4096), np.uint8)
        assert store.restore(keys, dest) == 0 and np.array_equal(dest, kv)
        assert store.counters.read_commands == commands  # SSD pages only: one per page, or per page-layer
        assert store.counters.bytes_read == store.counters.bytes_requested * 4 // 6
        assert store.counters.staging_peak_bytes == kv.nbytes  # the whole request is staged
        store.flush()
        assert not store.l2 and store.exists(keys) == 6
    finally:
        store.close()


def test_a_host_tier_hit_is_a_use_deepest_page_first(tmp_path: Path) -> None:
    """SGLang's host tier is LRU: a restored prefix survives newer puts, its leaf evicted before its root."""
    store = TieredStore(tmp_path, layers=2, page_bytes=4096, dram_pages=3, bucket_bytes=4 * 2 * 4096, buckets=4)
    try:
        kv = pages(2, 5, 4096)
        store.put(["a0", "a1"], kv[:, :2])
        store.put(["b0"], kv[:, 2:3])
        assert list(store.l2) == ["a1", "a0", "b0"]
        dest = np.zeros((2, 2, 4096), np.uint8)
        assert store.restore(["a0", "a1"], dest) == 0  # both in DRAM: now the most recently used
        assert list(store.l2) == ["b0", "a1", "a0"]
        store.put(["c0"], kv[:, 3:4])
        assert list(store.l2) == ["a1", "a0", "c0"] and set(store.l3) == {"b0"}
        store.put(["d0"], kv[:, 4:5])
        assert "a0" in store.l2 and "a1" in store.l3  # the leaf went first
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
        # Pages enter DRAM deepest first, so the log holds k6 first and the prefix k0..k2 last.
        assert set(store.l3) == {"k0", "k1", "k2"} and store.exists(keys) == 3
        dest = np.zeros((2, 7, 4096), np.uint8)
        assert store.restore(keys, dest) == 4  # the rest are missing: recompute
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
    from flatcake.loadgen.systems import FlatCakeSystem, SystemSpec
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
