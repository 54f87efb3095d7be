"""Which nodes the agent DaemonSet will run on (pure): the scheduler's node predicates a DaemonSet
pod meets, applied by the operator so NodeIDs, readiness and capacity count exactly the nodes that
get an agent, and a node left out says why.

A node gets an agent when it matches ``spec.nodeSelector`` (listed by the API server), is not
cordoned (the operator's own rule: a cordoned node is being drained), every ``NoSchedule`` and
``NoExecute`` taint on it is tolerated by ``spec.tolerations`` or by the tolerations the DaemonSet
controller adds to every daemon pod, and it satisfies ``spec.affinity.nodeAffinity``'s required
terms. Preferred terms and pod (anti-)affinity only rank or co-locate: they never keep a daemon pod
off a node, so they are passed through and not evaluated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The DaemonSet controller tolerates these on every daemon pod (kubernetes pkg/controller/daemon/util:
# AddOrUpdateDaemonPodTolerations); unschedulable is handled by the cordon rule instead.
DAEMON_TOLERATED = {
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ("node.kubernetes.io/network-unavailable", "NoSchedule"),
}
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
REPELLING = ("NoSchedule", "NoExecute")


def affinity_problem(affinity: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, what to fix) for required node-affinity terms the operator could not evaluate (the
    API server would refuse the DaemonSet too, after NodeIDs had been assigned by them); None if fine."""
    terms = _required_terms(affinity)
    for i, term in enumerate(terms):
        where = f"spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]"
        if not isinstance(term, Mapping):
            return (where, "must be an object with matchExpressions and/or matchFields")
        for kind in ("matchExpressions", "matchFields"):
            for j, expr in enumerate(term.get(kind) or []):
                field = f"{where}.{kind}[{j}]"
                if not isinstance(expr, Mapping) or not isinstance(expr.get("key"), str):
                    return (field, "needs a key (a label name, or metadata.name for matchFields)")
                op, values = expr.get("operator"), expr.get("values") or []
                if op not in SELECTOR_OPERATORS:
                    return (f"{field}.operator", f"{op!r} is not one of {', '.join(SELECTOR_OPERATORS)}")
                if op in ("In", "NotIn") and not values:
                    return (f"{field}.values", f"{op} needs at least one value")
                if op in ("Exists", "DoesNotExist") and values:
                    return (f"{field}.values", f"{op} takes no values; remove them")
                if op in ("Gt", "Lt") and (len(values) != 1 or not str(values[0]).lstrip("-").isdigit()):
                    return (f"{field}.values", f"{op} takes exactly one integer value")
                if kind == "matchFields" and (expr["key"] != "metadata.name" or op not in ("In", "NotIn")):
                    return (field, "matchFields supports only key metadata.name with In or NotIn")
    return None


def _required_terms(affinity: Mapping[str, Any]) -> Sequence[Any]:
    # Other shapes than core/v1's are left to the API server, which refuses the DaemonSet (Degraded).
    node_affinity = affinity.get("nodeAffinity")
    required = (
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node_affinity, Mapping)
        else None
    )
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    return terms if isinstance(terms, list) else []


def _matches(expr: Mapping[str, Any], value: str | None) -> bool:
    op, values = expr["operator"], [str(v) for v in expr.get("values") or []]
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if value is None or not value.lstrip("-").isdigit():
        return False  # Gt and Lt compare integers; a missing or non-integer label matches neither
    return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])


def _term_matches(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    # An empty term matches no node (the scheduler's rule), so a term must say something.
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False
    return all(_matches(e, labels.get(e["key"])) for e in exprs) and all(_matches(f, name) for f in fields)


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    key, effect = taint.get("key", ""), taint.get("effect", "")
    if (key, effect) in DAEMON_TOLERATED:
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != effect:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == key:  # an empty key with Exists tolerates every taint
                return True
        elif t.get("key") == key and str(t.get("value", "")) == str(taint.get("value", "")):
            return True
    return False


def why_excluded(node: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]],
                 affinity: Mapping[str, Any]) -> str | None:  # fmt: skip
    """Why a node that matches ``spec.nodeSelector`` gets no agent, naming the field that fixes it;
    None when it gets one."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable", False):
        return "cordoned (kubectl uncordon it to add it back)"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in REPELLING and not _tolerated(taint, tolerations):
            named = f"{taint.get('key', '')}" + (f"={taint['value']}" if taint.get("value") else "")
            return f"taint {named}:{taint['effect']} is not tolerated (add it to spec.tolerations)"
    terms = _required_terms(affinity)
    meta = node.get("metadata") or {}
    if terms and not any(_term_matches(t, meta.get("labels") or {}, meta.get("name", "")) for t in terms):
        return "no term of spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution matches it"
    return None
