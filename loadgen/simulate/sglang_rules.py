"""SGLang HiCache's rules, simulated: ``Tiered`` (the host tier alone, ``dram``, or over an SSD log,
``tiered``) and FlatCake as it ships (``ShippedFlatCake``: the same rules with FlatCake's backend as the
L3), charged by the node model (``model.py``) as the native system is, so they stay comparable."""

from __future__ import annotations

import dataclasses
from typing import Any

from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import Cluster, Instance, Job, System
from flatcake.loadgen.simulate.native import FlatCake, filled
from flatcake.loadgen.simulate.workload import SimRequest
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent.policy.gva import SSD_THRESHOLD


class Tiered(System):
    """SGLang HiCache's rules (loadgen/systems/hicache_rules.py): FCFS, prefetch at admission in 128-page batches
    by one I/O thread, declined at half the host pool in flight, stopped by the timeout policy."""

    def __init__(self, c: Cluster, loop: EventLoop, l3: bool = True) -> None:
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
        inst.passes += 1
        for job in hicache.due_lookups(inst.waiting, inst.passes):
            self._look_up(job, inst.hbm.prefix(job.req.keys))
            self._try_prefetch(job)
        chosen, wake = hicache.schedule(inst.waiting, self.c.prefetch_policy, now, pt, self._try_prefetch)
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
            self._l3_append(inst.node, self._unstored(inst.node, new))
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
            return self._l3_append(inst.node, self._unstored(inst.node, evicted))
        return None

    def _unstored(self, node: int, keys: list[int]) -> list[int]:
        """The keys the L3 does not hold (SGLang's backends are asked ``batch_exists`` and write the rest)."""
        l3 = self.l3[node]
        return [k for k in keys if k not in l3]

    def _l3_append(self, node: int, keys: list[int]) -> float | None:
        """Write ``keys`` to the node's log, found at once; returns when the device has written them."""
        if not keys:
            return None
        writes = self._log(node, keys)
        span = self.c.page_span
        return self.ssd[node].submit(self.loop.now, writes * span, max(1, writes * span // self.c.bucket_bytes),
                                     write=True)  # fmt: skip

    def _log(self, node: int, keys: list[int]) -> int:
        """Append ``keys`` to the node's bucket log (the index only); returns how many."""
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
        return writes

    def occupancy(self) -> tuple[int, int]:
        w, span = self.c.width, self.c.page_span
        dram = sum(len(i.l2) for node in self.instances for i in node) * span * w
        ssd = sum(len(m) for m in self.l3) * span * w
        return dram, ssd

    def counters(self) -> dict[str, Any]:
        return {"reclaimed_buckets": self.reclaimed_buckets, "invalidated_pages": self.invalidated_pages}


class HostTierOnly(Tiered):
    """SGLang HiCache's host tier alone (``dram``): ``Tiered`` with no storage below it."""

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        super().__init__(c, loop, l3=False)


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
