"""What the admission webhook adds to an inference pod that names a FlatCakeCache (pure).

A pod labelled ``flatcake.io/cache: NAME`` (the cache in the pod's namespace, or in the one its
``flatcake.io/cache-namespace`` annotation names) gets what its SGLang backend needs to reach the
node agent, which users otherwise wired by hand:

- the host paths the backend uses, at the same paths: the agent's run directory (its socket, the
  shared DRAM pool file and index, the cache's own hugetlbfs when the pool is in hugepages), the pool
  files' directory (the backend reads and writes them itself) and, read-only, the epoch file (held
  while it writes or restores); never the journal, nor the node's /dev/hugepages;
- ``FLATCAKE_CLIENT_ID`` (the pod's namespace/name: the agent caps connections per pod by it, since it
  cannot see a pod's pid), ``FLATCAKE_SOCKET``, ``FLATCAKE_HICACHE_EXTRA_CONFIG`` (the JSON SGLang's
  ``--hicache-storage-backend-extra-config`` takes; Kubernetes expands ``$(FLATCAKE_HICACHE_EXTRA_CONFIG)``
  in a container's args) and ``FLATCAKE_VLLM_KV_TRANSFER_CONFIG`` (vLLM's ``--kv-transfer-config`` for
  FlatCake's connector) in every container;
- a required node-affinity term on the operator's ready label, so the pod runs only where the cache's
  agent is ready (ANDed into every existing required term);
- ``supplementalGroups`` with ``spec.access.gid``, where the cache gives its files a group.

Nothing already there is changed: a volume, mount or variable of the same name is left as the pod
has it (the pod's own wiring wins). A pod of another namespace than the cache's is wired only when the
cache lists that namespace (``spec.access.namespaces``); an ``flatcake.io/injected`` annotation the pod
arrives with skips nothing (it is the webhook's own mark, overwritten).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from flatcake.node_agent.constants import CLIENT_ID_ENV

CACHE_LABEL = "flatcake.io/cache"
NAMESPACE_ANNOTATION = "flatcake.io/cache-namespace"
INJECTED_ANNOTATION = "flatcake.io/injected"
PREFIX = "flatcake-"  # the names of what is added


def cache_of(pod: Mapping[str, Any], default_namespace: str) -> tuple[str, str]:
    """(namespace, name) of the cache a pod names."""
    meta = pod.get("metadata") or {}
    name = str((meta.get("labels") or {}).get(CACHE_LABEL, ""))
    namespace = str((meta.get("annotations") or {}).get(NAMESPACE_ANNOTATION) or meta.get("namespace") or "")
    return namespace or default_namespace, name


def refusal(namespace: str, name: str, cache: Mapping[str, Any] | None, pod_namespace: str | None = None) -> str | None:
    """Why a pod (of ``pod_namespace``) naming this cache is refused, naming the fix; None when it may run."""
    if not name:
        return f"label {CACHE_LABEL}: empty; name the FlatCakeCache the pod's SGLang backend uses"
    if cache is None:
        return (f"label {CACHE_LABEL}: no FlatCakeCache {name!r} in namespace {namespace!r}; create it, or set the "
                f"{NAMESPACE_ANNOTATION} annotation to the namespace it is in")  # fmt: skip
    if pod_namespace is not None and pod_namespace != namespace:
        allowed = ((cache.get("spec") or {}).get("access") or {}).get("namespaces") or []
        if pod_namespace not in allowed and "*" not in allowed:
            return (f"FlatCakeCache {namespace}/{name}: spec.access.namespaces does not list namespace "
                    f"{pod_namespace!r}; its pages are other users' prompts. Add the namespace there to let its "
                    "pods use this cache, or use a cache of your own namespace")  # fmt: skip
    status = cache.get("status") or {}
    if status.get("phase") == "Degraded":
        why = status.get("problem") or "an agent reports errors (kubectl describe flatcakecache)"
        return f"FlatCakeCache {namespace}/{name} is Degraded ({why}); fix it before starting pods that use it"
    return None


def for_tenant(wiring: Mapping[str, Any], tenant: str) -> dict[str, Any]:
    """``wiring`` whose SGLang and vLLM configs name ``tenant`` (the pod's namespace): its pages are keyed
    apart from every other namespace's, even for the same prompt."""
    out = dict(wiring)
    out["extra_config"] = {**wiring["extra_config"], "tenant": tenant}
    vllm = dict(wiring["vllm_config"])
    vllm["kv_connector_extra_config"] = {**vllm.get("kv_connector_extra_config", {}), "tenant": tenant}
    out["vllm_config"] = vllm
    return out


def mutate(pod: Mapping[str, Any], wiring: Mapping[str, Any]) -> dict[str, Any]:
    """The pod's ``spec`` with the cache's wiring added (a copy; the pod is not changed).

    ``wiring``: ``run_dir``, ``pool_dir``, ``epoch_file``, ``socket``, ``extra_config``
    (SGLang's backend extra config), ``vllm_config`` (vLLM's kv-transfer config), ``ready_label`` and
    ``gid`` (or None), from the cache's
    rendered configuration (operator/render.py ``pod_wiring``)."""
    spec = copy.deepcopy(dict(pod.get("spec") or {}))
    # name -> host path, its hostPath type, and how it is mounted (the same path inside)
    shares: dict[str, tuple[str, str, dict[str, Any]]] = {
        "run": (wiring["run_dir"], "Directory", {"mountPropagation": "HostToContainer"}),  # hugetlbfs below
        "pool": (wiring["pool_dir"], "Directory", {}),
        "epoch": (wiring["epoch_file"], "File", {"readOnly": True}),
    }
    volumes = spec.setdefault("volumes", [])
    have = {v.get("name") for v in volumes}
    for short, (path, kind, _) in shares.items():
        if PREFIX + short not in have:
            volumes.append({"name": PREFIX + short, "hostPath": {"path": path, "type": kind}})
    env: list[dict[str, Any]] = [
        {"name": "FLATCAKE_SOCKET", "value": wiring["socket"]},
        {"name": "FLATCAKE_HICACHE_EXTRA_CONFIG", "value": json.dumps(dict(wiring["extra_config"]), sort_keys=True)},
        {"name": "FLATCAKE_VLLM_KV_TRANSFER_CONFIG", "value": json.dumps(dict(wiring["vllm_config"]), sort_keys=True)},
        # Who the pod is, for the agent's per-client cap (it cannot see a pod's pid): namespace/name, from the
        # downward API; the last one refers to the two before it, which Kubernetes expands in order.
        {"name": "FLATCAKE_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "FLATCAKE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": CLIENT_ID_ENV, "value": "$(FLATCAKE_POD_NAMESPACE)/$(FLATCAKE_POD_NAME)"},
    ]
    for container in spec.get("containers") or []:
        mounts = container.setdefault("volumeMounts", [])
        mounted = {m.get("mountPath") for m in mounts} | {m.get("name") for m in mounts}
        for short, (path, _, how) in shares.items():
            if path not in mounted and PREFIX + short not in mounted:
                mounts.append({"name": PREFIX + short, "mountPath": path, **how})
        variables = container.setdefault("env", [])
        named = {e.get("name") for e in variables}
        variables.extend(e for e in env if e["name"] not in named)
    _require_ready_node(spec, wiring["ready_label"])
    if wiring.get("gid") is not None:
        groups = spec.setdefault("securityContext", {}).setdefault("supplementalGroups", [])
        if wiring["gid"] not in groups:
            groups.append(wiring["gid"])
    return spec


def _require_ready_node(spec: dict[str, Any], label: str) -> None:
    want = {"key": label, "operator": "In", "values": ["true"]}
    node_affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:  # terms are ORed: each must require the ready label
        exprs = term.setdefault("matchExpressions", [])
        if want not in exprs:
            exprs.append(want)
