"""The tiered cache with the real Mooncake Store as its L3 (the main job's ``hicache-mooncake``): a
master process and an embedded client, driven with SGLang's Mooncake backend's batch calls."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.storage import Storage
from flatcake.loadgen.systems.mooncake import MooncakePages
from flatcake.loadgen.systems.tiered import BatchPageStore, TieredStore
from flatcake.node_agent import ChainSignals, aligned_empty

pytestmark = pytest.mark.integration

LAYERS, PAGE = 3, 4096


def test_evicted_pages_go_through_mooncake_a_batch_a_call_and_come_back_bit_exact(tmp_path: Path) -> None:
    pages = MooncakePages(tmp_path / "mooncake", LAYERS, PAGE)
    store = TieredStore(tmp_path, layers=LAYERS, page_bytes=PAGE, dram_pages=2, bucket_bytes=1 << 20, buckets=0,
                        l3=pages)  # fmt: skip
    try:
        assert isinstance(pages, BatchPageStore)
        assert pages.system.pids(), "no mooncake_master running"
        # Offload reads through io_uring (O_DIRECT, as every other system reads), not the page cache.
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]  # fmt: skip
        assert any("io_uring" in fd for fd in fds), "Mooncake's client runs no io_uring: its reads are buffered"
        kv = aligned_empty((LAYERS, 6, PAGE))
        kv[...] = np.random.default_rng(5).integers(0, 256, kv.shape, dtype=np.uint8)
        keys = [f"k{i}" for i in range(6)]
        store.put(keys, kv)
        store.flush()  # out of the host tier: only Mooncake holds them now
        assert store.media(keys) == ["ssd"] * 6 and store.dropped_pages == 0
        dest = np.zeros_like(kv)
        assert store.restore(keys, dest) == 0
        assert np.array_equal(dest, kv)
        assert store.counters.read_commands == 1  # one batch_get_into for the six pages, as SGLang's backend
        assert pages.system.failed_puts == 0
    finally:
        store.close()
    assert not pages.system.pids()  # closing the store stopped Mooncake's master


def test_the_emulators_tiered_mode_runs_on_mooncake(tmp_path: Path) -> None:
    cfg = EmulatorConfig(mode="tiered", l3="hicache-mooncake", data_dir=str(tmp_path), layers=2, page_tokens=64,
                         bytes_per_token_layer=64, dram_bytes=4 * 2 * 4096)  # fmt: skip
    storage = Storage(cfg)
    try:
        keys = [f"p{i}" for i in range(5)]
        storage.store([], keys, ChainSignals())
        assert storage.tiered is not None
        storage.tiered.drain()  # written through to Mooncake on the backup thread
        # Half the 4-page DRAM budget is the host tier (2 pages), half Mooncake's segment: it holds the rest.
        assert cfg.host_tier_bytes == 2 * cfg.page_span and cfg.l3_dram_bytes == 2 * cfg.page_span
        assert storage.media(keys) == ["dram"] * 2 + ["ssd"] * 3
        got, layers = storage.restore(keys)
        assert got == 5 and len(layers) == cfg.layers
    finally:
        storage.close()


def test_puts_refused_for_space_are_dropped_not_retried_and_reads_do_not_wait_for_writes(tmp_path: Path) -> None:
    layers, page = 4, 256 * 1024  # 1 MiB pages: 40 of them overflow the 16 MiB segment in one call
    pages = MooncakePages(tmp_path / "mooncake", layers, page)
    try:
        kv = aligned_empty((layers, 40, page))
        kv[...] = np.random.default_rng(6).integers(0, 256, kv.shape, dtype=np.uint8)
        keys = [f"big{i}" for i in range(40)]
        stored = pages.set_many(keys, [kv[:, i] for i in range(40)])
        # SGLang's backend reports a refused page as failed and HiCache does not retry it.
        assert 0 < sum(stored) < 40 and pages.system.refused_puts == stored.count(False)
        assert pages.system.failed_puts == 0
        # A write in progress (its lock held) does not hold up a read: separate registered buffers.
        first = keys[stored.index(True)]
        into = aligned_empty((layers, page))
        with pages._write_lock:
            assert pages.get_many([first], [into]) == [True]
        assert np.array_equal(into, kv[:, stored.index(True)])
    finally:
        pages.close()
