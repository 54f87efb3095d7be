"""FC-CIO restore into device memory: merged reads streamed through a bounded, double-buffered staging window
(host destinations read straight into place: ``host_restore``).

A restore holds one window of ``staging_layers`` slots. Fills (the commands of one slot, one layer)
are issued in layer order round-robin over the I/O workers; a slot is scattered into the destination
pages as soon as its reads complete, then reused. Reads for layer l+1 are in flight while the caller
works on layer l. When every slot is busy the next read waits: nothing is dropped or recomputed.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.catalog.checksum import crc32
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.io_backends import IOBackend
from flatcake.node_agent.datapath.layer_stream import LayerStream
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.policy.coalesce import Fill

# scatter(layer, slot, src, dst, count): run r copies count[r] pages from byte src[r] of the slot to
# destination pages dst[r]..dst[r]+count[r]-1 of that layer.
Ints = npt.NDArray[np.int64]
Scatter = Callable[[int, Any, Ints, Ints, Ints], None]


class Window:
    """One allocation cut into ``slots`` slots: one buffer to register with cuFile, whole."""

    def __init__(self, slots: int, slot_bytes: int, alloc: Callable[[int], Any]) -> None:
        self.slot_bytes = slot_bytes
        self.buffer = alloc(slots * slot_bytes)
        self.slots = [self.buffer[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]


class WindowPool:
    """At most ``streams`` windows exist; a restore that finds none free waits for one. ``on_new(buffer)``
    runs once per window made, before any read lands in it (the GPU path registers it with cuFile)."""

    def __init__(
        self,
        streams: int,
        slots: int,
        slot_bytes: int,
        stats: Stats,
        alloc: Callable[[int], Any] = aligned_empty,
        on_new: Callable[[Any], None] | None = None,
    ) -> None:
        self._free: list[Window] = []
        self._made = 0
        self._streams, self._slots, self._slot_bytes, self._alloc = streams, slots, slot_bytes, alloc
        self._on_new = on_new
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
        try:
            window = Window(self._slots, self._slot_bytes, self._alloc)
            if self._on_new is not None:
                self._on_new(window.buffer)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise
        return window

    def release(self, window: Window) -> None:
        with self._cond:
            self._free.append(window)
            self._cond.notify()

    @property
    def in_use_bytes(self) -> int:
        """Host (or device) bytes held by restores now: bounded by streams x slots x slot bytes."""
        with self._cond:
            return (self._made - len(self._free)) * self._slots * self._slot_bytes


class StagedVerifier:
    """Checks a GPU restore's pages as read: SSD pages from the staging slot just before its scatter (a
    device slot is brought back to the host first, ``to_host``: one device-to-host copy of what was read),
    DRAM pages from the DRAM pool (``dram_rows``). A page's layers must arrive in layer order (fills come in
    layer order, a page's layers in file-offset order); one that does not is failed rather than misjudged."""

    def __init__(self, request_index: Ints, dest_pages: Ints, expected: Ints, page_bytes: int, layers: int,
                 dram: dict[int, int], dram_rows: Callable[[int, int], Any],
                 to_host: Callable[[Any], Any] = lambda buf: buf) -> None:  # fmt: skip
        # ``dram``: dest page -> DRAM slot for the checked DRAM pages; ``dram_rows(slot, layer)`` its bytes.
        self._index = request_index.tolist()
        self._pages = dest_pages.tolist()
        self._expected = expected.tolist()
        self._crc = [0] * len(self._index)
        self._next = [0] * len(self._index)
        self._by_page = {p: k for k, p in enumerate(self._pages)}
        self._page_bytes, self._layers = page_bytes, layers
        self._dram = [(self._by_page[p], slot) for p, slot in dram.items() if p in self._by_page]
        self._dram_rows = dram_rows
        self._to_host = to_host
        self._bad: set[int] = set()

    def _add(self, k: int, layer: int, row: Any) -> None:
        if self._next[k] != layer:
            self._bad.add(k)
            return
        self._crc[k] = crc32(row, self._crc[k])
        self._next[k] = layer + 1

    def staged(self, layer: int, buf: Any, src: Ints, dst: Ints, count: Ints) -> None:
        pb = self._page_bytes
        if not len(src):
            return
        buf = self._to_host(buf[: int((src + count * pb).max())])
        for s, d, n in zip(src.tolist(), dst.tolist(), count.tolist(), strict=True):
            for j in range(n):
                k = self._by_page.get(d + j)
                if k is not None:
                    self._add(k, layer, buf[s + j * pb : s + (j + 1) * pb])

    def layer(self, layer: int) -> None:
        for k, slot in self._dram:
            self._add(k, layer, self._dram_rows(slot, layer))

    def failed(self, missing: set[int]) -> set[int]:
        """Request indexes whose bytes do not match (pages already missing are not judged)."""
        done = {k for k, n in enumerate(self._next) if n != self._layers} | self._bad
        return {i for k, (i, got, want) in enumerate(zip(self._index, self._crc, self._expected, strict=True))
                if (got != want or k in done) and i not in missing}  # fmt: skip


class StreamOrder:
    """CUDA ordering for one GPU restore: its scatter kernels run on a stream of its own, an event is
    recorded after each slot's scatter, and the slot takes its next read only once that event has
    completed. kvikio's read returns when the bytes are in the slot, but a kernel launch returns before
    the kernel has run: without the event the next read could overwrite a slot the kernel still reads.

    ``cuda`` is ``cupy.cuda`` (``Stream(non_blocking=True)`` usable as a context manager, ``Event()``
    with ``record(stream)`` and ``synchronize()``); tests pass a stand-in that records the order."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self.stream = cuda.Stream(non_blocking=True)
        self._pending: dict[int, Any] = {}  # slot -> event recorded after its last scatter
        self._last: Any = None

    def scattered(self, slot: int) -> None:
        event = self._cuda.Event()
        event.record(self.stream)
        self._pending[slot] = self._last = event

    def reuse(self, slot: int) -> None:
        event = self._pending.pop(slot, None)
        if event is not None:
            event.synchronize()

    def layer_ready(self) -> None:
        """Everything queued so far (the layer's scatters, its DRAM copy) has run: a yielded layer is in
        the destination, as the host path promises."""
        event = self._cuda.Event()
        event.record(self.stream)
        event.synchronize()

    def drain(self) -> None:
        """Before the window goes back to the pool: no kernel may still read one of its slots."""
        for slot in list(self._pending):
            self.reuse(slot)


class Restore(LayerStream):
    """Yields layer indexes in order; when layer ``l`` is yielded its bytes are in the destination.

    After iteration ``missing`` holds the indexes (into the requested keys) of pages whose bytes could
    not be read (I/O error or short read) or, with a ``Verifier``, did not match their checksum: the
    caller recomputes those. No I/O exception escapes.
    """

    def __init__(
        self,
        *,
        layers: int,
        fills: list[Fill],
        dest_pages: Ints,
        request_index: Ints,
        io: IOBackend,
        windows: WindowPool,
        scatter: Scatter,
        copy_dram: Callable[[int], None],
        stats: Stats,
        on_close: Callable[[], None],
        verify: StagedVerifier | None = None,
        order: StreamOrder | None = None,
        late: Callable[[], set[int]] | None = None,  # pages to count as missing, asked once all have landed
    ) -> None:
        self._order = order
        self._verify, self._late = verify, late
        self._layers, self._fills, self._dest_pages = layers, fills, dest_pages
        self._request_index = request_index  # plan index -> position in the caller's key list
        self._io, self._windows, self._scatter, self._copy_dram = io, windows, scatter, copy_dram
        self._stats, self._on_close = stats, on_close
        self.start()

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._stats.peak("staging_peak_bytes", self.staging_peak_bytes)
            self._on_close()

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
                    if self._order is not None:
                        self._order.reuse(slot)  # its last scatter has run: the slot may be overwritten
                    buf, futures, at = window.slots[slot], [], 0  # type: ignore[union-attr]
                    cmds = fill.commands
                    for file, offset, n in zip(
                        cmds.file[fill.lo : fill.hi].tolist(),
                        cmds.offset[fill.lo : fill.hi].tolist(),
                        cmds.length[fill.lo : fill.hi].tolist(),
                        strict=True,
                    ):
                        futures.append(self._io.submit_read(rr, file, offset, buf[at : at + n]))
                        rr += 1
                        at += n
                    inflight.append((fill, slot, futures))
                    staged += fill.nbytes
                    self.staging_peak_bytes = max(self.staging_peak_bytes, staged)

            for layer in range(self._layers):
                top_up()
                while inflight and inflight[0][0].layer <= layer:  # every fill holding part of this layer
                    fill, slot, futures = inflight.popleft()
                    self._complete(fill, window.slots[slot], futures)  # type: ignore[union-attr]
                    if self._order is not None:
                        self._order.scattered(slot)
                    free.append(slot)
                    staged -= fill.nbytes
                    top_up()
                self._copy_dram(layer)
                if self._order is not None:
                    self._order.layer_ready()
                if self._verify is not None:
                    self._verify.layer(layer)
                yield layer
            # A page that does not match what was published is never handed over as good: it is a miss the
            # caller recomputes, like a page that failed to read.
            bad = self._verify.failed(self.missing) if self._verify is not None else set()
            self.damaged = set(bad)
            if self._late is not None:
                bad |= self._late() - self.missing
            if bad:
                self.missing.update(bad)
                self._stats.add("verify_failures", len(bad))
                self._stats.add("pages_missing", len(bad))
        finally:
            for _, _, futures in inflight:  # never hand a slot back while a read may still land in it
                for f in futures:
                    f.exception()
            if self._order is not None:
                self._order.drain()
            if window is not None:
                self._windows.release(window)
            self._finish()

    def _complete(self, fill: Fill, buf: Any, futures: list[Future[int]]) -> None:
        cmds, lo, hi = fill.commands, fill.lo, fill.hi
        p0, p1 = int(cmds.piece_ptr[lo]), int(cmds.piece_ptr[hi])
        lengths = cmds.length[lo:hi]
        slot_at = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # where each command lands in the slot
        owner = np.repeat(np.arange(hi - lo), np.diff(cmds.piece_ptr[lo : hi + 1]))
        start, plen = cmds.piece_start[p0:p1], cmds.piece_length[p0:p1]
        got = np.empty(hi - lo, dtype=np.int64)
        for k, fut in enumerate(futures):
            try:
                got[k] = fut.result()
            except OSError as exc:
                got[k] = -1
                self._stats.add(f"io_errors_{errno.errorcode.get(exc.errno or 0, 'other').lower()}")
        short = int(((got >= 0) & (got < lengths)).sum())
        if short:
            self._stats.add("io_errors_short_read", short)
        self._stats.add("read_commands", hi - lo)
        self._stats.add("read_bytes", int(np.maximum(got, 0).sum()))
        self._stats.add("requested_bytes", int(plen.sum()))
        self._stats.add("descriptors", p1 - p0)
        ok = start + plen <= got[owner]  # a piece not fully read is left for the caller to recompute
        layer, page = np.divmod(cmds.piece_index[p0:p1], max(fill.pages, 1))
        if not ok.all():
            lost = set(self._request_index[page[~ok]].tolist()) - self.missing
            self.missing.update(lost)
            self._stats.add("pages_missing", len(lost))
        src_all, dst_all = slot_at[owner] + start, self._dest_pages[page]
        for k in np.unique(layer[ok]).tolist():
            mine = ok & (layer == k)
            src, dst = src_all[mine], dst_all[mine]
            size = int(plen[0])
            # Runs contiguous in both the slot and the destination become one copy each.
            brk = np.flatnonzero((np.diff(src) != size) | (np.diff(dst) != 1)) + 1
            first = np.concatenate(([0], brk))
            count = np.diff(np.append(first, len(src)))
            if self._verify is not None:
                self._verify.staged(fill.layer + k, buf, src[first], dst[first], count)
            self._scatter(fill.layer + k, buf, src[first], dst[first], count)


def cupy_scatter(dest: Any, page_bytes: int, stream: Any = None) -> Scatter:
    """Scatter on the GPU with one kernel launch per fill, on ``stream`` (the restore's own) when given."""
    from flatcake.node_agent.datapath import gpu

    layer_bytes = dest.shape[1] * page_bytes

    def scatter(layer: int, buf: Any, src: Ints, dst: Ints, count: Ints) -> None:
        with contextlib.nullcontext() if stream is None else stream:
            gpu.scatter(buf, dest.reshape(-1), src, layer * layer_bytes + dst * page_bytes, count * page_bytes)

    return scatter
