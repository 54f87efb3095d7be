"""The FlatCakeCache status, aggregated from its FlatCakeNodes (pure).

Conditions follow the Kubernetes convention: ``Ready``, ``Progressing`` and ``Degraded`` are always
present, and ``lastTransitionTime`` changes only when a condition's status does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatcake.operator.spec import format_bytes

SHOWN = 10  # excluded nodes listed in the status: enough to see the pattern, bounded for big clusters


@dataclass(frozen=True)
class NodeReport:
    """What one agent wrote in its FlatCakeNode status."""

    node: str
    node_id: int | None
    ready: bool
    dram_capacity: int
    dram_used: int
    ssd_capacity: int
    ssd_used: int
    last_error: str
    device_bytes: int | None = None  # the filesystem under the pool, when reported

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> NodeReport:
        s = obj.get("status") or {}
        return cls(
            node=obj.get("spec", {}).get("nodeName", obj.get("metadata", {}).get("name", "")),
            node_id=s.get("nodeId"),
            ready=bool(s.get("ready", False)),
            dram_capacity=int(s.get("dramCapacityBytes", 0)),
            dram_used=int(s.get("dramUsedBytes", 0)),
            ssd_capacity=int(s.get("ssdCapacityBytes", 0)),
            ssd_used=int(s.get("ssdUsedBytes", 0)),
            last_error=str(s.get("lastError", "")),
            device_bytes=s.get("deviceBytes"),
        )

    @property
    def holds_data(self) -> bool:
        return self.ssd_used > 0 or self.dram_used > 0


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int, now: str,
               previous: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:  # fmt: skip
    status = "True" if ok else "False"
    before = previous.get(ctype, {})
    since = before.get("lastTransitionTime") if before.get("status") == status else None
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since or now}  # fmt: skip


def aggregate(*, selected: Sequence[str], reports: Sequence[NodeReport], problem: str, generation: int,
              previous: Mapping[str, Any], now: str,
              excluded: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The status for a cache selecting ``selected`` nodes. ``problem`` is the spec problem that stopped
    the last reconcile (empty when it applied); it makes the cache Degraded until fixed. ``excluded``:
    nodes matching spec.nodeSelector that get no agent, and why (shown, at most ``SHOWN`` of them)."""
    left_out = [f"{n}: {why}" for n, why in sorted((excluded or {}).items())]
    by_node = {r.node: r for r in reports if r.node in set(selected)}
    ready = sorted(n for n, r in by_node.items() if r.ready)
    failing = sorted(f"{n}: {r.last_error}" for n, r in by_node.items() if r.last_error)
    waiting = sorted(set(selected) - set(ready))
    prev = {c["type"]: c for c in previous.get("conditions", []) if isinstance(c, dict) and "type" in c}
    all_ready = bool(selected) and not waiting and not problem
    if problem:
        degraded = (True, "InvalidSpec", problem)
    elif failing:
        degraded = (True, "NodeErrors", "; ".join(failing))
    else:
        degraded = (False, "AsExpected", "")
    if all_ready:
        progressing = (False, "Deployed", f"{len(ready)} nodes ready")
    elif problem:
        progressing = (False, "Blocked", "fix the spec to continue")
    elif not selected:
        why = "; ".join(left_out[:SHOWN]) if left_out else "no node matches spec.nodeSelector"
        progressing = (False, "NoNodes", why)
    else:
        progressing = (True, "NodesPreparing", "waiting for " + ", ".join(waiting[:10]))
    conditions = [
        _condition(
            "Ready",
            all_ready,
            "AllNodesReady" if all_ready else "NotReady",
            f"{len(ready)}/{len(selected)} nodes ready",
            generation,
            now,
            prev,
        ),
        _condition("Progressing", progressing[0], progressing[1], progressing[2], generation, now, prev),
        _condition("Degraded", degraded[0], degraded[1], degraded[2], generation, now, prev),
    ]
    phase = "Degraded" if degraded[0] else "Ready" if all_ready else "Progressing"
    dram = sum(r.dram_capacity for r in by_node.values())
    ssd = sum(r.ssd_capacity for r in by_node.values())
    return {
        "phase": phase,
        "observedGeneration": generation,
        "readyNodes": f"{len(ready)}/{len(selected)}",
        "dram": format_bytes(dram),
        "ssd": format_bytes(ssd),
        "problem": problem,
        "excludedNodes": left_out[:SHOWN],
        "conditions": conditions,
        "nodes": [
            {
                "name": n,
                "nodeId": r.node_id if r.node_id is not None else -1,
                "ready": r.ready,
                "dramUsedBytes": r.dram_used,
                "ssdUsedBytes": r.ssd_used,
                "lastError": r.last_error,
            }
            for n, r in sorted(by_node.items())
        ],
    }
