"""The tiered baseline: a DRAM LRU (L2) over an SSD log (L3). Pages are written through, as SGLang 0.5.23
does by default (``--hicache-write-policy write_through``, ``srt/arg_groups/fields/memory.py``): each
new page enters the host tier at once and is queued for the L3 on a backup thread of its own
(``managers/cache_controller.py`` ``write_storage`` → ``backup_thread_func``), apart from the prefetch
thread; until its backup is done the page is held in the host tier (``unified_radix_cache.py``
``write_backup_storage`` takes a host lock that the backup's ack releases). Host evictions then
drop pages, which the L3 already holds. SSD space is reclaimed in fixed-size buckets, oldest first
(Mooncake-style). A restore stages the
whole request in host memory (``O(context)``), then copies out. For measurement only, with real I/O
through the same O_DIRECT primitives FlatCake uses.

Two readers: ``whole_page`` (the honest baseline: one command per page, all its layers, as SGLang's
``page_first`` layouts and Mooncake's per-page objects read) and ``page_layer`` (one command per
page-layer: the fragmented access the paper measures, kept as ``tiered-naive``).

The L3 may instead be a real storage backend (``l3=``, a ``PageStore``: SGLang's ``HiCacheFile``, one
file per page, in ``loadgen/systems/sglang.py``; Mooncake Store, ``mooncake.py``): evicted pages are
written through it and prefetched pages read back through it, whole pages, as SGLang's I/O thread
calls a backend (a batch a call where the backend takes batches, else a page at a time); lookups past
the host tier ask it (``exists``), costing what the backend's ``batch_exists`` costs. FlatCake's
backend (``flatcake_pages.py``) is a ``ChainPageStore``: it is told each call's prefix keys, as SGLang
tells a backend that asks for them, and reads in place into the host rows.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from flatcake.loadgen.systems.base import Array, MiB, RequestTiming, RestoreCounters, StoreSystem, SystemSpec
from flatcake.loadgen.systems.hicache_rules import STORAGE_BATCH_PAGES, lock
from flatcake.node_agent import Key, aligned_empty
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.datapath.io_backends import PosixDirectIO

READERS = ("whole_page", "page_layer")


class PageStore(Protocol):
    """A real L3: whole pages (``[layers][page_bytes]`` uint8) by key."""

    def set(self, key: Key, page: Array) -> bool: ...
    def get(self, key: Key, into: Array) -> bool: ...


@runtime_checkable
class ExistsPageStore(PageStore, Protocol):
    """An L3 asked what it holds (the backend's ``batch_exists``: the stored prefix's length)."""

    def exists(self, keys: Sequence[Key]) -> int: ...


@runtime_checkable
class ChainPageStore(Protocol):
    """An L3 told the key chain before each call's keys (SGLang's ``prefix_keys``, for a backend that asks
    for them), written ``[layers][pages][page_bytes]`` a batch at a time and read in place into rows of a
    page-major host buffer: no page-at-a-time calls."""

    def exists_after(self, prefix: Sequence[Key], keys: Sequence[Key]) -> int: ...
    def set_after(self, prefix: Sequence[Key], keys: Sequence[Key], kv: Array) -> bool: ...
    def get_rows(self, keys: Sequence[Key], staging: Array, rows: Sequence[int]) -> list[bool]: ...


@runtime_checkable
class BatchPageStore(PageStore, Protocol):
    """An L3 whose backend takes a batch of pages a call (Mooncake's ``batch_get_into``); HiCacheFile's
    batch calls loop over pages, so it is a plain ``PageStore``."""

    def set_many(self, keys: Sequence[Key], pages: Sequence[Array]) -> list[bool]: ...
    def get_many(self, keys: Sequence[Key], into: Sequence[Array]) -> list[bool]: ...


def _l3_read(store: PageStore, keys: Sequence[Key], bufs: Sequence[Array]) -> tuple[list[bool], int]:
    """Whole pages through a real L3 as SGLang's I/O thread calls it: a batch a call where the backend
    takes batches (its v1 API), else a page at a time. Returns which arrived and the calls made."""
    if isinstance(store, BatchPageStore):
        return store.get_many(keys, bufs), -(-len(keys) // STORAGE_BATCH_PAGES)
    return [store.get(key, buf) for key, buf in zip(keys, bufs, strict=True)], len(keys)


def _l3_write(store: PageStore, keys: Sequence[Key], pages: Sequence[Array]) -> list[bool]:
    """Whole pages into a real L3, batched as ``_l3_read``; which were stored."""
    if isinstance(store, BatchPageStore):
        return store.set_many(keys, pages)
    return [store.set(key, page) for key, page in zip(keys, pages, strict=True)]


class TieredStore:
    """Safe to use from several threads, as SGLang's storage threads use a backend: an index lock is held
    only to look up, reserve and publish, never across I/O, so reads never wait for writes."""

    def __init__(
        self,
        directory: str | Path,
        *,
        layers: int,
        page_bytes: int,
        dram_pages: int,
        bucket_bytes: int,
        buckets: int,
        workers: int = 2,
        reader: str = "whole_page",
        host_pool_pages: int = 0,
        l3: PageStore | ChainPageStore | None = None,
    ) -> None:
        if reader not in READERS:
            raise ValueError(f"reader: {reader!r} must be one of {', '.join(READERS)}")
        self.reader = reader
        self.layers, self.page_bytes = layers, page_bytes
        self.page_span = layers * page_bytes  # a page is logged page-major: its layers back to back
        if bucket_bytes % self.page_span:
            bucket_bytes -= bucket_bytes % self.page_span
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes: must hold at least one page of all layers")
        self.bucket_bytes, self.buckets = bucket_bytes, buckets
        self.store = l3  # a real L3 instead of the log (then ``buckets`` is 0)
        if l3 is not None and reader != "whole_page":
            raise ValueError("l3: a page store is read whole pages at a time (reader 'whole_page')")
        # buckets=0: DRAM only (an L2 cache with no L3): evicted pages are simply dropped.
        files = create_pool(directory, buckets, bucket_bytes).files if buckets else []
        self.io = PosixDirectIO([str(Path(directory) / f) for f in files], workers)
        self.dram_pages = dram_pages
        self.l2: OrderedDict[Key, Array] = OrderedDict()
        self.l3: dict[Key, tuple[int, int]] = {}  # key -> (bucket, offset)
        self._bucket_keys: list[list[Key]] = [[] for _ in range(buckets)]
        # A bucket's generation moves on when it is reclaimed: a write reserved before that must not
        # publish into the reused space.
        self._bucket_gen = [0] * buckets
        self._bucket, self._cursor = 0, 0
        self._lock = threading.Lock()
        # A page-major host pool allocated (and faulted in) once, as SGLang's page_first host pool is:
        # whole-page reads land in it, and the restore's storage time ends when they have. Without one,
        # each restore stages into a fresh buffer and is timed whole by its caller. One restore at a
        # time uses it (bench context); concurrent callers (the emulator) pass none.
        self.host_pool: Array | None = None
        if host_pool_pages and reader == "whole_page":
            self.host_pool = aligned_empty((host_pool_pages, layers, page_bytes))
            self.host_pool.fill(0)
        self.counters = RestoreCounters()
        self.reclaimed_buckets = 0
        self.invalidated_pages = 0
        self.dropped_pages = 0  # evicted from the host tier with no L3 copy
        self.failed_backups = 0  # pages the L3 did not take
        self.on_backup: Callable[[int, int], None] | None = None  # (stored, failed) after each backup
        # Write-through: a backup thread of its own writes each put's pages to the L3 (none without one);
        # pages queued there are held in the host tier (SGLang's host lock until the backup's ack).
        self._pending: dict[Key, int] = {}
        self._backups: set[Future[None]] = set()
        self._backup = ThreadPoolExecutor(1, thread_name_prefix="tiered-backup") if buckets or l3 is not None else None

    def put(self, keys: Sequence[Key], kv: Array, prefix: Sequence[Key] = ()) -> None:
        """New pages enter the host tier now; with an L3 their backup is queued on the backup thread
        (write-through) and they are held in the host tier until it is done. ``prefix``: the keys before
        ``keys`` in their chain (what SGLang passes a backend as ``prefix_keys``)."""
        pages = [np.ascontiguousarray(kv[:, i]) for i in range(len(keys))]
        if self._backup is None:
            self._insert(keys, pages)
            return
        with self._lock:
            self._hold(keys, +1)
        self._insert(keys, pages)
        done = self._backup.submit(self._back_up, list(prefix), list(keys), pages)
        with self._lock:
            self._backups.add(done)
        done.add_done_callback(self._backed_up)

    def promote(self, keys: Sequence[Key], pages: Array) -> None:
        """Pages read back from SSD enter DRAM (SGLang inserts a finished prefetch into its host tier);
        they are still on SSD, so evicting them again costs no write."""
        self._insert(keys, [np.ascontiguousarray(pages[:, i]) for i in range(len(keys))])

    def _insert(self, keys: Sequence[Key], pages: list[Array]) -> None:
        # Deepest page first, so a prefix is more recent than its tail: eviction takes leaves first, as
        # SGLang's radix tree evicts (a page without its prefix is of no use).
        with self._lock:
            for key, page in reversed(list(zip(keys, pages, strict=True))):
                if key in self.l2:
                    self.l2.move_to_end(key)
                    continue
                self.l2[key] = page
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used pages past the host tier's size, skipping those whose backup is still
        queued. Called under the lock. Written through, a dropped page is in the L3 already (or its
        backup failed: then it is gone, as in SGLang)."""
        excess = len(self.l2) - self.dram_pages
        if excess <= 0:
            return
        for key in list(itertools.islice(self.l2, excess + len(self._pending))):
            if excess <= 0:
                break
            if key in self._pending:
                continue
            del self.l2[key]
            excess -= 1
            if key not in self.l3:
                self.dropped_pages += 1

    def _back_up(self, prefix: list[Key], keys: list[Key], pages: list[Array]) -> None:
        """The backup thread's work for one put: the pages into the L3, then published."""
        stored = [False] * len(keys)  # until the L3 says otherwise: an interrupted backup stored nothing
        try:
            if isinstance(self.store, ChainPageStore):  # the whole chain: the backend skips what it holds
                kv = aligned_empty((self.layers, len(keys), self.page_bytes))
                for j, page in enumerate(pages):
                    kv[:, j] = page
                stored = [self.store.set_after(prefix, keys, kv)] * len(keys)
            else:
                with self._lock:
                    todo = [j for j, key in enumerate(keys) if key not in self.l3]
                if self.store is not None:
                    ok = _l3_write(self.store, [keys[j] for j in todo], [pages[j] for j in todo])
                else:
                    ok = [self._log_write(keys[j], pages[j]) for j in todo]
                stored = [True] * len(keys)
                for j, good in zip(todo, ok, strict=True):
                    stored[j] = good
        except Exception:  # a failed backup loses the pages' L3 copy, never the caller's thread
            stored = [False] * len(keys)
        finally:
            with self._lock:
                for key, good in zip(keys, stored, strict=True):
                    if good and self.store is not None:
                        self.l3[key] = (-1, 0)
                    if not good:
                        self.failed_backups += 1
                self._hold(keys, -1)
                self._evict()
            if self.on_backup is not None:
                n_ok = sum(1 for ok in stored if ok)
                self.on_backup(n_ok, len(keys) - n_ok)

    def _backed_up(self, done: Future[None]) -> None:
        with self._lock:
            self._backups.discard(done)

    def _log_write(self, key: Key, page: Array) -> bool:
        """One page appended to the SSD log (the idealized L3), published if its bucket was not reused."""
        with self._lock:
            bucket, offset, gen = self._reserve()
        buf = aligned_empty(self.page_span)
        buf.reshape(self.layers, self.page_bytes)[...] = page
        self.io.submit_write(0, bucket, offset, [buf]).result()
        with self._lock:
            if self._bucket_gen[bucket] == gen:
                self.l3[key] = (bucket, offset)
                self._bucket_keys[bucket].append(key)
        return True

    def drain(self) -> None:
        """Wait until every queued backup is done."""
        while True:
            with self._lock:
                pending = list(self._backups)
            if not pending:
                return
            for done in pending:
                done.exception()

    def flush(self) -> None:
        """Evict everything from DRAM, as sustained pressure would; restores then come from SSD."""
        self.drain()
        with self._lock:
            saved, self.dram_pages = self.dram_pages, 0
            self._evict()
            self.dram_pages = saved

    def _reserve(self) -> tuple[int, int, int]:
        if self._cursor + self.page_span > self.bucket_bytes:
            self._bucket = (self._bucket + 1) % self.buckets
            self._cursor = 0
            if self._bucket_keys[self._bucket]:  # FIFO bucket reclaim: whatever lived there is gone
                self.reclaimed_buckets += 1
                for k in self._bucket_keys[self._bucket]:
                    if self.l3.get(k, (-1, 0))[0] == self._bucket:
                        del self.l3[k]
                        self.invalidated_pages += 1
                self._bucket_keys[self._bucket] = []
            self._bucket_gen[self._bucket] += 1
        slot = (self._bucket, self._cursor, self._bucket_gen[self._bucket])
        self._cursor += self.page_span
        return slot

    def exists(self, keys: Sequence[Key]) -> int:
        return len(self.media(keys))

    def hold(self, keys: Sequence[Key], delta: int = 1) -> None:
        """Hold host-tier pages (``delta`` 1) or let them go (-1): a waiting request's matched host pages are
        locked until it is scheduled (SGLang's ``inc_lock_ref`` on the matched node), so its own prefetch,
        entering the host tier, cannot evict them."""
        with self._lock:
            self._hold(keys, delta)
            if delta < 0:
                self._evict()

    def _hold(self, keys: Sequence[Key], delta: int) -> None:
        """Count holds on host-tier pages (a queued backup, a waiting request); eviction skips held pages.
        Called under the lock."""
        lock(self._pending, keys, delta)

    def host_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading pages of ``keys`` the host tier holds."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self.l2:
                n += 1
            return n

    def media(self, keys: Sequence[Key], prefix: Sequence[Key] = ()) -> list[str]:
        """Where each page of the stored prefix is: "dram" (L2) or "ssd" (L3). The idealized log answers
        from its index, anywhere in the prefix; a real L3 is asked past the host tier's prefix, as
        SGLang's storage hit query asks its backend (``_storage_hit_query``: ``STORAGE_BATCH_SIZE`` keys
        a call, stopping at the first short answer), costing what the backend's lookup costs."""
        with self._lock:
            if self.store is None or not isinstance(self.store, ExistsPageStore | ChainPageStore):
                n = 0
                while n < len(keys) and (keys[n] in self.l2 or keys[n] in self.l3):
                    n += 1
                return ["dram" if key in self.l2 else "ssd" for key in keys[:n]]
            host = 0
            while host < len(keys) and keys[host] in self.l2:
                host += 1
        chain, hit = [*prefix, *keys[:host]], 0
        for lo in range(host, len(keys), STORAGE_BATCH_PAGES):
            batch = keys[lo : lo + STORAGE_BATCH_PAGES]
            if isinstance(self.store, ChainPageStore):
                got = self.store.exists_after(chain, batch)
            else:
                got = self.store.exists(batch)
            hit += got
            if got < len(batch):
                break
            chain += batch
        return ["dram"] * host + ["ssd"] * hit

    def restore(self, keys: Sequence[Key], dest: Array) -> int:
        """Restore into ``dest[layer, i]``; returns pages missing."""
        return len(self.restore_pages(keys, dest))

    def restore_pages(self, keys: Sequence[Key], dest: Array) -> set[int]:
        """Restore into ``dest[layer, i]``; returns the indexes of the pages missing."""
        n, pb = len(keys), self.page_bytes
        c = self.counters
        started = time.perf_counter()
        pool = self.host_pool if self.host_pool is not None and n <= len(self.host_pool) else None
        with self._lock:  # what is where, now; the reads run unlocked
            in_dram = {i: self.l2[k] for i, k in enumerate(keys) if k in self.l2}
            # A hit is a use: the host tier evicts the least recently used, deepest page first (a radix
            # tree's leaves), so the prefix is touched last.
            for i in sorted(in_dram, reverse=True):
                self.l2.move_to_end(keys[i])
            # A real L3 is asked for every page the host tier lacks (its lookup said it holds them).
            on_ssd = {i: self.l3.get(k, (-1, 0)) for i, k in enumerate(keys)
                      if i not in in_dram and (self.store is not None or k in self.l3)}  # fmt: skip
        missing = {i for i in range(n) if i not in in_dram and i not in on_ssd}
        if self.reader == "whole_page":
            # Page-major staging, as the log stores pages: one read per page brings all its layers.
            staging = pool[:n] if pool is not None else aligned_empty((n, self.layers, pb))
            reads = [(i, loc, staging[i]) for i, loc in on_ssd.items()]
            for i, page in in_dram.items():
                staging[i] = page
        else:
            staging = aligned_empty((self.layers, n, pb))
            reads = []
            for layer in range(self.layers):
                for i in range(n):
                    if i in in_dram:
                        staging[layer, i] = in_dram[i][layer]
                    elif i in on_ssd:
                        bucket, offset = on_ssd[i]
                        reads.append((i, (bucket, offset + layer * pb), staging[layer, i]))
        c.staging_peak_bytes = max(c.staging_peak_bytes, staging.nbytes)
        if self.store is not None:
            rows = [i for i, _, _ in reads]
            if isinstance(self.store, ChainPageStore):  # in place, into the host rows
                arrived = self.store.get_rows([keys[i] for i in rows], staging, rows) if rows else []
                c.read_commands += -(-len(rows) // STORAGE_BATCH_PAGES)
            else:
                arrived, commands = _l3_read(self.store, [keys[i] for i in rows], [buf for _, _, buf in reads])
                c.read_commands += commands
            for (i, _, buf), ok in zip(reads, arrived, strict=True):
                if ok:
                    c.bytes_read += buf.nbytes
                else:
                    missing.add(i)
            reads = []
        pending = [(i, buf.nbytes, self.io.submit_read(rr, bucket, offset, buf))
                   for rr, (i, (bucket, offset), buf) in enumerate(reads)]  # fmt: skip
        for i, want, fut in pending:
            try:
                got = fut.result()
            except OSError:
                got = -1
            c.read_commands += 1
            c.bytes_read += max(got, 0)
            if got != want:
                missing.add(i)
        if self.store is None:
            with self._lock:  # a bucket reclaimed while it was read may hold another page's bytes now
                missing.update(i for i, loc in on_ssd.items() if self.l3.get(keys[i]) != loc)
        c.bytes_requested += n * self.layers * pb
        c.dram_pages += len(in_dram)
        # The prefix is in the host pool now; copying it into the benchmark's layer-major buffer is not timed.
        if pool is not None:
            took = time.perf_counter() - started
            c.requests.append(RequestTiming(took, took))
        dest[:, :n] = staging.transpose(1, 0, 2) if self.reader == "whole_page" else staging
        c.missing += len(missing)
        return missing

    def close(self) -> None:
        if self._backup is not None:
            self._backup.shutdown(wait=True)
        self.io.close()
        close = getattr(self.store, "close", None)  # a real L3 with processes of its own (Mooncake's master)
        if close is not None:
            close()


class TieredSystem(StoreSystem):
    """The tiered design read as its users read it: whole pages."""

    name = "tiered"
    reader = "whole_page"
    store: TieredStore

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        self.flush_dram = spec.flush_dram
        pages = spec.total_pages
        bucket = 64 * MiB
        self.store = TieredStore(
            directory,
            layers=spec.layers,
            page_bytes=spec.page_bytes,
            dram_pages=max(1, int(pages * spec.dram_fraction)),
            bucket_bytes=bucket,
            buckets=-(-pages * spec.page_span // bucket) + 2,
            workers=spec.workers,
            reader=self.reader,
            host_pool_pages=-(-spec.session_bytes // spec.page_span) if spec.host_pool else 0,
        )

    def prepare(self) -> None:
        if self.flush_dram:
            self.store.flush()
        self.store.drain()  # written through: every put's backup is done before restores are timed
        super().prepare()


class TieredNaiveSystem(TieredSystem):
    """The same tiered design with one read command per page-layer (the paper's fragmented baseline)."""

    name = "tiered-naive"
    reader = "page_layer"
