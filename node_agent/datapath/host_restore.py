"""FC-CIO restore into host memory: merged reads straight into the destination, checked as they land.

The plan (``policy.coalesce.plan_host``) merges a segment's layers into commands as large as the layout
allows; the commands go to the process's ``ReadQueue``, layer 0's first and the rest once they have
landed (together they would share the device and hold layer 0 back), and its threads run them. Where the
destination's page-layers are O_DIRECT-aligned and whole (the engine's own ``[layers][slots][page_bytes]``
buffer, a host pool whose rows are page-sized), a command is one ``preadv`` into the destination's rows,
with bridged holes read into a per-thread sink: no staging, no second copy. Otherwise (rows cut into
unaligned pieces, as SGLang's host pool keeps a DSV4 page) the command lands in the thread's scratch and
is written out from there, in the same thread.

Each page-layer's CRC-32 is computed in the thread that read it, right after its bytes land; the
restore folds them into page checksums at the end (``catalog.checksum.LayerFold``). Layer ``l`` is
yielded once every command holding a piece of layers ``<= l`` has landed, and its DRAM pages copied.
"""

from __future__ import annotations

import errno
import itertools
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.catalog.checksum import LayerFold, crc32
from flatcake.node_agent.datapath.layer_stream import LayerStream
from flatcake.node_agent.datapath.read_queue import Stream, Worker
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy.coalesce import HostPlan

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Check:
    """Which restored pages are checked: ``ssd`` (positions in the plan's SSD pages) against ``ssd_want``,
    and DRAM pages (``dram_slots``: pool slots, contiguous pages) against ``dram_want``."""

    ssd: Ints
    ssd_want: Ints
    dram: Ints  # positions in the request
    dram_slots: Ints
    dram_want: Ints


def direct_ok(target: PagedTarget, pages: Ints, page_bytes: int, align: int) -> bool:
    """Whether reads may land in ``target`` as they are: every piece of every destination page-layer starts
    and ends on an ``align`` boundary (O_DIRECT), and a stored row is exactly its pieces (no padding to
    drop, no limit to cut at)."""
    if target.raw_bytes != page_bytes or target.limits is not None or page_bytes % align:
        return False
    offsets = [target.memory.ctypes.data, target.layer_stride, target.piece_bytes, *target.piece_offsets.tolist()]
    if any(v % align for v in offsets):
        return False
    return not len(pages) or not (target.page_offsets[pages] % align).any()


class HostRestore(LayerStream):
    """Yields layer indexes in order; when layer ``l`` is yielded its bytes are in the destination.

    After iteration ``missing`` holds the request indexes of pages that failed to read or to match their
    checksum; the caller recomputes those. No I/O exception escapes. Close it (or use it as a context
    manager): commands not yet started are dropped, running ones finish, then the lease is released."""

    def __init__(
        self,
        *,
        layers: int,
        plan: HostPlan,
        target: PagedTarget,
        direct: bool,
        ssd_dest: Ints,
        request_index: Ints,
        page_bytes: int,
        stream: Stream,
        copy_dram: Callable[[int], None],
        stats: Stats,
        on_close: Callable[[], None],
        check: Check | None = None,
        dram_rows: Callable[[int], memoryview] | None = None,
        late: Callable[[], set[int]] | None = None,  # pages to count as missing, asked once all have landed
    ) -> None:
        self.direct = direct
        self._layers, self._plan, self._target = layers, plan, target
        self._ssd_dest, self._request_index, self._page_bytes = ssd_dest, request_index, page_bytes
        self._stream, self._copy_dram, self._stats, self._on_close = stream, copy_dram, stats, on_close
        self._check, self._dram_rows, self._late = check, dram_rows, late
        self._cond = threading.Condition()
        cmds = plan.commands
        # Layer l is whole once `need[l]` commands (those with first_layer <= l) have landed.
        self._need = np.cumsum(np.bincount(plan.first_layer, minlength=layers)[:layers]).tolist() if layers else []
        self._landed = [0] * max(layers, 1)
        self._lost_pieces: list[Ints] = []
        self._crc = np.zeros((layers, len(ssd_dest)), dtype=np.uint32) if check is not None else None
        self._staged_now = 0
        self._rest_issued = self._closed = False
        self.complete = False  # every layer landed and was accounted for (``missing`` is final)
        self._mem = target.memory.data
        # Per piece (in command order): its layer, its plan page, and where its pieces land in memory.
        self._piece_layer, self._piece_page = np.divmod(cmds.piece_index, max(plan.pages, 1))
        if direct:
            self._spans = self._direct_spans()
        self.start()

    @property
    def target(self) -> PagedTarget:
        """Where the pages land: the caller's memory, as a paged target."""
        return self._target

    # ---- planning (the restore's thread) --------------------------------------------------------------
    def _direct_spans(self) -> tuple[Ints, Ints, Ints]:
        """iovecs of every command as ``(ptr, offset, length)``: command ``c``'s are ``ptr[c]:ptr[c+1]``,
        an offset of -1 a bridged hole. Sub-pieces contiguous both on disk and in memory are one iovec."""
        t, cmds = self._target, self._plan.commands
        k = len(t.piece_offsets)
        addr = (self._piece_addr(0, len(cmds.piece_index))[:, None] + t.piece_offsets[None, :]).reshape(-1)
        disk = (cmds.piece_start[:, None] + np.arange(k, dtype=np.int64)[None, :] * t.piece_bytes).reshape(-1)
        owner = np.repeat(np.arange(len(cmds), dtype=np.int64), np.diff(cmds.piece_ptr) * k)
        n = len(addr)
        if not n:
            return np.zeros(len(cmds) + 1, np.int64), addr, addr
        pb = t.piece_bytes
        first = np.ones(n, bool)
        first[1:] = owner[1:] != owner[:-1]
        hole = np.where(first, disk, disk - np.concatenate(([0], disk[:-1] + pb)))
        # A new iovec where a command starts, a hole lies before, or memory is not contiguous.
        brk = first | (hole != 0)
        brk[1:] |= addr[1:] != addr[:-1] + pb
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, n)) * pb
        holes = hole[starts]
        # Interleave: (hole?, span) per start; holes of zero length are dropped.
        off = np.stack([np.full(len(starts), -1, np.int64), addr[starts]], axis=1).reshape(-1)
        length = np.stack([holes, lengths], axis=1).reshape(-1)
        cmd = np.repeat(owner[starts], 2)
        keep = length > 0
        off, length, cmd = off[keep], length[keep], cmd[keep]
        ptr = np.searchsorted(cmd, np.arange(len(cmds) + 1, dtype=np.int64)).astype(np.int64)
        return ptr, off, length

    # ---- commands (I/O threads) -----------------------------------------------------------------------
    def _job(self, c: int) -> Callable[[Worker], None]:
        return lambda worker: self._command(worker, c)

    def _command(self, worker: Worker, c: int) -> None:
        cmds = self._plan.commands
        file, offset, length = int(cmds.file[c]), int(cmds.offset[c]), int(cmds.length[c])
        p0, p1 = int(cmds.piece_ptr[c]), int(cmds.piece_ptr[c + 1])
        got = -1
        try:
            if self.direct:
                ptr, off, ln = self._spans
                a, b = int(ptr[c]), int(ptr[c + 1])
                mem = self._mem
                spans = zip(off[a:b].tolist(), ln[a:b].tolist(), strict=True)
                iov = [mem[o : o + n] if o >= 0 else worker.sink(n) for o, n in spans]
                got = worker.read(file, offset, iov)
                if self._crc is not None:
                    self._hash_direct(p0, p1, got)
            else:
                with self._cond:
                    self._staged_now += length
                    self.staging_peak_bytes = max(self.staging_peak_bytes, self._staged_now)
                try:
                    buf = worker.scratch(length)
                    got = worker.read(file, offset, [buf.data])
                    self._write_staged(buf, p0, p1, got)
                finally:
                    with self._cond:
                        self._staged_now -= length
        except OSError as exc:
            self._stats.add(f"io_errors_{errno.errorcode.get(exc.errno or 0, 'other').lower()}")
        except BaseException:  # never leave the restore waiting on a command that died
            got = -1
            raise
        finally:
            self._landed_command(c, p0, p1, length, got)

    def _ok(self, p0: int, p1: int, got: int) -> npt.NDArray[np.bool_]:
        cmds = self._plan.commands
        ends: npt.NDArray[np.bool_] = cmds.piece_start[p0:p1] + cmds.piece_length[p0:p1] <= got
        return ends

    def _hash_direct(self, p0: int, p1: int, got: int) -> None:
        crc, mem, t = self._crc, self._mem, self._target
        assert crc is not None
        ok = self._ok(p0, p1, got)
        addr = self._piece_addr(p0, p1)[ok].tolist()
        pb, sub = t.piece_bytes, t.piece_offsets.tolist()
        if len(sub) == 1:  # the common case, kept to one C call per page-layer
            values = [crc32(mem[a : a + pb]) for a in addr]
        else:
            values = []
            for a in addr:
                v = 0
                for s in sub:
                    v = crc32(mem[a + s : a + s + pb], v)
                values.append(v)
        crc[self._piece_layer[p0:p1][ok], self._piece_page[p0:p1][ok]] = values

    def _piece_addr(self, p0: int, p1: int) -> Ints:
        """Memory offset of pieces ``p0:p1`` (their first sub-piece: a page-layer is ``len(piece_offsets)``)."""
        t = self._target
        addr: Ints = t.page_offsets[self._ssd_dest[self._piece_page[p0:p1]]] + self._piece_layer[p0:p1] * t.layer_stride
        return addr

    def _write_staged(self, buf: npt.NDArray[np.uint8], p0: int, p1: int, got: int) -> None:
        """Pieces of a staged command to their pages: one row write per run of pieces back to back in the
        scratch and of one layer, each row hashed first (the published CRC covers the padded row)."""
        cmds, pb = self._plan.commands, self._page_bytes
        ok = self._ok(p0, p1, got)
        start, layer, page = cmds.piece_start[p0:p1][ok], self._piece_layer[p0:p1][ok], self._piece_page[p0:p1][ok]
        if not len(start):
            return
        brk = np.flatnonzero((np.diff(start) != pb) | (np.diff(layer) != 0)) + 1
        bounds = [0, *brk.tolist(), len(start)]
        if self._crc is not None:
            mem = buf.data
            self._crc[layer, page] = [crc32(mem[s : s + pb]) for s in start.tolist()]
        for a, b in itertools.pairwise(bounds):
            s, ly = int(start[a]), int(layer[a])
            rows = buf[s : s + (b - a) * pb].reshape(b - a, pb)
            self._target.write(ly, self._ssd_dest[page[a:b]], rows)

    def _landed_command(self, c: int, p0: int, p1: int, length: int, got: int) -> None:
        cmds = self._plan.commands
        if 0 <= got < length:
            self._stats.add("io_errors_short_read")
        self._stats.add("read_commands")
        self._stats.add("read_bytes", max(got, 0))
        self._stats.add("requested_bytes", int(cmds.piece_length[p0:p1].sum()))
        self._stats.add("descriptors", p1 - p0)
        lost = None if got >= length else np.flatnonzero(~self._ok(p0, p1, got)) + p0
        with self._cond:
            if lost is not None and len(lost):
                self._lost_pieces.append(lost)
            self._landed[int(self._plan.first_layer[c])] += 1
            if self._landed[0] == self._need[0] and not self._rest_issued:
                self._issue_rest()
            self._cond.notify_all()

    def _issue_rest(self) -> None:
        """The commands past layer 0, once layer 0 has landed (called under ``_cond``). Issued together with
        layer 0, they share the device with it and hold it back: measured here, layer 0 of a 4-segment
        restore took 9-14 ms instead of 1 ms behind 16 MiB commands, for <1 ms of lower depth after."""
        self._rest_issued = True
        if self._closed:
            return
        cmds = self._plan.commands
        for c in range(int(self._need[0]), len(cmds)):
            self._stream.submit(int(cmds.length[c]), self._job(c))

    # ---- the restore's thread -------------------------------------------------------------------------
    def _whole(self, layer: int) -> bool:
        return sum(self._landed[: layer + 1]) >= int(self._need[layer])

    def _run(self) -> Generator[int, None, None]:
        try:
            cmds = self._plan.commands
            with self._cond:
                for c in range(int(self._need[0]) if self._layers else 0):  # layer 0 first, alone
                    self._stream.submit(int(cmds.length[c]), self._job(c))
                if not self._layers or self._need[0] == 0:
                    self._issue_rest()
            for layer in range(self._layers):
                with self._cond:
                    self._cond.wait_for(lambda layer=layer: self._whole(layer))  # type: ignore[misc]
                self._copy_dram(layer)
                yield layer
            self._account()
            self.complete = True
        finally:
            self._finish()

    def _account(self) -> None:
        """Pages lost to failed reads, then pages whose bytes do not match what was published."""
        with self._cond:
            lost = np.concatenate(self._lost_pieces) if self._lost_pieces else np.zeros(0, np.int64)
        gone = set(self._request_index[np.unique(self._piece_page[lost])].tolist())
        if gone:
            self.missing.update(gone)
            self._stats.add("pages_missing", len(gone))
        bad = self._late() if self._late is not None else set()
        if self._check is not None and self._crc is not None:
            self.damaged = self._checked() - self.missing
            bad |= self.damaged
        bad -= self.missing
        if bad:
            self.missing.update(bad)
            self._stats.add("verify_failures", len(bad))
            self._stats.add("pages_missing", len(bad))

    def _checked(self) -> set[int]:
        """Pages whose bytes do not match their checksum (``check``)."""
        assert self._check is not None and self._crc is not None
        ch, bad = self._check, set()
        if len(ch.ssd):
            got = LayerFold(self._page_bytes).fold(self._crc[:, ch.ssd])
            bad.update(self._request_index[ch.ssd[got != ch.ssd_want.astype(np.uint32)]].tolist())
        if len(ch.dram) and self._dram_rows is not None:
            for i, slot, want in zip(ch.dram.tolist(), ch.dram_slots.tolist(), ch.dram_want.tolist(), strict=True):
                if crc32(self._dram_rows(slot)) != want:
                    bad.add(i)
        return bad

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        with self._cond:
            self._closed = True  # no command is issued after this
        self._stream.cancel()
        self._stream.wait_idle()  # no read may land in the destination after the caller takes it back
        self._stats.peak("staging_peak_bytes", self.staging_peak_bytes)
        self._on_close()
