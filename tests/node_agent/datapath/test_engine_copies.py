"""DRAM copies through the engine's own data path (real pool files, O_DIRECT): written with their SSD
home, filled by host restores, read back bit-exact from DRAM, from SSD, and from both in one restore."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints
from tests.support.engines import pages

pytestmark = pytest.mark.integration

Make = Callable[..., Engine]
AGENT = Hints(context_tokens=100_000)


def restore(e: Engine, keys: list[str]) -> tuple[np.ndarray, dict[str, int]]:
    """Restore ``keys``; the bytes, and how many pages came from each medium."""
    before = e.stats.snapshot()
    dest = np.zeros((e.config.layers, len(keys), e.config.page_bytes), np.uint8)
    with e.get(keys, dest) as r:
        assert r.run() == set()
    after = e.stats.snapshot()
    return dest, {m: after.get(f"restore_pages_{m}", 0) - before.get(f"restore_pages_{m}", 0) for m in ("dram", "ssd")}


def copies_engine(make_engine: Make, dram_pages: int, **kw: object) -> Engine:
    return make_engine(placement=PlacementConfig(mode="copies"), dram_bytes=dram_pages * 4 * 4096, **kw)


def test_copies_at_write_serve_reads_and_a_dropped_copy_loses_nothing(make_engine: Make) -> None:
    e = copies_engine(make_engine, dram_pages=6, io={"verify_reads": "all"})
    kv = pages(4, 5, 4096, seed=1)
    keys = [f"a{i}" for i in range(5)]
    assert e.put(keys, kv, AGENT).medium is Medium.SSD
    assert e.table.usage()["dram"]["copy_pages"] == 5  # DRAM had room: copied as written
    dest, media = restore(e, keys)
    assert np.array_equal(dest, kv) and media == {"dram": 5, "ssd": 0}
    # A shared prompt homed in DRAM takes the room: the copies go, their pages are read from SSD.
    shared = pages(4, 3, 4096, seed=2)
    assert e.put(["p0", "p1", "p2"], shared, Hints(prefix_refcount=2)).medium is Medium.DRAM
    assert e.table.usage()["dram"]["copy_pages"] == 0 and e.exists(keys) == 5
    dest, media = restore(e, keys)
    assert np.array_equal(dest, kv) and media == {"dram": 0, "ssd": 5}
    dest, _ = restore(e, ["p0", "p1", "p2"])
    assert np.array_equal(dest, shared)


def test_a_host_restore_fills_copies_and_the_next_restore_mixes_dram_and_ssd(make_engine: Make) -> None:
    e = copies_engine(make_engine, dram_pages=4, io={"verify_reads": "all"})
    kv = pages(4, 7, 4096, seed=3)
    keys = [f"s{i}" for i in range(7)]
    e.put(keys, kv, AGENT)  # 7 pages, DRAM holds 4: no copies at write
    assert e.table.usage()["dram"]["copy_pages"] == 0
    dest, media = restore(e, keys[:3])  # the session comes back: the reader copies what it read
    assert np.array_equal(dest, kv[:, :3]) and media == {"dram": 0, "ssd": 3}
    assert e.table.copy_stats.admitted_restore == 3 and e.stats.snapshot()["copy_pages_written"] == 3
    # One restore, one plan: three pages from their DRAM copies (checked against the copies' crc32s),
    # four from SSD, every byte as written.
    dest, media = restore(e, keys)
    assert np.array_equal(dest, kv) and media == {"dram": 3, "ssd": 4}


def test_copies_from_a_caller_layout_and_none_from_a_restore_stopped_early(make_engine: Make) -> None:
    e = copies_engine(make_engine, dram_pages=8)
    c = e.config
    kv = pages(4, 4, 4096, seed=4)
    keys = [f"t{i}" for i in range(4)]
    e.put(keys, kv, Hints(context_tokens=100_000))
    e.table._drop_copies(e.table.scopes[min(e.table.scopes)], count=True)  # as DRAM pressure would
    # A restore stopped after its first layer fills nothing: its pages were never whole.
    dest = np.zeros((c.layers, 4, c.page_bytes), np.uint8)
    r = e.get(keys, dest)
    next(r)
    r.close()
    assert e.table.usage()["dram"]["copy_pages"] == 0 and e.table.copy_stats.unfilled == 4
    # A page-first caller layout (SGLang's host pool): the copies are taken from where the pages landed.
    memory = np.zeros(4 * c.layers * c.page_bytes, np.uint8)
    target = PagedTarget(memory, c.layers, np.arange(4) * c.layers * c.page_bytes, c.page_bytes, [0], c.page_bytes)
    with e.get(keys, target) as r2:
        assert r2.run() == set()
    assert e.table.usage()["dram"]["copy_pages"] == 4
    dest, media = restore(e, keys)
    assert np.array_equal(dest, kv) and media == {"dram": 4, "ssd": 0}
