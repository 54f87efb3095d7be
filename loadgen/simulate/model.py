"""The simulated cluster's node model, shared by every simulated system: its sizes (``Cluster``), a
request's record, the jobs and instances (each serving instance: a tensor/expert-parallel group of
``width`` GPUs with one GPU that prefills one request at a time, an HBM prefix cache and a
host-to-device link) and ``System``, the base each system (``native.py``, ``sglang_rules.py``) builds on.
Everything is in one rank's view: a page is one rank's ``layers x page_layer_bytes`` and the node's
devices and DRAM/SSD are divided by the ranks that share them (ranks are symmetric)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flatcake.loadgen.overlap import even_arrivals, latest, prefill_end
from flatcake.loadgen.simulate.devices import Device, DeviceProfile
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.hbm import HbmCache
from flatcake.loadgen.simulate.workload import SimRequest, route
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent import PlacementConfig
from flatcake.node_agent.policy.scheduler import Scheduler
from flatcake.node_agent.policy.scope import Location

OFFSET_MASK = (1 << 48) - 1


@dataclass(frozen=True)
class Cluster:
    """Sizes and costs in one rank's view (``run.cluster`` derives them from the CLI's node sizes)."""

    nodes: int
    instances_per_node: int
    width: int  # GPUs per instance (ranks sharing a page's bytes)
    layers: int
    page_tokens: int
    page_layer_bytes: int
    hbm_pages: int  # per instance
    dram_bytes: int  # per node, one rank's share (node DRAM / width)
    ssd_bytes: int  # per node, one rank's share
    device: DeviceProfile
    prefill_s: Callable[[int, int], float]
    decode_s_per_token: float
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    scheduler: str = "mas"
    scope_file_bytes: int = 256 << 20  # per rank: SsdConfig's default
    gap_bytes: int = 64 * 1024  # Δgap (IOConfig default)
    staging_slot_bytes: int = 8 << 20
    streams: int = 4  # FlatCake's concurrent restores per instance (IOConfig default)
    prefetch_policy: str = hicache.DEFAULT_PREFETCH_POLICY
    bucket_bytes: int = 64 << 20  # tiered L3 log bucket (bench restore's)
    device_ranks: int = 1  # ranks sharing a node's devices (run.cluster: an instance's width by default)
    # FlatCake across nodes (node_agent/service/cluster.py): a node's lookup goes on in the other nodes'
    # catalogs, their pages fetched over each node's NIC at this rate (one rank's share); 0: off.
    cross_node_bytes_per_s: float = 0.0
    cross_node_latency_s: float = 20e-6  # per transfer: the lookup and lease round trips, the first byte
    storage_dram_share: float = 0.5  # flatcake (shipped): FlatCake's pool's share of DRAM, the rest SGLang's host tier
    wait_rule: str = "cost"  # flatcake-native: wait for a load only where computing would cost more (policy.offer)

    @property
    def page_span(self) -> int:
        return self.layers * self.page_layer_bytes


@dataclass
class Record:
    """One request's outcome."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    pages: int
    hit: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "dram": 0, "ssd": 0, "remote": 0})
    start: float = 0.0
    first_token: float = 0.0
    done: float = 0.0
    prefetch_s: float | None = None
    declined_pages: int = 0
    unprefetched_pages: int = 0


@dataclass(eq=False)
class Job:
    req: SimRequest
    rec: Record
    inst: Instance
    hbm_pages: int  # leading pages in HBM at arrival (not pinned: they may be evicted before dispatch)
    leases: list[Any] = field(default_factory=list)  # FlatCake: pinned scopes, released once stored
    ssd_keys: list[int] = field(default_factory=list)
    ssd_locs: list[Location] = field(default_factory=list)
    prefetched: set[int] = field(default_factory=set)  # prepared in host staging: copied in at dispatch
    remote: set[int] = field(default_factory=set)  # FlatCake: of those, pages fetched from another node
    remote_leases: list[tuple[int, int]] = field(default_factory=list)  # (node, lease id) on other nodes
    remote_locs: list[Location] = field(default_factory=list)
    remote_node: int = -1
    staged: int = 0  # tokens prepared (in flight) until the request is dispatched
    # tiered (SGLang HiCache)
    op: hicache.Prefetch | None = None
    attempts: int = 0
    retry: bool = False
    lookups: int = 0  # tiered: storage lookups asked again after a miss
    lookup_at: int | None = None  # tiered: the scheduling pass that asks storage again
    declined: int = 0
    io_pos: int = 0
    est_prefill_s: float = 0.0  # flatcake-native: its prefill as expected at arrival (the GPU's queued work)
    l3_dram: set[int] = field(default_factory=set)  # flatcake: prefetched pages its L3 served from DRAM
    ssd_declined: bool = False  # flatcake-native: its SSD pages declined at arrival (computing beat waiting)


class Instance:
    def __init__(self, node: int, index: int, c: Cluster) -> None:
        self.node, self.index = node, index
        self.hbm = HbmCache(c.hbm_pages)
        self.h2d = Device(c.device.h2d_bytes_per_s, 0.0, 1)
        self.writer = Device(c.device.h2d_bytes_per_s, 0.0, 1)  # tiered: the one thread filling the host tier
        self.busy = False
        self.sched = Scheduler(c.scheduler)
        self.jobs: dict[str, Job] = {}
        self.active_prefetches = 0
        self.busy_until = 0.0  # when the running prefill ends
        self.preparing_bytes = 0  # flatcake-native: SSD bytes of requests whose prefetch has not started
        self.queued_work_s = 0.0  # flatcake-native: expected prefill seconds of the requests waiting here
        # tiered
        self.l2: OrderedDict[int, None] = OrderedDict()
        self.waiting: list[Job] = []
        self.staging_tokens = 0
        self.io: deque[Job] = deque()
        self.io_busy = False
        self.wake_at: float | None = None
        self.passes = 0  # tiered: scheduling passes so far (SGLang paces lookup retries by them)


class System:
    name = "system"

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        self.c, self.loop = c, loop
        ranks = c.device_ranks
        # A node's devices serve all its ranks at once: one rank's view gets a rank's share.
        self.ssd = [
            Device(c.device.read_bytes_per_s / ranks, c.device.command_s, max(1, c.device.queue_depth // ranks),
                   c.device.write_bytes_per_s / ranks)
            for _ in range(c.nodes)
        ]  # fmt: skip
        self.instances = [[Instance(n, i, c) for i in range(c.instances_per_node)] for n in range(c.nodes)]
        self.records: list[Record] = []
        self.on_done: Callable[[Record], None] | None = None
        # Each instance's host pool is its ranks' share of the node's DRAM; prepared pages wait in host
        # staging, bounded by half of it for every system (SGLang's rule: hicache.capacity_tokens).
        self.l2_pages = max(1, c.dram_bytes // c.instances_per_node // c.page_span)
        self.host_pool_tokens = self.l2_pages * c.page_tokens
        self.useful_ssd_bytes = 0  # bytes of SSD pages that reached a prefill as hits
        self.ssd_pages_read = 0
        self.store_failures = 0

    # ---- shared ---------------------------------------------------------------------------------
    def instance(self, req: SimRequest) -> Instance:
        node = route(req.session, self.c.nodes)
        return self.instances[node][route(req.session + "/i", self.c.instances_per_node)]

    def arrive(self, req: SimRequest) -> None:
        raise NotImplementedError

    def _admit(self, req: SimRequest) -> Job:
        """Route the request and note the prefix it finds in its instance's HBM, for every system. It is
        not pinned: SGLang locks a request's radix-tree match only when it schedules the request
        (``PrefillAdder._lock_node`` in ``managers/schedule_policy.py``), so a waiting request's prefix
        can be evicted, and is looked up again at dispatch (as the emulator does)."""
        inst = self.instance(req)
        rec = Record(req.index, self.loop.now, req.input_tokens, req.output_tokens, len(req.keys))
        h = inst.hbm.prefix(req.keys)
        inst.hbm.touch(req.keys[:h])
        return Job(req, rec, inst, h)

    def _resident(self, job: Job, start: int) -> tuple[int, int]:
        """The pages from ``start`` in HBM or prepared in the job's host staging, counted as hits:
        (how many, how many of them staged, to copy in)."""
        keys, hbm, hit = job.req.keys, job.inst.hbm, job.rec.hit
        n = staged = 0
        while start + n < len(keys):
            key = keys[start + n]
            if key in hbm:
                hit["hbm"] += 1
            elif key in job.prefetched:
                hit["remote" if key in job.remote else "dram" if key in job.l3_dram else "ssd"] += 1
                staged += 1
            else:
                break
            n += 1
        return n, staged

    def _unstage(self, job: Job) -> None:
        """A dispatched request's prepared tokens leave the in-flight count (its pages are copied in now)."""
        job.inst.staging_tokens -= job.staged
        job.staged = 0

    def _finish_prefill(self, job: Job, cached: int, host_pages: int, ready: float | None = None) -> None:
        """Start the prefill of the uncached tokens, its compute overlapping the layers restored for it
        (``host_pages`` copied in from DRAM or host staging; ``ready``: when an inline SSD read lands;
        each moves its layers in turn at one rate): the rule the emulator charges too
        (loadgen/overlap.py). The GPU is busy from now until the first token."""
        c, now, rec = self.c, self.loop.now, job.rec
        rec.start = now
        cached_tokens = min(cached * c.page_tokens, job.req.input_tokens)
        ssd = even_arrivals(now, ready, c.layers) if ready is not None and ready > now else []
        dram = []
        if host_pages:
            dram = even_arrivals(now, job.inst.h2d.submit(now, host_pages * c.page_span, 1), c.layers)
        compute = c.prefill_s(job.req.input_tokens - cached_tokens, cached_tokens)
        end = prefill_end(now, latest(ssd, dram), c.layers, compute)
        job.inst.busy, job.inst.busy_until = True, end
        self.loop.at(end, self._prefill_done, job, cached)

    def _prefill_done(self, job: Job, cached: int) -> None:
        rec, inst, now = job.rec, job.inst, self.loop.now
        rec.first_token = now
        rec.done = now + rec.output_tokens * self.c.decode_s_per_token
        inst.busy = False
        keys = job.req.keys
        inst.hbm.insert(list(keys))  # the whole prompt is in HBM after its prefill
        self.store(job, cached)
        self.records.append(rec)
        if self.on_done is not None:
            self.on_done(rec)
        self.dispatch(inst)

    def store(self, job: Job, cached: int) -> None:
        raise NotImplementedError

    def dispatch(self, inst: Instance) -> None:
        raise NotImplementedError

    def occupancy(self) -> tuple[int, int]:
        """(DRAM bytes, SSD bytes) used, cluster-wide, all ranks."""
        raise NotImplementedError

    def counters(self) -> dict[str, Any]:
        return {}
