"""The agent's side of the operator contract: NodeID from the mounted map, reclaim of a node."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flatcake.node_agent.config import ClusterConfig
from flatcake.node_agent.node import identity as R
from flatcake.node_agent.node import prepare as P
from flatcake.node_agent.service.server import Agent
from tests.support.engines import small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def test_node_id_waits_for_the_operator_then_reads_it(tmp_path: Path) -> None:
    ids = tmp_path / "node-ids"
    ids.mkdir()
    c = dataclasses.replace(small_config(tmp_path), cluster=ClusterConfig(node_ids_dir=str(ids)))
    threading.Timer(0.3, lambda: (ids / "node-a").write_text("17")).start()
    started = time.monotonic()
    assert R.resolve_node_id(c, "node-a", timeout=10, poll=0.05) == 17
    assert time.monotonic() - started >= 0.25
    with pytest.raises(RuntimeError, match="no NodeID for node node-b.*operator"):
        R.resolve_node_id(c, "node-b", timeout=0.2, poll=0.05)
    (ids / "node-c").write_text("5000")
    with pytest.raises(RuntimeError, match="not a NodeID"):
        R.resolve_node_id(c, "node-c", timeout=1, poll=0.05)


def test_node_name_must_come_from_the_downward_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(RuntimeError, match="spec.nodeName"):
        R.node_name()


def test_reclaim_erases_pool_and_dram_file_and_is_idempotent(tmp_path: Path) -> None:
    c = small_config(tmp_path)
    agent = Agent(c)  # creates the pool, the journal and the shared DRAM file
    agent.close()
    pool, dram = Path(c.ssd.dir), Path(c.dram.shm_dir) / c.dram.name
    assert pool.exists() and dram.exists()
    removed = P.reclaim(c, log=lambda _: None)
    assert set(removed) == {str(pool), str(dram)} and not pool.exists() and not dram.exists()
    assert P.reclaim(c, log=lambda _: None) == []


def test_reporter_keeps_going_while_the_api_server_is_away(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from flatcake.kube import Kube

    c = dataclasses.replace(
        small_config(tmp_path), cluster=ClusterConfig(cache="main", namespace="kv", report_interval_s=0.05)
    )
    usage = {"dram": {"capacity_bytes": 1, "used_bytes": 0}, "ssd": {"capacity_bytes": 1, "used_bytes": 0}}
    reporter = R.NodeReporter(
        c, "node-a", 3, lambda: usage, lambda: True, Kube.for_url("http://127.0.0.1:9", "t"), filesystem_bytes=lambda: 1
    )
    with caplog.at_level("WARNING", logger="flatcake.node_agent"):
        reporter.start()
        failures = lambda: sum("FlatCakeNode report failed" in r.message for r in caplog.records)  # noqa: E731
        wait_until(lambda: failures() >= 2, what="two failed reports, logged")
        assert reporter._thread.is_alive()  # failed reports are logged and retried, never fatal
        reporter.stop()
    assert not reporter._thread.is_alive()
    assert sum("FlatCakeNode report failed" in r.message for r in caplog.records) >= 2


class _RecordingKube:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.patches = 0

    def get(self, res: Any, namespace: str, name: str) -> Any:
        return self.objects.get(name)

    def create(self, res: Any, body: dict[str, Any]) -> Any:
        self.objects[body["metadata"]["name"]] = body
        return body

    def patch(self, res: Any, namespace: str, name: str, body: dict[str, Any], subresource: str | None = None) -> Any:
        self.patches += 1
        self.objects[name] |= body
        return self.objects[name]

    def list(self, res: Any, namespace: str, selector: dict[str, str] | None = None) -> list[Any]:
        labels = selector or {}
        return [o for o in self.objects.values()
                if all(o["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())]  # fmt: skip


def test_reporter_writes_on_change_and_as_a_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = dataclasses.replace(
        small_config(tmp_path), cluster=ClusterConfig(cache="main", namespace="kv", report_interval_s=10)
    )
    usage = {"dram": {"capacity_bytes": 8, "used_bytes": 0}, "ssd": {"capacity_bytes": 8, "used_bytes": 0}}
    kube = _RecordingKube()
    reporter = R.NodeReporter(c, "node-a", 3, lambda: usage, lambda: True, kube, filesystem_bytes=lambda: 1)
    assert reporter.report_once() and kube.patches == 1
    assert not reporter.report_once() and kube.patches == 1  # nothing changed: no write, no event
    usage["ssd"]["used_bytes"] = 4096
    assert reporter.report_once() and kube.patches == 2
    assert kube.objects["main-node-a"]["status"]["ssdUsedBytes"] == 4096
    assert reporter.report_once(ready=False, force=True) and kube.patches == 3
    assert reporter.report_once() and kube.patches == 4  # ready again: a change
    assert not reporter.report_once() and kube.patches == 4
    clock = time.monotonic() + R.HEARTBEAT_INTERVALS * 10
    monkeypatch.setattr(R.time, "monotonic", lambda: clock)
    assert reporter.report_once() and kube.patches == 5  # unchanged, but the heartbeat is due


def test_agents_serving_other_nodes_report_where_and_learn_each_other(tmp_path: Path) -> None:
    """spec.crossNode: each agent writes status.peer; the others' ready peers of the same cache are its
    peers (clients ask their agent: op ``peers``)."""
    secret = tmp_path / "peer-secret"
    secret.write_bytes(b"k" * 32)
    c = dataclasses.replace(small_config(tmp_path), cluster=ClusterConfig(cache="main", namespace="kv",
                                                                          listen="10.0.0.1:7471",
                                                                          secret_file=str(secret)))  # fmt: skip
    usage = {"dram": {"capacity_bytes": 8, "used_bytes": 0}, "ssd": {"capacity_bytes": 8, "used_bytes": 0}}
    kube = _RecordingKube()
    found: list[list[str]] = []
    for node, ip, ready, cache in (("node-b", "10.0.0.2", True, "main"), ("node-c", "10.0.0.3", False, "main"),
                                   ("node-d", "10.0.0.4", True, "other"), ("node-e", "", True, "main")):  # fmt: skip
        other = dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, cache=cache))
        kube.create(None, R.node_object(other, node))
        kube.objects[f"{cache}-{node}"]["status"] = {"ready": ready, "peer": f"{ip}:7471" if ip else ""}
    reporter = R.NodeReporter(c, "node-a", 1, lambda: usage, lambda: True, kube, filesystem_bytes=lambda: 1,
                              peer=lambda: "10.0.0.1:7471", on_peers=found.append)  # fmt: skip
    assert reporter.report_once()
    assert kube.objects["main-node-a"]["status"]["peer"] == "10.0.0.1:7471"
    # Itself, a node not ready, another cache's node and one that serves no peers are left out.
    assert reporter.discover_once() == ["10.0.0.2:7471"] and found == [["10.0.0.2:7471"]]
    agent = Agent(dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, listen="", peers=("10.0.0.9:7471",))))
    try:
        agent.set_discovered_peers(found[-1])
        assert agent.op_peers(None, {}) == ["10.0.0.2:7471", "10.0.0.9:7471"]  # type: ignore[arg-type]
    finally:
        agent.close()
