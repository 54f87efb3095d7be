"""The agent's side of the operator contract: its NodeID from the NodeID map, and its FlatCakeNode.

The operator writes one file per node name into the NodeID ConfigMap (mounted at
``cluster.node_ids_dir``); the agent waits for its own before it starts, because every GVA it hands
out carries that ID. While serving, it writes ``FlatCakeNode <cache>-<node>`` with its capacity,
usage and readiness; the operator aggregates those into the FlatCakeCache status."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import MAX_NODE_ID
from flatcake.node_agent.node.hugepages import reserved_bytes

log = logging.getLogger("flatcake.node_agent")
USER_AGENT = "flatcake-agent"
HEARTBEAT_INTERVALS = 6  # an unchanged status is rewritten every 6 report intervals


def node_name() -> str:
    """The node this agent runs on (the DaemonSet sets NODE_NAME from spec.nodeName)."""
    name = os.environ.get("NODE_NAME", "")
    if not name:
        raise RuntimeError("NODE_NAME is not set: the agent's pod must set it from the downward API spec.nodeName")
    return name


def resolve_node_id(config: EngineConfig, node: str, timeout: float = 600, poll: float = 2.0) -> int:
    """This node's NodeID from the mounted map, waiting for the operator to assign it."""
    path = Path(config.cluster.node_ids_dir) / node
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no NodeID for node {node} in {path.parent} after {timeout:.0f}s: "
                               "is the operator running, and does the cache select this node?")  # fmt: skip
        log.warning("waiting for the operator to assign a NodeID to %s (%s)", node, path)
        time.sleep(poll)
    text = path.read_text().strip()
    if not text.isdigit() or int(text) > MAX_NODE_ID:
        raise RuntimeError(f"{path}: {text!r} is not a NodeID (0..{MAX_NODE_ID}); the NodeID map is damaged")
    return int(text)


def resource_name(config: EngineConfig, node: str) -> str:
    return f"{config.cluster.cache}-{node}"


def node_status(usage: dict[str, dict[str, int]], *, node_id: int, ready: bool, last_error: str,
                device_bytes: int, hugepages_bytes: int, now: str, peer: str = "") -> dict[str, Any]:  # fmt: skip
    """The FlatCakeNode status for the given engine usage (pure)."""
    return {
        "nodeId": node_id,
        "ready": ready,
        "dramCapacityBytes": usage["dram"]["capacity_bytes"],
        "dramUsedBytes": usage["dram"]["used_bytes"],
        "ssdCapacityBytes": usage["ssd"]["capacity_bytes"],
        "ssdUsedBytes": usage["ssd"]["used_bytes"],
        "deviceBytes": device_bytes,
        "hugepagesBytes": hugepages_bytes,
        "lastError": last_error,
        "peer": peer,
        "lastReportTime": now,
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "Serving" if ready else "NotServing",
                "message": last_error,
            }
        ],
    }


def node_object(config: EngineConfig, node: str) -> dict[str, Any]:
    c = config.cluster
    meta: dict[str, Any] = {"name": resource_name(config, node), "namespace": c.namespace,
                            "labels": {"flatcake.io/cache": c.cache, "flatcake.io/node": node}}  # fmt: skip
    if c.cache_uid:  # collected with its cache
        meta["ownerReferences"] = [{"apiVersion": "flatcake.io/v1alpha1", "kind": "FlatCakeCache",
                                    "name": c.cache, "uid": c.cache_uid}]  # fmt: skip
    return {"apiVersion": "flatcake.io/v1alpha1", "kind": "FlatCakeNode", "metadata": meta,
            "spec": {"cache": c.cache, "nodeName": node}}  # fmt: skip


class NodeReporter:
    """Writes the FlatCakeNode every ``cluster.report_interval_s`` from a daemon thread; API errors are
    logged and retried at the next interval (the agent keeps serving without the API server)."""

    def __init__(self, config: EngineConfig, node: str, node_id: int, usage: Callable[[], dict[str, dict[str, int]]],
                 ready: Callable[[], bool], kube: Any, filesystem_bytes: Callable[[], int] | None = None,
                 peer: Callable[[], str] = str, on_peers: Callable[[list[str]], None] | None = None,
                 ) -> None:  # fmt: skip
        self.config, self.node, self.node_id = config, node, node_id
        self.usage, self.ready, self.kube = usage, ready, kube
        self.peer, self.on_peers = peer, on_peers  # where this agent serves other nodes; who the others are
        self.filesystem_bytes = filesystem_bytes or (lambda: shutil.disk_usage(config.ssd.dir).total)
        self.last_error = ""
        self._sent: dict[str, Any] | None = None  # the last status written, less its timestamp
        self._sent_at = -float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flatcake-node-report")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def report_once(self, ready: bool | None = None, force: bool = False) -> bool:
        """Write the FlatCakeNode when something in it changed, or as a heartbeat every
        HEARTBEAT_INTERVALS intervals (every write is an event the operator reacts to). Returns
        whether it wrote."""
        from flatcake import kube as K

        c = self.config
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        status = node_status(
            self.usage(), node_id=self.node_id, ready=self.ready() if ready is None else ready,
            last_error=self.last_error, device_bytes=self.filesystem_bytes(),
            hugepages_bytes=reserved_bytes(), now=now, peer=self.peer(),
        )  # fmt: skip
        content = {k: v for k, v in status.items() if k != "lastReportTime"}
        due = time.monotonic() - self._sent_at >= HEARTBEAT_INTERVALS * c.cluster.report_interval_s
        if not force and content == self._sent and not due:
            return False
        name = resource_name(c, self.node)
        if self.kube.get(K.FLATCAKE_NODES, c.cluster.namespace, name) is None:
            self.kube.create(K.FLATCAKE_NODES, node_object(c, self.node))
        self.kube.patch(K.FLATCAKE_NODES, c.cluster.namespace, name, {"status": status}, subresource="status")
        self._sent, self._sent_at = content, time.monotonic()
        return True

    def discover_once(self) -> list[str]:
        """The other agents of this cache that serve other nodes and are ready, from their FlatCakeNodes
        (``status.peer``), handed to ``on_peers``: how clients learn their peers, off the read path."""
        from flatcake import kube as K

        c = self.config.cluster
        found = sorted(
            str(n["status"]["peer"])
            for n in self.kube.list(K.FLATCAKE_NODES, c.namespace, {"flatcake.io/cache": c.cache})
            if n.get("spec", {}).get("nodeName") != self.node
            and (n.get("status") or {}).get("ready") and (n.get("status") or {}).get("peer")
        )  # fmt: skip
        if self.on_peers is not None:
            self.on_peers(found)
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.report_once()
                if self.on_peers is not None:
                    self.discover_once()
            except Exception as exc:
                log.warning(
                    "FlatCakeNode report failed (retrying in %.0fs): %s", self.config.cluster.report_interval_s, exc
                )
            self._stop.wait(self.config.cluster.report_interval_s)
