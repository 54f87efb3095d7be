from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from flatcake.node_agent.catalog.journal import Journal, replay
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.service.client import connect
from tests.support.agents import AgentThread
from tests.support.engines import pages
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_records_replay_in_order_under_every_policy(tmp_path: Path, policy: str) -> None:
    j = Journal(tmp_path / "j.log", policy, fsync_ms=5)
    for i in range(20):
        j.append({"t": "pub", "i": i, "keys": [f"k{i}", i, b"raw"]})
    j.close()
    got = list(replay(tmp_path / "j.log"))
    assert [r["i"] for r in got] == list(range(20)) and got[3]["keys"] == ["k3", 3, b"raw"]


def test_a_torn_or_corrupt_tail_is_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    j = Journal(path, "never")
    for i in range(3):
        j.append({"i": i})
    j.close()
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(struct.pack("<II", 100, 0) + b"short")
    assert [r["i"] for r in replay(path)] == [0, 1, 2]
    assert path.stat().st_size == good
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a bit of the last record: its checksum fails
    path.write_bytes(bytes(data))
    assert [r["i"] for r in replay(path)] == [0, 1]


def test_rewrite_replaces_the_journal_atomically(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.log", "always")
    for i in range(5):
        j.append({"i": i})
    j.rewrite([{"i": 99}])
    j.append({"i": 100})
    j.close()
    assert [r["i"] for r in replay(tmp_path / "j.log")] == [99, 100]
    with pytest.raises(ValueError, match="journal_fsync"):
        Journal(tmp_path / "x.log", "sometimes")


def test_restart_drops_pages_whose_bytes_changed(agent_thread: Callable[..., AgentThread]) -> None:
    a = agent_thread()
    kv = pages(4, 3, 4096)
    with connect(a.socket) as e:
        e.put(["a", "b", "c"], kv)
        e.put(["d"], pages(4, 1, 4096), hints=None)
        loc_b = a.agent.catalog.table.lookup("b")
    assert loc_b is not None
    a.stop()
    # Overwrite layer 2 of page b in its pool file, as a write that raced a crash could.
    offset = G.decode(loc_b.gva).offset
    file, at = divmod(offset, a.config.ssd.file_bytes)
    with open(Path(a.config.ssd.dir) / f"pool-{file:05d}.dat", "r+b") as f:
        f.seek(at + 2 * loc_b.layer_stride)
        f.write(b"\x00" * 4096)
    b = AgentThread(a.config)
    try:
        # Recovery reads no page; the background scan finds the damage after the socket opens.
        wait_until(lambda: b.agent.recovered.scan_done, what="the recovery scan to finish")
        assert b.agent.recovered.dropped_pages == 1 and b.agent.recovered.pages == 3
        with connect(b.socket) as e:
            assert e.exists(["a", "b", "c"]) == 1 and e.exists(["c"]) == 1 and e.exists(["d"]) == 1
            dest = np.zeros((4, 1, 4096), np.uint8)
            e.get(["c"], dest).run()
            assert np.array_equal(dest[:, 0], kv[:, 2])
    finally:
        b.stop()
