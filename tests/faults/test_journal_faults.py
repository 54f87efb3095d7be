"""Journal faults: a full disk mid-append, an I/O error, a damaged record in the middle, a lost
``free`` record. Each ends with the audit: acknowledged keys lost and wrong bytes served, both 0."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from flatcake.errors import StorageIOError
from flatcake.node_agent.catalog import journal as J
from flatcake.node_agent.catalog.journal import MAGIC, ReplayReport, replay
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import connect
from tests.support.agents import AgentThread
from tests.support.engines import small_config
from tests.support.faults import audit, fill, tmpfs
from tests.support.kv_client import fill as kv_fill
from tests.support.kv_client import page_bytes_for

pytestmark = pytest.mark.faults

SSD = Hints(context_tokens=1 << 20)  # long context: placed on SSD
DRAM = Hints(prefix_refcount=2)  # a shared prompt: placed in DRAM


def expect(config: object) -> Callable[[str], object]:
    return lambda key: page_bytes_for(key, 4, 4096)


def put(e: object, keys: list[str], hints: Hints | None = None) -> None:
    e.put(keys, kv_fill(keys, 4, 4096), hints)  # type: ignore[attr-defined]


def journal_is_whole(path: Path) -> ReplayReport:
    report = ReplayReport()
    list(replay(path, report))
    return report


def test_full_disk_fails_the_put_and_leaves_journal_keys_and_space_intact(tmp_path: Path) -> None:
    node = tmp_path / "node"
    # Pages go to DRAM (outside the tmpfs, large enough to never reclaim); the journal fills the tmpfs.
    config = small_config(node, files=4, file_bytes=40 * 4096, dram_bytes=1024 * 4 * 4096)
    with tmpfs(node / "pool", "2m") as pool:
        a = AgentThread(config)
        acknowledged: list[str] = []
        failed: list[list[str]] = []
        try:
            with connect(a.socket) as e:
                put(e, ["warm-0"], DRAM)
                acknowledged.append("warm-0")
                filler = fill(pool)
                # Long keys make records larger than what is left of the journal's last page, so the
                # first failing append is a real short write into that page, then ENOSPC.
                for i in range(200):
                    keys = [f"k{i}-{j}-" + "x" * 120 for j in range(4)]
                    try:
                        put(e, keys, DRAM)
                        acknowledged += keys
                    except StorageIOError as exc:
                        assert "Errno 28" in str(exc) and "nothing was published" in str(
                            exc
                        )  # the wire keeps the message
                        failed.append(keys)
                    if len(failed) >= 3:
                        break
                assert failed, "the journal never filled up"
                stats = e.catalog.conn.call("stats")  # type: ignore[attr-defined]
                assert stats["journal_errors"]["append"] >= 1 and stats["open_allocations"] == 0
                # Nothing poisoned: the failed keys are absent, and once there is room they store.
                assert all(e.exists(keys) == 0 for keys in failed)
                assert journal_is_whole(pool / "journal.log").skipped_records == 0
                filler.unlink()
                for keys in failed:
                    put(e, keys, DRAM)
                    acknowledged += keys
                stats = e.catalog.conn.call("stats")  # type: ignore[attr-defined]
            usage = stats["usage"]
            # No leaked space: every held DRAM slot belongs to a stored page, every SSD file to a scope.
            assert usage["dram"]["used_bytes"] == len(acknowledged) * 4 * 4096
            assert usage["ssd"]["used_bytes"] == usage["ssd"]["scopes"] == 0
            assert usage["dram"]["reclaimed_scopes"] == 0
        finally:
            a.stop()
        report = journal_is_whole(pool / "journal.log")
        assert report.skipped_records == 0 and report.torn_bytes == 0
        b = AgentThread(config)
        try:
            assert audit(config, acknowledged, expect(config), what="full disk") == (0, 0)
        finally:
            b.stop()


def test_an_io_error_or_short_write_on_append_fails_only_that_put(agent_thread: Callable[..., AgentThread]) -> None:
    a = agent_thread(files=64, file_bytes=4 * 4 * 4096, dram_bytes=128 * 4 * 4096)
    journal = a.agent.journal
    assert journal is not None
    real = journal._write
    mode = {"fault": ""}

    def faulty(fd: int, data: bytes) -> int:
        if mode["fault"] == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        if mode["fault"] == "short":
            return real(fd, data[: len(data) // 2])  # half a record reaches the file
        return real(fd, data)

    journal._write = faulty
    acknowledged: list[str] = []
    with connect(a.socket) as e:
        for i, fault in enumerate(["", "eio", "", "short", "", "short", "eio", ""] * 2):
            mode["fault"] = fault
            keys = [f"p{i}-{j}" for j in range(3)]
            hints = SSD if i % 2 else DRAM
            if fault:
                with pytest.raises(StorageIOError, match="append failed"):
                    put(e, keys, hints)
                assert e.exists(keys) == 0
                mode["fault"] = ""
                put(e, keys, hints)  # the same keys, right after: not poisoned
            else:
                put(e, keys, hints)
            acknowledged += keys
    assert journal.append_errors == 8
    usage = a.agent.catalog.table.usage()  # no space held by the failed puts
    assert usage["dram"]["used_bytes"] == 24 * 4 * 4096  # 8 DRAM puts of 3 pages
    assert usage["ssd"]["used_bytes"] == 24 * 4 * 4096 and a.agent.catalog.handles() == (0, 0)  # 8 SSD puts of 3
    report = journal_is_whole(journal.path)  # the halves were cut back off
    assert report.skipped_records == 0 and report.torn_bytes == 0
    config = a.config
    a.stop()
    b = AgentThread(config)
    try:
        assert b.agent.recovered.pages == len(acknowledged)
        assert audit(config, acknowledged, expect(config), what="EIO and short appends") == (0, 0)
    finally:
        b.stop()


@pytest.mark.parametrize("damage", ["payload", "length", "magic"])
def test_one_damaged_record_mid_journal_costs_that_record_only(tmp_path: Path, damage: str) -> None:
    config = small_config(tmp_path / "node", files=64, file_bytes=8 * 4 * 4096,
                          agent={"verify_on_recovery": False})  # fmt: skip
    a = AgentThread(config)
    acknowledged: list[list[str]] = []
    with connect(a.socket) as e:
        for i in range(30):
            keys = [f"s{i}-{j}" for j in range(2)]
            put(e, keys, SSD if i % 3 else None)
            acknowledged.append(keys)
    a.stop()
    path = Path(config.ssd.dir) / "journal.log"
    data = bytearray(path.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(MAGIC, i)]
    victim = starts[15]  # a record in the middle (the agent's compaction wrote none: it started empty)
    at = {"payload": victim + J._HEADER.size + 5, "length": victim + 5, "magic": victim}[damage]
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    b = AgentThread(config)
    try:
        r = b.agent.recovered
        assert r.skipped_records == 1 and r.pages == 58
        lost_keys = acknowledged[15]
        survivors = [k for keys in acknowledged for k in keys if keys is not lost_keys]
        assert audit(config, survivors, expect(config), what=f"damaged {damage}") == (0, 0)
        with connect(b.socket) as e:
            assert e.exists(lost_keys) == 0
        metrics = b.agent.snapshot()["recovered"]
        assert metrics["skipped_records"] == 1
    finally:
        b.stop()


def test_a_lost_free_record_never_revives_a_scope_over_reused_space(tmp_path: Path) -> None:
    # Two pool files of 4 pages: the second session's scope reuses the space reclaim took from the first.
    # If the record of that reclaim is lost, recovery must not serve the first session from that space.
    config = small_config(tmp_path / "node", files=2, file_bytes=4 * 4 * 4096,
                          ssd={"high_watermark": 0.25, "low_watermark": 0.25},
                          agent={"verify_on_recovery": False})  # fmt: skip
    a = AgentThread(config)
    with connect(a.socket) as e:
        put(e, ["old-0", "old-1"], SSD)
        put(e, ["new-0", "new-1"], SSD)  # above the high watermark: the old scope is reclaimed
        assert e.exists(["old-0"]) == 0 and e.exists(["new-0", "new-1"]) == 2
    a.stop()
    path = Path(config.ssd.dir) / "journal.log"
    records = list(replay(path))
    assert [r["t"] for r in records] == ["pub", "free", "pub"]
    data = bytearray(path.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(MAGIC, i)]
    data[starts[1] + J._HEADER.size] ^= 0xFF  # damage the free record
    path.write_bytes(bytes(data))
    b = AgentThread(config)
    try:
        r = b.agent.recovered
        assert r.skipped_records == 1 and r.superseded_pages == 2 and r.pages == 2
        with connect(b.socket) as e:
            assert e.exists(["old-0"]) == 0
        assert audit(config, ["new-0", "new-1"], expect(config), what="lost free record") == (0, 0)
    finally:
        b.stop()


def test_compaction_syncs_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(J, "fsync_dir", lambda d: synced.append(Path(d)))
    j = J.Journal(tmp_path / "journal.log", "always")
    j.append({"t": "x"})
    j.rewrite([{"t": "y"}])
    j.close()
    assert synced == [tmp_path]
    assert [r["t"] for r in replay(tmp_path / "journal.log")] == ["y"]
    assert not (tmp_path / "journal.tmp").exists()
    assert os.stat(tmp_path / "journal.log").st_mode & 0o777 == 0o660


def test_a_full_disk_during_compaction_keeps_the_old_journal(tmp_path: Path) -> None:
    config = dataclasses.replace(small_config(tmp_path / "node"))
    with tmpfs(Path(config.ssd.dir), "3m") as pool:
        a = AgentThread(config)
        with connect(a.socket) as e:
            put(e, ["c0", "c1"])
        a.stop()
        filler = fill(pool)
        b = AgentThread(config)  # compaction cannot write its copy: the agent starts on the old journal
        try:
            assert audit(config, ["c0", "c1"], expect(config), what="full disk at compaction") == (0, 0)
        finally:
            b.stop()
        filler.unlink()
        assert not (pool / "journal.tmp").exists()


def test_an_unexpected_compaction_error_is_counted_and_the_compactor_keeps_serving(
    agent_thread: Callable[..., AgentThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online compaction that fails with something other than an OSError (a bug) is counted and logged,
    the journal stays as it was, and the next due compaction runs: the compactor thread did not die."""
    from tests.support.waiting import wait_until

    a = agent_thread(files=64, file_bytes=4 * 4 * 4096, dram_bytes=128 * 4 * 4096,
                     agent={"journal_compact_bytes": 4096, "journal_compact_ratio": 1.1})  # fmt: skip
    journal, catalog = a.agent.journal, a.agent.catalog
    assert journal is not None
    real, calls = catalog.compact_journal, {"n": 0}

    def broken_once(force: bool = False) -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: a bug in compaction")
        return real(force)

    monkeypatch.setattr(catalog, "compact_journal", broken_once)
    before = journal.compactions
    acknowledged: list[str] = []
    with connect(a.socket) as e:
        for i in range(400):  # puts until a second due compaction has run (bounded: none would fail)
            keys = [f"c{i}-{j}" for j in range(2)]
            put(e, keys, SSD)
            acknowledged += keys
            if journal.compact_errors and journal.compactions > before:
                break
    assert journal.compact_errors == 1, "the injected error was not counted"
    wait_until(lambda: journal.compactions > before, what="a compaction after the failed one")
    assert a.agent.journal_errors()["compact"] == 1  # what the agent reports (stats, flatcake_journal_errors)
    config = a.config
    a.stop()
    b = AgentThread(config)
    try:
        assert audit(config, acknowledged, expect(config), what="a compaction bug") == (0, 0)
    finally:
        b.stop()
