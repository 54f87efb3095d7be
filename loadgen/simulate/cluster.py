"""The simulated systems on one cluster: FlatCake (the agent's catalog, placement, reclaim, read plans
and FC-MAS), tiered-l2 (SGLang HiCache's host tier only) and tiered-l3 (host tier evicting into an
SSD log in eviction order, Mooncake-like, read a whole page per command).

Each node has its storage devices; each serving instance (a tensor/expert-parallel group of
``width`` GPUs) has a GPU that prefills one request at a time, an HBM prefix cache and a host-to-device
link. Everything is in one rank's view: a page is one rank's ``layers x page_layer_bytes`` and the
node's devices and DRAM/SSD are divided by the ranks that share them (ranks are symmetric).

Why one module of this size: the three systems share the node model (devices, HBM, links) and are
charged by the same rules, which stay comparable only side by side; each system is one class.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake.errors import CapacityError
from flatcake.loadgen import names
from flatcake.loadgen.overlap import even_arrivals, latest, prefill_end
from flatcake.loadgen.simulate.devices import Device, DeviceProfile
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.hbm import HbmCache
from flatcake.loadgen.simulate.workload import SimRequest, route
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent import ChainSignals, Hints, PlacementConfig
from flatcake.node_agent.catalog.local import Lease, LocalCatalog
from flatcake.node_agent.policy.coalesce import plan_restore
from flatcake.node_agent.policy.gva import SSD_THRESHOLD, Medium
from flatcake.node_agent.policy.scheduler import Request, Scheduler
from flatcake.node_agent.policy.scopes import Location, ScopeTable

SYSTEMS = names.names("simulate")
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
    l3_dram: set[int] = field(default_factory=set)  # flatcake: prefetched pages its L3 served from DRAM


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
        job.inst.busy = True
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


class FlatCake(System):
    name = "flatcake-native"

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        super().__init__(c, loop)
        self.tables = [
            ScopeTable(node_id=n, layers=c.layers, page_bytes=c.page_layer_bytes, file_bytes=c.scope_file_bytes,
                       files=max(1, c.ssd_bytes // c.scope_file_bytes), dram_slots=max(1, c.dram_bytes // c.page_span),
                       adaptive=c.placement.mode == "adaptive", copies=c.placement.mode == "copies")
            for n in range(c.nodes)
        ]  # fmt: skip
        # The agent's catalog, without a journal: allocate (placement by Table 2, parent scopes), publish,
        # leases that pin scopes, reclaim whole scopes oldest first.
        self.catalogs = [LocalCatalog(t, c.placement) for t in self.tables]
        self.signals = [ChainSignals() for _ in range(c.nodes)]  # what each node's backends derive
        self.decisions: list[tuple[Hints, Medium, str]] = []  # every allocation: for the placement check
        self.placed_bytes = {Medium.DRAM: 0, Medium.SSD: 0}
        self.read_commands = 0
        self.read_bytes = 0
        # Each node's NIC (one rank's share), receiving pages other nodes hold (cross_node_bytes_per_s).
        rate = c.cross_node_bytes_per_s / c.device_ranks
        self.nics = [Device(rate, c.cross_node_latency_s, 1) for _ in range(c.nodes)] if rate > 0 else []
        self.remote_bytes = 0
        self.remote_declined = 0  # continuations found on another node, cheaper to prefill than to fetch

    def arrive(self, req: SimRequest) -> None:
        job = self._admit(req)
        inst, now, keys, h = job.inst, self.loop.now, req.keys, job.hbm_pages
        catalog = self.catalogs[inst.node]
        rest = keys[h:]
        self.signals[inst.node].observe(keys[:h], rest)  # SGLang's hit query names the chain past HBM
        n = catalog.exists(rest)
        if n:
            lease = catalog.acquire(rest[:n], copy=True)  # copies mode: filled once read (released at store)
            job.leases.append(lease)
            for key, loc in zip(rest[:n], lease.locations, strict=True):
                if loc.gva >= SSD_THRESHOLD:
                    job.ssd_keys.append(key)
                    job.ssd_locs.append(loc)
        if self.nics and n < len(rest):
            self._find_remote(job, inst.node, rest[n:])
        # FC-MAS: a request waits on its slowest medium; another node's pages count as the SSD's do.
        slow = (len(job.ssd_keys) + len(job.remote)) * self.c.page_span
        r = Request(str(req.index), now, ssd_bytes=slow)
        inst.jobs[r.id] = job
        inst.sched.arrive(r)
        self._pump_prefetch(inst)
        self.dispatch(inst)

    def _find_remote(self, job: Job, node: int, keys: tuple[int, ...] | list[int]) -> None:
        """Where this node's stored prefix ends, the longest continuation another node's catalog holds, as
        ``Cluster.exists`` asks the peers: leased there (no reclaim under the fetch) until the job stores."""
        best, hit = -1, 0
        for other, catalog in enumerate(self.catalogs):
            if other != node:
                h = catalog.exists(keys)
                if h > hit:
                    best, hit = other, h
        if not hit:
            return
        # Worth it only when moving the pages beats computing them: at TCP rates a GPU prefills a
        # prompt sooner than the network brings its KV (the rule the real client needs too).
        c = self.c
        cached = len(job.req.keys) - len(keys)
        fetch_s = c.cross_node_latency_s + hit * c.page_span * c.device_ranks / c.cross_node_bytes_per_s
        if fetch_s >= c.prefill_s(hit * c.page_tokens, cached * c.page_tokens):
            self.remote_declined += 1
            return
        lease = self.catalogs[best].acquire(keys[:hit])
        job.remote_leases.append((best, lease.id))
        job.remote.update(keys[:hit])
        job.remote_node = best
        job.remote_locs = [loc for loc in lease.locations if loc.gva >= SSD_THRESHOLD]

    def _fetch_remote(self, inst: Instance, job: Job) -> float:
        """The peer reads its SSD pages (FC-CIO), then every remote page crosses this node's NIC."""
        if not job.remote:
            return self.loop.now
        peer_ready = self._read(job.remote_node, job.remote_locs) if job.remote_locs else self.loop.now
        nbytes = len(job.remote) * self.c.page_span
        self.remote_bytes += nbytes
        return self.nics[inst.node].submit(max(self.loop.now, peer_ready), nbytes, 1)

    def _pump_prefetch(self, inst: Instance) -> None:
        """Start prefetches into host staging while streams are free and the prepared tokens stay below
        SGLang's bound (past it they wait for a dispatch; tiered's are declined)."""
        c, now = self.c, self.loop.now
        while inst.active_prefetches < c.streams:
            if hicache.rate_limited(inst.staging_tokens, self.host_pool_tokens):
                return
            r = inst.sched.next_prefetch(now)
            if r is None:
                return
            job = inst.jobs[r.id]
            job.staged = (len(job.ssd_keys) + len(job.remote)) * c.page_tokens
            inst.staging_tokens += job.staged
            local = self._read(inst.node, job.ssd_locs) if job.ssd_locs else now
            done = max(local, self._fetch_remote(inst, job))
            inst.active_prefetches += 1
            self.loop.at(done, self._prefetched, inst, r.id)

    def _read(self, node: int, locs: list[Location]) -> float:
        """Read SSD pages as the engine's restore plans them (the real ``plan_restore``); returns when done."""
        c = self.c
        gva = np.fromiter((loc.gva & OFFSET_MASK for loc in locs), np.int64, len(locs))
        stride = np.fromiter((loc.layer_stride for loc in locs), np.int64, len(locs))
        fb = c.scope_file_bytes
        fills = plan_restore(gva // fb, gva % fb, stride, c.layers, c.page_layer_bytes, c.gap_bytes,
                             c.staging_slot_bytes)  # fmt: skip
        commands = sum(f.hi - f.lo for f in fills)
        nbytes = sum(f.nbytes for f in fills)
        self.read_commands += commands
        self.read_bytes += nbytes
        self.ssd_pages_read += len(locs)
        return self.ssd[node].submit(self.loop.now, nbytes, commands)

    def _prefetched(self, inst: Instance, rid: str) -> None:
        job = inst.jobs[rid]
        job.rec.prefetch_s = self.loop.now - job.rec.arrival
        job.prefetched.update(job.ssd_keys)
        job.prefetched.update(job.remote)
        inst.active_prefetches -= 1
        inst.sched.prefetch_done(rid)
        self._pump_prefetch(inst)
        self.dispatch(inst)

    def dispatch(self, inst: Instance) -> None:
        if inst.busy:
            return
        r = inst.sched.next_dispatch()
        if r is None:
            return
        job = inst.jobs.pop(r.id)
        self._unstage(job)
        self._pump_prefetch(inst)  # staging freed
        keys, rec = job.req.keys, job.rec
        catalog = self.catalogs[inst.node]
        # As the engine restores at dispatch (the emulator's _run_prefill): the prefix in HBM or prepared
        # in host staging (copied in), then whatever is stored beyond it (DRAM pages copied in, SSD pages
        # read now while the GPU waits: evicted since arrival, or stored meanwhile), then HBM again, ...
        cached = dram = staged = 0
        late: list[Location] = []
        while True:
            n, s = self._resident(job, cached)
            cached += n
            staged += s
            n = catalog.exists(keys[cached:]) if cached < len(keys) else 0
            if not n:
                break
            lease = catalog.acquire(keys[cached : cached + n], copy=True)
            job.leases.append(lease)
            for loc in lease.locations:
                if loc.gva < SSD_THRESHOLD:
                    dram += 1
                else:
                    late.append(loc)
            cached += n
        rec.hit["dram"] += dram
        rec.hit["ssd"] += len(late)
        ready = self._read(inst.node, late) if late else None
        self.useful_ssd_bytes += rec.hit["ssd"] * self.c.page_span
        self._finish_prefill(job, cached, dram + staged, ready)

    def store(self, job: Job, cached: int) -> None:
        inst, req = job.inst, job.req
        catalog = self.catalogs[inst.node]
        for lease in job.leases:
            catalog.release(lease.id, filled(lease))  # the pages are read: their copies are filled
        job.leases.clear()
        for node, lease_id in job.remote_leases:
            self.catalogs[node].release(lease_id)
        job.remote_leases.clear()
        keys = list(req.keys)
        if cached >= len(keys):
            return
        # Each run with the hints SGLang's backend derives for it (the emulator's derivation too).
        signals = self.signals[inst.node]
        runs = signals.write(keys[:cached], keys[cached:], self.c.page_tokens)
        for run in runs:
            if not self._place(inst, keys[cached + run.start : cached + run.stop], run.hints()):
                return
        signals.record(keys[cached:], runs)

    def _place(self, inst: Instance, keys: list[int], hints: Hints, pin: bool = True) -> bool:
        """One put as the engine makes it; False when the pool refused it (the pages stay uncached).
        ``pin``: the new pages stay in ``inst``'s HBM until written (as shipped, the host tier holds them)."""
        catalog = self.catalogs[inst.node]
        try:
            alloc = catalog.allocate(keys, hints)
        except CapacityError:
            self.store_failures += 1
            return False
        if alloc is None:
            return True
        new = [keys[i] for i in alloc.index]
        self.decisions.append((hints, alloc.medium, alloc.reason))
        c = self.c
        if alloc.medium is Medium.DRAM:
            self.placed_bytes[Medium.DRAM] += len(alloc.slots) * c.page_span
            catalog.publish(alloc.id, [0] * len(new))
            return True
        self.placed_bytes[Medium.SSD] += sum(s.pages for s in alloc.segments) * c.page_span  # byte extents
        # New pages stay pinned in HBM until their write lands; then the key is published.
        if pin:
            inst.hbm.pin(new, +1)
        done = self.ssd[inst.node].submit(self.loop.now, len(new) * c.page_span, len(alloc.segments), write=True)
        self.loop.at(done, self._written, inst, alloc.id, new, pin)
        return True

    def _written(self, inst: Instance, alloc_id: int, new: list[int], pin: bool) -> None:
        self.catalogs[inst.node].publish(alloc_id, [0] * len(new))
        if pin:
            inst.hbm.pin(new, -1)

    def occupancy(self) -> tuple[int, int]:
        w = self.c.width
        dram = sum(t.used(Medium.DRAM) * t.unit_bytes(Medium.DRAM) for t in self.tables) * w
        ssd = sum(t.used(Medium.SSD) * t.unit_bytes(Medium.SSD) for t in self.tables) * w
        return dram, ssd

    def counters(self) -> dict[str, Any]:
        placements: dict[str, int] = {}
        for cat in self.catalogs:
            for k, v in cat.placements.snapshot().items():
                placements[k] = placements.get(k, 0) + v
        copies: dict[str, int] = {}
        for t in self.tables:
            for k, v in t.copy_stats.snapshot().items():
                copies[k] = copies.get(k, 0) + v
        out: dict[str, Any] = {"placements_pages": placements, "store_failures": self.store_failures}
        if any(t.copy_index is not None for t in self.tables):
            out["copy_pages"] = copies
        return out


class Tiered(System):
    """SGLang HiCache's rules (loadgen/systems/hicache_rules.py): FCFS, prefetch at admission in 128-page batches
    by one I/O thread, declined at half the host pool in flight, stopped by the timeout policy."""

    def __init__(self, c: Cluster, loop: EventLoop, l3: bool) -> None:
        super().__init__(c, loop)
        self.name = "tiered" if l3 else "dram"
        self.l3_enabled = l3
        self.bucket_pages = max(1, c.bucket_bytes // c.page_span)
        self.buckets = max(1, c.ssd_bytes // (self.bucket_pages * c.page_span)) if l3 else 0
        self.l3: list[dict[int, int]] = [{} for _ in range(c.nodes)]  # key -> bucket
        self.bucket_keys: list[list[list[int]]] = [[[] for _ in range(self.buckets)] for _ in range(c.nodes)]
        self.cursor = [0] * c.nodes
        self.reclaimed_buckets = 0
        self.invalidated_pages = 0
        self.read_commands = 0
        self.read_bytes = 0

    def _l3_prefix(self, node: int, keys: tuple[int, ...], start: int) -> int:
        l3, n = self.l3[node], start
        while n < len(keys) and keys[n] in l3:
            n += 1
        return n - start

    def arrive(self, req: SimRequest) -> None:
        job = self._admit(req)
        self._look_up(job, job.hbm_pages)
        self._try_prefetch(job)
        job.inst.waiting.append(job)
        self.dispatch(job.inst)

    def _look_up(self, job: Job, hbm_pages: int) -> None:
        """The storage span past HBM and the host tier: what a prefetch would bring."""
        inst, keys, h, d = job.inst, job.req.keys, hbm_pages, 0
        while h + d < len(keys) and keys[h + d] in inst.l2:
            d += 1
        if self.l3_enabled:
            s = self._l3_prefix(inst.node, keys, h + d)
            job.ssd_keys = list(keys[h + d : h + d + s])

    def _try_prefetch(self, job: Job) -> None:
        tokens = len(job.ssd_keys) * self.c.page_tokens
        job.retry = False
        if not self.l3_enabled:
            return
        if not hicache.worth_prefetching(tokens):  # a miss (or too little): asked again passes later
            job.lookup_at = hicache.miss_retry_at(job.inst.passes, job.lookups)
            return
        inst = job.inst
        if hicache.rate_limited(inst.staging_tokens, self.host_pool_tokens):
            job.attempts += 1
            job.retry = job.attempts <= hicache.RETRY_MAX_ATTEMPTS
            return
        job.op = hicache.Prefetch(pages=len(job.ssd_keys))
        job.staged = tokens
        inst.staging_tokens += tokens
        inst.io.append(job)
        self._pump_io(inst)

    def _pump_io(self, inst: Instance) -> None:
        """The one prefetch I/O thread: the next 128-page batch of the oldest operation."""
        while not inst.io_busy and inst.io:
            job = inst.io[0]
            op = job.op
            assert op is not None
            if op.terminated or job.io_pos >= op.pages:
                self._op_finished(inst, job)
                continue
            batch = job.ssd_keys[job.io_pos : job.io_pos + hicache.STORAGE_BATCH_PAGES]
            got, done = self._read_batch(inst.node, batch, job)
            inst.io_busy = True
            self.loop.at(done, self._batch_done, inst, job, batch[:got], len(batch))

    def _read_batch(self, node: int, batch: list[int], job: Job) -> tuple[int, float]:
        """Read one batch's stored prefix from the L3 (a page reclaimed meanwhile stops it); returns how many
        pages and when they are in: the log's whole-page reader, one command per page, all its layers."""
        got = self._l3_prefix(node, tuple(batch), 0)
        span = self.c.page_span
        self.read_commands += got
        self.read_bytes += got * span
        self.ssd_pages_read += got
        return got, self.ssd[node].submit(self.loop.now, got * span, got)

    def _batch_done(self, inst: Instance, job: Job, got: list[int], asked: int) -> None:
        inst.io_busy = False
        op = job.op
        assert op is not None
        if not op.terminated:  # a stopped prefetch's late pages are not the request's
            job.prefetched.update(got)  # held in host staging until the request is dispatched
            op.completed += len(got)
        self._l2_insert(inst, got)  # read pages join the host tier
        job.io_pos += asked
        if len(got) < asked:
            job.io_pos = op.pages
        if job.io_pos >= op.pages:
            self._op_finished(inst, job)
        self._pump_io(inst)
        self.dispatch(inst)

    def _op_finished(self, inst: Instance, job: Job) -> None:
        assert job.op is not None
        if not job.op.finished:
            job.op.finished = True
            job.rec.prefetch_s = self.loop.now - job.rec.arrival
        if inst.io and inst.io[0] is job:
            inst.io.popleft()

    def dispatch(self, inst: Instance) -> None:
        """One SGLang scheduling pass over the FCFS waiting queue."""
        if inst.busy:
            return
        now, pt = self.loop.now, self.c.page_tokens
        wake: float | None = None
        chosen = None
        inst.passes += 1
        for job in hicache.due_lookups(inst.waiting, inst.passes):
            self._look_up(job, inst.hbm.prefix(job.req.keys))
            self._try_prefetch(job)
        for job in inst.waiting:
            if job.retry:
                self._try_prefetch(job)
            op = job.op
            if op is not None and not op.terminated:
                if not op.may_stop(self.c.prefetch_policy, now, pt):
                    deadline = op.deadline(pt) if self.c.prefetch_policy == "timeout" else None
                    if deadline is not None:
                        wake = deadline if wake is None else min(wake, deadline)
                    continue
                op.terminated = True
            chosen = job
            break
        if chosen is None:
            if wake is not None and (inst.wake_at is None or wake < inst.wake_at or inst.wake_at <= now):
                inst.wake_at = wake
                self.loop.at(wake + 1e-6, self.dispatch, inst)
            return
        inst.waiting.remove(chosen)
        job = chosen
        self._unstage(job)
        if job.retry or (job.attempts and job.op is None):
            job.declined = len(job.ssd_keys)
        keys, rec, l2 = job.req.keys, job.rec, inst.l2
        cached = dram = staged = 0
        while True:  # HBM or host staging (prepared), then the host tier, then HBM again, ...
            start = cached
            n, s = self._resident(job, cached)
            cached += n
            staged += s
            hit = cached
            while cached < len(keys) and keys[cached] in l2:
                dram += 1
                cached += 1
            for key in reversed(keys[hit:cached]):  # a use, deepest page first (as the host tier inserts)
                l2.move_to_end(key)
            if cached == start:
                break
        rec.hit["dram"] += dram
        rest = self._l3_prefix(inst.node, keys, cached) if self.l3_enabled and cached < len(keys) else 0
        if rest:
            # SGLang reads storage only through a prefetch: what it did not bring is recomputed.
            if job.declined:
                rec.declined_pages = min(job.declined, rest)
            else:
                rec.unprefetched_pages = rest
        self.useful_ssd_bytes += rec.hit["ssd"] * self.c.page_span
        self._finish_prefill(job, cached, dram + staged)

    def store(self, job: Job, cached: int) -> None:
        """New pages enter the host tier and (``tiered``) are backed up to the node's SSD log (L3); what
        falls off the host tier's LRU end is dropped (``dram``). HiCache evicts a page from HBM only once
        it is backed up, so the new pages stay pinned there until the one writer has copied them into the
        host tier (and written what that pushed out, as the emulator's store returns then)."""
        inst, new = job.inst, list(job.req.keys[cached:])
        if not new:
            return
        inst.hbm.pin(new, +1)
        done = inst.writer.submit(self.loop.now, len(new) * self.c.page_span, 1)
        spilled = self._l2_insert(inst, new)
        if self.l3_enabled:
            # SGLang's write_through (its documented setting with a storage backend) backs every page up
            # to storage as it enters the host tier, so the node's L3 serves its other instances too. HBM
            # waits for the host copy only: the backup runs from the host tier.
            self._l3_append(inst.node, [k for k in new if k not in self.l3[inst.node]])
        self.loop.at(max(done, spilled or done), inst.hbm.pin, new, -1)

    def _l2_insert(self, inst: Instance, keys: list[int]) -> float | None:
        """Insert into the host tier; when the evicted pages' write to the log lands (None: no write)."""
        if not keys:
            return None
        l2 = inst.l2
        for key in reversed(keys):
            l2[key] = None
            l2.move_to_end(key)
        excess = len(l2) - self.l2_pages
        if excess <= 0:
            return None
        evicted = [l2.popitem(last=False)[0] for _ in range(excess)]
        if self.l3_enabled:
            return self._l3_append(inst.node, [k for k in evicted if k not in self.l3[inst.node]])
        return None

    def _l3_append(self, node: int, keys: list[int]) -> float | None:
        if not keys:
            return None
        l3, buckets = self.l3[node], self.bucket_keys[node]
        writes = 0
        for key in keys:
            b = self.cursor[node] // self.bucket_pages
            if self.cursor[node] % self.bucket_pages == 0 and buckets[b]:
                # The log wrapped: the oldest bucket is freed whole, whoever's pages it holds.
                self.reclaimed_buckets += 1
                for old in buckets[b]:
                    if l3.get(old) == b:
                        del l3[old]
                        self.invalidated_pages += 1
                buckets[b] = []
            buckets[b].append(key)
            l3[key] = b
            writes += 1
            self.cursor[node] = (self.cursor[node] + 1) % (self.bucket_pages * self.buckets)
        span = self.c.page_span
        return self.ssd[node].submit(self.loop.now, writes * span, max(1, writes * span // self.c.bucket_bytes),
                                     write=True)  # fmt: skip

    def occupancy(self) -> tuple[int, int]:
        w, span = self.c.width, self.c.page_span
        dram = sum(len(i.l2) for node in self.instances for i in node) * span * w
        ssd = sum(len(m) for m in self.l3) * span * w
        return dram, ssd

    def counters(self) -> dict[str, Any]:
        return {"reclaimed_buckets": self.reclaimed_buckets, "invalidated_pages": self.invalidated_pages}


class ShippedFlatCake(Tiered):
    """FlatCake as it ships: SGLang HiCache's rules (``Tiered``'s: FCFS, prefetch at admission by one I/O thread
    in 128-page batches, declined at half the host pool, stopped by the timeout, no storage reads after
    admission) with FlatCake's backend as the L3 under SGLang's host tier, as the emulator's ``flatcake``
    runs it: the DRAM budget split between the host tier and FlatCake's pool (``storage_dram_share``, half
    each by default); new pages are written through to
    FlatCake (Table 2 placement from the chain, per run, as the backend derives it) and read back by the
    engine's coalesced plan (SSD pages) or from its DRAM pool. The agent's catalog is ``FlatCake``'s own
    (its tables, leases, reclaim), sharing this system's devices."""

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        pool = int(c.dram_bytes * c.storage_dram_share)
        super().__init__(dataclasses.replace(c, dram_bytes=c.dram_bytes - pool), loop, l3=True)
        self.name = "flatcake"
        self.fc = FlatCake(dataclasses.replace(c, dram_bytes=pool), loop)
        self.fc.ssd = self.ssd  # one node's devices serve both the reads and the write-throughs

    def _l3_prefix(self, node: int, keys: tuple[int, ...], start: int) -> int:
        self.fc.signals[node].observe(keys[:start], keys[start:])  # the backend's batch_exists sees the chain
        return self.fc.catalogs[node].exists(keys[start:])

    def _read_batch(self, node: int, batch: list[int], job: Job) -> tuple[int, float]:
        """One prefetch batch restored by FlatCake's engine under a lease: SSD pages by its coalesced plan,
        DRAM pages (homes, copies) from its pool (counted as DRAM hits, ``Job.l3_dram``)."""
        catalog = self.fc.catalogs[node]
        got = catalog.exists(batch)  # reclaimed meanwhile: the batch stops there
        done = self.loop.now
        if got:
            lease = catalog.acquire(batch[:got], copy=True)
            ssd = [loc for loc in lease.locations if loc.gva >= SSD_THRESHOLD]
            job.l3_dram.update(k for k, loc in zip(batch, lease.locations, strict=False) if loc.gva < SSD_THRESHOLD)
            if ssd:
                done = self.fc._read(node, ssd)
            self.ssd_pages_read += len(ssd)
            self.loop.at(done, catalog.release, lease.id, filled(lease))
        return got, done

    def store(self, job: Job, cached: int) -> None:
        """New pages enter the host tier and are written through to FlatCake, run by run with their hints."""
        inst, keys = job.inst, list(job.req.keys)
        new = keys[cached:]
        if not new:
            return
        inst.hbm.pin(new, +1)
        done = inst.writer.submit(self.loop.now, len(new) * self.c.page_span, 1)
        self._l2_insert(inst, new)
        signals = self.fc.signals[inst.node]
        runs = signals.write(keys[:cached], new, self.c.page_tokens)
        for run in runs:  # FlatCake's put, from the host tier: nothing pinned in HBM for it
            if not self.fc._place(inst, new[run.start : run.stop], run.hints(), pin=False):
                break
        else:
            signals.record(new, runs)
        self.loop.at(done, inst.hbm.pin, new, -1)

    def _l3_append(self, node: int, keys: list[int]) -> float | None:
        return None  # written through already: a host eviction writes nothing

    def occupancy(self) -> tuple[int, int]:
        host, _ = super().occupancy()
        dram, ssd = self.fc.occupancy()
        return host + dram, ssd

    def counters(self) -> dict[str, Any]:
        return self.fc.counters()


def filled(lease: Lease) -> list[int]:
    """What the engine reports to ``release`` once a lease's pages are read: every copy it was asked
    for filled (the simulator's pages have checksum 0)."""
    return [0 for slot in lease.copies if slot >= 0]


def make(name: str, c: Cluster, loop: EventLoop) -> System:
    if name == "flatcake":
        return ShippedFlatCake(c, loop)
    if name == "flatcake-native":
        return FlatCake(c, loop)
    if name in ("dram", "tiered"):
        return Tiered(c, loop, l3=name == "tiered")
    raise ValueError(f"--systems: {name!r} is not a system; choose from {','.join(SYSTEMS)}")
