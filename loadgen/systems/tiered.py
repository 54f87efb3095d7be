"""The tiered baseline: a DRAM LRU (L2) whose evictions append to an SSD log (L3) in eviction order;
SSD space is reclaimed in fixed-size buckets, oldest first (Mooncake-style). A restore stages the
whole request in host memory (``O(context)``), then copies out. For measurement only, with real I/O
through the same O_DIRECT primitives FlatCake uses.

Two readers: ``whole_page`` (the honest baseline: one command per page, all its layers, as SGLang's
``page_first`` layouts and Mooncake's per-page objects read) and ``page_layer`` (one command per
page-layer: the fragmented access the paper measures, kept as ``tiered-naive``).

The L3 may instead be a real storage backend (``l3=``, a ``PageStore``: SGLang's ``HiCacheFile``, one
file per page, in ``loadgen/systems/sglang.py``; Mooncake Store, ``mooncake.py``): evicted pages are
written through it and prefetched pages read back through it, whole pages, as SGLang's I/O thread
calls a backend (a batch a call where the backend takes batches, else a page at a time).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from flatcake.loadgen.systems.base import Array, MiB, RequestTiming, RestoreCounters, StoreSystem, SystemSpec
from flatcake.loadgen.systems.hicache_rules import STORAGE_BATCH_PAGES
from flatcake.node_agent import Key, aligned_empty
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.datapath.io_backends import PosixDirectIO

READERS = ("whole_page", "page_layer")


class PageStore(Protocol):
    """A real L3: whole pages (``[layers][page_bytes]`` uint8) by key."""

    def set(self, key: Key, page: Array) -> bool: ...
    def get(self, key: Key, into: Array) -> bool: ...


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
        l3: PageStore | None = None,
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
        self.dropped_pages = 0

    def put(self, keys: Sequence[Key], kv: Array) -> None:
        """New pages always enter DRAM; whatever falls off the LRU end goes to the SSD log."""
        self._insert(keys, [np.ascontiguousarray(kv[:, i]) for i in range(len(keys))])

    def promote(self, keys: Sequence[Key], pages: Array) -> None:
        """Pages read back from SSD enter DRAM (SGLang inserts a finished prefetch into its host tier);
        they are still on SSD, so evicting them again costs no write."""
        self._insert(keys, [np.ascontiguousarray(pages[:, i]) for i in range(len(keys))])

    def _insert(self, keys: Sequence[Key], pages: list[Array]) -> None:
        # Deepest page first, so a prefix is more recent than its tail: eviction takes leaves first, as
        # SGLang's radix tree evicts (a page without its prefix is of no use).
        for key, page in reversed(list(zip(keys, pages, strict=True))):
            with self._lock:
                if key in self.l2:
                    self.l2.move_to_end(key)
                    continue
                self.l2[key] = page
                victims = self._pop_victims()
            self._write_back(victims)

    def flush(self) -> None:
        """Evict everything from DRAM, as sustained pressure would; restores then come from SSD."""
        with self._lock:
            saved, self.dram_pages = self.dram_pages, 0
            victims = self._pop_victims()
            self.dram_pages = saved
        self._write_back(victims)

    def _pop_victims(self) -> list[tuple[Key, Array, tuple[int, int, int]]]:
        victims = []
        while len(self.l2) > self.dram_pages:
            key, page = self.l2.popitem(last=False)
            if not self.buckets and self.store is None:
                self.dropped_pages += 1
            elif key not in self.l3:  # a promoted page is still on SSD: nothing to write
                victims.append((key, page, self._reserve() if self.store is None else (-1, 0, 0)))
        return victims

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

    def _write_back(self, victims: list[tuple[Key, Array, tuple[int, int, int]]]) -> None:
        if self.store is not None and victims:
            stored = _l3_write(self.store, [k for k, _, _ in victims], [p for _, p, _ in victims])
            with self._lock:
                for (key, _, _), ok in zip(victims, stored, strict=True):
                    if ok:
                        self.l3[key] = (-1, 0)
            return
        for key, page, (bucket, offset, gen) in victims:
            buf = aligned_empty(self.page_span)
            buf.reshape(self.layers, self.page_bytes)[...] = page
            self.io.submit_write(0, bucket, offset, [buf]).result()
            with self._lock:
                if self._bucket_gen[bucket] == gen:
                    self.l3[key] = (bucket, offset)
                    self._bucket_keys[bucket].append(key)

    def exists(self, keys: Sequence[Key]) -> int:
        with self._lock:
            return self._exists(keys)

    def _exists(self, keys: Sequence[Key]) -> int:
        for i, key in enumerate(keys):
            if key not in self.l2 and key not in self.l3:
                return i
        return len(keys)

    def media(self, keys: Sequence[Key]) -> list[str]:
        """Where each page of the stored prefix is: "dram" (L2) or "ssd" (L3)."""
        with self._lock:
            return ["dram" if key in self.l2 else "ssd" for key in keys[: self._exists(keys)]]

    def restore(self, keys: Sequence[Key], dest: Array) -> int:
        """Restore into ``dest[layer, i]``; returns pages missing."""
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
            on_ssd = {i: self.l3[k] for i, k in enumerate(keys) if i not in in_dram and k in self.l3}
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
            arrived, commands = _l3_read(self.store, [keys[i] for i, _, _ in reads], [buf for _, _, buf in reads])
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
        return len(missing)

    def close(self) -> None:
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
        super().prepare()


class TieredNaiveSystem(TieredSystem):
    """The same tiered design with one read command per page-layer (the paper's fragmented baseline)."""

    name = "tiered-naive"
    reader = "page_layer"
