"""Recovery rebuilds the same byte extents from the journal, and still reads whole-file records."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.errors import PoolFullError
from flatcake.node_agent.catalog.journal import Journal, replay
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.recovery import recover
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.extents import Extent
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.policy.scopes import ScopeTable
from flatcake.node_agent.service.client import connect
from tests.support.agents import AgentThread
from tests.support.engines import pages, small_config

LAYERS, PAGE = 2, 4096
SPAN = LAYERS * PAGE
SSD_HINTS = Hints(context_tokens=1 << 30)  # an agent session: SSD


def catalog(journal: Journal | None, files: int = 3, pages_per_file: int = 8) -> LocalCatalog:
    table = ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=pages_per_file * SPAN, files=files,
                       dram_slots=4, high_watermark=0.9, low_watermark=0.6)  # fmt: skip
    return LocalCatalog(table, PlacementConfig(), journal)


def allocation(c: LocalCatalog) -> tuple[dict[int, list[Extent]], list[Extent], dict[object, object]]:
    t = c.table
    return {s.id: sorted(s.extents) for s in t.scopes.values()}, list(t.ssd.runs()), dict(t.items())


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 20), st.integers(1, 5), st.booleans()), max_size=40),
    st.integers(-1, 40),
)
def test_a_restart_rebuilds_identical_extents(steps: list[tuple[bool, int, int, bool]], compact_at: int) -> None:
    """Also across an online compaction at step ``compact_at`` (-1: none): a snapshot in columns, then a
    tail of publishes and frees, some of scopes the snapshot holds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.log"
        j = Journal(path, "never")
        c = catalog(j)
        names = iter(range(1 << 30))
        published: list[str] = []
        for step, (append, pick, n, abort) in enumerate(steps):
            if step == compact_at:
                assert c.compact_journal(force=True)
            live = [k for k, loc in zip(published, c.table.lookup_many(published), strict=True) if loc is not None]
            parent = live[pick % len(live)] if append and live else None
            keys = [f"k{next(names)}" for _ in range(n)]
            try:
                alloc = c.allocate(keys, Hints(context_tokens=1 << 30, parent_key=parent))
            except PoolFullError:  # the session would outgrow the whole pool: refused, nothing changed
                continue
            assert alloc is not None
            if abort:  # a failed write: nothing journaled, the space goes back
                c.abort(alloc.id)
            else:
                c.publish(alloc.id, [0] * n)
                published += keys
        j.close()
        before = allocation(c)
        again = catalog(None)
        recover(again, path, None)
        assert allocation(again) == before
        compacted = catalog(None)  # and the compacted journal (snapshot records) rebuilds it too
        j2 = Journal(Path(tmp) / "compact.log", "never")
        j2.rewrite(c.snapshot_records())
        j2.close()
        recover(compacted, Path(tmp) / "compact.log", None)
        assert allocation(compacted) == before


@pytest.mark.unit
def test_records_of_whole_files_are_still_read(tmp_path: Path) -> None:
    # Journal records written before byte extents: a scope named whole files and an append cursor.
    c = catalog(None)
    pub = {"t": "pub", "medium": int(Medium.SSD), "slots": [], "crc": [0, 0]}
    legacy = [
        {**pub, "scope": 1, "keys": ["a0", "a1"], "gva": [G.encode(Medium.SSD, 1, o) for o in (0, PAGE)],
         "stride": [2 * PAGE] * 2, "files": [0], "cursor": 2 * SPAN},
        {**pub, "scope": 2, "keys": ["b0", "b1"], "gva": [G.encode(Medium.SSD, 1, 8 * SPAN + o) for o in (0, PAGE)],
         "stride": [2 * PAGE] * 2, "files": [1], "cursor": 2 * SPAN},
        {**pub, "scope": 1, "keys": ["a2", "a3"], "gva": [G.encode(Medium.SSD, 1, 2 * 8 * SPAN + o) for o in (0, PAGE)],
         "stride": [2 * PAGE] * 2, "files": [0, 2], "cursor": 2 * SPAN},
    ]  # fmt: skip
    j = Journal(tmp_path / "j.log", "never")
    for rec in legacy:
        j.append(rec)
    j.close()
    r = recover(c, tmp_path / "j.log", None)
    assert (r.pages, r.scopes, r.skipped_records, r.superseded_pages) == (6, 2, 0, 0)
    assert c.exists(["a0", "a1", "a2", "a3"]) == 4 and c.exists(["b0", "b1"]) == 2  # keys hashed as published
    scopes = {s.id: s.extents for s in c.table.scopes.values()}
    # Scope 1 held file 0 whole (no longer its last file) and file 2 up to its cursor; scope 2 file 1's start.
    assert scopes == {1: [Extent(0, 0, 8 * SPAN), Extent(2, 0, 2 * SPAN)], 2: [Extent(1, 0, 2 * SPAN)]}
    assert c.table.ssd.free_bytes == 24 * SPAN - 12 * SPAN
    nxt = c.allocate(["new"], SSD_HINTS)  # the space after a cursor is free for anyone now
    assert nxt is not None and (nxt.segments[0].file, nxt.segments[0].offset) == (1, 2 * SPAN)
    j = Journal(tmp_path / "j2.log", "never")  # compaction rewrites them as extents, in snapshot columns
    j.rewrite(c.snapshot_records())
    j.close()
    (snap,) = replay(tmp_path / "j2.log")
    assert snap["t"] == "snap" and "files" not in snap
    assert np.frombuffer(snap["exts"], "<u8").reshape(-1, 3).tolist() == [
        [0, 0, 8 * SPAN],
        [2, 0, 2 * SPAN],
        [1, 0, 2 * SPAN],
    ]
    again = catalog(None)
    assert recover(again, tmp_path / "j2.log", None).pages == 6
    assert {s.id: s.extents for s in again.table.scopes.values()} == scopes


@pytest.mark.unit
def test_a_lost_free_over_part_of_an_extent_drops_the_older_scope(tmp_path: Path) -> None:
    # Scope 1 held [0, 4 pages) of file 0; its free was lost; scope 2 was given pages 2-3 of it.
    c = catalog(None)
    pub = {"t": "pub", "medium": int(Medium.SSD), "slots": [], "stride": [PAGE], "crc": [0]}
    j = Journal(tmp_path / "j.log", "never")
    j.append({**pub, "scope": 1, "keys": ["old"], "gva": [G.encode(Medium.SSD, 1, 0)], "ext": [[0, 0, 4 * SPAN]]})
    j.append({**pub, "scope": 2, "keys": ["new"], "gva": [G.encode(Medium.SSD, 1, 2 * SPAN)],
              "ext": [[0, 2 * SPAN, SPAN]]})  # fmt: skip
    j.close()
    r = recover(c, tmp_path / "j.log", None)
    assert (r.pages, r.superseded_pages) == (1, 1) and c.table.lookup("old") is None
    assert [s.extents for s in c.table.scopes.values()] == [[Extent(0, 2 * SPAN, SPAN)]]


@pytest.mark.unit
def test_a_key_published_again_belongs_to_its_last_scope_and_that_scopes_first_page(tmp_path: Path) -> None:
    """Recovery works in columns; the pages whose owner is not their own record's scope are resolved
    apart: "k" published by scope 1, then 2, then 1 again (twice in that record) belongs to scope 1, at
    its first page of it (offset 0); scope 2 keeps its other key; "u" (published once) is untouched."""
    c = catalog(None)
    pub = {"t": "pub", "medium": int(Medium.SSD), "slots": []}

    def record(scope: int, keys: list[str], offsets: list[int], file: int) -> dict[str, object]:
        base = file * 8 * SPAN
        return {**pub, "scope": scope, "keys": keys, "gva": [G.encode(Medium.SSD, 1, base + o * SPAN) for o in offsets],
                "stride": [PAGE] * len(keys), "crc": [o + 10 * scope for o in offsets],
                "ext": [[file, min(offsets) * SPAN, (max(offsets) - min(offsets) + 1) * SPAN]]}  # fmt: skip

    j = Journal(tmp_path / "j.log", "never")
    j.append(record(1, ["k", "u"], [0, 1], 0))
    j.append(record(2, ["k", "v"], [0, 1], 1))
    j.append(record(1, ["k", "k"], [2, 3], 0))
    j.close()
    r = recover(c, tmp_path / "j.log", None)
    assert (r.pages, r.scopes, r.superseded_pages) == (3, 2, 3)  # k, u in scope 1; v in scope 2
    found = c.table.find(["k", "u", "v"])
    assert found.hit.tolist() == [True, True, True]
    assert found.scope.tolist() == [1, 1, 2]
    assert found.gva.tolist() == [G.encode(Medium.SSD, 1, o) for o in (0, SPAN, 9 * SPAN)]
    assert found.crc.tolist() == [10, 11, 21]


@pytest.mark.integration
def test_ten_one_page_sessions_share_one_file_across_an_agent_restart(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node", files=4, file_bytes=64 * 4 * 4096)
    a = AgentThread(config)
    kv = [pages(4, 1, 4096, seed=i) for i in range(10)]
    try:
        with connect(a.socket) as e:
            for i in range(10):
                e.put([f"s{i}"], kv[i], SSD_HINTS)
        table = a.agent.catalog.table
        files = {G.decode(loc.gva).offset // config.ssd.file_bytes for _, loc in table.items()}
        assert files == {0} and table.usage()["ssd"]["used_bytes"] == 10 * 4 * 4096
        before = {s.id: sorted(s.extents) for s in table.scopes.values()}, list(table.ssd.runs())
    finally:
        a.stop()
    b = AgentThread(config)
    try:
        table = b.agent.catalog.table
        assert ({s.id: sorted(s.extents) for s in table.scopes.values()}, list(table.ssd.runs())) == before
        with connect(b.socket) as e:
            dest = np.zeros((4, 10, 4096), np.uint8)
            e.get([f"s{i}" for i in range(10)], dest).run()
            assert all(np.array_equal(dest[:, i], kv[i][:, 0]) for i in range(10))
    finally:
        b.stop()


@pytest.mark.unit
def test_publish_records_carry_digests_not_keys(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.log", "never")
    c = catalog(j)
    keys = [f"{'ab' * 32}{i}" for i in range(3)]  # SGLang-like: 65 characters each
    a = c.allocate(keys, SSD_HINTS)
    assert a is not None
    c.publish(a.id, [0, 0, 0])
    j.close()
    (rec,) = [r for r in replay(tmp_path / "j.log") if r["t"] == "pub"]
    assert "keys" not in rec and isinstance(rec["kd"], bytes) and len(rec["kd"]) == 3 * 16
    fresh = catalog(None)
    recover(fresh, tmp_path / "j.log", None)
    assert fresh.exists(keys) == 3


@pytest.mark.unit
def test_a_scope_outside_a_shrunk_pool_is_dropped_and_the_rest_served(tmp_path: Path) -> None:
    """Recovery takes every scope's space in one pass; when the pool shrank under the journal (one file
    fewer), that pass refuses and each scope takes its own: only the scope in the missing file is
    dropped, the other served with its space, none of the dropped scope's left taken."""
    j = Journal(tmp_path / "j.log", "never")
    c = catalog(j)
    for s in range(2):  # one 8-page session per file
        keys = [f"s{s}-{i}" for i in range(8)]
        alloc = c.allocate(keys, SSD_HINTS)
        c.publish(alloc.id, [0] * 8)
    j.close()
    assert sorted(e.file for s in c.table.scopes.values() for e in s.extents) == [0, 1]
    small = catalog(None, files=1)
    r = recover(small, tmp_path / "j.log", None)
    assert (r.scopes, r.pages, r.superseded_pages) == (1, 8, 8)
    assert [e.file for s in small.table.scopes.values() for e in s.extents] == [0]
    assert small.table.ssd.free_bytes == 0
    assert small.exists([f"s1-{i}" for i in range(8)]) == 0 and small.exists([f"s0-{i}" for i in range(8)]) == 8
    full = catalog(None)  # the same journal on the pool it was written for: taken in one pass
    r = recover(full, tmp_path / "j.log", None)
    assert (r.scopes, r.pages, r.superseded_pages) == (2, 16, 0) and allocation(full) == allocation(c)
