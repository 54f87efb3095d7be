"""Baselines for measurement only: the designs FlatCake is compared against, with real I/O.

- ``TieredStore``: DRAM LRU (L2) whose evictions append to an SSD log (L3) in eviction order; SSD space
  is reclaimed in fixed-size buckets, oldest first (Mooncake-style). A restore reads page-layer by
  page-layer into a host staging buffer sized to the whole request (``O(context)``), then copies out.
- ``PerBlockStore``: one file per page on a local disk (LMCache-style local backend); a restore opens
  each page's file and reads it layer by layer into a host staging buffer.

Neither is used by the engine; the restore benchmark and the emulator's tiered modes use them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.buffers import aligned_empty
from flatcake.node_agent.file_pool import create_pool, open_direct
from flatcake.node_agent.io_backends import PosixDirectIO
from flatcake.node_agent.placement import Key

Array = npt.NDArray[np.uint8]


@dataclass
class RestoreCounters:
    read_commands: int = 0
    bytes_read: int = 0
    bytes_requested: int = 0
    staging_peak_bytes: int = 0
    missing: int = 0


class TieredStore:
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
    ) -> None:
        self.layers, self.page_bytes = layers, page_bytes
        self.page_span = layers * page_bytes  # a page is logged page-major: its layers back to back
        if bucket_bytes % self.page_span:
            bucket_bytes -= bucket_bytes % self.page_span
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes: must hold at least one page of all layers")
        self.bucket_bytes, self.buckets = bucket_bytes, buckets
        # buckets=0: DRAM only (an L2 cache with no L3): evicted pages are simply dropped.
        files = create_pool(directory, buckets, bucket_bytes).files if buckets else []
        self.io = PosixDirectIO([str(Path(directory) / f) for f in files], workers)
        self.dram_pages = dram_pages
        self.l2: OrderedDict[Key, Array] = OrderedDict()
        self.l3: dict[Key, tuple[int, int]] = {}  # key -> (bucket, offset)
        self._bucket_keys: list[list[Key]] = [[] for _ in range(buckets)]
        self._bucket, self._cursor = 0, 0
        self._write_buf = aligned_empty(self.page_span)
        self.counters = RestoreCounters()
        self.reclaimed_buckets = 0
        self.invalidated_pages = 0
        self.dropped_pages = 0

    def put(self, keys: Sequence[Key], kv: Array) -> None:
        """New pages always enter DRAM; whatever falls off the LRU end goes to the SSD log."""
        for i, key in enumerate(keys):
            if key in self.l2:
                self.l2.move_to_end(key)
                continue
            self.l2[key] = np.ascontiguousarray(kv[:, i])
            while len(self.l2) > self.dram_pages:
                self._evict()

    def flush(self) -> None:
        """Evict everything from DRAM, as sustained pressure would; restores then come from SSD."""
        while self.l2:
            self._evict()

    def _evict(self) -> None:
        key, page = self.l2.popitem(last=False)
        if not self.buckets:
            self.dropped_pages += 1
            return
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
        self._write_buf.reshape(self.layers, self.page_bytes)[...] = page
        self.io.submit_write(0, self._bucket, self._cursor, [self._write_buf]).result()
        self.l3[key] = (self._bucket, self._cursor)
        self._bucket_keys[self._bucket].append(key)
        self._cursor += self.page_span

    def exists(self, keys: Sequence[Key]) -> int:
        for i, key in enumerate(keys):
            if key not in self.l2 and key not in self.l3:
                return i
        return len(keys)

    def media(self, keys: Sequence[Key]) -> list[str]:
        """Where each page of the stored prefix is: "dram" (L2) or "ssd" (L3)."""
        out = []
        for key in keys[: self.exists(keys)]:
            out.append("dram" if key in self.l2 else "ssd")
        return out

    def restore(self, keys: Sequence[Key], dest: Array) -> int:
        """Restore into ``dest[layer, i]``; returns pages missing. Reads one page-layer per command."""
        n, pb = len(keys), self.page_bytes
        staging = aligned_empty((self.layers, n, pb))  # the whole prefix is staged in host memory
        c = self.counters
        c.staging_peak_bytes = max(c.staging_peak_bytes, staging.nbytes)
        pending: list[tuple[int, Future[int]]] = []
        rr = 0
        for layer in range(self.layers):
            for i, key in enumerate(keys):
                if key in self.l2:
                    staging[layer, i] = self.l2[key][layer]
                    continue
                where = self.l3.get(key)
                if where is None:
                    continue
                bucket, offset = where
                pending.append((i, self.io.submit_read(rr, bucket, offset + layer * pb, staging[layer, i])))
                rr += 1
        missing = set(i for i, k in enumerate(keys) if k not in self.l2 and k not in self.l3)
        for i, fut in pending:
            try:
                got = fut.result()
            except OSError:
                got = -1
            c.read_commands += 1
            c.bytes_read += max(got, 0)
            if got != pb:
                missing.add(i)
        c.bytes_requested += n * self.layers * pb
        dest[:, :n] = staging
        c.missing += len(missing)
        return len(missing)

    def close(self) -> None:
        self.io.close()


class PerBlockStore:
    def __init__(self, directory: str | Path, *, layers: int, page_bytes: int, workers: int = 2) -> None:
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.layers, self.page_bytes = layers, page_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="flatcake-perblock")
        self.counters = RestoreCounters()

    def _path(self, key: Key) -> Path:
        return self.root / f"{key!s}.kv"

    def put(self, keys: Sequence[Key], kv: Array) -> None:
        buf = aligned_empty((self.layers, self.page_bytes))
        for i, key in enumerate(keys):
            path = self._path(key)
            if path.exists():
                continue
            buf[...] = kv[:, i]
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                os.pwrite(fd, buf.data, 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # a page file is visible only once complete

    def exists(self, keys: Sequence[Key]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).exists():
                return i
        return len(keys)

    def _read_page(self, key: Key, staging: Array, i: int) -> tuple[int, int]:
        """Open the page's file and read it one layer per command, as a layer-wise loader does."""
        try:
            fd = open_direct(self._path(key))
        except OSError:
            return 0, 0
        got = 0
        try:
            for layer in range(self.layers):
                got += os.preadv(fd, [staging[layer, i].data], layer * self.page_bytes)
        except OSError:
            pass
        finally:
            os.close(fd)
        return self.layers, got

    def restore(self, keys: Sequence[Key], dest: Array) -> int:
        n = len(keys)
        staging = aligned_empty((self.layers, n, self.page_bytes))
        c = self.counters
        c.staging_peak_bytes = max(c.staging_peak_bytes, staging.nbytes)
        futures = [self._pool.submit(self._read_page, k, staging, i) for i, k in enumerate(keys)]
        missing = 0
        for fut in futures:
            commands, got = fut.result()
            c.read_commands += commands
            c.bytes_read += got
            if got != self.layers * self.page_bytes:
                missing += 1
        c.bytes_requested += n * self.layers * self.page_bytes
        dest[:, :n] = staging
        c.missing += missing
        return missing

    def close(self) -> None:
        self._pool.shutdown(wait=True)
