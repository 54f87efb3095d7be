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
HiCache (loadgen/systems/hicache.py cites the code): at admission the span found in storage beyond the
host tier is prefetched by one I/O thread in 128-page batches, unless the tokens already in flight
reach half the host pool (then it is declined and retried at later scheduling passes); the FCFS
scheduler skips a request whose prefetch may not stop yet under the stop policy (``best_effort``,
``wait_complete``, ``timeout``; SGLang's default ``timeout``) and schedules later ones; what had not
arrived when it stops is recomputed, as are pages that reached storage after admission. FlatCake
restores whatever is stored when the request is scheduled, streaming into HBM through its bounded
window, which waits instead; requests are ordered by FC-MAS (or FCFS, for the ablation).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import shutil
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

import flatcake
from flatcake import metrics as M
from flatcake.errors import ConfigError
from flatcake.loadgen import tokens
from flatcake.loadgen.models import ModelPreset, gpu_profile, preset
from flatcake.loadgen.systems import hicache
from flatcake.loadgen.systems.tiered import TieredStore
from flatcake.node_agent import (
    SSD_THRESHOLD,
    DramConfig,
    Engine,
    EngineConfig,
    Hints,
    IOConfig,
    Request,
    Scheduler,
    SsdConfig,
    ThreadBuffers,
    aligned_empty,
)
from flatcake.node_agent.constants import SCHEDULER_POLICIES

log = logging.getLogger(__name__)

MODES = ("flatcake", "tiered", "dram", "none")
EMULATOR: web.AppKey[Emulator] = web.AppKey("emulator")
MiB = 1 << 20


@dataclass(frozen=True)
class EmulatorConfig:
    mode: str = "flatcake"
    data_dir: str = ".flatcake-emulator"
    agent_socket: str | None = None  # flatcake mode: use this node agent instead of an in-process engine
    # A model preset sets the KV geometry (layers, page bytes) and the GPU's costs; without one the
    # geometry and rates below are used as given.
    model: str | None = None
    gpu: str = "h200"
    page_tokens: int = 256
    layers: int = 4
    bytes_per_token_layer: int = 64  # a 256-token page is 16 KiB per layer
    hbm_bytes: int = 16 * MiB
    dram_bytes: int = 64 * MiB  # FlatCake's DRAM pool, or the tiered host tier (SGLang's host pool)
    ssd_bytes: int = 2048 * MiB  # FlatCake's file pool, or the tiered L3 log
    scope_file_bytes: int = 8 * MiB  # FlatCake: one session scope's file
    prefill_tokens_per_s: float = 100_000.0  # without a model preset
    decode_tokens_per_s: float = 200.0  # without a model preset
    # flatcake only (the tiered modes are FCFS as SGLang schedules); None: the node agent's
    # scheduler.policy when connected to one, else mas
    scheduler: str | None = None
    prefetch_policy: str = hicache.DEFAULT_PREFETCH_POLICY  # tiered: SGLang's prefetch stop policy
    prefetchers: int = 2  # flatcake: concurrent SSD prefetches

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token_layer

    @property
    def page_span(self) -> int:
        return self.layers * self.page_bytes

    @property
    def preset(self) -> ModelPreset | None:
        return preset(self.model) if self.model else None

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        p = self.preset
        if p is not None:
            return p.prefill_s(new_tokens, cached_tokens, self.gpu) if new_tokens else 0.0
        return new_tokens / self.prefill_tokens_per_s

    def decode_seconds_per_token(self) -> float:
        p = self.preset
        return p.decode_s_per_token(self.gpu) if p is not None else 1.0 / self.decode_tokens_per_s

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} must be one of {MODES}")
        # Checked before anything is created (``serve`` binds, then makes the pools).
        for name in ("hbm_bytes", "ssd_bytes", "scope_file_bytes", "layers", "page_tokens", "bytes_per_token_layer",
                     "prefetchers"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
        if not isinstance(self.dram_bytes, int) or self.dram_bytes < 0:
            raise ConfigError(f"dram_bytes: {self.dram_bytes!r} must be an integer >= 0")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be > 0")
        p = self.preset  # an unknown model or GPU is refused here, naming the field
        gpu_profile(self.gpu)
        if p is not None:  # the preset's geometry, padded page-layers as the engine stores them
            object.__setattr__(self, "layers", p.layers)
            object.__setattr__(self, "page_tokens", p.page_tokens)
            object.__setattr__(self, "bytes_per_token_layer", p.page_layer_bytes // p.page_tokens)
        if self.page_bytes % 4096:  # pages are read with O_DIRECT
            raise ConfigError(f"page_tokens x bytes_per_token_layer ({self.page_tokens} x {self.bytes_per_token_layer}"
                              ") must be a multiple of 4096: with 64 bytes per token-layer, use a multiple of 64 "
                              "page tokens")  # fmt: skip
        if self.scheduler is not None and self.scheduler not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler: {self.scheduler!r} must be one of {', '.join(SCHEDULER_POLICIES)}")
        hicache.check_policy(self.prefetch_policy)


def page_keys(tokens: Sequence[int], page_tokens: int) -> list[str]:
    """Prefix-chained keys of the prompt's full pages (a partial last page is never cached)."""
    keys, prev = [], b""
    arr = np.asarray(tokens, dtype=np.int64)
    for i in range(len(arr) // page_tokens):
        h = hashlib.blake2b(prev + arr[i * page_tokens : (i + 1) * page_tokens].tobytes(), digest_size=16)
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


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


class Storage:
    """What each mode stores and restores behind HBM."""

    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        root = Path(cfg.data_dir) / cfg.mode
        root.mkdir(parents=True, exist_ok=True)
        self.engine: Engine | None = None
        self.tiered: TieredStore | None = None
        # The bytes written for new pages: a few pages' worth, reused (their content is irrelevant).
        chunk = max(1, min(64, (64 * MiB) // cfg.page_span))
        self._kv = aligned_empty((cfg.layers, chunk, cfg.page_bytes))
        self._kv[...] = np.random.default_rng(0).integers(0, 256, size=self._kv.shape, dtype=np.uint8)
        self._dests = ThreadBuffers()  # restores land in a reused host buffer, as in a serving engine's pool
        if cfg.mode == "flatcake":
            if cfg.agent_socket:
                from flatcake.node_agent import connect

                self.engine = connect(cfg.agent_socket, layers=cfg.layers, page_bytes=cfg.page_bytes)
            else:
                self.engine = Engine(engine_config(cfg, root))
        elif cfg.mode in ("tiered", "dram"):
            bucket = max(cfg.page_span, (64 * MiB) // cfg.page_span * cfg.page_span)
            self.tiered = TieredStore(root, layers=cfg.layers, page_bytes=cfg.page_bytes,
                                      dram_pages=max(1, cfg.dram_bytes // cfg.page_span), bucket_bytes=bucket,
                                      buckets=-(-cfg.ssd_bytes // bucket) if cfg.mode == "tiered" else 0,
                                      workers=4, reader="whole_page")  # fmt: skip

    def media(self, keys: list[str]) -> list[str]:
        """Medium of each page of the stored prefix of ``keys``."""
        if self.engine is not None:
            hit = self.engine.exists(keys)
            if not hit:
                return []
            lease = self.engine.catalog.acquire(keys[:hit])
            self.engine.catalog.release(lease.id)
            return ["ssd" if loc.gva >= SSD_THRESHOLD else "dram" for loc in lease.locations]
        if self.tiered is not None:
            return self.tiered.media(keys)
        return []

    def restore(self, keys: list[str], promote: bool = False) -> int:
        """Bring pages to HBM (really read them); returns how many of the leading pages arrived.
        ``promote``: the tiered host tier keeps what was read from SSD (a finished SGLang prefetch)."""
        if not keys:
            return 0
        dest = self._dests.get((self.cfg.layers, len(keys), self.cfg.page_bytes))
        if self.engine is not None:
            try:
                with self.engine.get(keys, dest) as restore:
                    missing = restore.run()
            except KeyError:  # reclaimed between lookup and restore: recompute
                return 0
            return min(missing) if missing else len(keys)
        if self.tiered is not None:
            media = self.tiered.media(keys)
            if self.tiered.restore(keys[: len(media)], dest):
                return 0  # a page went missing during the read: the batch is not used
            if promote:
                self.tiered.promote(keys[: len(media)], dest)
            return len(media)
        return 0

    def store(self, keys: list[str], parent: str | None, context_tokens: int, refcount: int) -> list[str]:
        """Write-through of newly computed pages (in the background; not on the TTFT path). Returns
        where each stored page was placed (FlatCake), for placement accuracy."""
        placed: list[str] = []
        for lo in range(0, len(keys), self._kv.shape[1]):
            chunk = keys[lo : lo + self._kv.shape[1]]
            kv = aligned_empty((self.cfg.layers, len(chunk), self.cfg.page_bytes))  # contiguous, as put wants
            kv[...] = self._kv[:, : len(chunk)]
            if self.engine is not None:
                hints = Hints(prefix_refcount=refcount, turn=2 if parent else 1,
                              context_tokens=context_tokens, parent_key=parent)  # fmt: skip
                try:
                    self.engine.put(chunk, kv, hints)
                except (OSError, RuntimeError, ValueError) as exc:  # pool full: the pages stay uncached
                    log.warning("store failed: %s", exc)
                    return placed
                placed += self.media(chunk)
                parent = chunk[-1]
            elif self.tiered is not None:
                self.tiered.put(chunk, kv)
        return placed

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.tiered is not None:
            self.tiered.close()


def engine_config(cfg: EmulatorConfig, root: Path) -> EngineConfig:
    files = max(4, cfg.ssd_bytes // cfg.scope_file_bytes)
    return EngineConfig(
        layers=cfg.layers, page_bytes=cfg.page_bytes, page_tokens=cfg.page_tokens,
        dram=DramConfig(bytes=cfg.dram_bytes, huge_pages=False, shm_dir=str(root), name="emulator-dram"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=cfg.scope_file_bytes, file_count=files),
        io=IOConfig(backend="posix", workers=2, staging_slot_bytes=max(cfg.page_bytes, 2 * MiB)),
    )  # fmt: skip


def scheduler_policy(cfg: EmulatorConfig, engine: Engine | None) -> str:
    """How FlatCake orders requests: as chosen, else as its node agent hands clients at registration
    (``scheduler.policy``: a cluster's setting reaches the serving side), else FC-MAS. The other
    modes are FCFS, as SGLang schedules."""
    if cfg.mode != "flatcake":
        return "fcfs"
    if cfg.scheduler is not None:
        return cfg.scheduler
    if cfg.agent_socket and engine is not None:
        return engine.config.scheduler.policy
    return "mas"


class Emulator:
    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        self.storage = Storage(cfg)
        self.hbm: OrderedDict[str, None] = OrderedDict()
        self.pinned: dict[str, int] = {}  # prefetched pages waiting for their prefill: not evicted
        self.hbm_pages = max(1, cfg.hbm_bytes // cfg.page_span)
        # Write-time sharing signal: how many different continuations a page has had (a shared
        # system prompt or a fork point has several; a session's own history has one).
        self.children: dict[str | None, set[str]] = {}
        self.sched = Scheduler(scheduler_policy(cfg, self.storage.engine))
        # Tiered (SGLang HiCache): the FCFS waiting queue, the tokens in flight in prefetches
        # (prefetch_tokens_occupied) against half the host pool, and the one prefetch I/O thread.
        self.sglang_like = cfg.mode in ("tiered", "dram")
        self.waiting: list[_Job] = []
        self.staging_tokens = 0
        self.host_pool_tokens = max(1, cfg.dram_bytes // cfg.page_span) * cfg.page_tokens
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
        self.registry = CollectorRegistry()
        m = {n: f(n, self.registry) for n, f in (
            ("flatcake_requests", M.counter), ("flatcake_prompt_tokens", M.counter),
            ("flatcake_hit_tokens", M.counter), ("flatcake_miss_tokens", M.counter),
            ("flatcake_prefetch_declined", M.counter), ("flatcake_prefetch_retries", M.counter),
            ("flatcake_prefetch_seconds", M.histogram), ("flatcake_ssd_restore_bytes", M.counter),
            ("flatcake_ssd_restore_busy_seconds", M.counter),
            ("flatcake_queue_depth", M.gauge), ("flatcake_queue_wait_seconds", M.histogram),
            ("flatcake_staging_tokens", M.gauge), ("flatcake_server_ttft_seconds", M.histogram),
            ("flatcake_staging_bytes", M.gauge), ("flatcake_placed_pages", M.counter),
            ("flatcake_placed_reused_pages", M.counter),
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
        for reason in ("uncached", "declined", "not_prefetched", "failed"):
            m["flatcake_miss_tokens"].labels(cfg.mode, reason)

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
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._writer.shutdown(wait=True)
        self._prefetch_io.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.storage.close()

    # ---- one request -----------------------------------------------------------------------------
    async def prefill(self, tokens: Sequence[int]) -> Outcome:
        """Admit, prefetch, schedule and prefill one prompt; returns when its first token is ready.

        At arrival the prefix is looked up; pages found on SSD are prefetched into HBM in the
        background (pinned there until this request's prefill). At dispatch whatever is not in HBM
        by then is looked up again and loaded inline (DRAM, or pages stored meanwhile)."""
        assert self._cond is not None
        cfg = self.cfg
        out = Outcome(len(tokens), arrival=time.monotonic())
        keys = page_keys(tokens, cfg.page_tokens)
        self._mark_reused(keys)
        hbm = self._hbm_prefix(keys)
        media = await asyncio.get_running_loop().run_in_executor(self._pool, self.storage.media, keys[hbm:])
        n_dram = media.index("ssd") if "ssd" in media else len(media)
        ssd_keys = keys[hbm + n_dram : hbm + len(media)]
        job = _Job(next(self._ids), keys, ssd_keys, out)
        async with self._cond:
            if self.sglang_like:
                self._try_prefetch(job)
                self.waiting.append(job)
                self._tiered_depths()
            else:
                req = Request(str(job.id), out.arrival, ssd_bytes=len(ssd_keys) * cfg.page_span)
                self._jobs[req.id] = job
                out.queue = self.sched.arrive(req)
                self._depths()
            self._cond.notify_all()
        await job.done.wait()
        return out

    def _mark_reused(self, keys: list[str]) -> None:
        for key in keys:
            medium = self.placed.get(key)
            if medium is not None and key not in self.reused:
                self.reused.add(key)
                self.m["flatcake_placed_reused_pages"].labels(self.cfg.mode, medium).inc()

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
        for key in keys:
            n = self.pinned.get(key, 0) + delta
            if n > 0:
                self.pinned[key] = n
            else:
                self.pinned.pop(key, None)

    def _hbm_insert(self, keys: list[str]) -> None:
        self._touch(keys)
        excess = len(self.hbm) - self.hbm_pages
        for key in list(itertools.islice(self.hbm, max(0, excess) + len(self.pinned))):
            if excess <= 0:
                break
            if key not in self.pinned:
                del self.hbm[key]
                excess -= 1

    def _staging_add(self, tokens: int) -> None:
        self.staging_tokens += tokens
        self.m["flatcake_staging_tokens"].labels(self.cfg.mode).set(self.staging_tokens)
        self.m["flatcake_staging_bytes"].labels(self.cfg.mode).set(self.staging_tokens * self._token_bytes)

    async def _restore(self, pool: ThreadPoolExecutor, keys: list[str], ssd_pages: int, promote: bool = False) -> int:
        """``storage.restore`` on ``pool``; restores that read SSD pages count their bytes and the time with
        any of them in flight (the storage's rate as this run sees it: ``simulate --validate`` uses it)."""
        loop = asyncio.get_running_loop()
        if not ssd_pages:
            return await loop.run_in_executor(pool, self.storage.restore, keys, promote)
        if not self._ssd_inflight:
            self._ssd_busy_since = time.monotonic()
        self._ssd_inflight += 1
        try:
            got = await loop.run_in_executor(pool, self.storage.restore, keys, promote)
        finally:
            self._ssd_inflight -= 1
            if not self._ssd_inflight:
                busy = time.monotonic() - self._ssd_busy_since
                self.m["flatcake_ssd_restore_busy_seconds"].labels(self.cfg.mode).inc(busy)
        self.m["flatcake_ssd_restore_bytes"].labels(self.cfg.mode).inc(min(got, ssd_pages) * self.cfg.page_span)
        return got

    # ---- FlatCake: FC-MAS (or FCFS) queues, prefetches that wait for window space ---------------
    async def _prefetch_loop(self) -> None:
        """SSD prefetches, in the scheduler's order (HRRN by volume for FlatCake, arrival for FCFS)."""
        assert self._cond is not None
        while True:
            async with self._cond:
                req = None
                while req is None:
                    req = self.sched.next_prefetch(time.monotonic())
                    if req is None:
                        await self._cond.wait()
            job = self._jobs[req.id]
            started = time.monotonic()
            # FlatCake streams into HBM through its bounded window, which waits when full and never declines.
            got = await self._restore(self._pool, job.ssd_keys, len(job.ssd_keys))
            self._prefetched(job, job.ssd_keys[:got])
            self.m["flatcake_prefetch_seconds"].labels(self.cfg.mode).observe(time.monotonic() - started)
            async with self._cond:
                self.sched.prefetch_done(req.id)
                self._depths()
                self._cond.notify_all()

    def _prefetched(self, job: _Job, keys: list[str]) -> None:
        for key in keys:
            job.prefetched[key] = "ssd"
        self._pin(keys, +1)
        self._hbm_insert(keys)

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
                self._depths()
            await self._run_prefill(self._jobs.pop(req.id))

    # ---- tiered: SGLang HiCache's prefetch and scheduling rules ----------------------------------
    def _try_prefetch(self, job: _Job) -> None:
        """Start the job's storage prefetch, or decline it (retried at later passes) while the tokens
        in flight reach half the host pool. Called under the condition's lock."""
        tokens = len(job.ssd_keys) * self.cfg.page_tokens
        job.retry = False
        if self.cfg.mode != "tiered" or not hicache.worth_prefetching(tokens):
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
        batches once the scheduler has terminated it. Arrived pages are held in HBM for the request
        (SGLang holds them in its host pool until the request loads them) and join the host tier."""
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
                got = await self._restore(self._prefetch_io, batch, len(batch), promote=True)
                async with self._cond:
                    if not op.terminated:  # a stopped prefetch's late pages are not the request's
                        self._prefetched(job, batch[:got])
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
        wake: float | None = None
        pt = self.cfg.page_tokens
        for job in self.waiting:
            if job.retry:
                self._try_prefetch(job)
            op = job.op
            if op is not None and not op.terminated:
                if not op.may_stop(self.cfg.prefetch_policy, now, pt):
                    deadline = op.deadline(pt) if self.cfg.prefetch_policy == "timeout" else None
                    if deadline is not None:
                        wake = deadline if wake is None else min(wake, deadline)
                    continue
                op.terminated = True
            self.waiting.remove(job)
            return job, None
        return None, wake

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
                if job.staged:  # the prefetch is handled: its tokens leave the in-flight count
                    self._staging_add(-job.staged)
                    job.staged = 0
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
        prefetched = dict(job.prefetched)
        # Walk the prefix: pages in HBM (resident, or prefetched for this request), then pages
        # looked up again in storage (stored since arrival count), then HBM again, and so on.
        while True:
            while cached < len(keys) and keys[cached] in self.hbm:
                hits[prefetched.get(keys[cached], "hbm")] += 1
                cached += 1
            if cached == len(keys):
                break
            late = await loop.run_in_executor(self._pool, self.storage.media, keys[cached:])
            cut = cfg.mode == "tiered" and "ssd" in late
            if cut:
                # SGLang reads storage only through a prefetch; pages not brought by it (declined,
                # stopped early, or stored since admission) are recomputed. FlatCake restores them
                # now, layer-pipelined through its window.
                if job.declined:
                    job.declined = min(job.declined, len(late) - late.index("ssd"))
                else:
                    out.unprefetched_pages += len(late) - late.index("ssd")
                late = late[: late.index("ssd")]
            got = await self._restore(self._pool, keys[cached : cached + len(late)], late.count("ssd"))
            for medium in late[:got]:
                hits[medium] += 1
            out.failed_pages += len(late) - got
            cached += got
            if cut or not late or got < len(late):
                break
        self._touch(keys[:cached])
        out.declined_pages += job.declined
        miss_tokens = out.prompt_tokens - cached * cfg.page_tokens
        await asyncio.sleep(cfg.prefill_seconds(miss_tokens, cached * cfg.page_tokens))
        self._pin(list(job.prefetched), -1)
        self._hbm_insert(keys)  # the whole prompt is in HBM after prefill
        new = keys[cached:]
        if new:
            parent = keys[cached - 1] if cached else None
            kids = self.children.setdefault(parent, set()) if parent else {new[0]}
            kids.add(new[0])
            # New pages stay in HBM until their write-back is done (HiCache evicts only backed-up
            # pages), so a next turn arriving meanwhile still finds them.
            self._pin(new, +1)
            done = self._writer.submit(self._store, new, parent, out.prompt_tokens, len(kids))
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

    def _store(self, keys: list[str], parent: str | None, context_tokens: int, refcount: int) -> None:
        try:
            placed = self.storage.store(keys, parent, context_tokens, refcount)
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

    async def flush_hbm(self) -> int:
        """Drop HBM's prefix cache (SGLang's ``/flush_cache``): the next requests start cold on the GPU
        and find their prefixes in the storage under test, which keeps everything. Write-backs still
        running are waited for first (their pages are pinned in HBM until stored), so a flush that
        returns has dropped every page of every answered request, however slow the storage is. Pages
        prefetched for a request still waiting stay. Returns the pages dropped."""
        while self._writes:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._writes)), return_exceptions=True)
            await asyncio.sleep(0)  # the writer's unpin callbacks, queued before the gather woke, run now
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
    staged: int = 0  # tiered: tokens counted in flight until the request is scheduled
    op: hicache.Prefetch | None = None  # tiered: its storage prefetch
    attempts: int = 0  # tiered: declined prefetch attempts
    retry: bool = False  # tiered: declined, to be retried at the next scheduling pass
    prefetched: dict[str, str] = field(default_factory=dict)  # key -> medium it was prefetched from
    done: asyncio.Event = field(default_factory=asyncio.Event)


# ---- HTTP ----------------------------------------------------------------------------------------
# The OpenAI (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and SGLang (``/generate``,
# ``/flush_cache``, ...) conventions that common clients rely on (``openai``, ``sglang.bench_serving``
# with the sglang, sglang-oai, vllm and their -chat backends, Locust). Prompts are text or token ids;
# text is tokenized by the rule in flatcake.loadgen.tokens (4 characters a token), which the load
# generator shares. The output is synthetic: token i is the 4 characters " tNN" (NN = i mod 100), one
# token under the same rule.
# A parameter is served, accepted as a no-op (sampling parameters: they choose among a model's tokens,
# and there is no model), or refused with a 400 that names it: never silently ignored.
MODEL_NAME = "flatcake-emulator"
HTTP: web.AppKey[_Http] = web.AppKey("http")
MAX_BATCH = 256  # prompts in one request
MAX_N = 128  # choices per prompt
MAX_STOPS = 4  # OpenAI's limit on stop strings

# Accepted and changing nothing: they shape sampling, and the output is synthetic.
_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "ignore_eos", "logit_bias", "user"})  # fmt: skip
# Accepted only at their "off" value (a non-default value would ask for something not served).
_OAI_OFF: dict[str, tuple[object, ...]] = {
    "logprobs": (None,), "echo": (None, False), "suffix": (None, ""), "lora_path": (None,), "image_data": (None,),
}  # fmt: skip
_OAI_SERVED = frozenset({"model", "prompt", "max_tokens", "min_tokens", "stream", "stream_options", "n", "best_of",
                         "stop", "return_cached_tokens_details"})  # fmt: skip
# Chat: tools, structured output and logprobs ask for what a synthetic output cannot give.
_CHAT_OFF: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, ()), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "lora_path": (None,), "parallel_tool_calls": (None, True),
}  # fmt: skip
_CHAT_SERVED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
                          "stream_options", "n", "stop", "return_cached_tokens_details"})  # fmt: skip
_GEN_OFF: dict[str, tuple[object, ...]] = {
    "return_logprob": (None, False), "top_logprobs_num": (None, 0), "token_ids_logprob": (None,),
    "lora_path": (None,), "return_routed_experts": (None, False), "return_hidden_states": (None, False),
    "image_data": (None,), "custom_logit_processor": (None,),
}  # fmt: skip
# logprob_start_len and return_text_in_logprobs only matter with return_logprob, which is refused.
_GEN_SERVED = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "logprob_start_len",
                         "return_text_in_logprobs"})  # fmt: skip
_SP_OFF: dict[str, tuple[object, ...]] = {
    "n": (None, 1), "stop_token_ids": (None, ()), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,),
}  # fmt: skip
_SP_SERVED = frozenset({"max_new_tokens", "min_new_tokens", "stop", "skip_special_tokens",
                        "spaces_between_special_tokens", "no_stop_trim", "sampling_seed"})  # fmt: skip


@dataclass
class _Http:
    """The HTTP side's own state: requests being answered (``/flush_cache`` refuses while any are)."""

    inflight: int = 0


def output_token(i: int) -> str:
    """The ``i``-th synthetic output token: 4 characters, so one token under the tokenization rule."""
    return f" t{i % 100:02d}"


def _bad_request(message: str, param: str | None = None) -> web.HTTPBadRequest:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return web.HTTPBadRequest(text=json.dumps({"error": error}), content_type="application/json")


def _same(value: object, allowed: tuple[object, ...]) -> bool:
    # Type-aware: 0 is not False (logprobs=0 asks for logprobs), () stands for any empty list.
    return any(
        value is a or (type(value) is type(a) and value == a) or (a == () and isinstance(value, list) and not value)
        for a in allowed
    )


def _check_params(
    body: dict[str, Any], served: frozenset[str], off: dict[str, tuple[object, ...]], prefix: str = ""
) -> None:
    unknown = sorted(set(body) - served - _SAMPLING - set(off))
    if unknown:
        names = ", ".join(prefix + u for u in unknown)
        raise _bad_request(f"{names}: not supported by the emulator (docs/benchmarks.md lists what is)", unknown[0])
    for name, allowed in off.items():
        if name in body and not _same(body[name], allowed):
            shown = " or ".join("[]" if a == () else json.dumps(a) for a in allowed)
            raise _bad_request(
                f"{prefix}{name}: {json.dumps(body[name])} is not supported by the emulator (its output is "
                f"synthetic); leave it unset or {shown}",
                prefix + name,
            )


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(value: Any, name: str) -> tuple[list[list[int]], bool]:
    """The token ids of each prompt, and whether the request was a batch. Text is tokenized by the
    shared rule (flatcake.loadgen.tokens)."""
    if isinstance(value, str):
        return [tokens.encode(value)], False
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            batch = [tokens.encode(v) for v in value]
        elif all(isinstance(v, list) for v in value):
            if not all(_token_ids(v) and v for v in value):
                raise _bad_request(f"{name}: each prompt of a batch must be non-empty token ids (list of int)", name)
            batch = list(value)
        elif _token_ids(value):
            return [list(value)], False
        else:
            batch = []
        if batch:
            if len(batch) > MAX_BATCH:
                raise _bad_request(f"{name}: {len(batch)} prompts; at most {MAX_BATCH} in one request", name)
            return batch, True
    raise _bad_request(
        f"{name}: a string, a list of strings, token ids (list of int) or a list of token-id lists", name
    )


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise _bad_request("body is not JSON") from None
    if not isinstance(body, dict):
        raise _bad_request("body must be an object")
    return body


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional nested object (``stream_options``, ``sampling_params``): absent or null is empty."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad_request(f"{name}: an object, got {type(value).__name__}", name)
    return value


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad_request(f"{name}: true or false, got {type(value).__name__}", name)
    return value


def _int(value: Any, name: str, default: int, hi: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > hi:
        raise _bad_request(f"{name}: an integer in 1..{hi}", name)
    return value


def _stops(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise _bad_request(f"{name}: a non-empty string or a list of at most {MAX_STOPS} of them", name)
    return stops


@dataclass
class _Event:
    """One prompt's generation step: new text (every choice of the prompt has the same), the tokens so
    far, and the finish reason on its last step (``length``, or ``stop`` with the stop string)."""

    prompt: int
    outcome: Outcome
    delta: str
    tokens: int
    finish: str | None = None
    matched: str | None = None


class _Cut:
    """The synthetic output cut at a stop string (its text excluded, as OpenAI and SGLang do) or at the
    token limit; text that may still begin a stop string is held back until it cannot."""

    def __init__(self, limit: int, stops: list[str]) -> None:
        self.limit, self.stops = limit, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.tokens = "", 0, 0
        self.finish: str | None = None
        self.matched: str | None = None

    def step(self) -> str:
        """Generate one token; returns the text that may be sent now."""
        self.text += output_token(self.tokens)
        self.tokens += 1
        hits = [(self.text.find(s), s) for s in self.stops if s in self.text]
        if hits:
            at, self.matched = min(hits)
            self.finish, end = "stop", at
        elif self.tokens >= self.limit:
            self.finish, end = "length", len(self.text)
        else:
            end = max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


async def _run_prompt(
    emu: Emulator, index: int, prompt: list[int], limit: int, stops: list[str], queue: asyncio.Queue[Any]
) -> None:
    """Prefill one prompt, then decode it: the first token at once, then one per decode step."""
    try:
        out = await emu.prefill(prompt)
        cut = _Cut(limit, stops)
        delta = cut.step()
        queue.put_nowait(_Event(index, out, delta, cut.tokens, cut.finish, cut.matched))
        if cut.finish is None:
            async for _ in emu.decode(limit - 1):
                delta = cut.step()
                if delta or cut.finish:
                    queue.put_nowait(_Event(index, out, delta, cut.tokens, cut.finish, cut.matched))
                if cut.finish:
                    break
    except Exception as exc:  # the handler re-raises it: a prompt's failure fails the request
        queue.put_nowait(exc)


async def _events(emu: Emulator, prompts: list[list[int]], limit: int, stops: list[str]) -> AsyncIterator[_Event]:
    """Every prompt's steps as they happen (the prompts run concurrently, each through the emulator's
    scheduler, as a serving engine runs a batch's prompts)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [asyncio.create_task(_run_prompt(emu, i, p, limit, stops, queue)) for i, p in enumerate(prompts)]
    try:
        left = len(prompts)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item.finish is not None
            yield item
    finally:
        for t in tasks:
            t.cancel()


def _hits(emu: Emulator, outs: Sequence[Outcome]) -> dict[str, int]:
    pt = emu.cfg.page_tokens
    return {m: sum(o.hit_pages[m] for o in outs) * pt for m in ("hbm", "dram", "ssd")}


def _details(emu: Emulator, outs: Sequence[Outcome]) -> dict[str, int]:
    """SGLang's ``cached_tokens_details``: device (HBM), host (DRAM) and storage (SSD) tokens."""
    hits = _hits(emu, outs)
    return {"device": hits["hbm"], "host": hits["dram"], "storage": hits["ssd"]}


def _usage(emu: Emulator, outs: Sequence[Outcome], completion: int) -> dict[str, Any]:
    pt = emu.cfg.page_tokens
    prompt = sum(o.prompt_tokens for o in outs)
    queues = [o.queue for o in outs]
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens(pt) for o in outs)},
        "flatcake": {"hit_tokens": _hits(emu, outs), "declined_tokens": sum(o.declined_pages for o in outs) * pt,
                     "queue": queues[0] if len(queues) == 1 else queues, "system": emu.cfg.mode},
    }  # fmt: skip


@contextlib.asynccontextmanager
async def _answering(request: web.Request) -> AsyncIterator[Emulator]:
    state = request.app[HTTP]
    state.inflight += 1
    try:
        yield request.app[EMULATOR]
    finally:
        state.inflight -= 1


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _stream_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


@dataclass
class _Answer:
    """Every prompt's result once all have finished, in prompt order."""

    outs: list[Outcome]
    texts: list[str]
    done: list[_Event]


async def _answer(
    emu: Emulator, prompts: list[list[int]], limit: int, stops: list[str],
    write: Callable[[_Event, str], Awaitable[None]] | None = None,
) -> _Answer:  # fmt: skip
    """Run the prompts; ``write`` (streaming) gets each event with its prompt's text so far. The one
    loop behind ``/v1/completions``, ``/v1/chat/completions`` and ``/generate``."""
    outs: dict[int, Outcome] = {}
    texts = [""] * len(prompts)
    done: dict[int, _Event] = {}
    async for ev in _events(emu, prompts, limit, stops):
        outs[ev.prompt] = ev.outcome
        texts[ev.prompt] += ev.delta
        if ev.finish is not None:
            done[ev.prompt] = ev
        if write is not None:
            await write(ev, texts[ev.prompt])
    order = range(len(prompts))
    return _Answer([outs[i] for i in order], texts, [done[i] for i in order])


async def _end_stream(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _stream_usage(body: dict[str, Any], stream: bool) -> bool:
    """OpenAI's ``stream_options``: allowed only with ``stream``; whether ``include_usage`` asks for the
    final usage chunk (``choices: []``)."""
    options = _object(body, "stream_options")
    if options and not stream:
        raise _bad_request("stream_options: only allowed when stream is true", "stream_options")
    _check_params(options, frozenset({"include_usage"}), {}, "stream_options.")
    return _flag(options, "include_usage")


@dataclass(frozen=True)
class _OpenAIOptions:
    """What both OpenAI endpoints take alike, parsed and checked once."""

    n: int
    stops: list[str]
    stream: bool
    include_usage: bool
    details: bool  # SGLang's return_cached_tokens_details
    model: str


def _openai_options(body: dict[str, Any]) -> _OpenAIOptions:
    stream = _flag(body, "stream")
    return _OpenAIOptions(
        n=_int(body.get("n"), "n", 1, MAX_N),
        stops=_stops(body.get("stop"), "stop"),
        stream=stream,
        include_usage=_stream_usage(body, stream),
        details=_flag(body, "return_cached_tokens_details"),
        model=str(body.get("model") or MODEL_NAME),
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI ``POST /v1/completions``: text or token-id prompts, batches, ``n``, ``stop``, ``stream``
    (the usage chunk with ``choices: []`` only when ``stream_options.include_usage`` asks for it)."""
    body = await _body(request)
    _check_params(body, _OAI_SERVED, _OAI_OFF)
    prompts, _ = _prompts(body.get("prompt"), "prompt")
    limit = _int(body.get("max_tokens"), "max_tokens", 16, 65536)
    opts = _openai_options(body)
    n, stops, details = opts.n, opts.stops, opts.details
    if body.get("best_of") is not None and _int(body["best_of"], "best_of", 1, MAX_N) != n:
        raise _bad_request("best_of: only best_of = n is served (the emulator does not rank choices)", "best_of")
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": opts.model, "choices": choices,
                **extra}  # fmt: skip

    async with _answering(request) as emu:
        if not opts.stream:
            got = await _answer(emu, prompts, limit, stops)
            choices = [{"index": i * n + j, "text": got.texts[i], "logprobs": None, "finish_reason": ev.finish}
                       for i, ev in enumerate(got.done) for j in range(n)]  # fmt: skip
            usage = _usage(emu, got.outs, n * sum(ev.tokens for ev in got.done))
            return web.json_response(chunk(choices, usage=usage, **_sglext(emu, got.outs, details)))
        resp = await _stream_response(request)

        async def write(ev: _Event, _: str) -> None:
            choices = [{"index": ev.prompt * n + j, "text": ev.delta, "logprobs": None,
                        "finish_reason": ev.finish} for j in range(n)]  # fmt: skip
            await resp.write(_sse(chunk(choices, **(_sglext(emu, [ev.outcome], details) if ev.finish else {}))))

        got = await _answer(emu, prompts, limit, stops, write)
        if opts.include_usage:
            await resp.write(_sse(chunk([], usage=_usage(emu, got.outs, n * sum(ev.tokens for ev in got.done)))))
        return await _end_stream(resp)


def _sglext(emu: Emulator, outs: Sequence[Outcome], details: bool) -> dict[str, Any]:
    """SGLang's ``sglext`` extension, when ``return_cached_tokens_details`` asked for it."""
    return {"sglext": {"cached_tokens_details": _details(emu, outs)}} if details else {}


# The chat template: each message is ``<|ROLE|>\n`` + its text + ``<|end|>\n``, and the prompt ends with
# ``<|assistant|>\n`` (where the reply goes). A message's rendering depends on it alone, and the
# generation prompt is how the assistant's message begins, so turn k+1's prompt (turn k's messages, the
# reply, a new user message) starts with turn k's prompt: a growing conversation is a shared prefix,
# and under the 4-characters rule a shared token prefix (page keys follow it).
CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(messages: Any) -> str:
    """The prompt text of OpenAI chat ``messages`` (content: a string or a list of ``text`` parts,
    joined). Bad input is a 400 naming the message and field."""
    if not isinstance(messages, list) or not messages:
        raise _bad_request("messages: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad_request(f"{where}: an object with role and content", where)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _bad_request(f"{where}.{extra[0]}: not supported by the emulator (only role and content)",
                               f"{where}.{extra[0]}")  # fmt: skip
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad_request(f"{where}.role: {json.dumps(role)} must be one of {', '.join(CHAT_ROLES)}",
                               f"{where}.role")  # fmt: skip
        out.append(f"<|{role}|>\n{_chat_text(m.get('content'), where + '.content')}<|end|>\n")
    return "".join(out) + "<|assistant|>\n"


def _chat_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad_request(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                   f"supported, got {json.dumps(kind)}", f"{where}[{j}]")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)
    raise _bad_request(f"{where}: a string or a non-empty list of text parts", where)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI ``POST /v1/chat/completions``: ``messages`` rendered by ``chat_prompt`` and tokenized by
    the shared rule; ``max_completion_tokens`` (or ``max_tokens``; default 128, SGLang's), ``n``,
    ``stop``, ``stream`` (``chat.completion.chunk`` deltas; the usage chunk only with
    ``stream_options.include_usage``)."""
    body = await _body(request)
    _check_params(body, _CHAT_SERVED, _CHAT_OFF)
    prompt = tokens.encode(chat_prompt(body.get("messages")))
    limits = {k: _int(body.get(k), k, 128, 65536) for k in ("max_completion_tokens", "max_tokens") if k in body}
    if len(set(limits.values())) > 1:
        raise _bad_request("max_tokens: differs from max_completion_tokens; give one of them", "max_tokens")
    limit = next(iter(limits.values()), 128)
    opts = _openai_options(body)
    n, stops, details = opts.n, opts.stops, opts.details
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def reply(kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": cid, "object": kind, "created": created, "model": opts.model, "choices": choices, **extra}

    async with _answering(request) as emu:
        if not opts.stream:
            got = await _answer(emu, [prompt], limit, stops)
            ev = got.done[0]
            choices = [{"index": j, "message": {"role": "assistant", "content": got.texts[0]}, "logprobs": None,
                        "finish_reason": ev.finish} for j in range(n)]  # fmt: skip
            usage = _usage(emu, got.outs, n * ev.tokens)
            return web.json_response(reply("chat.completion", choices, usage=usage,
                                           **_sglext(emu, got.outs, details)))  # fmt: skip
        resp = await _stream_response(request)
        first = True

        async def write(ev: _Event, _: str) -> None:
            nonlocal first
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if ev.delta or first:
                delta["content"] = ev.delta
            first = False
            choices = [{"index": j, "delta": delta, "logprobs": None, "finish_reason": ev.finish} for j in range(n)]
            extra = _sglext(emu, [ev.outcome], details) if ev.finish else {}
            await resp.write(_sse(reply("chat.completion.chunk", choices, **extra)))

        got = await _answer(emu, [prompt], limit, stops, write)
        if opts.include_usage:
            usage = _usage(emu, got.outs, n * got.done[0].tokens)
            await resp.write(_sse(reply("chat.completion.chunk", [], usage=usage)))
        return await _end_stream(resp)


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params``
    (``max_new_tokens``, ``stop``), ``stream`` (cumulative text per event, as SGLang streams)."""
    body = await _body(request)
    _check_params(body, _GEN_SERVED, _GEN_OFF)
    if ("text" in body) == ("input_ids" in body):
        raise _bad_request("text or input_ids: give exactly one of them", "input_ids")
    name = "text" if "text" in body else "input_ids"
    if name == "text" and not (isinstance(body["text"], str) or _strings(body["text"])):
        raise _bad_request("text: a string or a list of strings (token ids go in input_ids)", "text")
    if name == "input_ids" and (isinstance(body["input_ids"], str) or _strings(body["input_ids"])):
        raise _bad_request("input_ids: token ids (list of int) or a list of them (text goes in text)", "input_ids")
    prompts, batched = _prompts(body[name], name)
    sp = _object(body, "sampling_params")
    _check_params(sp, _SP_SERVED, _SP_OFF, "sampling_params.")
    limit = _int(sp.get("max_new_tokens"), "sampling_params.max_new_tokens", 128, 65536)
    stops = _stops(sp.get("stop"), "sampling_params.stop")
    stream = _flag(body, "stream")
    rids = body.get("rid")

    def result(ev: _Event, text: str) -> dict[str, Any]:
        rid = rids[ev.prompt] if isinstance(rids, list) and ev.prompt < len(rids) else rids
        u = _usage(emu, [ev.outcome], ev.tokens)
        finish = None
        if ev.finish == "length":
            finish = {"type": "length", "length": ev.tokens}
        elif ev.finish == "stop":
            finish = {"type": "stop", "matched": ev.matched}
        meta = {"id": str(rid) if rid is not None else f"{ev.prompt}-{cid}", "finish_reason": finish,
                "prompt_tokens": ev.outcome.prompt_tokens, "completion_tokens": ev.tokens,
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "cached_tokens_details": _details(emu, [ev.outcome]), "flatcake": u["flatcake"]}  # fmt: skip
        out: dict[str, Any] = {"text": text, "meta_info": meta}
        if batched and stream:
            out["index"] = ev.prompt
        return out

    cid = uuid.uuid4().hex
    async with _answering(request) as emu:
        if not stream:
            got = await _answer(emu, prompts, limit, stops)
            results = [result(ev, got.texts[i]) for i, ev in enumerate(got.done)]
            return web.json_response(results if batched else results[0])
        resp = await _stream_response(request)

        async def write(ev: _Event, text: str) -> None:
            await resp.write(_sse(result(ev, text)))

        await _answer(emu, prompts, limit, stops, write)
        return await _end_stream(resp)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


async def models(request: web.Request) -> web.Response:
    """OpenAI ``GET /v1/models``: the one model served (any ``model`` in a request is answered)."""
    cfg = request.app[EMULATOR].cfg
    name = cfg.model or MODEL_NAME
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "flatcake", "root": name},
    ]})  # fmt: skip


async def model_info(request: web.Request) -> web.Response:
    """SGLang ``GET /get_model_info`` (and ``/model_info``). No tokenizer ships: text is tokenized by
    the 4-characters rule, so ``tokenizer_path`` is null and clients that need one bring their own."""
    cfg = request.app[EMULATOR].cfg
    return web.json_response({"model_path": cfg.model or MODEL_NAME, "tokenizer_path": None, "is_generation": True,
                              "preferred_sampling_params": None, "weight_version": "default",
                              "has_image_understanding": False, "has_audio_understanding": False,
                              "model_type": None, "architectures": None,
                              "tokenization": f"{tokens.CHARS_PER_TOKEN} characters per token"})  # fmt: skip


async def server_info(request: web.Request) -> web.Response:
    """SGLang ``GET /server_info``: the emulator's configuration (bench_serving records it)."""
    cfg = request.app[EMULATOR].cfg
    return web.json_response({"flatcake_emulator": dataclasses.asdict(cfg), "internal_states": [{}],
                              "version": flatcake.__version__})  # fmt: skip


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang ``/flush_cache`` (vLLM: ``/reset_prefix_cache``): empties HBM's prefix cache, not the
    storage under test. Refused while requests are being answered, as SGLang refuses."""
    if request.app[HTTP].inflight:
        return web.Response(status=400, text="Cache not flushed. (When there are running or waiting requests, "
                                             "the operation will not be performed.)\n")  # fmt: skip
    pages = await request.app[EMULATOR].flush_hbm()
    return web.Response(text=f"Cache flushed. ({pages} HBM pages dropped; the storage under test keeps its pages)\n")


async def metrics_handler(request: web.Request) -> web.Response:
    emu: Emulator = request.app[EMULATOR]
    return web.Response(body=generate_latest(emu.registry), content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def make_app(cfg: EmulatorConfig, emulator: Emulator | None = None) -> web.Application:
    """The HTTP app. ``emulator``: one already made (``serve`` makes it after binding); else the app
    makes its own at startup."""
    app = web.Application(client_max_size=64 * MiB)
    app[HTTP] = _Http()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/flush_cache", "/reset_prefix_cache"):
        app.router.add_post(path, flush_cache)
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics_handler)
    for path in ("/health", "/healthz", "/health_generate"):
        app.router.add_get(path, health)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        app[EMULATOR] = emulator if emulator is not None else Emulator(cfg)
        await app[EMULATOR].start()
        yield
        await app[EMULATOR].stop()

    app.cleanup_ctx.append(lifecycle)
    return app


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any pool is made: a bad address costs nothing."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: {port} is not a TCP port (0..65535; 0 picks a free one)")
    if not host or "/" in host:  # a URL (the load generator's --host takes one) or nothing
        raise ConfigError(f"--host: {host!r} is not an address to listen on; expected an IP address or a name, "
                          "without scheme or port (e.g. 127.0.0.1, ::1, or 0.0.0.0 for every interface)")  # fmt: skip
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError):
        raise ConfigError(
            f"--host: {host!r} is neither an IP address nor a name this machine resolves "
            "(e.g. 127.0.0.1, ::1, or 0.0.0.0 for every interface)"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror}); pick another "
                          "port (0 picks a free one) or stop what holds it") from None  # fmt: skip
    return sock


def create(cfg: EmulatorConfig) -> Emulator:
    """The emulator and its pools; if making them fails, the directories this call created go too
    (a failed start leaves no pool files behind)."""
    root = Path(cfg.data_dir)
    made = next((d for d in (root, root / cfg.mode) if not d.exists()), None)
    try:
        return Emulator(cfg)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def serve(cfg: EmulatorConfig, host: str, port: int) -> None:
    """Bind, then make the pools, then serve until interrupted."""
    sock = bind(host, port)
    if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        log.warning("emulator listening on %s", host)
    try:
        emulator = create(cfg)
    except BaseException:
        sock.close()
        raise
    web.run_app(make_app(cfg, emulator), sock=sock, print=lambda m: log.warning("%s", m))
