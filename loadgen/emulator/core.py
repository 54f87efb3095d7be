"""``flatcake emulate``: an inference server for benchmarking where no GPU is at hand.

What is real: the KV storage. Every prompt page's KV (``layers x page_bytes`` of real bytes, the model
preset's bytes per token per rank) is stored and restored through the storage under test: FlatCake's
engine (placement, FC-MAS ordering, coalesced restore into a bounded window that waits when full), or
the tiered baselines (an SGLang-HiCache-like host LRU tier over an SSD log), with real I/O on this
machine's disk.

What is modelled: the GPU. With a model preset (``model``, ``gpu``; loadgen/models.py) a prefill of the
tokens not in HBM costs the preset's FLOPs for that many new tokens after the cached ones; without
one, ``tokens / prefill_tokens_per_s``. One GPU runs one prefill at a time; decode streams
``max_tokens`` tokens at the preset's (or the given) per-token time. HBM is an LRU prefix cache of
``hbm_bytes``.

Hits are delivered hits: tokens whose KV is in HBM before prefill starts. ``tiered`` follows SGLang
HiCache (loadgen/systems/hicache_rules.py cites the code): at admission the span found in storage beyond the
host tier is prefetched by one I/O thread in 128-page batches, unless the tokens already in flight
reach half the host pool (then it is declined and retried at later scheduling passes); the FCFS
scheduler skips a request whose prefetch may not stop yet under the stop policy (``best_effort``,
``wait_complete``, ``timeout``; SGLang's default ``timeout``) and schedules later ones; what had not
arrived when it stops is recomputed, as are pages that reached storage after admission. FlatCake
restores whatever is stored when the request is scheduled, streaming into HBM through its bounded
window, which waits instead; requests are ordered by FC-MAS (or FCFS, for the ablation).

Prepared pages (read from SSD before dispatch) wait in the request's host staging, never in HBM, for
both sides: SGLang holds them in its host pool until the request loads them. Both are bounded the
same way, by the tokens in flight against half the host pool: tiered declines past it, FlatCake's
prefetches wait. At dispatch they are copied into HBM layer by layer under the prefill.

Why one module of this size: a request's life (admit, restore, prefill, decode, store) is one
state machine over one clock; storage wiring is storage.py, settings config.py, the HTTP face
server.py and what it accepts params.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge

from flatcake import metrics as M
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.storage import Storage
from flatcake.loadgen.overlap import latest, prefill_end
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent import ChainSignals, aligned_empty
from flatcake.node_agent.policy.scheduler import Request, Scheduler

log = logging.getLogger(__name__)


def page_keys(tokens: Sequence[int], page_tokens: int) -> list[str]:
    """Prefix-chained keys of the prompt's full pages (a partial last page is never cached)."""
    keys, prev = [], b""
    arr = np.asarray(tokens, dtype=np.int64)
    for i in range(len(arr) // page_tokens):
        h = hashlib.blake2b(prev + arr[i * page_tokens : (i + 1) * page_tokens].tobytes(), digest_size=16)
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


def ssd_span(keys: list[str], hbm: int, media: list[str]) -> list[str]:
    """The pages a prefetch brings: from the first SSD page of the stored span past HBM (``media``,
    one entry per stored page after ``keys[:hbm]``) to its end."""
    first = media.index("ssd") if "ssd" in media else len(media)
    return keys[hbm + first : hbm + len(media)]


@dataclass
class Outcome:
    prompt_tokens: int
    hit_pages: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "dram": 0, "ssd": 0})
    declined_pages: int = 0
    unprefetched_pages: int = 0
    failed_pages: int = 0
    queue: str = "dram_ready"
    arrival: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0

    def cached_tokens(self, page_tokens: int) -> int:
        return sum(self.hit_pages.values()) * page_tokens


def scheduler_policy(cfg: EmulatorConfig) -> str:
    """How FlatCake orders requests: as chosen (``--scheduler``), else FC-MAS. The other modes are
    FCFS, as SGLang schedules. A benchmark setting, not the agent's: a real server's requests are
    ordered by its own scheduler."""
    if cfg.rules != "native":
        return "fcfs"
    return cfg.scheduler or "mas"


class Emulator:
    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        self.storage = Storage(cfg)
        self.hbm: OrderedDict[str, None] = OrderedDict()
        self.pinned: dict[str, int] = {}  # new pages until written back: not evicted
        self.hbm_pages = max(1, cfg.hbm_bytes // cfg.page_span)
        # Write-time signals as SGLang's backend derives them from the key chains it is shown (lookups
        # at arrival, write-backs after prefill): the backend's own ChainSignals.
        self.signals = ChainSignals()
        self.sched = Scheduler(scheduler_policy(cfg))
        # Tiered (SGLang HiCache): the FCFS waiting queue, the tokens in flight in prefetches
        # (prefetch_tokens_occupied) against half the host pool, and the one prefetch I/O thread.
        self.sglang_like = cfg.mode in ("flatcake", "tiered", "dram")
        self.waiting: list[_Job] = []
        self.staging_tokens = 0
        self._passes = 0  # tiered: scheduling passes so far (SGLang paces lookup retries by them)
        # SGLang's host pool bounds the tokens in flight; the native what-if has no host tier, and its
        # prefetches are bounded the same way by its DRAM budget.
        host = cfg.host_tier_bytes if self.sglang_like else cfg.dram_bytes
        self.host_pool_tokens = max(1, host // cfg.page_span) * cfg.page_tokens
        self._io_queue: asyncio.Queue[_Job] | None = None
        # Placement accuracy (FlatCake): where each stored page went, and which were asked for again.
        self.placed: dict[str, str] = {}
        self.reused: set[str] = set()
        self._cond: asyncio.Condition | None = None
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="emulator-io")
        self._prefetch_io = ThreadPoolExecutor(1, thread_name_prefix="emulator-prefetch")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="emulator-store")
        self._writes: set[Future[None]] = set()  # write-backs not yet done (a flush waits for them)
        self._tasks: list[asyncio.Task[None]] = []
        self._lookups: set[asyncio.Task[None]] = set()  # SGLang-like: missed lookups being asked again
        self.registry = CollectorRegistry()
        m = {n: f(n, self.registry) for n, f in (
            ("flatcake_requests", M.counter), ("flatcake_prompt_tokens", M.counter),
            ("flatcake_hit_tokens", M.counter), ("flatcake_miss_tokens", M.counter),
            ("flatcake_prefetch_declined", M.counter), ("flatcake_prefetch_retries", M.counter),
            ("flatcake_prefetch_seconds", M.histogram), ("flatcake_ssd_restore_bytes", M.counter),
            ("flatcake_l3_write_pages", M.counter),
            ("flatcake_ssd_restore_busy_seconds", M.counter),
            ("flatcake_queue_depth", M.gauge), ("flatcake_queue_wait_seconds", M.histogram),
            ("flatcake_staging_tokens", M.gauge), ("flatcake_server_ttft_seconds", M.histogram),
            ("flatcake_staging_bytes", M.gauge), ("flatcake_placed_pages", M.counter),
            ("flatcake_placed_reused_pages", M.counter), ("flatcake_placed_lost_pages", M.counter),
        )}  # fmt: skip
        self.m: dict[str, Any] = m
        # Series exist from the start (at 0), so dashboards and alerts see them before the first event.
        per_system = (
            "flatcake_requests",
            "flatcake_prompt_tokens",
            "flatcake_prefetch_declined",
            "flatcake_prefetch_retries",
            "flatcake_prefetch_seconds",
            "flatcake_ssd_restore_bytes",
            "flatcake_ssd_restore_busy_seconds",
            "flatcake_staging_tokens",
            "flatcake_staging_bytes",
            "flatcake_server_ttft_seconds",
        )
        for name in per_system:
            m[name].labels(cfg.mode)
        self._token_bytes = cfg.layers * cfg.bytes_per_token_layer
        self._ssd_inflight, self._ssd_busy_since = 0, 0.0
        engine = self.storage.engine
        if engine is not None:  # FlatCake: what its bounded restore windows hold, read at scrape time
            gauge = m["flatcake_staging_bytes"]
            assert isinstance(gauge, Gauge)
            gauge.labels(cfg.mode).set_function(lambda: engine.staging_bytes)
        for medium in ("hbm", "dram", "ssd"):
            m["flatcake_hit_tokens"].labels(cfg.mode, medium)
        for medium in ("dram", "ssd"):
            m["flatcake_placed_pages"].labels(cfg.mode, medium)
            m["flatcake_placed_reused_pages"].labels(cfg.mode, medium)
            m["flatcake_placed_lost_pages"].labels(cfg.mode, medium)
        for reason in ("uncached", "declined", "not_prefetched", "failed"):
            m["flatcake_miss_tokens"].labels(cfg.mode, reason)
        tiered = self.storage.tiered
        if tiered is not None and cfg.storage is not None:  # SGLang's backup thread's write-throughs
            counter = m["flatcake_l3_write_pages"]
            assert isinstance(counter, Counter)
            written = {r: counter.labels(cfg.mode, r) for r in ("stored", "failed")}

            def backed_up(stored: int, failed: int) -> None:  # on the backup thread; counters are thread-safe
                written["stored"].inc(stored)
                written["failed"].inc(failed)

            tiered.on_backup = backed_up

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._cond = asyncio.Condition()
        if self.sglang_like:
            self._io_queue = asyncio.Queue()
            self._tasks.append(asyncio.create_task(self._tiered_gpu_loop()))
            self._tasks.append(asyncio.create_task(self._tiered_prefetch_loop()))
            return
        self._tasks.append(asyncio.create_task(self._gpu_loop()))
        for _ in range(self.cfg.prefetchers):
            self._tasks.append(asyncio.create_task(self._prefetch_loop()))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._lookups]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._writer.shutdown(wait=True)
        self._prefetch_io.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.storage.close()

    # ---- one request -----------------------------------------------------------------------------
    async def prefill(self, tokens: Sequence[int]) -> Outcome:
        """Admit, prefetch, schedule and prefill one prompt; returns when its first token is ready.

        At arrival the prefix is looked up; pages found on SSD are prefetched into the request's host
        staging in the background. At dispatch they are copied into HBM, and whatever is in neither is
        looked up again and loaded inline (DRAM, or pages stored meanwhile)."""
        assert self._cond is not None
        cfg = self.cfg
        out = Outcome(len(tokens), arrival=time.monotonic())
        keys = page_keys(tokens, cfg.page_tokens)
        hbm = self._hbm_prefix(keys)
        if not self.sglang_like:  # under SGLang's rules the L3 backend sees the chain in its own lookups
            self.signals.observe(keys[:hbm], keys[hbm:])  # SGLang's hit query names the chain past HBM
        media = await asyncio.get_running_loop().run_in_executor(self._pool, self.storage.media, keys[hbm:], keys[:hbm])
        self._mark_reused(keys, hbm + len(media))
        job = _Job(next(self._ids), keys, ssd_span(keys, hbm, media), out)
        async with self._cond:
            if self.sglang_like:
                self._hold_host(job, hbm, media)
                self._try_prefetch(job)
                self.waiting.append(job)
                self._tiered_depths()
            else:
                req = Request(str(job.id), out.arrival, ssd_bytes=len(job.ssd_keys) * cfg.page_span)
                self._jobs[req.id] = job
                out.queue = self.sched.arrive(req)
                self._depths()
            self._cond.notify_all()
        await job.done.wait()
        return out

    def _mark_reused(self, keys: list[str], found: int) -> None:
        """Placement accuracy: stored pages asked for again (the first time), and which of them were
        gone by then (past ``found``, the prefix in HBM or storage)."""
        for i, key in enumerate(keys):
            medium = self.placed.get(key)
            if medium is not None and key not in self.reused:
                self.reused.add(key)
                self.m["flatcake_placed_reused_pages"].labels(self.cfg.mode, medium).inc()
                if i >= found:
                    self.m["flatcake_placed_lost_pages"].labels(self.cfg.mode, medium).inc()

    def _depths(self) -> None:
        for queue, depth in self.sched.depths().items():
            self.m["flatcake_queue_depth"].labels(self.cfg.mode, queue).set(depth)

    def _tiered_depths(self) -> None:
        self.m["flatcake_queue_depth"].labels(self.cfg.mode, "waiting").set(len(self.waiting))

    def _hbm_prefix(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.hbm:
            n += 1
        self._touch(keys[:n])
        return n

    def _touch(self, keys: list[str]) -> None:
        # Deepest page first, so the prefix is the most recently used: eviction then takes the
        # tails of prefixes first, as a radix-tree cache evicts leaves (a page never outlives its prefix).
        for key in reversed(keys):
            self.hbm[key] = None
            self.hbm.move_to_end(key)

    def _pin(self, keys: Sequence[str], delta: int) -> None:
        hicache.lock(self.pinned, keys, delta)

    def _hbm_insert(self, keys: list[str]) -> None:
        self._touch(keys)
        excess = len(self.hbm) - self.hbm_pages
        for key in list(itertools.islice(self.hbm, max(0, excess) + len(self.pinned))):
            if excess <= 0:
                break
            if key not in self.pinned:
                del self.hbm[key]
                excess -= 1

    def _unstage(self, job: _Job) -> None:
        """A scheduled request's prepared tokens leave the in-flight count (its pages are copied in now)."""
        if job.staged:
            self._staging_add(-job.staged)
            job.staged = 0

    def _staging_add(self, tokens: int) -> None:
        self.staging_tokens += tokens
        self.m["flatcake_staging_tokens"].labels(self.cfg.mode).set(self.staging_tokens)
        self.m["flatcake_staging_bytes"].labels(self.cfg.mode).set(self.staging_tokens * self._token_bytes)

    async def _restore(
        self,
        pool: ThreadPoolExecutor,
        keys: list[str],
        ssd_pages: int,
        promote: bool = False,
        dest: npt.NDArray[np.uint8] | None = None,
    ) -> tuple[int, list[float]]:
        """``storage.restore`` on ``pool``: pages arrived and each layer's time; restores that read SSD pages
        count their bytes and the time with any of them in flight (the storage's rate as this run sees
        it: ``simulate --validate`` uses it)."""
        loop = asyncio.get_running_loop()
        if not ssd_pages:
            return await loop.run_in_executor(pool, self.storage.restore, keys, promote, dest)
        if not self._ssd_inflight:
            self._ssd_busy_since = time.monotonic()
        self._ssd_inflight += 1
        try:
            got, times = await loop.run_in_executor(pool, self.storage.restore, keys, promote, dest)
        finally:
            self._ssd_inflight -= 1
            if not self._ssd_inflight:
                busy = time.monotonic() - self._ssd_busy_since
                self.m["flatcake_ssd_restore_busy_seconds"].labels(self.cfg.mode).inc(busy)
        self.m["flatcake_ssd_restore_bytes"].labels(self.cfg.mode).inc(min(got, ssd_pages) * self.cfg.page_span)
        return got, times

    # ---- FlatCake: FC-MAS (or FCFS) queues, prefetches that wait for window space ---------------
    async def _prefetch_loop(self) -> None:
        """SSD prefetches, in the scheduler's order (HRRN by volume for FlatCake, arrival for FCFS), into
        host staging while the tokens staged stay below SGLang's bound (half the host pool): past it a
        prefetch waits for a dispatch to free staging, where tiered's is declined."""
        assert self._cond is not None
        while True:
            async with self._cond:
                req = None
                while req is None:
                    if not hicache.rate_limited(self.staging_tokens, self.host_pool_tokens):
                        req = self.sched.next_prefetch(time.monotonic())
                    if req is None:
                        await self._cond.wait()
                job = self._jobs[req.id]
                job.staged = len(job.ssd_keys) * self.cfg.page_tokens
                self._staging_add(job.staged)
            started = time.monotonic()
            # FlatCake's restore streams through its bounded window, which waits when full and never declines.
            stage = self._stage(len(job.ssd_keys))
            got, _ = await self._restore(self._pool, job.ssd_keys, len(job.ssd_keys), dest=stage)
            self._prefetched(job, job.ssd_keys[:got], stage)
            self.m["flatcake_prefetch_seconds"].labels(self.cfg.mode).observe(time.monotonic() - started)
            async with self._cond:
                self.sched.prefetch_done(req.id)
                self._depths()
                self._cond.notify_all()

    def _stage(self, pages: int) -> npt.NDArray[np.uint8]:
        return aligned_empty((self.cfg.layers, pages, self.cfg.page_bytes))

    def _prefetched(self, job: _Job, keys: list[str], stage: npt.NDArray[np.uint8]) -> None:
        """Pages read into ``stage`` (host staging) for ``job``: held there until its prefill copies them."""
        for i, key in enumerate(keys):
            job.held[key] = (stage, i)

    async def _gpu_loop(self) -> None:
        """One GPU: prefills one request at a time, in the scheduler's dispatch order."""
        assert self._cond is not None
        while True:
            async with self._cond:
                req = None
                while req is None:
                    req = self.sched.next_dispatch()
                    if req is None:
                        await self._cond.wait()
                job = self._jobs.pop(req.id)
                self._unstage(job)
                self._depths()
                self._cond.notify_all()  # staging freed: a waiting prefetch may start
            await self._run_prefill(job)

    # ---- tiered: SGLang HiCache's prefetch and scheduling rules ----------------------------------
    def _try_prefetch(self, job: _Job) -> None:
        """Start the job's storage prefetch, or decline it (retried at later passes) while the tokens
        in flight reach half the host pool. Called under the condition's lock."""
        tokens = len(job.ssd_keys) * self.cfg.page_tokens
        job.retry = False
        if self.cfg.storage is None:
            return
        if not hicache.worth_prefetching(tokens):  # a miss (or too little): asked again a few passes later
            job.lookup_at = hicache.miss_retry_at(self._passes, job.lookups)
            return
        if hicache.rate_limited(self.staging_tokens, self.host_pool_tokens):
            if job.attempts:
                self.m["flatcake_prefetch_retries"].labels(self.cfg.mode).inc()
            else:
                self.m["flatcake_prefetch_declined"].labels(self.cfg.mode).inc()
            job.attempts += 1
            job.retry = job.attempts <= hicache.RETRY_MAX_ATTEMPTS
            return
        if job.attempts:
            self.m["flatcake_prefetch_retries"].labels(self.cfg.mode).inc()
        job.op = hicache.Prefetch(pages=len(job.ssd_keys))
        job.staged = tokens
        self._staging_add(tokens)
        assert self._io_queue is not None
        self._io_queue.put_nowait(job)

    async def _tiered_prefetch_loop(self) -> None:
        """SGLang's prefetch I/O thread: one operation at a time, in 128-page batches, stopping between
        batches once the scheduler has terminated it. Arrived pages are held in the request's host
        staging (SGLang holds them in its host pool until the request loads them) and join the host tier."""
        assert self._cond is not None and self._io_queue is not None
        while True:
            job = await self._io_queue.get()
            op = job.op
            assert op is not None
            started = time.monotonic()
            for lo in range(0, op.pages, hicache.STORAGE_BATCH_PAGES):
                if op.terminated:
                    break
                batch = job.ssd_keys[lo : lo + hicache.STORAGE_BATCH_PAGES]
                stage = self._stage(len(batch))
                got, _ = await self._restore(self._prefetch_io, batch, len(batch), promote=True, dest=stage)
                async with self._cond:
                    if not op.terminated:  # a stopped prefetch's late pages are not the request's
                        self._prefetched(job, batch[:got], stage)
                        op.completed += got
                    self._cond.notify_all()
                if got < len(batch):
                    break
            self.m["flatcake_prefetch_seconds"].labels(self.cfg.mode).observe(time.monotonic() - started)
            async with self._cond:
                op.finished = True
                self._cond.notify_all()

    def _next_tiered(self, now: float) -> tuple[_Job | None, float | None]:
        """One scheduling pass over the FCFS waiting queue: retry declined prefetches, skip requests
        whose prefetch may not stop yet, and take the first that may run. Returns it, or the time
        of the next timeout deadline to wake at."""
        pt = self.cfg.page_tokens
        self._passes += 1
        for job in hicache.due_lookups(self.waiting, self._passes):  # before admission, as SGLang
            task = asyncio.create_task(self._look_up_again(job))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)
        chosen, wake = hicache.schedule(self.waiting, self.cfg.prefetch_policy, now, pt, self._try_prefetch)
        if chosen is not None:
            self.waiting.remove(chosen)
        return chosen, wake

    def _hold_host(self, job: _Job, hbm: int, media: list[str]) -> None:
        """Lock the host-tier pages this waiting request matched (and let go of what it held before)."""
        self.storage.hold_host(job.host_held, -1)
        job.host_held = [key for key, medium in zip(job.keys[hbm:], media, strict=False) if medium == "dram"]
        self.storage.hold_host(job.host_held, +1)

    async def _look_up_again(self, job: _Job) -> None:
        """A missed storage lookup asked again: pages stored since (another request's write-back) may
        now be prefetched. The lookup asks the L3 (off the loop, as SGLang's prefetch thread asks it);
        a request scheduled meanwhile keeps what it had."""
        assert self._cond is not None
        self.m["flatcake_prefetch_retries"].labels(self.cfg.mode).inc()
        hbm = self._hbm_prefix(job.keys)
        loop = asyncio.get_running_loop()
        media = await loop.run_in_executor(self._pool, self.storage.media, job.keys[hbm:], job.keys[:hbm])
        async with self._cond:
            if job in self.waiting and job.op is None:
                self._hold_host(job, hbm, media)
                job.ssd_keys = ssd_span(job.keys, hbm, media)
                self._try_prefetch(job)
                self._cond.notify_all()

    async def _tiered_gpu_loop(self) -> None:
        assert self._cond is not None
        while True:
            async with self._cond:
                while True:
                    job, wake = self._next_tiered(time.monotonic())
                    if job is not None:
                        break
                    timeout = None if wake is None else max(0.0, wake - time.monotonic()) + 1e-3
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), timeout)
                self._unstage(job)  # the prefetch is handled: its tokens leave the in-flight count
                if job.retry or (job.attempts and job.op is None):
                    job.declined = len(job.ssd_keys)  # scheduled before any retry got capacity
                self._tiered_depths()
            await self._run_prefill(job)

    # ---- the prefill itself, for every mode ------------------------------------------------------
    async def _run_prefill(self, job: _Job) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        out = job.outcome
        out.prefill_start = time.monotonic()
        self.m["flatcake_queue_wait_seconds"].labels(cfg.mode, out.queue).observe(out.prefill_start - out.arrival)
        keys = job.keys
        hits = out.hit_pages
        cached = 0
        arrivals: list[float] = []  # when each layer restored inline for this prefill was in HBM
        # Walk the prefix: pages in HBM or prepared in this request's staging (copied in now), then
        # pages looked up again in storage (stored since arrival count), then HBM again, and so on.
        while True:
            held: dict[int, tuple[npt.NDArray[np.uint8], list[int]]] = {}
            while cached < len(keys) and (keys[cached] in self.hbm or keys[cached] in job.held):
                if keys[cached] in self.hbm:
                    hits["hbm"] += 1
                else:
                    stage, i = job.held[keys[cached]]
                    held.setdefault(id(stage), (stage, []))[1].append(i)
                    hits["ssd"] += 1
                cached += 1
            if held:
                times = await loop.run_in_executor(self._pool, self.storage.load_held, list(held.values()))
                arrivals = latest(arrivals, times)
            if cached == len(keys):
                break
            if self.sglang_like:
                # SGLang matches device and host pages at scheduling, never storage: what its prefetch did
                # not bring (declined, stopped early, or stored since admission) is recomputed.
                late = await loop.run_in_executor(self._pool, self.storage.host_media, keys[cached:])
            else:  # the native what-if restores it now, layer-pipelined through its window
                late = await loop.run_in_executor(self._pool, self.storage.media, keys[cached:], keys[:cached])
            got, times = await self._restore(self._pool, keys[cached : cached + len(late)], late.count("ssd"))
            arrivals = latest(arrivals, times)
            for medium in late[:got]:
                hits[medium] += 1
            out.failed_pages += len(late) - got
            cached += got
            if not late or got < len(late):
                break
        if self.sglang_like:  # scheduled: its host pages are in HBM now, and may leave the host tier
            self.storage.hold_host(job.host_held, -1)
            job.host_held = []
        if self.sglang_like and job.ssd_keys:  # storage pages found at admission that did not arrive
            arrived = set(keys[:cached])
            left = sum(1 for key in job.ssd_keys if key not in arrived)
            if job.declined:
                job.declined = min(job.declined, left)
            else:
                out.unprefetched_pages += left
        self._touch(keys[:cached])
        out.declined_pages += job.declined
        miss_tokens = out.prompt_tokens - cached * cfg.page_tokens
        # The modelled compute overlaps the layers restored inline, layer by layer, for every mode.
        compute = cfg.prefill_seconds(miss_tokens, cached * cfg.page_tokens)
        end = prefill_end(out.prefill_start, arrivals, cfg.layers, compute)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        job.held.clear()
        self._hbm_insert(keys)  # the whole prompt is in HBM after prefill
        new = keys[cached:]
        if new:
            # New pages stay in HBM until their write-back is done (HiCache evicts only backed-up
            # pages), so a next turn arriving meanwhile still finds them.
            self._pin(new, +1)
            done = self._writer.submit(self._store, keys[:cached], new)
            done.add_done_callback(self._unpin_later(loop, new))
            self._writes.add(done)
            done.add_done_callback(lambda f: loop.call_soon_threadsafe(self._writes.discard, f))
        out.first_token = time.monotonic()
        self._count(out, miss_tokens)
        job.done.set()

    def _unpin_later(self, loop: asyncio.AbstractEventLoop, keys: list[str]) -> Callable[[Future[None]], None]:
        """A done-callback (run on the writer thread) that unpins ``keys`` on the event loop."""

        def unpin(_: Future[None]) -> None:
            loop.call_soon_threadsafe(self._pin, keys, -1)

        return unpin

    def _store(self, prefix: list[str], keys: list[str]) -> None:
        try:
            placed = self.storage.store(prefix, keys, self.signals)
        except Exception:  # a background write must not die silently
            log.exception("storing %d pages failed", len(keys))
            return
        for key, medium in zip(keys, placed, strict=False):
            if key not in self.placed:
                self.placed[key] = medium
                self.m["flatcake_placed_pages"].labels(self.cfg.mode, medium).inc()

    def _count(self, out: Outcome, miss_tokens: int) -> None:
        mode, pt = self.cfg.mode, self.cfg.page_tokens
        self.m["flatcake_requests"].labels(mode).inc()
        self.m["flatcake_prompt_tokens"].labels(mode).inc(out.prompt_tokens)
        for medium, pages in out.hit_pages.items():
            self.m["flatcake_hit_tokens"].labels(mode, medium).inc(pages * pt)
        declined, failed = out.declined_pages * pt, max(0, out.failed_pages) * pt
        late = out.unprefetched_pages * pt
        self.m["flatcake_miss_tokens"].labels(mode, "declined").inc(declined)
        self.m["flatcake_miss_tokens"].labels(mode, "failed").inc(failed)
        self.m["flatcake_miss_tokens"].labels(mode, "not_prefetched").inc(late)
        self.m["flatcake_miss_tokens"].labels(mode, "uncached").inc(max(0, miss_tokens - declined - failed - late))
        self.m["flatcake_server_ttft_seconds"].labels(mode).observe(out.first_token - out.arrival)

    async def decode(self, n: int) -> AsyncIterator[int]:
        step = self.cfg.decode_seconds_per_token()
        for i in range(n):
            await asyncio.sleep(step)
            yield i

    async def flush_hbm(self, busy: Callable[[], bool] = lambda: False) -> int | None:
        """Drop HBM's prefix cache (SGLang's ``/flush_cache``): the next requests start cold on the GPU
        and find their prefixes in the storage under test, which keeps everything. Write-backs still
        running are waited for first (their pages are pinned in HBM until stored), so a flush that
        returns has dropped every page of every answered request, however slow the storage is. Pages
        prepared for a request still waiting are in its host staging, not HBM, and stay. Returns the
        pages dropped, or None (nothing dropped) when ``busy()`` says requests arrived while it waited:
        they were admitted with their prefix in HBM, which SGLang never flushes under a running request."""
        while self._writes:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._writes)), return_exceptions=True)
            await asyncio.sleep(0)  # the writer's unpin callbacks, queued before the gather woke, run now
        if busy():  # checked again after the wait, with no await between it and the drop
            return None
        drop = [key for key in self.hbm if key not in self.pinned]
        for key in drop:
            del self.hbm[key]
        return len(drop)


@dataclass(eq=False)
class _Job:
    id: int
    keys: list[str]
    ssd_keys: list[str]  # found on SSD at arrival: prefetched in the background
    outcome: Outcome
    declined: int = 0
    staged: int = 0  # tokens counted in flight (prepared in host staging) until the request is scheduled
    op: hicache.Prefetch | None = None  # tiered: its storage prefetch
    attempts: int = 0  # tiered: declined prefetch attempts
    retry: bool = False  # tiered: declined, to be retried at the next scheduling pass
    lookups: int = 0  # tiered: storage lookups asked again after a miss
    lookup_at: int | None = None  # tiered: the scheduling pass that asks storage again (a missed lookup)
    held: dict[str, tuple[npt.NDArray[np.uint8], int]] = field(default_factory=dict)  # prepared: key -> (staging, page)
    host_held: list[str] = field(default_factory=list)  # SGLang-like: host pages it matched, locked until scheduled
    done: asyncio.Event = field(default_factory=asyncio.Event)
