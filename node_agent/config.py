"""The engine configuration: one file, rendered by the operator from a FlatCakeCache spec and read by
the agent and the engine. Every field is validated here, and errors name the field and the fix."""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from flatcake.node_agent.buffers import ALIGN
from flatcake.node_agent.gva import MAX_NODE_ID
from flatcake.node_agent.placement import PlacementConfig

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class DramConfig:
    bytes: int = 256 * MiB
    huge_pages: bool = True
    shm_dir: str = "/dev/shm"
    hugetlbfs_dir: str | None = None
    name: str = "flatcake-dram"
    pinned: bool = True  # cudaHostRegister the pool when a GPU is usable (direct H2D copies)


@dataclass(frozen=True)
class SsdConfig:
    dir: str = "/var/lib/flatcake/pool"
    file_bytes: int = 256 * MiB
    file_count: int = 16
    extent_policy: str = "warn"
    high_watermark: float = 0.9
    low_watermark: float = 0.8


@dataclass(frozen=True)
class IOConfig:
    backend: str = "auto"  # auto | posix | kvikio
    workers: int = 2
    gap_bytes: int = 64 * 1024  # Δgap: holes smaller than this are read through
    staging_layers: int = 2  # slots per restore stream: double buffering
    staging_slot_bytes: int = 8 * MiB
    streams: int = 4  # concurrent restores; more wait for a window


@dataclass(frozen=True)
class PrepareConfig:
    """What `flatcake agent prepare` makes of a node before the agent starts."""

    hugepage_size: str = "2Mi"  # 2Mi | 1Gi | none
    hugepages: int = 0  # pages to have reserved; 0 derives them from dram.bytes
    devices: tuple[str, ...] = ()  # NVMe devices for RAID-0 + XFS; empty: use ssd.dir as it is
    mount: str = "/var/lib/flatcake"  # where the array (or device) is mounted; ssd.dir lives below it
    raid_name: str = "flatcake"  # /dev/md/<name>
    wipe: bool = False  # allow mkfs over an existing filesystem (destroys its data)
    restart_kubelet: bool = False  # opt-in: restart the kubelet so it sees newly reserved hugepages


@dataclass(frozen=True)
class AgentConfig:
    socket: str = "/run/flatcake/agent.sock"  # control socket, mode 0660
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9470  # /metrics, /healthz, /readyz
    journal_fsync: str = "interval"  # always | interval | never (see node_agent/journal.py)
    journal_fsync_ms: int = 100
    verify_on_recovery: bool = True  # re-read every journaled page and check its crc32 at start-up


@dataclass(frozen=True)
class SchedulerConfig:
    """Handed to clients at registration: how they order restores (FC-MAS, or FCFS for ablation)."""

    policy: str = "mas"  # mas | fcfs


@dataclass(frozen=True)
class ClusterConfig:
    """Set by the operator; all empty when the agent runs outside Kubernetes."""

    cache: str = ""  # the FlatCakeCache served: the agent reports a FlatCakeNode for it
    namespace: str = ""
    cache_uid: str = ""  # owner of the FlatCakeNode (garbage-collected with the cache)
    node_ids_dir: str = ""  # a ConfigMap volume with one file per node name holding its NodeID
    report_interval_s: float = 10.0


@dataclass(frozen=True)
class EngineConfig:
    layers: int = 43
    page_bytes: int = 12 * 1024  # one page (of page_tokens tokens) of one layer, per rank
    page_tokens: int = 64
    node_id: int = 0
    dram: DramConfig = field(default_factory=DramConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    io: IOConfig = field(default_factory=IOConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _positive(self, "layers", "page_tokens")
        if self.page_bytes <= 0 or self.page_bytes % ALIGN:
            raise ValueError(
                f"page_bytes: {self.page_bytes} must be a positive multiple of {ALIGN} "
                "(pad the page to 4 KiB: O_DIRECT and GDS need aligned offsets)"
            )
        if not 0 <= self.node_id <= MAX_NODE_ID:
            raise ValueError(f"node_id: {self.node_id} must be within 0..{MAX_NODE_ID}")
        if self.ssd.file_bytes % ALIGN or self.ssd.file_bytes < self.layers * self.page_bytes:
            raise ValueError(
                f"ssd.file_bytes: {self.ssd.file_bytes} must be a multiple of {ALIGN} and hold "
                f"at least one page of all layers ({self.layers * self.page_bytes} bytes)"
            )
        _positive(self.ssd, "file_count", prefix="ssd.")
        if self.ssd.extent_policy not in ("warn", "refuse"):
            raise ValueError(f"ssd.extent_policy: {self.ssd.extent_policy!r} must be 'warn' or 'refuse'")
        if not 0 < self.ssd.low_watermark <= self.ssd.high_watermark <= 1:
            raise ValueError(
                "ssd.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                f"{self.ssd.low_watermark} and {self.ssd.high_watermark}"
            )
        if self.dram.bytes < 0:
            raise ValueError(f"dram.bytes: {self.dram.bytes} must be >= 0")
        _positive(self.io, "workers", "staging_layers", "streams", prefix="io.")
        if self.io.gap_bytes < 0:
            raise ValueError(f"io.gap_bytes: {self.io.gap_bytes} must be >= 0")
        if self.io.staging_slot_bytes % ALIGN or self.io.staging_slot_bytes < self.page_bytes:
            raise ValueError(
                f"io.staging_slot_bytes: {self.io.staging_slot_bytes} must be a multiple of "
                f"{ALIGN} and at least page_bytes ({self.page_bytes})"
            )
        if self.agent.journal_fsync not in ("always", "interval", "never"):
            raise ValueError(f"agent.journal_fsync: {self.agent.journal_fsync!r} must be always, interval or never")
        if not 0 <= self.agent.metrics_port <= 65535:
            raise ValueError(f"agent.metrics_port: {self.agent.metrics_port} is not a TCP port (0 picks a free one)")
        _positive(self.agent, "journal_fsync_ms", prefix="agent.")
        if self.prepare.hugepage_size not in ("2Mi", "1Gi", "none"):
            raise ValueError(f"prepare.hugepage_size: {self.prepare.hugepage_size!r} must be 2Mi, 1Gi or none")
        if self.prepare.devices and not Path(self.ssd.dir).is_relative_to(self.prepare.mount):
            raise ValueError(f"ssd.dir: {self.ssd.dir} must lie under prepare.mount ({self.prepare.mount}) "
                             "when prepare.devices are given")  # fmt: skip
        if self.scheduler.policy not in ("mas", "fcfs"):
            raise ValueError(f"scheduler.policy: {self.scheduler.policy!r} must be 'mas' or 'fcfs'")
        if self.cluster.cache and not self.cluster.namespace:
            raise ValueError("cluster.namespace: required with cluster.cache (the FlatCakeCache's namespace)")
        if self.cluster.report_interval_s <= 0:
            raise ValueError(f"cluster.report_interval_s: {self.cluster.report_interval_s} must be > 0")
        if self.io.backend not in ("auto", "posix", "kvikio"):
            raise ValueError(f"io.backend: {self.io.backend!r} must be 'auto', 'posix' or 'kvikio'")

    @property
    def dram_slots(self) -> int:
        return self.dram.bytes // (self.layers * self.page_bytes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return _build(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(obj: object, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{prefix}{name}: {value!r} must be a positive integer")


T = TypeVar("T")


def _build(cls: type[T], data: Any, path: str) -> T:
    """Build a (nested) config dataclass from plain data, naming the field of any mismatch."""
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path or 'config'}: unknown field(s) {unknown}; known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, value in data.items():
        where = f"{path}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, where + ".")  # type: ignore[arg-type]
        else:
            values[name] = _check_type(value, hint, where)
    return cls(**values)


def _check_type(value: Any, hint: Any, where: str) -> Any:
    allowed = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and type(value) is t:
            return value
        if get_origin(t) is tuple and isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ValueError(f"{where}: {value!r} is not of type {names}")
