"""The paper's engine-integrated FlatCake (``flatcake-native``), simulated: the agent's catalog,
placement, reclaim, read plans and FC-MAS, charged by the node model (``model.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from flatcake.errors import CapacityError
from flatcake.loadgen.simulate.devices import Device
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import OFFSET_MASK, Cluster, Instance, Job, System
from flatcake.loadgen.simulate.workload import SimRequest
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent import ChainSignals, Hints
from flatcake.node_agent.catalog.interface import Lease
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.policy import offer
from flatcake.node_agent.policy.coalesce import plan_restore
from flatcake.node_agent.policy.gva import SSD_THRESHOLD, Medium
from flatcake.node_agent.policy.scheduler import Request
from flatcake.node_agent.policy.scope import Location
from flatcake.node_agent.policy.scopes import ScopeTable


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
        if job.ssd_keys and self.c.wait_rule != "always":
            self._offer(job, lease.locations, h, n)
        if self.nics and n < len(rest) and not job.ssd_declined:
            self._find_remote(job, inst.node, rest[n:])
        # FC-MAS: a request waits on its slowest medium; another node's pages count as the SSD's do.
        slow = (len(job.ssd_keys) + len(job.remote)) * self.c.page_span
        r = Request(str(req.index), now, ssd_bytes=slow)
        inst.preparing_bytes += slow
        inst.queued_work_s += job.est_prefill_s
        inst.jobs[r.id] = job
        inst.sched.arrive(r)
        self._pump_prefetch(inst)
        self.dispatch(inst)

    def _offer(self, job: Job, locations: list[Location], hbm: int, stored: int) -> None:
        """Wait for the SSD pages, or decline them and compute (``policy.offer``): their expected landing
        (the device's backlog, the prefetches this instance has queued, their read) against when the GPU
        could start the request anyway (what runs and waits ahead) plus computing them. Declined, the
        prefix ends at its first SSD page; HBM and DRAM pages before it still count."""
        c, now, inst = self.c, self.loop.now, job.inst
        first = next(i for i, loc in enumerate(locations) if loc.gva >= SSD_THRESHOLD)
        dev = self.ssd[inst.node]
        own = len(job.ssd_keys) * c.page_span
        ready = offer.read_s(dev.free_at - now, inst.preparing_bytes, own, dev.bytes_per_s, c.layers * dev.command_s)
        gpu = max(0.0, inst.busy_until - now) + inst.queued_work_s
        loaded, declined = self._prefills(job, hbm + stored, hbm + first)
        choice = offer.decide(ready, gpu, declined - loaded, c.wait_rule)
        job.est_prefill_s = loaded if choice.load else declined
        if choice.load:
            return
        job.ssd_declined = True
        job.rec.declined_pages += stored - first
        job.ssd_keys.clear()
        job.ssd_locs.clear()

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
            inst.preparing_bytes -= (len(job.ssd_keys) + len(job.remote)) * c.page_span
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
        inst.queued_work_s -= job.est_prefill_s
        self._unstage(job)
        self._pump_prefetch(inst)  # staging freed
        keys, rec = job.req.keys, job.rec
        catalog = self.catalogs[inst.node]
        # As the engine restores at dispatch (the emulator's _run_prefill): the prefix in HBM or prepared
        # in host staging (copied in), then whatever is stored beyond it (DRAM pages copied in, SSD pages
        # read now while the GPU waits: evicted since arrival, or stored meanwhile), then HBM again, ...
        cached = dram = staged = 0
        late: list[Location] = []
        cut: tuple[int, dict[str, int], int, int] | None = None  # where the first late SSD page sits, and the counts
        while True:
            n, s = self._resident(job, cached)
            cached += n
            staged += s
            n = catalog.exists(keys[cached:]) if cached < len(keys) else 0
            if not n:
                break
            lease = catalog.acquire(keys[cached : cached + n], copy=True)
            job.leases.append(lease)
            for i, loc in enumerate(lease.locations):
                if loc.gva < SSD_THRESHOLD:
                    dram += 1
                elif job.ssd_declined:  # computing beat waiting for these at arrival: the prefix ends here
                    n = i
                    break
                else:
                    if cut is None:
                        cut = (cached + i, dict(rec.hit), dram, staged)
                    late.append(loc)
            cached += n
            if job.ssd_declined and n < len(lease.locations):
                break
        if late and cut is not None and not self._worth_reading_late(job, late, cut[0], cached):
            cached, rec.hit, dram, staged = cut  # computed instead: the prefix ends at the first late page
            rec.declined_pages += len(late)
            late = []
        rec.hit["dram"] += dram
        rec.hit["ssd"] += len(late)
        ready = self._read(inst.node, late) if late else None
        self.useful_ssd_bytes += rec.hit["ssd"] * self.c.page_span
        self._finish_prefill(job, cached, dram + staged, ready)

    def _worth_reading_late(self, job: Job, late: list[Location], first: int, cached: int) -> bool:
        """SSD pages found only at dispatch (stored after arrival, or evicted from HBM since) are read while
        the GPU waits for them (it is this request's now): worth it only where the read lands sooner than
        computing them would take (``policy.offer``, no GPU queue ahead)."""
        c, dev = self.c, self.ssd[job.inst.node]
        ready = offer.read_s(dev.free_at - self.loop.now, 0, len(late) * c.page_span, dev.bytes_per_s,
                             c.layers * dev.command_s)  # fmt: skip
        loaded, declined = self._prefills(job, cached, first)
        return offer.decide(ready, 0.0, declined - loaded, c.wait_rule).load

    def _prefills(self, job: Job, cached: int, kept: int) -> tuple[float, float]:
        """The request's prefill seconds with ``cached`` leading pages loaded, and with only ``kept``."""
        c, tokens = self.c, job.req.input_tokens
        full, keep = min(cached * c.page_tokens, tokens), min(kept * c.page_tokens, tokens)
        return c.prefill_s(tokens - full, full), c.prefill_s(tokens - keep, keep)

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
        if any(t.copies is not None for t in self.tables):
            out["copy_pages"] = copies
        return out


def filled(lease: Lease) -> list[int]:
    """What the engine reports to ``release`` once a lease's pages are read: every copy it was asked
    for filled (the simulator's pages have checksum 0)."""
    return [0 for slot in lease.copies if slot >= 0]
