"""Everything the operator creates for one FlatCakeCache, as plain manifests (pure: no API calls).

``engine_config`` is the one function that turns a spec into the engine configuration; the agent
reads exactly that JSON from the ConfigMap (``EngineConfig.from_dict``), and ``check_engine_config``
runs that same model on it first, so what an agent would refuse never reaches a node."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flatcake.errors import ConfigError
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import EPOCH_FILE, HUGEPAGE_BYTES, SGLANG_BACKEND, VLLM_CONNECTOR
from flatcake.operator.spec import (
    CONFIG_HASH_ANNOTATION,
    GROUP,
    VERSION,
    CacheSpec,
    SpecError,
    agent_resources,
    check_cache_name,
)

CONFIG_KEY = "engine.json"
CONFIG_DIR = "/etc/flatcake"
NODE_IDS_DIR = "/etc/flatcake/node-ids"
PEER_SECRET_DIR = "/etc/flatcake/peer-secret"  # agents only (spec.crossNode); the webhook never mounts it
PEER_SECRET_KEY = "secret"
RUN_ROOT = "/run/flatcake"  # host directory shared with inference pods: socket and DRAM pool file
# Every cache's hugepage share on a node (node/hugepages.py): one host folder for all caches, on /run
# so the records go with the reservations at reboot.
HUGEPAGE_SHARES_DIR = f"{RUN_ROOT}/hugepages"
DEVICE_MOUNT_ROOT = "/var/lib/flatcake"  # where prepared arrays are mounted, one folder per cache
SOCKET_PATH_MAX = 107  # bytes of a Unix socket path (sun_path holds 108 with the terminating NUL)


@dataclass(frozen=True)
class Cache:
    """The identity of the FlatCakeCache being rendered."""

    name: str
    namespace: str
    uid: str

    @property
    def instance(self) -> str:
        """Host paths are shared by every cache on a node, so they carry namespace and name."""
        return f"{self.namespace}.{self.name}"

    def owner_reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FlatCakeCache", "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def check_cache(cache: Cache) -> None:
    """What the cache's name and namespace must allow: valid object names, and host paths the agent
    can use (its socket path carries both)."""
    check_cache_name(cache.name)
    socket = socket_path(cache)
    if len(socket.encode()) > SOCKET_PATH_MAX:
        raise SpecError("metadata.name", f"the agent's socket {socket} would be {len(socket.encode())} bytes, over "
                        f"the {SOCKET_PATH_MAX} a Unix socket path may have; recreate the cache under a shorter "
                        f"name (namespace and name together at most {SOCKET_PATH_MAX - len(RUN_ROOT) - 13} "
                        "characters)")  # fmt: skip


def ready_label(cache: Cache) -> str:
    """The Node label the operator sets while this cache's agent on that node is ready: inference
    pods use it in their node affinity (a pod cannot select on a custom resource's status)."""
    name = cache.instance
    if len(name) > 63:  # a label name is at most 63 characters: keep a readable head, make it unique
        name = f"{name[:46].rstrip('.-')}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return f"ready.flatcake.io/{name}"


def names(cache: Cache) -> dict[str, str]:
    base = cache.name
    return {
        "daemonset": f"{base}-agent",
        "config": f"{base}-config",
        "node_ids": f"{base}-node-ids",
        "service": f"{base}-metrics",
        "service_monitor": base,
        "service_account": f"{base}-agent",
        "role_binding": f"{base}-agent",
        "reclaim": f"{base}-reclaim",
        "peer_secret": f"{base}-peer-secret",
        "network_policy": f"{base}-agents",
    }


def labels(cache: Cache, component: str = "agent") -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "flatcake",
        "app.kubernetes.io/instance": cache.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "flatcake-operator",
        "flatcake.io/cache": cache.name,
    }


def run_dir(cache: Cache) -> str:
    """The host directory shared by a cache's agent and its inference pods: socket, DRAM pool file."""
    return f"{RUN_ROOT}/{cache.instance}"


def socket_path(cache: Cache) -> str:
    return f"{run_dir(cache)}/agent.sock"


def hugetlbfs_dir(spec: CacheSpec, cache: Cache) -> str | None:
    """The cache's own hugetlbfs (prepare mounts it, limited to the cache's pages), inside its run
    directory: its pods see it and no other cache's pool. None for a DRAM pool in ordinary pages."""
    return f"{run_dir(cache)}/hugepages" if spec.hugepage_size in HUGEPAGE_BYTES else None


def state_dir(spec: CacheSpec, cache: Cache) -> str:
    """The journal, epoch and owner lock: beside the pool files, in a directory pods do not mount."""
    return f"{pool_root(spec, cache)}/state"


def pool_root(spec: CacheSpec, cache: Cache) -> str:
    """The host directory holding this cache's pool: a mounted array, or below the given directory."""
    if spec.devices:
        return f"{DEVICE_MOUNT_ROOT}/{cache.instance}"
    assert spec.directory is not None
    return f"{spec.directory.rstrip('/')}/{cache.instance}"


# The pod's IP for the agent's HTTP endpoint: scraped and probed there, not on every interface.
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def engine_config(spec: CacheSpec, cache: Cache, wipe: bool = False) -> dict[str, Any]:
    """The engine configuration for every agent of this cache (NodeIDs come from the NodeID map)."""
    huge = spec.hugepage_size != "none"
    root = pool_root(spec, cache)
    return {
        "layers": spec.layers,
        "page_bytes": spec.page_bytes,
        "page_tokens": spec.page_tokens,
        "node_id": 0,
        "dram": {
            "bytes": spec.dram_bytes,
            "huge_pages": huge,
            "shm_dir": run_dir(cache),
            "hugetlbfs_dir": hugetlbfs_dir(spec, cache),
            "name": f"flatcake-{cache.instance}",
            "pinned": spec.pinned,
        },
        "ssd": {
            "dir": f"{root}/pool",
            "file_bytes": spec.file_bytes,
            "file_count": spec.file_count,
            # On XFS over prepared devices every file must be one extent; a given directory may
            # sit on any filesystem, where a fragmented file is only warned about.
            "extent_policy": "refuse" if spec.devices else "warn",
            "high_watermark": spec.high_watermark,
            "low_watermark": spec.low_watermark,
        },
        "io": {
            "backend": spec.io_backend,
            "workers": spec.io_workers,
            "gap_bytes": spec.gap_bytes,
            "staging_layers": spec.staging_layers,
            "staging_slot_bytes": spec.staging_slot_bytes,
            "streams": spec.streams,
            # Inference pods write pages into the shared pool themselves, so a DRAM page too is checked against
            # the crc32 it was published with before it is served (a pod's stray write is a miss, not a wrong
            # page; ISA-L's crc32 costs little next to the copy). An accident check, not a MAC.
            "verify_reads": "all",
        },
        "placement": {
            "mode": spec.placement_mode,
            "agent_context_tokens": spec.agent_context_tokens,
            "agent_reply_tokens": spec.agent_reply_tokens,
            "short_reply_tokens": spec.short_reply_tokens,
        },
        "agent": {
            "socket": socket_path(cache),
            "state_dir": state_dir(spec, cache),
            # Each pod binds its own IP (`agent serve --metrics-host $(POD_IP)`, below): the ConfigMap is
            # shared by every node, and the default (loopback) is what an agent run by hand gets.
            "metrics_host": "127.0.0.1",
            "metrics_port": spec.metrics_port,
            "journal_fsync": "interval",
            "journal_fsync_ms": 100,
            "verify_on_recovery": True,
            # Files mode 0660 in this group: inference pods given it (the webhook adds it) may use them.
            **({} if spec.access_gid is None else {"group": str(spec.access_gid)}),
        },
        "prepare": {
            "hugepage_size": spec.hugepage_size,
            "hugepages": 0,
            "hugepage_shares_dir": HUGEPAGE_SHARES_DIR,
            "devices": list(spec.devices),
            "mount": root,
            "raid_name": f"flatcake-{cache.name}"[:32],
            "wipe": wipe,
            "restart_kubelet": spec.restart_kubelet,
        },
        "cluster": {
            "cache": cache.name,
            "namespace": cache.namespace,
            "cache_uid": cache.uid,
            "node_ids_dir": NODE_IDS_DIR,
            "report_interval_s": 10.0,
            # Each pod serves other nodes at its own IP (`agent serve --listen-host $(POD_IP)`, below).
            **_cross_node(spec),
        },
    }


def _cross_node(spec: CacheSpec) -> dict[str, Any]:
    """cluster.* for spec.crossNode: the host is each pod's own IP (`agent serve --listen-host $(POD_IP)`)."""
    if not spec.cross_node:
        return {}
    return {"listen": f"0.0.0.0:{spec.cross_node_port}", "transfer_protocol": spec.transfer_protocol,
            "transfer_device": spec.transfer_device, "prefill_tokens_per_s": spec.prefill_tokens_per_s,
            "secret_file": f"{PEER_SECRET_DIR}/{PEER_SECRET_KEY}"}  # fmt: skip


def peer_secret(cache: Cache, value: str) -> dict[str, Any]:
    """The cache's peer secret (spec.crossNode): mounted into its agents only, never into inference pods;
    created once with a random ``value`` (handlers.ensure_peer_secret), owned by the cache."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(cache, names(cache)["peer_secret"]), "stringData": {PEER_SECRET_KEY: value}}  # fmt: skip


# The spec field each checked engine field is rendered from (the prefix of EngineConfig's errors),
# so that a refused configuration is reported in the vocabulary of the FlatCakeCache the user wrote.
SPEC_FIELDS = {
    "layers": "spec.kv.layers",
    "page_bytes": "spec.kv.pageBytes",
    "page_tokens": "spec.kv.pageTokens",
    "dram.bytes": "spec.dram.size",
    "prepare.hugepage_size": "spec.dram.hugepageSize",
    "ssd.file_bytes": "spec.ssd.fileSize",
    "ssd.file_count": "spec.ssd.fileCount",
    "ssd.low_watermark/high_watermark": "spec.ssd.lowWatermark",
    "io.backend": "spec.io.backend",
    "io.workers": "spec.io.workers",
    "io.gap_bytes": "spec.io.gapBytes",
    "io.staging_layers": "spec.io.stagingLayers",
    "io.staging_slot_bytes": "spec.io.stagingSlotBytes",
    "io.streams": "spec.io.streams",
    "placement.mode": "spec.placement.mode",
    "placement.agent_context_tokens": "spec.placement.agentContextTokens",
    "placement.agent_reply_tokens": "spec.placement.agentReplyTokens",
    "placement.short_reply_tokens": "spec.placement.shortReplyTokens",
    "agent.metrics_port": "spec.metrics.port",
}


def spec_error(exc: ConfigError) -> SpecError:
    """EngineConfig's refusal (``<engine path>: <rule>``) as the spec field it was rendered from; a
    field no spec field maps to (one the operator derives) keeps its engine path."""
    path, _, rule = str(exc).partition(": ")
    field = SPEC_FIELDS.get(path)
    if field is None:
        return SpecError(path, f"{rule} (in the rendered engine.json)")
    return SpecError(field, f"{rule} (checked as {path} of the rendered engine.json)")


def check_engine_config(config: dict[str, Any]) -> EngineConfig:
    """The rendered configuration, read by the agent's own model: its rules are checked once, there,
    and a refusal comes back as a SpecError naming the spec field."""
    try:
        return EngineConfig.from_dict(config)
    except ConfigError as exc:
        raise spec_error(exc) from exc


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _meta(cache: Cache, name: str, component: str = "agent") -> dict[str, Any]:
    return {"name": name, "namespace": cache.namespace, "labels": labels(cache, component),
            "ownerReferences": [cache.owner_reference()]}  # fmt: skip


def config_map(cache: Cache, config: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(cache, names(cache)["config"]),
            "data": {CONFIG_KEY: json.dumps(config, indent=2, sort_keys=True)}}  # fmt: skip


def node_ids_map(cache: Cache, ids: dict[str, int]) -> dict[str, Any]:
    """NodeIDs live in their own ConfigMap with no owner: under reclaimPolicy Retain they outlive the
    cache, so a cache recreated with the same name finds its nodes' data under the same IDs."""
    meta = _meta(cache, names(cache)["node_ids"])
    del meta["ownerReferences"]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {node: str(i) for node, i in sorted(ids.items())}}  # fmt: skip


def pod_wiring(spec: CacheSpec, cache: Cache) -> dict[str, Any]:
    """What an inference pod using this cache needs (operator/inject.py adds it): the same host paths
    and socket as the agents' (the run directory with the cache's own hugetlbfs, the pool files, the
    epoch file to read), SGLang's backend extra config, the ready label, the files' group."""
    socket = socket_path(cache)
    return {
        "run_dir": run_dir(cache),
        "pool_dir": f"{pool_root(spec, cache)}/pool",
        "epoch_file": f"{state_dir(spec, cache)}/{EPOCH_FILE}",
        "socket": socket,
        "extra_config": {**SGLANG_BACKEND, "socket": socket},
        "vllm_config": {**VLLM_CONNECTOR, "kv_connector_extra_config": {"socket": socket}},
        "ready_label": ready_label(cache),
        "gid": spec.access_gid,
    }


def _host_volumes(spec: CacheSpec, cache: Cache) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names(cache)["config"]}},
        {"name": "node-ids", "configMap": {"name": names(cache)["node_ids"], "optional": True}},
        {"name": "run", "hostPath": {"path": run_dir(cache), "type": "DirectoryOrCreate"}},
        {"name": "pool", "hostPath": {"path": pool_root(spec, cache), "type": "DirectoryOrCreate"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "node-ids", "mountPath": NODE_IDS_DIR, "readOnly": True},
        # HostToContainer: the mounts prepare makes below them (the cache's hugetlbfs, the XFS) reach the agent.
        {"name": "run", "mountPath": run_dir(cache), "mountPropagation": "HostToContainer"},
        {"name": "pool", "mountPath": pool_root(spec, cache), "mountPropagation": "HostToContainer"},
    ]
    return volumes, mounts


def _shares_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """The hugepage share records, for the prepare and reclaim containers only (the agent has no use)."""
    volume = {"name": "hugepage-shares", "hostPath": {"path": HUGEPAGE_SHARES_DIR, "type": "DirectoryOrCreate"}}
    return volume, {"name": "hugepage-shares", "mountPath": HUGEPAGE_SHARES_DIR}


def daemon_set(spec: CacheSpec, cache: Cache, config: dict[str, Any]) -> dict[str, Any]:
    """Node agents: a privileged init container prepares the node, the agent itself runs with
    IPC_LOCK (to lock the pinned pool) and no other capability."""
    n = names(cache)
    volumes, mounts = _host_volumes(spec, cache)
    command = ["flatcake", "agent"]
    config_arg = ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"]
    prepare_mounts = [dict(m) for m in mounts]
    for m in prepare_mounts:
        if m["name"] in ("pool", "run"):
            m["mountPropagation"] = "Bidirectional"  # the mounts it makes (XFS, hugetlbfs) must reach the host
    shares_volume, shares_mount = _shares_volume()
    prepare_mounts += [{"name": "dev", "mountPath": "/dev"}, {"name": "sys", "mountPath": "/sys"}, shares_mount]
    node_env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    pod = spec.pod
    pod_meta = {"labels": {**pod.labels, **labels(cache)},
                "annotations": {**pod.annotations, CONFIG_HASH_ANNOTATION: config_hash(config)}}  # fmt: skip
    options: dict[str, Any] = {}
    if pod.priority_class_name:
        options["priorityClassName"] = pod.priority_class_name
    if pod.image_pull_secrets:
        options["imagePullSecrets"] = [{"name": name} for name in pod.image_pull_secrets]
    prepare_resources = {"resources": pod.prepare_resources} if pod.prepare_resources else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(cache, n["daemonset"]),
        "spec": {
            "selector": {"matchLabels": {"flatcake.io/cache": cache.name, "app.kubernetes.io/component": "agent"}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": pod_meta,
                "spec": {
                    **options,
                    "serviceAccountName": n["service_account"],
                    "nodeSelector": spec.node_selector,
                    "tolerations": spec.tolerations,
                    **({"affinity": spec.affinity} if spec.affinity else {}),
                    "hostPID": spec.restart_kubelet,  # only to reach the host's systemd for the kubelet
                    "terminationGracePeriodSeconds": 30,
                    "initContainers": [
                        {
                            "name": "prepare",
                            "image": spec.image,
                            "imagePullPolicy": spec.image_pull_policy,
                            "command": [*command, "prepare", *config_arg],
                            "env": node_env,
                            "securityContext": {"privileged": True},
                            **prepare_resources,
                            "volumeMounts": prepare_mounts,
                        }
                    ],
                    "containers": [
                        {
                            "name": "agent",
                            "image": spec.image,
                            "imagePullPolicy": spec.image_pull_policy,
                            "command": [
                                *command,
                                "serve",
                                "--metrics-host",
                                "$(POD_IP)",
                                *(["--listen-host", "$(POD_IP)"] if spec.cross_node else []),
                                *config_arg,
                            ],
                            "env": [*node_env, POD_IP_ENV],
                            "ports": [
                                {"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"},
                                *(
                                    [{"name": "peers", "containerPort": spec.cross_node_port, "protocol": "TCP"}]
                                    if spec.cross_node
                                    else []
                                ),
                            ],
                            "resources": agent_resources(spec),
                            "securityContext": {
                                "privileged": False,
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
                            },
                            # /healthz answers from process start, through recovery (which may take minutes on
                            # a large cache); the startup probe gives a slow start room before liveness counts,
                            # and readiness waits on /readyz (503 while recovering).
                            "startupProbe": {
                                "httpGet": {"path": "/healthz", "port": "metrics"},
                                "periodSeconds": 5,
                                "failureThreshold": 120,
                            },
                            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
                            "livenessProbe": {
                                "httpGet": {"path": "/healthz", "port": "metrics"},
                                "periodSeconds": 10,
                                "failureThreshold": 6,
                            },
                            "volumeMounts": [*mounts, *_peer_secret_mount(spec)],
                        }
                    ],
                    "volumes": [
                        *volumes,
                        *_peer_secret_volume(spec, cache),
                        {"name": "dev", "hostPath": {"path": "/dev"}},
                        {"name": "sys", "hostPath": {"path": "/sys"}},
                        shares_volume,
                    ],
                },
            },
        },
    }


def _peer_secret_volume(spec: CacheSpec, cache: Cache) -> list[dict[str, Any]]:
    if not spec.cross_node:
        return []
    return [{"name": "peer-secret", "secret": {"secretName": names(cache)["peer_secret"], "defaultMode": 0o400}}]


def _peer_secret_mount(spec: CacheSpec) -> list[dict[str, Any]]:
    return [{"name": "peer-secret", "mountPath": PEER_SECRET_DIR, "readOnly": True}] if spec.cross_node else []


def reclaim_daemon_set(spec: CacheSpec, cache: Cache) -> dict[str, Any]:
    """Erases this cache's pool and DRAM pool file on every node (reclaimPolicy Delete); each pod turns
    ready once its node is clean, and the operator removes the DaemonSet when all are."""
    volumes, mounts = _host_volumes(spec, cache)
    shares_volume, shares_mount = _shares_volume()
    volumes, mounts = [*volumes, shares_volume], [*mounts, shares_mount]  # its share is forgotten too
    ds = daemon_set(spec, cache, {})
    pod = ds["spec"]["template"]["spec"]
    pod["initContainers"] = []
    pod["hostPID"] = False
    pod["volumes"] = volumes
    container = pod["containers"][0]
    container.update({
        "name": "reclaim",
        "command": ["sh", "-c", f"flatcake agent reclaim --config {CONFIG_DIR}/{CONFIG_KEY} "
                                "&& touch /tmp/reclaimed && exec sleep infinity"],
        "readinessProbe": {"exec": {"command": ["test", "-e", "/tmp/reclaimed"]}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": mounts,
        "ports": [],
    })  # fmt: skip
    del container["livenessProbe"]
    del container["startupProbe"]
    ds["metadata"] = _meta(cache, names(cache)["reclaim"], "reclaim")
    del ds["metadata"]["ownerReferences"]  # it runs while the cache is being deleted
    ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "reclaim"
    ds["spec"]["template"]["metadata"] = {"labels": {**spec.pod.labels, **labels(cache, "reclaim")},
                                          "annotations": dict(spec.pod.annotations)}  # fmt: skip
    return ds


def network_policy(spec: CacheSpec, cache: Cache) -> dict[str, Any]:
    """spec.crossNode: who may reach the agents over the network. The peer port checks the cache's secret
    itself, but the transfer engine's ports (ephemeral, unauthenticated) cannot: only pods of this cache
    (its agents, and inference pods the webhook wired to it, labelled flatcake.io/cache) from the
    namespaces allowed to use it reach any agent port; anyone may scrape the metrics port. Enforced where
    the cluster's network plugin implements NetworkPolicy."""
    allowed = [cache.namespace, *(ns for ns in spec.access_namespaces if ns != "*")]
    namespaces: dict[str, Any] = (
        {} if "*" in spec.access_namespaces
        else {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": allowed}]}
    )  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(cache, names(cache)["network_policy"]),
        "spec": {
            "podSelector": {"matchLabels": {"flatcake.io/cache": cache.name, "app.kubernetes.io/component": "agent"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"namespaceSelector": namespaces,
                           "podSelector": {"matchLabels": {"flatcake.io/cache": cache.name}}}]},
                {"ports": [{"port": spec.metrics_port, "protocol": "TCP"}]},
            ],
        },
    }  # fmt: skip


# The Prometheus job of every agent target: the ServiceMonitor's jobLabel reads it from the Service
# (otherwise the job is the Service's name, `<cache>-metrics`), so one alert rule matches every cache
# (FlatCakeAgentDown in dashboards/prometheus-rules.yml).
JOB_LABEL = "flatcake.io/job"
AGENT_JOB = "flatcake-agent"


def service(spec: CacheSpec, cache: Cache) -> dict[str, Any]:
    """Headless: Prometheus scrapes every agent, not one behind a virtual IP."""
    meta = _meta(cache, names(cache)["service"])
    meta["labels"] = {**meta["labels"], JOB_LABEL: AGENT_JOB}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "selector": {"flatcake.io/cache": cache.name, "app.kubernetes.io/component": "agent"},
            "ports": [{"name": "metrics", "port": spec.metrics_port, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


# The scraped pod's node name as ``node``: what the dashboards' node picker lists (kube-prometheus-stack's
# convention; ``instance`` is the pod's IP:port, which says nothing to an operator).
NODE_RELABELING = [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"}]


def service_monitor(spec: CacheSpec, cache: Cache) -> dict[str, Any]:
    meta = _meta(cache, names(cache)["service_monitor"])
    meta["labels"] = {**meta["labels"], **spec.service_monitor_labels}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "jobLabel": JOB_LABEL,
            "selector": {"matchLabels": {"flatcake.io/cache": cache.name, "app.kubernetes.io/component": "agent"}},
            "namespaceSelector": {"matchNames": [cache.namespace]},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": spec.service_monitor_interval,
                    "scrapeTimeout": spec.service_monitor_interval,
                    "relabelings": NODE_RELABELING,
                }
            ],
        },
    }


def objects(
    spec: CacheSpec, cache: Cache, config: dict[str, Any], agent_cluster_role: str, with_monitor: bool
) -> list[dict[str, Any]]:
    """Everything a cache's reconcile applies, in order (the NodeID map aside: it depends on the
    cluster's nodes); the ServiceMonitor ``with_monitor`` (the spec asks for one, the cluster has the kind)."""
    out = [service_account(cache), role_binding(cache, agent_cluster_role), config_map(cache, config),
           daemon_set(spec, cache, config), service(spec, cache)]  # fmt: skip
    if spec.cross_node:
        out.append(network_policy(spec, cache))
    if with_monitor:
        out.append(service_monitor(spec, cache))
    return out


def service_account(cache: Cache) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cache, names(cache)["service_account"])}


def role_binding(cache: Cache, agent_cluster_role: str) -> dict[str, Any]:
    """Binds the agents' account to the chart's agent ClusterRole (write their FlatCakeNodes), in the
    cache's namespace only."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(cache, names(cache)["role_binding"]),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": agent_cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": names(cache)["service_account"], "namespace": cache.namespace}],
    }
