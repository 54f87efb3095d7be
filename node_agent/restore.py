"""FC-CIO restore execution: merged reads streamed through a bounded, double-buffered staging window.

A restore holds one window of ``staging_layers`` slots. Fills (the commands of one slot, one layer)
are issued in layer order round-robin over the I/O workers; a slot is scattered into the destination
pages as soon as its reads complete, then reused. Reads for layer l+1 are in flight while the caller
works on layer l. When every slot is busy the next read waits: nothing is dropped or recomputed.
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.buffers import aligned_empty
from flatcake.node_agent.coalesce import Command, Fill
from flatcake.node_agent.io_backends import IOBackend
from flatcake.node_agent.stats import Stats

# A run of pieces that is contiguous both in the slot and in the destination: (slot byte offset,
# first destination page, page count).
Run = tuple[int, int, int]
Scatter = Callable[[int, Any, list[Run]], None]


class Window:
    def __init__(self, slots: int, slot_bytes: int, alloc: Callable[[int], Any]) -> None:
        self.slot_bytes = slot_bytes
        self.slots = [alloc(slot_bytes) for _ in range(slots)]


class WindowPool:
    """At most ``streams`` windows exist; a restore that finds none free waits for one."""

    def __init__(
        self, streams: int, slots: int, slot_bytes: int, stats: Stats, alloc: Callable[[int], Any] = aligned_empty
    ) -> None:
        self._free: list[Window] = []
        self._made = 0
        self._streams, self._slots, self._slot_bytes, self._alloc = streams, slots, slot_bytes, alloc
        self._cond = threading.Condition()
        self._stats = stats

    def acquire(self) -> Window:
        with self._cond:
            if not self._free and self._made >= self._streams:
                self._stats.add("staging_waits")
                self._cond.wait_for(lambda: bool(self._free))
            if self._free:
                return self._free.pop()
            self._made += 1
        return Window(self._slots, self._slot_bytes, self._alloc)

    def release(self, window: Window) -> None:
        with self._cond:
            self._free.append(window)
            self._cond.notify()


class Restore(Iterator[int]):
    """Yields layer indexes in order; when layer ``l`` is yielded its bytes are in the destination.

    After iteration ``missing`` holds the indexes (into the requested keys) of pages whose bytes could
    not be read (I/O error or short read): the caller recomputes those. No I/O exception escapes.
    """

    def __init__(
        self,
        *,
        layers: int,
        fills: list[Fill],
        dest_pages: list[int],
        io: IOBackend,
        windows: WindowPool,
        scatter: Scatter,
        copy_dram: Callable[[int], None],
        stats: Stats,
        on_close: Callable[[], None],
    ) -> None:
        self.missing: set[int] = set()
        self.staging_peak_bytes = 0
        self._layers, self._fills, self._dest_pages = layers, fills, dest_pages
        self._io, self._windows, self._scatter, self._copy_dram = io, windows, scatter, copy_dram
        self._stats, self._on_close = stats, on_close
        self._finished = False
        self._gen = self._run()

    def __next__(self) -> int:
        return next(self._gen)

    def close(self) -> None:
        """Stop early: in-flight reads drain, then the window and the pins are released."""
        self._gen.close()
        self._finish()  # the generator's own cleanup does not run if it never started

    def __del__(self) -> None:
        self.close()

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._stats.peak("staging_peak_bytes", self.staging_peak_bytes)
            self._on_close()

    def __enter__(self) -> Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self) -> set[int]:
        """Restore every layer; returns the missing page indexes."""
        for _ in self:
            pass
        return self.missing

    def _run(self) -> Generator[int, None, None]:
        window = self._windows.acquire() if self._fills else None
        inflight: deque[tuple[Fill, int, list[Future[int]]]] = deque()
        try:
            queue = deque(self._fills)
            free = deque(range(len(window.slots))) if window else deque()
            rr = 0
            staged = 0

            def top_up() -> None:
                nonlocal rr, staged
                while queue and free:
                    fill, slot = queue.popleft(), free.popleft()
                    buf, futures, at = window.slots[slot], [], 0  # type: ignore[union-attr]
                    for cmd in fill.commands:
                        futures.append(self._io.submit_read(rr, cmd.file, cmd.offset, buf[at : at + cmd.length]))
                        rr += 1
                        at += cmd.length
                    inflight.append((fill, slot, futures))
                    staged += fill.nbytes
                    self.staging_peak_bytes = max(self.staging_peak_bytes, staged)

            for layer in range(self._layers):
                top_up()
                while inflight and inflight[0][0].layer == layer:
                    fill, slot, futures = inflight.popleft()
                    self._complete(fill, window.slots[slot], futures)  # type: ignore[union-attr]
                    free.append(slot)
                    staged -= fill.nbytes
                    top_up()
                self._copy_dram(layer)
                yield layer
        finally:
            for _, _, futures in inflight:  # never hand a slot back while a read may still land in it
                for f in futures:
                    f.exception()
            if window is not None:
                self._windows.release(window)
            self._finish()

    def _complete(self, fill: Fill, buf: Any, futures: list[Future[int]]) -> None:
        runs: list[Run] = []
        at = 0
        for cmd, fut in zip(fill.commands, futures, strict=True):
            try:
                got = fut.result()
            except OSError as exc:
                got = -1
                self._stats.add(f"io_errors_{errno.errorcode.get(exc.errno or 0, 'other').lower()}")
            if 0 <= got < cmd.length:
                self._stats.add("io_errors_short_read")
            self._stats.add("read_commands")
            self._stats.add("read_bytes", max(got, 0))
            self._stats.add("requested_bytes", cmd.requested)
            self._stats.add("descriptors", len(cmd.pieces))
            runs.extend(self._runs(cmd, at, got))
            at += cmd.length
        if runs:
            self._scatter(fill.layer, buf, runs)

    def _runs(self, cmd: Command, at: int, got: int) -> list[Run]:
        runs: list[Run] = []
        dest = self._dest_pages
        for p in cmd.pieces:
            if p.start + p.length > got:  # not (fully) read: the caller recomputes this page
                if p.tag not in self.missing:
                    self.missing.add(p.tag)
                    self._stats.add("pages_missing")
                continue
            src, page = at + p.start, dest[p.tag]
            if runs:
                s, d, n = runs[-1]
                if s + n * p.length == src and d + n == page:
                    runs[-1] = (s, d, n + 1)
                    continue
            runs.append((src, page, 1))
        return runs


def numpy_scatter(dest: npt.NDArray[np.uint8], page_bytes: int) -> Scatter:
    """Scatter on the CPU: each run is one contiguous copy into ``dest[layer, first:first+n]``."""

    def scatter(layer: int, buf: Any, runs: list[Run]) -> None:
        for src, first, n in runs:
            dest[layer, first : first + n] = buf[src : src + n * page_bytes].reshape(n, page_bytes)

    return scatter


def cupy_scatter(dest: Any, page_bytes: int) -> Scatter:
    """Scatter on the GPU with one kernel launch per fill."""
    from flatcake.node_agent import gpu

    layer_bytes = dest.shape[1] * page_bytes

    def scatter(layer: int, buf: Any, runs: list[Run]) -> None:
        src_off = [s for s, _, _ in runs]
        dst_off = [layer * layer_bytes + d * page_bytes for _, d, _ in runs]
        length = [n * page_bytes for _, _, n in runs]
        gpu.scatter(buf, dest.reshape(-1), src_off, dst_off, length)

    return scatter
