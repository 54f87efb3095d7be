"""The per-block baseline: one file per page on a local disk (LMCache-style local backend); a restore
opens each page's file and reads it layer by layer into a host staging buffer. For measurement only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flatcake.loadgen.systems.base import Array, RestoreCounters, StoreSystem, SystemSpec
from flatcake.node_agent import Key, aligned_empty
from flatcake.node_agent.datapath.file_pool import open_direct


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


class PerBlockSystem(StoreSystem):
    name = "per-block"

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        self.store = PerBlockStore(directory, layers=spec.layers, page_bytes=spec.page_bytes, workers=spec.workers)
