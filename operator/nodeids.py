"""NodeIDs, the 12-bit node field of every GVA (pure).

An ID is assigned to a node the first time the cache selects it and kept while the node is
selected or still holds data (its FlatCakeNode reports used bytes): a GVA stored anywhere keeps
naming the same node. IDs are released only when neither holds, and then the lowest free one is
reused first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flatcake.node_agent.constants import MAX_NODE_ID
from flatcake.operator.spec import SpecError


def assign(current: Mapping[str, int], selected: Iterable[str], holding_data: Iterable[str]) -> dict[str, int]:
    """The new NodeID map: existing IDs kept for selected and data-holding nodes, new nodes numbered
    from the lowest free ID, in name order so the result does not depend on listing order."""
    keep = set(selected) | set(holding_data)
    ids = {node: i for node, i in current.items() if node in keep}
    used = set(ids.values())
    if len(used) != len(ids):
        raise ValueError(f"the NodeID map gives one ID to several nodes: {sorted(ids.items())}")
    free = (i for i in range(MAX_NODE_ID + 1) if i not in used)
    for node in sorted(set(selected) - ids.keys()):
        i = next(free, None)
        if i is None:
            raise SpecError(
                "spec.nodeSelector",
                f"no NodeID left for node {node}: {MAX_NODE_ID + 1} IDs (12 bits) are held by selected nodes "
                "or nodes that still hold data; split the nodes across caches or delete stale FlatCakeNodes",
            )
        ids[node] = i
    return ids


def parse(data: Mapping[str, str] | None) -> dict[str, int]:
    """The ConfigMap form (node name -> decimal ID); malformed entries are an error, never dropped:
    dropping one would hand its ID to another node while data under it remains."""
    ids: dict[str, int] = {}
    for node, text in (data or {}).items():
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"NodeID map: {node}={text!r} is not an integer; fix the ConfigMap by hand") from None
        if not 0 <= value <= MAX_NODE_ID:
            raise ValueError(f"NodeID map: {node}={value} is outside 0..{MAX_NODE_ID}")
        ids[node] = value
    return ids
