"""A FlatCakeCache spec as typed data, and the checks its OpenAPI schema cannot express.

The API server applies the CRD's defaults and types before the operator sees a spec, so parsing here
only converts; a field that is missing anyway (an API server without structural defaulting, or a
hand-edited object) is reported by its path rather than with a KeyError."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity as parse_k8s_quantity

from flatcake.errors import ConfigError
from flatcake.node_agent import geometry
from flatcake.node_agent.constants import HUGEPAGE_BYTES, MAX_NODE_ID
from flatcake.operator import scheduling

GROUP = "flatcake.io"
VERSION = "v1alpha1"
_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?$")
# The cache's name is the stem of every object it owns; the tightest is the Service "<name>-metrics",
# a DNS-1035 label (at most 63 characters). The CRD's schema admits only such names; the operator
# checks again for caches admitted before that rule (a CRD upgrade does not revalidate objects).
MAX_CACHE_NAME = 63 - len("-metrics")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # an RFC 1123 label
_DEVICE = re.compile(r"^/dev/[A-Za-z0-9/_.:+-]+$")
# The pod annotation by which a config change rolls the agents (render.daemon_set).
CONFIG_HASH_ANNOTATION = "flatcake.io/config-hash"
RESERVED_ANNOTATIONS = frozenset({CONFIG_HASH_ANNOTATION})
AGENT_MEMORY_BYTES = 512 << 20  # the agent's own heap: index, journal buffers, HTTP
AGENT_CPU_REQUEST = "500m"


class SpecError(ConfigError):
    """A spec the operator will not deploy: names the spec field and says what to do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def parse_quantity(value: str, field: str) -> int:
    """Binary-suffixed sizes as the CRD admits them ("64Gi"); the field is named on error."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise SpecError(field, f"{value!r} is not a size; write it like 64Gi (suffixes Ki, Mi, Gi, Ti)")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def check_cache_name(name: str) -> None:
    if len(name) > MAX_CACHE_NAME or not _DNS1035_LABEL.match(name):
        raise SpecError("metadata.name", f"{name!r} cannot name this cache's objects: the Service {name}-metrics "
                        "must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, at "
                        f"most 63 characters). Recreate the cache under such a name of at most {MAX_CACHE_NAME} "
                        "characters")  # fmt: skip


def _check_key(field: str, key: str, kind: str) -> None:
    prefix, _, name = str(key).rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix))) or (
        len(name) > 63 or not _LABEL_NAME.match(name)
    ):
        raise SpecError(field, f"{key!r} is not {kind} key: an optional DNS subdomain prefix and '/', then at "
                        "most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric")  # fmt: skip


def check_labels(field: str, labels: dict[str, Any]) -> None:
    """Kubernetes label keys and values (they land in a pod's nodeSelector, a list selector, or an
    object's labels, where the API server refuses anything else)."""
    for key, value in labels.items():
        _check_key(field, key, "a label")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            raise SpecError(f"{field}.{key}", f"{value!r} is not a label value: at most 63 letters, digits, '-', "
                            "'_' or '.', starting and ending alphanumeric (or empty)")  # fmt: skip


def _check_annotations(field: str, annotations: dict[str, Any]) -> None:
    for key, value in annotations.items():
        _check_key(field, key, "an annotation")
        if key in RESERVED_ANNOTATIONS:
            raise SpecError(f"{field}.{key}", "is set by the operator (it restarts agents on a config change); "
                            "remove it")  # fmt: skip
        if not isinstance(value, str):
            raise SpecError(f"{field}.{key}", f"{value!r} must be a string; quote it")


Resources = dict[str, dict[str, str]]  # {"requests": {"cpu": "500m"}, "limits": {...}}


def quantity(field: str, value: Any) -> Decimal:
    try:
        parsed: Decimal = parse_k8s_quantity(value)  # type: ignore[no-untyped-call]
        return parsed
    except ValueError:
        raise SpecError(field, f"{value!r} is not a Kubernetes quantity; write it like 500m or 2 (CPU), "
                        "2Gi or 2G (memory)") from None  # fmt: skip


def check_resources(field: str, resources: Resources) -> None:
    """Every quantity parses (so a typo is named here, not by the API server refusing the DaemonSet)
    and every request is at most its limit."""
    parsed = {part: {name: quantity(f"{field}.{part}.{name}", value) for name, value in resources.get(part, {}).items()}
              for part in ("requests", "limits")}  # fmt: skip
    for name, request in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        if limit is not None and request > limit:
            raise SpecError(f"{field}.requests.{name}", f"{resources['requests'][name]} exceeds its limit "
                            f"{resources['limits'][name]}; lower the request or raise the limit")  # fmt: skip


def _check_host_path(field: str, path: str) -> None:
    # The API server refuses a hostPath with a '..' element, and a device path with one could name
    # something outside /dev.
    if not path.startswith("/") or ".." in path.split("/") or "\0" in path or len(path) > 200:
        raise SpecError(field, f"{path!r} must be an absolute path of at most 200 characters without '..' elements")


def format_bytes(n: int) -> str:
    """The largest binary unit that keeps one decimal, for printer columns ("1.5Ti")."""
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if n >= _UNITS[unit]:
            value = n / _UNITS[unit]
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return str(n)


@dataclass(frozen=True)
class PodOptions:
    """spec.pod: what the operator adds to the agent and reclaim pods it derives from the rest."""

    priority_class_name: str = ""
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    image_pull_secrets: tuple[str, ...] = ()
    agent_resources: Resources = dataclasses.field(default_factory=dict)
    prepare_resources: Resources = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class CacheSpec:
    image: str
    image_pull_policy: str
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any]
    layers: int
    page_bytes: int
    page_tokens: int
    dram_bytes: int
    hugepage_size: str
    pinned: bool
    devices: tuple[str, ...]
    directory: str | None
    file_bytes: int
    file_count: int
    high_watermark: float
    low_watermark: float
    placement_mode: str
    agent_context_tokens: int
    agent_reply_tokens: int
    short_reply_tokens: int
    io_backend: str
    gap_bytes: int
    io_workers: int
    staging_layers: int
    staging_slot_bytes: int
    streams: int
    metrics_port: int
    service_monitor: bool
    service_monitor_labels: dict[str, str]
    service_monitor_interval: str
    restart_kubelet: bool
    reclaim_policy: str
    wipe_policy: str
    pod: PodOptions = dataclasses.field(default_factory=lambda: PodOptions())
    access_gid: int | None = None  # the group given the agent's files; injected pods get it as a supplemental group
    # Namespaces besides the cache's own whose pods the webhook wires to it ("*": any); KV pages are prompts.
    access_namespaces: tuple[str, ...] = ()
    cross_node: bool = False  # spec.crossNode.enabled: serve and read pages across nodes
    cross_node_port: int = 7471
    transfer_protocol: str = "tcp"
    transfer_device: str = ""
    prefill_tokens_per_s: float = 0.0

    @property
    def pool_bytes(self) -> int:
        return self.file_bytes * self.file_count


class _Reader:
    """Reads dotted paths of the spec, naming the full path of anything missing or mistyped."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def get(self, path: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        node: Any = self.spec
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                if default is not ...:
                    return default
                raise SpecError(f"spec.{path}", "is required (install the CRD from crds/ so defaults apply)")
            node = node[part]
        if kind is float and isinstance(node, int) and not isinstance(node, bool):
            node = float(node)
        if not isinstance(node, kind) or (kind is int and isinstance(node, bool)):
            raise SpecError(f"spec.{path}", f"{node!r} has the wrong type")
        return node


def parse_spec(spec: dict[str, Any]) -> CacheSpec:
    """The typed spec; raises SpecError for what the schema admits but FlatCake cannot run and the
    engine configuration cannot tell (the rest is checked on the rendered configuration)."""
    r = _Reader(spec)
    devices = tuple(r.get("ssd.devices", list, []))
    directory = r.get("ssd.directory", str, None)
    if bool(devices) == (directory is not None):
        raise SpecError("spec.ssd", "set exactly one of devices (NVMe to format) and directory (an existing path)")
    for i, device in enumerate(devices):
        _check_host_path(f"spec.ssd.devices[{i}]", str(device))
        if not _DEVICE.match(str(device)):
            raise SpecError(f"spec.ssd.devices[{i}]", f"{device!r} is not a device path: /dev/ followed by "
                            "letters, digits and / _ . : + - (for example /dev/disk/by-id/nvme-...)")  # fmt: skip
    if directory is not None:
        _check_host_path("spec.ssd.directory", directory)
    check_labels("spec.nodeSelector", r.get("nodeSelector", dict, {}))
    check_labels("spec.metrics.serviceMonitor.labels", r.get("metrics.serviceMonitor.labels", dict, {}))
    pod = _pod_options(r)
    affinity = dict(r.get("affinity", dict, {}))
    problem = scheduling.affinity_problem(affinity)
    if problem is not None:
        raise SpecError(*problem)
    page_tokens = r.get("kv.pageTokens", int)
    layers, page_bytes = _kv_geometry(r, page_tokens)
    gid = r.get("access.gid", int, None)
    namespaces = tuple(r.get("access.namespaces", list, []))
    for i, ns in enumerate(namespaces):
        if not isinstance(ns, str) or not (ns == "*" or _NAMESPACE.fullmatch(ns)):
            raise SpecError(f"spec.access.namespaces[{i}]", f"{ns!r} is not a namespace name (lowercase letters, "
                            "digits and -, at most 63) or \"*\" (any namespace)")  # fmt: skip
    parsed = CacheSpec(
        image=r.get("image", str),
        image_pull_policy=r.get("imagePullPolicy", str, "IfNotPresent"),
        node_selector=dict(r.get("nodeSelector", dict, {})),
        tolerations=list(r.get("tolerations", list, [])),
        affinity=affinity,
        layers=layers,
        page_bytes=page_bytes,
        page_tokens=page_tokens,
        dram_bytes=parse_quantity(r.get("dram.size", str), "spec.dram.size"),
        hugepage_size=r.get("dram.hugepageSize", str),
        pinned=r.get("dram.pinned", bool),
        devices=devices,
        directory=directory,
        file_bytes=parse_quantity(r.get("ssd.fileSize", str), "spec.ssd.fileSize"),
        file_count=r.get("ssd.fileCount", int),
        high_watermark=r.get("ssd.highWatermark", float),
        low_watermark=r.get("ssd.lowWatermark", float),
        placement_mode=r.get("placement.mode", str, "table2"),
        agent_context_tokens=r.get("placement.agentContextTokens", int),
        agent_reply_tokens=r.get("placement.agentReplyTokens", int),
        short_reply_tokens=r.get("placement.shortReplyTokens", int),
        io_backend=r.get("io.backend", str),
        gap_bytes=r.get("io.gapBytes", int),
        io_workers=r.get("io.workers", int),
        staging_layers=r.get("io.stagingLayers", int),
        staging_slot_bytes=r.get("io.stagingSlotBytes", int),
        streams=r.get("io.streams", int),
        metrics_port=r.get("metrics.port", int),
        service_monitor=r.get("metrics.serviceMonitor.enabled", bool, True),
        service_monitor_labels=dict(r.get("metrics.serviceMonitor.labels", dict, {})),
        service_monitor_interval=r.get("metrics.serviceMonitor.interval", str, "15s"),
        restart_kubelet=r.get("prepare.restartKubelet", bool, False),
        reclaim_policy=r.get("reclaimPolicy", str, "Retain"),
        wipe_policy=r.get("wipePolicy", str, "Refuse"),
        pod=pod,
        access_gid=gid,
        access_namespaces=namespaces,
        cross_node=r.get("crossNode.enabled", bool, False),
        cross_node_port=r.get("crossNode.port", int, 7471),
        transfer_protocol=r.get("crossNode.transferProtocol", str, "tcp"),
        transfer_device=r.get("crossNode.transferDevice", str, ""),
        prefill_tokens_per_s=r.get("crossNode.prefillTokensPerSecond", float, 0.0),
    )
    # Watermarks, file and staging slot sizes are the engine configuration's own rules: the rendered
    # configuration is checked by EngineConfig (render.check_engine_config), not again here.
    slot = parsed.layers * parsed.page_bytes
    if parsed.dram_bytes and parsed.dram_bytes < slot:
        raise SpecError("spec.dram.size", f"holds no page of all layers ({slot} bytes); raise it or set 0")
    agent_resources(parsed)  # spec.pod.resources.agent against what the DRAM pool needs
    return parsed


def agent_resources(spec: CacheSpec) -> Resources:
    """The agent container's resources: the DRAM pool's hugepages (or, for a tmpfs pool, its bytes
    charged to the agent's memory cgroup) plus the agent's own heap, then spec.pod.resources.agent
    on top. Memory may be raised, never lowered below what the pool needs (the kernel would kill the
    agent on its first large put)."""
    floor = AGENT_MEMORY_BYTES
    derived: dict[str, str] = {}
    if spec.hugepage_size in HUGEPAGE_BYTES and spec.dram_bytes:
        derived[f"hugepages-{spec.hugepage_size}"] = str(spec.dram_bytes)
    else:
        floor += spec.dram_bytes
    derived["memory"] = str(floor)
    merged: Resources = {"requests": {"cpu": AGENT_CPU_REQUEST, **derived}, "limits": dict(derived)}
    user = spec.pod.agent_resources
    for part in ("requests", "limits"):
        for name, value in user.get(part, {}).items():
            field = f"spec.pod.resources.agent.{part}.{name}"
            if name == "memory" and quantity(field, value) < floor:
                raise SpecError(field, f"{value} is below the {format_bytes(floor)} the agent needs (its own "
                                f"{format_bytes(AGENT_MEMORY_BYTES)}, plus a tmpfs DRAM pool of spec.dram.size); "
                                "raise it or remove it")  # fmt: skip
            merged[part][name] = value
    check_resources("spec.pod.resources.agent", merged)
    return merged


def _kv_geometry(r: _Reader, page_tokens: int) -> tuple[int, int]:
    """(layers, pageBytes): derived from ``kv.model`` (the served model's config.json, as SGLang holds
    its pages) when given, and then equal to ``kv.layers``/``kv.pageBytes`` where those are given too;
    otherwise those two, required."""
    given = {name: r.get(f"kv.{name}", int, None) for name in ("layers", "pageBytes")}
    config = r.get("kv.model.config", dict, None)
    if config is None:
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise SpecError(f"spec.kv.{missing[0]}", "is required without spec.kv.model: name the served model "
                            "(kv.model.config: its config.json; kv.model.tensorParallel) or give layers and "
                            "pageBytes (flatcake geometry CONFIG.json --tp N prints them)")  # fmt: skip
        return given["layers"] or 0, given["pageBytes"] or 0
    tp, dtype = r.get("kv.model.tensorParallel", int, 1), r.get("kv.model.kvCacheDtype", str, "auto")
    try:
        derived = geometry.from_config(config, tp=tp, page_tokens=page_tokens, kv_dtype=dtype)
    except ConfigError as exc:
        raise SpecError("spec.kv.model.config", str(exc)) from None
    for name, value in (("layers", derived.layers), ("pageBytes", derived.page_bytes)):
        if given[name] is not None and given[name] != value:
            raise SpecError(f"spec.kv.{name}", f"is {given[name]} but the model gives {value} ({derived.model_type}, "
                            f"tensorParallel {tp}, kvCacheDtype {dtype}, pageTokens {page_tokens}); remove "
                            f"spec.kv.{name} or fix spec.kv.model")  # fmt: skip
    return derived.layers, derived.page_bytes


def _pod_options(r: _Reader) -> PodOptions:
    labels = dict(r.get("pod.labels", dict, {}))
    check_labels("spec.pod.labels", labels)
    for key in labels:
        if key in OPERATOR_LABELS or key.startswith("app.kubernetes.io/"):
            raise SpecError(f"spec.pod.labels.{key}", "is one of the operator's own labels (its selectors find "
                            "the pods by them); choose another key")  # fmt: skip
    annotations = dict(r.get("pod.annotations", dict, {}))
    _check_annotations("spec.pod.annotations", annotations)
    secrets = r.get("pod.imagePullSecrets", list, [])
    for i, name in enumerate(secrets):
        if not isinstance(name, str) or len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
            raise SpecError(f"spec.pod.imagePullSecrets[{i}]", f"{name!r} is not a Secret name (a DNS subdomain)")
    resources: dict[str, Resources] = {}
    for container in ("agent", "prepare"):
        value = r.get(f"pod.resources.{container}", dict, {})
        resources[container] = {part: {k: str(v) for k, v in dict(value.get(part) or {}).items()}
                                for part in ("requests", "limits") if value.get(part)}  # fmt: skip
        check_resources(f"spec.pod.resources.{container}", resources[container])
    for part, quantities in resources["agent"].items():
        for name in quantities:
            if name.startswith("hugepages-"):
                raise SpecError(f"spec.pod.resources.agent.{part}.{name}", "follows spec.dram.size and "
                                "spec.dram.hugepageSize; remove it and size the DRAM pool there")  # fmt: skip
    return PodOptions(
        priority_class_name=r.get("pod.priorityClassName", str, ""),
        annotations=annotations,
        labels=labels,
        image_pull_secrets=tuple(secrets),
        agent_resources=resources["agent"],
        prepare_resources=resources["prepare"],
    )


# The labels render.labels puts on every object; the selectors depend on them.
OPERATOR_LABELS = frozenset({"flatcake.io/cache"})


def hugepage_bytes(spec: CacheSpec) -> int:
    return HUGEPAGE_BYTES.get(spec.hugepage_size, 0)


def check_node_fit(spec: CacheSpec, node_name: str, allocatable: dict[str, str], device_bytes: int | None) -> None:
    """What only a node can tell: enough allocatable hugepages for the DRAM pool, room for the file pool.

    Hugepages are checked unless the spec opts into reserving them (and restarting the kubelet)."""
    page = hugepage_bytes(spec)
    if page and spec.dram_bytes and not spec.restart_kubelet:
        resource = f"hugepages-{spec.hugepage_size}"
        have = parse_quantity(allocatable.get(resource, "0"), f"node {node_name} allocatable {resource}")
        if have < spec.dram_bytes:
            raise SpecError(
                "spec.dram.size",
                f"{format_bytes(spec.dram_bytes)} exceeds node {node_name}'s allocatable {resource} "
                f"({format_bytes(have)}); reserve hugepages on the node, lower the size, "
                "or set spec.prepare.restartKubelet to let the agent reserve them",
            )
    if device_bytes is not None and spec.pool_bytes > device_bytes:
        raise SpecError(
            "spec.ssd.fileCount",
            f"the pool ({spec.file_count} x {format_bytes(spec.file_bytes)} = {format_bytes(spec.pool_bytes)}) "
            f"exceeds node {node_name}'s filesystem ({format_bytes(device_bytes)}); lower fileCount or fileSize",
        )


def check_node_count(count: int) -> None:
    if count > MAX_NODE_ID + 1:
        raise SpecError(
            "spec.nodeSelector",
            f"selects {count} nodes; a GVA has 12 bits of NodeID ({MAX_NODE_ID + 1} nodes at most): "
            "split the nodes across several FlatCakeCaches",
        )
