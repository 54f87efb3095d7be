"""Clients look keys up in the agent's shared index, with the semantics of the socket path."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import numpy as np
import pytest

from flatcake.node_agent.service.client import RemoteCatalog, connect
from tests.support.agents import AgentThread
from tests.support.engines import pages

pytestmark = pytest.mark.integration

Start = Callable[..., AgentThread]


def remote(e: object) -> RemoteCatalog:
    catalog = e.catalog  # type: ignore[attr-defined]
    assert isinstance(catalog, RemoteCatalog)
    return catalog


def test_exists_and_lookup_read_the_shared_index_not_the_socket(agent_thread: Start) -> None:
    a = agent_thread()
    with connect(a.socket, layers=4, page_bytes=4096) as e:
        keys = [f"s{i}" for i in range(6)]
        e.put(keys, pages(4, 6, 4096))
        assert remote(e).index is not None
        assert e.exists(keys) == 6 and e.exists(["zz", *keys]) == 0 and e.exists([*keys[:3], "zz"]) == 3
        assert a.agent.requests["exists"] == 0 and e.stats.get("index_lookups_shared") == 3
        # The same answer as the agent's own lookup op.
        hit, gva, stride = remote(e).lookup([*keys, "zz"])
        wire = remote(e).conn.call("lookup", keys=[*keys, "zz"])
        assert (hit, gva, stride) == (wire["hit"], wire["gva"], wire["stride"]) and hit == 6
        dest = np.zeros((4, 6, 4096), np.uint8)
        e.get(keys, dest).run()  # bytes still read under the agent's lease
    body = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=5).read().decode()
    assert 'flatcake_shared_index_slots{state="live"} 6.0' in body
    assert 'flatcake_index_lookups_total{path="shared"}' in body


def test_reclaimed_pages_leave_the_shared_index(agent_thread: Start) -> None:
    a = agent_thread(files=1, file_bytes=4 * 4 * 4096, dram_bytes=0, ssd={"high_watermark": 1.0, "low_watermark": 1.0})
    with connect(a.socket) as e:
        old = [f"a{i}" for i in range(4)]  # the one file's 4 pages
        e.put(old, pages(4, 4, 4096))
        assert e.exists(old) == 4
        e.put(["b0"], pages(4, 1, 4096))  # reclaims the old scope whole
        assert e.exists(old) == 0 and e.exists(["b0"]) == 1
        assert a.agent.requests["exists"] == 0


def test_without_a_shared_index_lookups_go_to_the_agent(agent_thread: Start) -> None:
    a = agent_thread(agent={"shared_index": False})
    with connect(a.socket) as e:
        e.put(["a"], pages(4, 1, 4096))
        assert remote(e).index is None and e.exists(["a", "b"]) == 1
        assert a.agent.requests["exists"] == 1 and e.stats.get("index_lookups_agent") == 1


def test_a_restarted_agent_rebuilds_the_shared_index(agent_thread: Start) -> None:
    a = agent_thread()
    keys = [f"k{i}" for i in range(5)]
    with connect(a.socket) as e:
        e.put(keys, pages(4, 5, 4096))
        e.put(["d0", "d1"], pages(4, 2, 4096, 3), hints=None)
        index = remote(e).index
        assert index is not None
    a.stop()
    assert index.find(keys) is None  # the stopped agent retired its table
    b = AgentThread(a.config)  # the same node: recovery from the journal
    assert b.agent.catalog.index is not None and b.agent.catalog.index.stats()["entries"] == 7
    assert index.hit_prefix(keys) == 5  # a reader of the old table moves to the new one
    try:
        with connect(b.socket) as e:
            assert e.exists([*keys, "d0", "d1"]) == 7 and b.agent.requests["exists"] == 0
    finally:
        b.stop()


def test_on_a_weakly_ordered_cpu_the_agent_keeps_the_index_private(
    agent_thread: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seqlock is sound only with total store order: on Arm the agent does not share the table, even
    with agent.shared_index on, and clients get the same answers over the socket."""
    from flatcake.node_agent.catalog import shared_index

    assert shared_index.seqlock_safe("x86_64") and shared_index.seqlock_safe("AMD64")
    assert not any(shared_index.seqlock_safe(m) for m in ("aarch64", "arm64", "ppc64le", "riscv64"))
    monkeypatch.setattr(shared_index.platform, "machine", lambda: "aarch64")
    a = agent_thread()
    assert a.agent.index is None
    with connect(a.socket) as e:
        e.put(["a"], pages(4, 1, 4096))
        assert remote(e).index is None and e.exists(["a", "b"]) == 1 and a.agent.requests["exists"] == 1
