"""The tiered cache with SGLang's real ``HiCacheFile`` as its L3 (the main job's ``hicache-file``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.storage import Storage
from flatcake.loadgen.systems.sglang import HiCacheFilePages
from flatcake.loadgen.systems.tiered import TieredStore
from flatcake.node_agent import ChainSignals, aligned_empty

pytestmark = pytest.mark.integration

LAYERS, PAGE = 3, 4096


def test_evicted_pages_go_through_hicache_file_and_come_back_bit_exact(tmp_path: Path) -> None:
    files = HiCacheFilePages(tmp_path / "files", LAYERS, PAGE)
    store = TieredStore(tmp_path, layers=LAYERS, page_bytes=PAGE, dram_pages=2, bucket_bytes=1 << 20, buckets=0,
                        l3=files)  # fmt: skip
    kv = aligned_empty((LAYERS, 6, PAGE))
    kv[...] = np.random.default_rng(5).integers(0, 256, kv.shape, dtype=np.uint8)
    keys = [f"k{i}" for i in range(6)]
    store.put(keys, kv)
    store.flush()  # out of the host tier: only the file backend holds them now
    assert store.media(keys) == ["ssd"] * 6 and store.dropped_pages == 0
    assert len(list((tmp_path / "files").iterdir())) == 6  # one file per page, as HiCacheFile stores them
    dest = np.zeros_like(kv)
    assert store.restore(keys, dest) == 0
    assert np.array_equal(dest, kv)
    assert store.counters.read_commands == 6  # a page at a time
    (tmp_path / "files" / next(iter(sorted(p.name for p in (tmp_path / "files").iterdir())))).unlink()
    assert store.restore(keys, np.zeros_like(kv)) == 1  # a page file gone: that page is missing, not garbage


def test_the_emulators_tiered_mode_runs_on_hicache_file(tmp_path: Path) -> None:
    cfg = EmulatorConfig(mode="tiered", l3="hicache-file", data_dir=str(tmp_path), layers=2, page_tokens=64,
                         bytes_per_token_layer=64, dram_bytes=2 * 2 * 4096)  # fmt: skip
    storage = Storage(cfg)
    try:
        keys = [f"p{i}" for i in range(5)]
        storage.store([], keys, ChainSignals())
        # The host tier keeps 2 pages; it evicts leaves before their prefix, into the page files.
        assert storage.media(keys) == ["dram"] * 2 + ["ssd"] * 3
        got, layers = storage.restore(keys)
        assert got == 5 and len(layers) == cfg.layers
        assert any((tmp_path / "tiered" / "hicache").iterdir())
    finally:
        storage.close()
    with pytest.raises(ConfigError, match="l3: 'nfs' must be one of log, hicache-file"):
        EmulatorConfig(mode="tiered", l3="nfs")
