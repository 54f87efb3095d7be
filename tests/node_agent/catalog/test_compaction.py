"""Online journal compaction: the journal stays proportional to the live records while clients go on,
and a restart from a journal compacted under a concurrent writer rebuilds exactly the live state."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from flatcake.errors import PoolFullError
from flatcake.node_agent.catalog.journal import Journal, encode, replay
from flatcake.node_agent.catalog.recovery import recover
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import connect
from tests.node_agent.catalog.test_recovery_extents import allocation, catalog
from tests.support.agents import AgentThread
from tests.support.engines import pages, small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def test_compaction_keeps_the_records_appended_after_its_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = Journal(path, "never", compact_min_bytes=1)
    for i in range(5):
        j.append({"i": i})
    mark = j.mark()
    for i in range(5, 8):  # appended while the snapshot is being written
        j.append({"i": i})
    j.compact([{"snap": 5}], mark)
    j.append({"i": 8})  # lands in the new file
    j.close()
    assert list(replay(path)) == [{"snap": 5}] + [{"i": i} for i in range(5, 9)]
    assert j.records == 5 and j.compactions == 1 and not path.with_suffix(".tmp").exists()


def test_a_failed_compaction_keeps_the_journal_and_waits_for_as_much_growth(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = Journal(path, "never", compact_min_bytes=1, compact_ratio=2.0)
    j.append({"i": 0})
    path.with_suffix(".tmp").mkdir()  # the new file cannot be created
    with pytest.raises(OSError):
        j.compact([{"snap": 0}], j.mark())
    assert not j.due()  # not retried at once
    j.append({"i": 1})
    j.close()
    assert list(replay(path)) == [{"i": 0}, {"i": 1}] and j.compactions == 0


def test_a_journal_compacted_under_a_concurrent_writer_rebuilds_the_live_state(tmp_path: Path) -> None:
    path = tmp_path / "journal.log"
    j = Journal(path, "never", compact_min_bytes=1, compact_ratio=1.5)
    c = catalog(j, files=3, pages_per_file=8)  # 24 pages: reclaim frees scopes all the time
    stop = threading.Event()
    errors: list[BaseException] = []

    def compactor() -> None:
        while not stop.is_set():
            try:
                c.compact_journal()
            except BaseException as exc:  # pragma: no cover - reported by the assertion below
                errors.append(exc)
                return

    thread = threading.Thread(target=compactor)
    thread.start()
    rng = np.random.default_rng(7)
    published: list[str] = []
    n = 0
    try:
        # Write until the compactor has finished several compactions in the middle of the stream.
        while j.compactions < 20 and n < 200_000 and not errors:
            live = published[-8:]
            parent = live[int(rng.integers(len(live)))] if live and rng.random() < 0.5 else None
            keys = [f"k{n}-{i}" for i in range(int(rng.integers(1, 4)))]
            n += 1
            try:
                alloc = c.allocate(keys, Hints(context_tokens=1 << 30, parent_key=parent))
            except PoolFullError:
                continue
            assert alloc is not None
            c.publish(alloc.id, [n] * len(keys))
            published += keys
    finally:
        stop.set()
        thread.join()
    assert not errors and j.compactions >= 20
    j.close()
    again = catalog(None, files=3, pages_per_file=8)
    r = recover(again, path, None)
    assert allocation(again) == allocation(c) and r.skipped_records == 0
    live = [k for k in published if c.table.lookup(k) is not None]
    assert live and all(again.table.lookup(k) == c.table.lookup(k) for k in live)


def test_an_agent_keeps_its_journal_proportional_to_live_records_in_a_soak(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node", files=4, file_bytes=16 * 4 * 4096,
                          agent={"journal_compact_bytes": 16 * 1024, "journal_compact_ratio": 2.0})  # fmt: skip
    a = AgentThread(config)
    journal = a.agent.journal
    assert journal is not None
    kv = pages(4, 2, 4096, seed=1)
    appended = 0
    i = 0
    try:
        with connect(a.socket) as e:
            # 64 pages of SSD: every put past the first few reclaims an older session.
            while journal.compactions < 6 and i < 20_000:
                before = journal.size
                e.put([f"s{i}a", f"s{i}b"], kv, Hints(context_tokens=1 << 30))
                appended += max(0, journal.size - before)
                i += 1
            wait_until(lambda: not journal.due(), what="the compactor to catch up")
            size = journal.size
            stats = a.agent.snapshot()
            live_bytes = len(b"".join(map(encode, a.agent.catalog.snapshot_records())))
            last = [f"s{i - 1}a", f"s{i - 1}b"]
            assert e.exists(last) == 2
    finally:
        a.stop()
    assert journal.compactions >= 6 and stats["journal_compactions"] >= 6
    # Compaction starts at ratio x the last compacted size (the live records then, which a full pool
    # keeps near today's) or journal_compact_bytes, whichever is larger.
    assert size <= config.agent.journal_compact_ratio * max(config.agent.journal_compact_bytes, 1.5 * live_bytes)
    assert stats["journal_bytes"] == size
    assert size * 4 < appended  # the soak appended far more than the journal now holds
    b = AgentThread(config)  # the online-compacted journal restarts the agent with the newest session
    try:
        with connect(b.socket) as e:
            dest = np.zeros((4, 2, 4096), np.uint8)
            assert e.exists(last) == 2
            e.get(last, dest).run()
            assert np.array_equal(dest, kv)
    finally:
        b.stop()
