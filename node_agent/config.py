"""The engine configuration: one typed model, rendered by the operator from a FlatCakeCache spec
(which validates it before anything reaches a node) and read by the agent and the engine. Every field
is validated here, and a ``ConfigError`` names the field and the fix.

This is the contract between the operator and the node agent: it imports only ``constants``."""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from flatcake.errors import ConfigError
from flatcake.node_agent.constants import (
    ALIGN,
    EXTENT_POLICIES,
    HUGEPAGE_SIZES,
    IO_BACKENDS,
    JOURNAL_FSYNC_POLICIES,
    MAX_FRAME,
    MAX_NODE_ID,
    PLACEMENT_MODES,
    TRANSFER_PROTOCOLS,
    VERIFY_READS,
    watermark_problem,
)

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class PlacementConfig:
    """Thresholds of Table 2. The paper gives the signals, not values; these defaults are ours.

    - ``agent_context_tokens`` (L_agent, default 32,768): contexts this long are agent sessions or long
      documents whose history outgrows DRAM; the paper's Claude Code trace averages 218,922 tokens.
    - ``agent_reply_tokens`` (τ, default 2,048): a reply this long marks tool-heavy agent work.
    - ``short_reply_tokens`` (default 512): previous replies at most this long make a short chat.
    - ``mode``: ``table2`` (the paper's rules), ``adaptive`` (Table 2 corrected by measured reuse
      distances against DRAM's residence: ``policy/adaptive.py``) or ``copies`` (Table 2's homes, and
      pages homed on SSD get clean DRAM copies, dropped at no cost under pressure, while copies made
      that way are read: ``policy/copies.py``).
    """

    agent_context_tokens: int = 32_768
    agent_reply_tokens: int = 2_048
    short_reply_tokens: int = 512
    mode: str = "table2"

    def __post_init__(self) -> None:
        _positive(self, "agent_context_tokens", "agent_reply_tokens", "short_reply_tokens", prefix="placement.")
        if self.mode not in PLACEMENT_MODES:
            raise ConfigError(f"placement.mode: {self.mode!r} must be one of {', '.join(PLACEMENT_MODES)}")


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
    verify_reads: str = "ssd"  # off | ssd | all: check restored pages against their crc32 (a mismatch is a miss)
    # kvikio's thread pool (num_threads); 0: streams x staging_layers x workers, every read a restore can have in
    # flight, so the device queue stays full (kvikio's own default is 1 thread: one read at a time)
    kvikio_threads: int = 0
    # Host restores (numpy destinations, SGLang's host pool): one read queue per process with this many
    # threads (preadv releases the GIL), commands up to command_bytes (a segment's layers back to back),
    # and at most restore_inflight_bytes of one restore in flight while another waits (fairness).
    read_threads: int = 4
    command_bytes: int = 16 * MiB
    restore_inflight_bytes: int = 64 * MiB

    def kvikio_pool(self) -> int:
        """kvikio's ``num_threads``: as given, or one per read a restore can have in flight."""
        return self.kvikio_threads or self.streams * self.staging_layers * self.workers


@dataclass(frozen=True)
class PrepareConfig:
    """What `flatcake agent prepare` makes of a node before the agent starts."""

    hugepage_size: str = "2Mi"  # 2Mi | 1Gi | none
    hugepages: int = 0  # this cache's pages; 0 derives them from dram.bytes
    # Each cache on a node records its share here; the node's count is the sum (node/hugepages.py).
    hugepage_shares_dir: str = "/run/flatcake/hugepages"
    devices: tuple[str, ...] = ()  # NVMe devices for RAID-0 + XFS; empty: use ssd.dir as it is
    mount: str = "/var/lib/flatcake"  # where the array (or device) is mounted; ssd.dir lives below it
    raid_name: str = "flatcake"  # /dev/md/<name>
    wipe: bool = False  # allow mkfs over an existing filesystem (destroys its data)
    restart_kubelet: bool = False  # opt-in: restart the kubelet so it sees newly reserved hugepages


@dataclass(frozen=True)
class AgentConfig:
    socket: str = "/run/flatcake/agent.sock"  # control socket, mode 0660
    # The journal, the epoch file and the pool's owner lock; empty: ssd.dir. The operator puts it beside the
    # pool, out of inference pods' mounts, so no pod can forge a record the agent trusts at its next start.
    state_dir: str = ""
    # /metrics, /healthz and /readyz on loopback unless configured: an agent started by hand is not on
    # the network. In a cluster the DaemonSet passes the pod's IP (`agent serve --metrics-host`).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9470  # /metrics, /healthz, /readyz
    http_timeout_s: float = 5.0  # an HTTP connection silent this long is closed
    http_max_connections: int = 64  # HTTP connections served at once; more are closed at accept
    journal_fsync: str = "interval"  # always | interval | never (see catalog/journal.py)
    journal_fsync_ms: int = 100
    # Online compaction: rewrite the journal as the live records (clients go on meanwhile) once it is
    # this many times its size after the last compaction, and at least journal_compact_bytes.
    journal_compact_ratio: float = 2.0
    journal_compact_bytes: int = 64 * KiB
    # ... or once this many records were appended since: a restart decodes those one by one (about 30 us
    # each), while the compacted part is read in columns, so this bounds the restart at any size.
    journal_compact_records: int = 65536
    # How long a starting agent waits for the previous agent's writes and restores still in flight
    # (catalog/epoch.py); past it, it starts anyway and such a restore's DRAM pages are misses.
    epoch_wait_s: float = 30.0
    # Check every recovered page's crc32 after a restart: in the background once serving, and on every
    # read of a scope not yet checked (recovery itself reads no page: restart is O(journal records)).
    verify_on_recovery: bool = True
    max_clients: int = 1024  # control connections at once; more are answered `busy` and closed
    # Control connections one process (the socket peer's pid) may hold, so that no client can take every
    # slot from the others; an SGLang or vLLM rank keeps one or two.
    max_clients_per_process: int = 64
    frame_timeout_s: float = 10.0  # a started frame must arrive whole, and a new connection register, within it
    idle_timeout_s: float = 0.0  # close a registered client silent this long (0: never; clients stay connected)
    frame_budget_bytes: int = 64 * MiB  # request bytes being received across all connections
    group: str = ""  # group given the socket, pools and journal (mode 0660); empty: the agent's own
    shared_index: bool = True  # publish the key index into shared memory; clients look up without the agent
    shared_index_slots: int = 0  # table slots (a power of two); 0: twice the pages the pools can hold


@dataclass(frozen=True)
class ClusterConfig:
    """Set by the operator; all empty when the agent runs outside Kubernetes."""

    cache: str = ""  # the FlatCakeCache served: the agent reports a FlatCakeNode for it
    namespace: str = ""
    cache_uid: str = ""  # owner of the FlatCakeNode (garbage-collected with the cache)
    node_ids_dir: str = ""  # a ConfigMap volume with one file per node name holding its NodeID
    report_interval_s: float = 10.0
    # Cross-node reads (service/peer_service.py, service/cluster.py) over Mooncake's transfer engine. ``listen``
    # ("host:port", port 0 picks one) serves this agent's pages to other nodes; ``peers`` are the other
    # agents' listen addresses, which this node's clients ask for what the local cache lacks.
    listen: str = ""
    peers: tuple[str, ...] = ()
    # The cache's peer secret (a file only agents can read): peers prove they hold it before anything else
    # is answered on the listen port (service/peer_auth.py). Required with listen, unless insecure_peers.
    secret_file: str = ""
    insecure_peers: bool = False  # serve the listen port to anyone who reaches it (a lab, never a cluster)
    # Register the DRAM pool with the transfer engine for one-sided reads by peers: auto (over rdma only),
    # on, off. Its port authenticates nobody: whoever reaches it reads (and writes) what is registered.
    one_sided_dram: str = "auto"
    transfer_protocol: str = "tcp"  # the transfer engine's transport: tcp, or rdma where the nodes have it
    transfer_device: str = ""  # RDMA devices for the transfer engine (empty: its own choice)
    staging_bytes: int = 64 * MiB  # registered memory SSD pages are staged in for peers (and land in, reading)
    peer_timeout_s: float = 5.0  # a peer's answer or transfer not done within it turns into misses
    # What other nodes' connections may take, apart from what this node's own clients have (agent.*): so a
    # flood on the peer port never makes local inference processes wait or get `busy`.
    max_peer_clients: int = 64  # connections from other nodes at once; more are answered `busy`
    peer_idle_timeout_s: float = 60.0  # a registered peer connection silent this long is closed
    peer_frame_budget_bytes: int = 32 * MiB  # request bytes being received across peer connections
    max_peer_leases: int = 64  # leases one peer connection may hold at once (each pins scopes from reclaim)
    # The serving engine's prefill rate for this model (tokens/s); a peer's pages slower to fetch (at the
    # link rate measured on earlier reads) than to prefill are not used. 0: always fetch.
    prefill_tokens_per_s: float = 0.0


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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _positive(self, "layers", "page_tokens")
        if self.page_bytes <= 0 or self.page_bytes % ALIGN:
            raise ConfigError(
                f"page_bytes: {self.page_bytes} must be a positive multiple of {ALIGN} "
                "(pad the page to 4 KiB: O_DIRECT and GDS need aligned offsets)"
            )
        if not 0 <= self.node_id <= MAX_NODE_ID:
            raise ConfigError(f"node_id: {self.node_id} must be within 0..{MAX_NODE_ID}")
        if self.ssd.file_bytes % ALIGN or self.ssd.file_bytes < self.layers * self.page_bytes:
            raise ConfigError(
                f"ssd.file_bytes: {self.ssd.file_bytes} must be a multiple of {ALIGN} and hold "
                f"at least one page of all layers ({self.layers * self.page_bytes} bytes)"
            )
        _positive(self.ssd, "file_count", prefix="ssd.")
        _one_of(self.ssd.extent_policy, EXTENT_POLICIES, "ssd.extent_policy")
        problem = watermark_problem(self.ssd.low_watermark, self.ssd.high_watermark)
        if problem:
            raise ConfigError(f"ssd.low_watermark/high_watermark: {problem}")
        if self.dram.bytes < 0:
            raise ConfigError(f"dram.bytes: {self.dram.bytes} must be >= 0")
        if not self.dram.name or "/" in self.dram.name or self.dram.name in (".", ".."):
            raise ConfigError(f"dram.name: {self.dram.name!r} must be a plain file name (no '/', not '.' or '..'); "
                              "the pool file is created inside dram.shm_dir or the hugetlbfs mount")  # fmt: skip
        _positive(self.io, "workers", "staging_layers", "streams", "read_threads", prefix="io.")
        if self.io.read_threads > 256:
            raise ConfigError(f"io.read_threads: {self.io.read_threads} must be 1 to 256")
        if self.io.command_bytes % ALIGN or self.io.command_bytes < self.page_bytes:
            raise ConfigError(
                f"io.command_bytes: {self.io.command_bytes} must be a multiple of {ALIGN} and at least "
                f"page_bytes ({self.page_bytes}); the default is {16 * MiB}"
            )
        if self.io.restore_inflight_bytes < self.io.command_bytes:
            raise ConfigError(
                f"io.restore_inflight_bytes: {self.io.restore_inflight_bytes} must be at least io.command_bytes "
                f"({self.io.command_bytes}), or a restore could not have one command in flight"
            )
        if self.io.gap_bytes < 0:
            raise ConfigError(f"io.gap_bytes: {self.io.gap_bytes} must be >= 0")
        if not 0 <= self.io.kvikio_threads <= 1024:
            raise ConfigError(f"io.kvikio_threads: {self.io.kvikio_threads} must be 0 (derived) to 1024")
        if self.io.staging_slot_bytes % ALIGN or self.io.staging_slot_bytes < self.page_bytes:
            raise ConfigError(
                f"io.staging_slot_bytes: {self.io.staging_slot_bytes} must be a multiple of "
                f"{ALIGN} and at least page_bytes ({self.page_bytes})"
            )
        _one_of(self.agent.journal_fsync, JOURNAL_FSYNC_POLICIES, "agent.journal_fsync")
        if not 0 <= self.agent.metrics_port <= 65535:
            raise ConfigError(f"agent.metrics_port: {self.agent.metrics_port} is not a TCP port (0 picks a free one)")
        _positive(self.agent, "journal_fsync_ms", "journal_compact_bytes", "journal_compact_records",
                  "http_max_connections", "max_clients", "max_clients_per_process", prefix="agent.")  # fmt: skip
        if not self.agent.epoch_wait_s >= 0:
            raise ConfigError(f"agent.epoch_wait_s: {self.agent.epoch_wait_s} must be >= 0 (seconds a starting agent "
                              "waits for the previous one's writes and restores; default 30)")  # fmt: skip
        if not self.agent.journal_compact_ratio > 1:
            raise ConfigError(f"agent.journal_compact_ratio: {self.agent.journal_compact_ratio} must be > 1 (growth "
                              "over the compacted size that triggers a compaction; default 2)")  # fmt: skip
        if self.agent.shared_index_slots < 0:
            raise ConfigError(f"agent.shared_index_slots: {self.agent.shared_index_slots} must be >= 0 "
                              "(0: sized from the pools)")  # fmt: skip
        for name in ("http_timeout_s", "frame_timeout_s"):
            if not getattr(self.agent, name) > 0:
                raise ConfigError(f"agent.{name}: {getattr(self.agent, name)} must be > 0 seconds")
        if not self.agent.idle_timeout_s >= 0:
            raise ConfigError(f"agent.idle_timeout_s: {self.agent.idle_timeout_s} must be >= 0 (0: never)")
        if self.agent.frame_budget_bytes < MAX_FRAME:
            raise ConfigError(f"agent.frame_budget_bytes: {self.agent.frame_budget_bytes} must be at least one "
                              f"whole frame ({MAX_FRAME} bytes)")  # fmt: skip
        _one_of(self.io.verify_reads, VERIFY_READS, "io.verify_reads")
        self._check_cluster()

    def _check_cluster(self) -> None:
        c = self.cluster
        for where, address in (("cluster.listen", c.listen), *(("cluster.peers", p) for p in c.peers)):
            if address and host_port(address) is None:
                raise ConfigError(f"{where}: {address!r} must be host:port (an IPv4 address or name, and a port "
                                  "0..65535; port 0 in listen picks a free one)")  # fmt: skip
        _one_of(c.transfer_protocol, TRANSFER_PROTOCOLS, "cluster.transfer_protocol")
        _one_of(c.one_sided_dram, ("auto", "on", "off"), "cluster.one_sided_dram")
        if c.listen and not c.secret_file and not c.insecure_peers:
            raise ConfigError("cluster.secret_file: required with cluster.listen, so that only this cache's agents "
                              "read its pages: give a file holding the cache's peer secret (the operator mounts "
                              "<cache>-peer-secret), or set cluster.insecure_peers to serve anyone who reaches "
                              "the port")  # fmt: skip
        min_stage = 2 * self.layers * self.page_bytes
        if c.staging_bytes % ALIGN or c.staging_bytes < min_stage:
            raise ConfigError(f"cluster.staging_bytes: {c.staging_bytes} must be a multiple of {ALIGN} and hold at "
                              f"least two pages of all layers ({min_stage} bytes)")  # fmt: skip
        if not c.peer_timeout_s > 0:
            raise ConfigError(f"cluster.peer_timeout_s: {c.peer_timeout_s} must be > 0 seconds")
        if c.max_peer_clients < 1:
            raise ConfigError(f"cluster.max_peer_clients: {c.max_peer_clients} must be >= 1")
        if c.max_peer_leases < 1:
            raise ConfigError(f"cluster.max_peer_leases: {c.max_peer_leases} must be >= 1")
        if not c.peer_idle_timeout_s > 0:
            raise ConfigError(f"cluster.peer_idle_timeout_s: {c.peer_idle_timeout_s} must be > 0 seconds (peer "
                              "connections always idle out)")  # fmt: skip
        if c.peer_frame_budget_bytes < MAX_FRAME:
            raise ConfigError(f"cluster.peer_frame_budget_bytes: {c.peer_frame_budget_bytes} must be at least one "
                              f"whole frame ({MAX_FRAME} bytes)")  # fmt: skip
        if c.prefill_tokens_per_s < 0:
            raise ConfigError(f"cluster.prefill_tokens_per_s: {c.prefill_tokens_per_s} must be >= 0 (0: always fetch)")
        _one_of(self.prepare.hugepage_size, HUGEPAGE_SIZES, "prepare.hugepage_size")
        if self.prepare.devices and not Path(self.ssd.dir).is_relative_to(self.prepare.mount):
            raise ConfigError(f"ssd.dir: {self.ssd.dir} must lie under prepare.mount ({self.prepare.mount}) "
                             "when prepare.devices are given")  # fmt: skip
        if self.cluster.cache and not self.cluster.namespace:
            raise ConfigError("cluster.namespace: required with cluster.cache (the FlatCakeCache's namespace)")
        if self.cluster.report_interval_s <= 0:
            raise ConfigError(f"cluster.report_interval_s: {self.cluster.report_interval_s} must be > 0")
        _one_of(self.io.backend, IO_BACKENDS, "io.backend")

    @property
    def state_dir(self) -> str:
        """Where the journal, the epoch file and the pool's owner lock live (``agent.state_dir``)."""
        return self.agent.state_dir or self.ssd.dir

    @property
    def dram_slots(self) -> int:
        """Pages the DRAM pool holds (``dram.bytes`` over one page's bytes, all layers)."""
        return self.dram.bytes // (self.layers * self.page_bytes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """A configuration from its JSON form, every field checked (a ``ConfigError`` names the field and the fix)."""
        if isinstance(data, dict) and RETIRED.keys() & data.keys():
            for name in sorted(RETIRED.keys() & data.keys()):
                log.warning("config: %s is no longer a configuration field (%s); ignored", name, RETIRED[name])
            data = {k: v for k, v in data.items() if k not in RETIRED}
        return _build(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        """An agent's configuration file: every field is checked, and the ``REQUIRED`` ones must be
        given (``from_dict`` fills defaults, for in-process engines and tests)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        config = cls.from_dict(data)  # a malformed field is named first, then what is missing
        missing = missing_required(data)
        if missing:
            raise ConfigError(
                f"{path}: required field(s) missing: {', '.join(missing)}. The KV geometry must match the "
                "serving engine's, and the pool's place and size are the operator's choice (no default writes "
                'gigabytes to a guessed directory); e.g. {"layers": 43, "page_bytes": 49152, "page_tokens": 256, '
                '"dram": {"bytes": 1073741824}, "ssd": {"dir": "/var/lib/flatcake/pool", "file_bytes": '
                '268435456, "file_count": 16}}'
            )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``from_dict`` reads back (what the operator renders as engine.json)."""
        return dataclasses.asdict(self)


# Fields earlier versions rendered, accepted and ignored (with a warning) so an agent upgraded before its
# operator still starts: the reason each left.
RETIRED = {
    "scheduler": "request ordering is the serving engine's: FC-MAS runs in flatcake emulate --scheduler, "
    "SGLang's own scheduler orders a real server's requests",
}


# What a configuration file must give: no default fits every model (the geometry) or node (the pool).
REQUIRED = ("layers", "page_bytes", "page_tokens", "dram.bytes", "ssd.dir", "ssd.file_bytes", "ssd.file_count")


def missing_required(data: dict[str, Any]) -> list[str]:
    """The ``REQUIRED`` dotted fields absent from ``data``."""
    missing = []
    for name in REQUIRED:
        node: Any = data
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            missing.append(name)
    return missing


def _one_of(value: str, allowed: tuple[str, ...], where: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}: {value!r} must be one of {', '.join(allowed)}")


def _positive(obj: object, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{prefix}{name}: {value!r} must be a positive integer")


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` address, or None where it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535 or "/" in host:
        return None
    return host, int(port)


T = TypeVar("T")


def _build(cls: type[T], data: Any, path: str) -> T:
    """Build a (nested) config dataclass from plain data, naming the field of any mismatch."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{path or 'config'}: unknown field(s) {unknown}; known: {sorted(fields)}")
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
    raise ConfigError(f"{where}: {value!r} is not of type {names}")
