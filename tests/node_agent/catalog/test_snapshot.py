"""The compacted journal in columns (``snap`` records): what a restart reads instead of a record per
scope, each record checked on its own, and compaction bounded by the records appended since."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

from flatcake.node_agent.catalog.journal import Journal, encode, replay, snapshot_records
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.recovery import recover
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.policy.scopes import ScopeTable
from flatcake.node_agent.policy.slots import SlotAllocator

pytestmark = pytest.mark.unit

LAYERS, PAGE = 2, 4096
SSD = Hints(context_tokens=1 << 30)  # an agent session: SSD
DRAM = Hints(prefix_refcount=4)  # a shared prompt: DRAM


def catalog(journal: Journal | None = None) -> LocalCatalog:
    table = ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=64 * LAYERS * PAGE, files=16,
                       dram_slots=64, high_watermark=1.0, low_watermark=1.0)  # fmt: skip
    return LocalCatalog(table, PlacementConfig(), journal)


def filled(journal: Journal | None = None, scopes: int = 24) -> tuple[LocalCatalog, list[list[str]]]:
    """SSD sessions (some grown by a second put: two extents' worth of records) and DRAM prompts."""
    c = catalog(journal)
    keys: list[list[str]] = []
    for s in range(scopes):
        ks = [f"s{s}-{p}" for p in range(3 + s % 5)]
        hints = DRAM if s % 4 == 0 else SSD
        for part in (ks[:2], ks):  # a put, then the session's next turn
            a = c.allocate(part, hints)
            if a is not None:
                c.publish(a.id, [s * 100 + i for i in a.index])
        keys.append(ks)
    return c, keys


def state(c: LocalCatalog) -> dict[object, object]:
    """Every key's location and crc32, and each scope's space."""
    t = c.table
    found = {k: (loc, int(crc)) for k, loc, crc in ((k, v, c.table.find([k]).crc[0]) for k, v in t.items())}
    space = {s.id: (s.medium, sorted(s.extents), sorted(s.slots), s.keys.raw().tolist()) for s in t.scopes.values()}
    return {"pages": found, "scopes": space, "runs": list(t.ssd.runs()), "dram_free": t.dram.free}


def test_a_compacted_journal_is_columns_that_rebuild_the_same_catalog(tmp_path: Path) -> None:
    c, _ = filled()
    records = c.snapshot_records()
    assert {r["t"] for r in records} == {"snap"}
    j = Journal(tmp_path / "j.log", "never")
    j.rewrite(records)
    j.close()
    again = catalog()
    r = recover(again, tmp_path / "j.log", None)
    assert (r.records, r.snapshot_records, r.skipped_records) == (len(records), len(records), 0)
    assert state(again) == state(c)
    assert r.pages == len(list(c.table.items())) > 0


def test_a_damaged_snapshot_record_loses_only_its_own_scopes(tmp_path: Path) -> None:
    c, keys = filled()
    t = c.table
    scopes = sorted((s for s in t.scopes.values() if s.keys), key=lambda s: s.id)
    d = np.concatenate([s.keys.raw() for s in scopes])
    found = t.find_digests((d[:, 0], d[:, 1]))
    records = snapshot_records(scopes, d, found.gva, found.stride, found.crc, max_pages=16)
    assert len(records) >= 4
    path = tmp_path / "j.log"
    frames = [encode(r) for r in records]
    blob = bytearray(b"".join(frames))
    at = sum(map(len, frames[:2])) + len(frames[2]) // 2  # the middle of the third record's payload
    blob[at] ^= 0xFF
    path.write_bytes(bytes(blob))
    lost = set(np.frombuffer(records[2]["scopes"], "<u8").tolist())
    again = catalog()
    r = recover(again, path, None)
    assert r.skipped_records == 1
    assert set(again.table.scopes) == {s.id for s in scopes} - lost
    for s, ks in zip(range(len(keys)), keys, strict=True):
        sid = c.table.lookup(ks[0]).scope  # type: ignore[union-attr]
        want = 0 if sid in lost else len(ks)
        assert again.exists(ks) == want, f"session {s}"
    kept = {k: v for k, v in state(c)["pages"].items() if v[0].scope not in lost}  # type: ignore[attr-defined]
    assert state(again)["pages"] == kept


@pytest.mark.parametrize("field", ["counts", "ext_counts", "slot_counts", "kd", "gvas", "media"])
def test_a_snapshot_record_whose_columns_disagree_is_skipped_not_misread(tmp_path: Path, field: str) -> None:
    c, _ = filled(scopes=8)
    (good,) = c.snapshot_records()
    bad = dict(good)
    if field == "media":
        bad[field] = b"\x07" * len(good[field])  # no such medium
    else:
        raw = np.frombuffer(good[field], np.uint8)
        width = {"counts": 4, "ext_counts": 4, "slot_counts": 4, "kd": 16, "gvas": 8}[field]
        bad[field] = raw[:-width].tobytes()  # one entry short
    path = tmp_path / "j.log"
    path.write_bytes(encode(bad))
    again = catalog()
    r = recover(again, path, None)
    assert (r.skipped_records, r.pages, len(again.table.scopes)) == (1, 0, 0)
    assert again.table.ssd.free_bytes == again.table.ssd.capacity and again.table.dram.free == 64


def test_an_older_agent_skips_a_snapshot_record_rather_than_misread_it() -> None:
    """An older agent took every record not ``free`` for a ``pub`` and read its ``scope``: a snapshot
    has none, so that agent skipped it (a miss for its pages) instead of serving wrong space."""
    c, _ = filled(scopes=4)
    (snap,) = msgpack.unpackb(msgpack.packb(c.snapshot_records()), raw=False)
    assert "scope" not in snap and "gva" not in snap and "ext" not in snap


def test_a_tail_of_frees_and_publishes_after_the_snapshot_is_replayed_onto_it(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.log", "never")
    c, keys = filled(j)
    assert c.compact_journal(force=True)
    gone = c.table.lookup(keys[1][0]).scope  # type: ignore[union-attr]
    assert c.table.drop(gone)  # a free record after the snapshot
    a = c.allocate(keys[1][:2], SSD)  # the same keys published again, into a new scope
    assert a is not None
    c.publish(a.id, [7, 8])
    a = c.allocate([*keys[2], "next-turn"], SSD)  # a snapshot scope grown by the tail
    assert a is not None
    c.publish(a.id, [9])
    j.close()
    kinds = [r["t"] for r in replay(tmp_path / "j.log")]
    assert kinds[0] == "snap" and kinds[-3:] == ["free", "pub", "pub"]
    again = catalog()
    r = recover(again, tmp_path / "j.log", None)
    assert r.snapshot_records == kinds.count("snap") and r.superseded_pages == 0
    assert state(again) == state(c)


def test_compaction_is_due_after_compact_records_appends_whatever_their_size(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.log", "never", compact_min_bytes=1 << 30, compact_records=10)
    for i in range(9):
        j.append({"t": "x", "i": i})
        assert not j.due()
    j.append({"t": "x", "i": 9})
    assert j.due() and j.due_event.is_set()
    j.compact([{"t": "y"}] * 3, j.mark())
    assert not j.due() and j.records == 3
    for i in range(9):
        j.append({"t": "x", "i": i})
    assert not j.due()  # the three compacted records do not count towards the next ten
    j.append({"t": "x"})
    assert j.due()
    j.close()
    # A journal opened after a recovery counts what that recovery read: here 12 records, 2 of them snapshot.
    k = Journal(tmp_path / "j.log", "never", compact_min_bytes=1 << 30, compact_records=10, records=(12, 2))
    assert k.due()
    k.close()


def test_slots_taken_at_recovery_are_never_handed_out_and_repeats_are_refused() -> None:
    a = SlotAllocator(1000)
    for start in range(0, 1000, 3):  # many scopes' slots, one take each (was a rebuild of the free list each)
        a.take([start])
    with pytest.raises(ValueError, match="repeated"):
        a.take([1, 1])
    assert a.free == 1000 - 334
    got = a.alloc(666)
    assert not {x for x in got if x % 3 == 0} and len(set(got)) == 666
    with pytest.raises(ValueError, match="already allocated"):
        a.take([2])
    a.release([3])
    assert a.alloc(1) == [3]


@pytest.mark.parametrize("session", [1, 0], ids=["ssd", "dram"])
def test_a_snapshot_holds_only_published_space_never_a_write_in_flight(tmp_path: Path, session: int) -> None:
    """Compaction while a session's next turn is allocated but not yet published: the snapshot records the
    space its published pages hold, not the reservation. The write then fails and another session's pages
    take that space; a restart gives every scope back exactly its pages. (It recorded the reservation: a
    restart then dropped the first session whole, its space claimed later by the other's record, or held
    space no page was in.)"""
    j = Journal(tmp_path / "j.log", "never")
    c, keys = filled(j)
    hints = DRAM if session == 0 else SSD
    inflight = c.allocate([*keys[session], "turn-0", "turn-1"], hints)
    assert inflight is not None
    assert c.compact_journal(force=True)
    c.abort(inflight.id)  # the write failed: its space goes back ...
    other = c.allocate(["other-0", "other-1"], hints)  # ... and another session's pages take it
    assert other is not None
    c.publish(other.id, [1, 2])
    j.close()
    again = catalog()
    r = recover(again, tmp_path / "j.log", None)
    assert r.superseded_pages == 0 and again.exists(keys[session]) == len(keys[session])
    assert state(again) == state(c)
