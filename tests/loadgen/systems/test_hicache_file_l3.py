"""The tiered cache with SGLang's real ``HiCacheFile`` as its L3 (the main job's ``hicache-file``)."""

from __future__ import annotations

import subprocess
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
    store.flush()  # written through, then out of the host tier: only the file backend holds them now
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
        assert storage.tiered is not None
        storage.tiered.drain()  # the backup thread has written every page through to the page files
        # The host tier keeps 2 pages (leaves evicted before their prefix); the files hold all five.
        assert storage.media(keys) == ["dram"] * 2 + ["ssd"] * 3
        assert len(list((tmp_path / "tiered" / "hicache").iterdir())) == 5
        got, layers = storage.restore(keys)
        assert got == 5 and len(layers) == cfg.layers
        assert any((tmp_path / "tiered" / "hicache").iterdir())
    finally:
        storage.close()
    with pytest.raises(ConfigError, match="l3: 'nfs' must be one of log, hicache-file"):
        EmulatorConfig(mode="tiered", l3="nfs")


def _resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the OS page cache (util-linux's fincore; bin/test installs it)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.strip())


@pytest.mark.parametrize("drop", [True, False])
def test_page_files_leave_the_page_cache_once_written_so_reads_hit_the_device(tmp_path: Path, drop: bool) -> None:
    """Every other system reads O_DIRECT; HiCacheFile reads buffered, so pages it wrote moments ago would be
    served from memory outside the DRAM budget. By default each page file is synced and dropped from the
    page cache once written (the report's calibration says so); --keep-page-cache leaves it resident."""
    files = HiCacheFilePages(tmp_path / "files", LAYERS, 4 * PAGE, drop_page_cache=drop)
    page = np.random.default_rng(9).integers(0, 256, (LAYERS, 4 * PAGE), dtype=np.uint8)
    assert files.set("k0", page)
    (path,) = (tmp_path / "files").iterdir()
    assert (_resident_bytes(path) == 0) is drop
    into = np.zeros_like(page)
    assert files.get("k0", into) and np.array_equal(into, page)
    assert files.exists(["k0", "k1"]) == 1
    cfg = EmulatorConfig(mode="tiered", l3="hicache-file", drop_page_cache=drop)
    assert cfg.page_cache.startswith("dropped" if drop else "kept")
