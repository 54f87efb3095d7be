"""The FlatCake storage engine: ``put`` / ``exists`` / ``get`` over DRAM and SSD as peer media.

Write path (FC-GVA): placement picks the medium once; space is reserved (GVAs allocated), bytes are
written, and only then are the keys published. Read path (FC-CIO): keys resolve to locations, SSD
page-layers are sorted and merged into few large reads that land in place in host memory
(``host_restore``), or stream layer by layer through a bounded window into device memory, scattered
into the caller's (non-contiguous) page slots (``restore``).

Why one module of this size: ``put`` and ``get`` hold the fences a restart needs (the epoch held from
the check to the last byte, the lease released after the copies) around the plans they hand to
``host_restore``/``restore``; the reads themselves live there.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.errors import (
    FencedError,
    FlatCakeError,
    StorageWriteError,
    UnknownHandleError,
)
from flatcake.node_agent.catalog import epoch as E
from flatcake.node_agent.catalog.checksum import page_checksum
from flatcake.node_agent.catalog.interface import Allocation, Catalog, Lease
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import ALIGN
from flatcake.node_agent.datapath import gpu
from flatcake.node_agent.datapath.buffers import aligned_empty, is_aligned
from flatcake.node_agent.datapath.dram_pool import DramPool
from flatcake.node_agent.datapath.file_pool import PoolManifest, create_pool
from flatcake.node_agent.datapath.host_restore import Check, HostRestore, direct_ok
from flatcake.node_agent.datapath.io_backends import IOBackend, PosixDirectIO, select_backend
from flatcake.node_agent.datapath.read_queue import ReadQueue
from flatcake.node_agent.datapath.restore import Restore, StagedVerifier, StreamOrder, WindowPool, cupy_scatter
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.datapath.target import PagedTarget, host_target
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.coalesce import plan_host, plan_restore
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints, Key
from flatcake.node_agent.policy.scopes import ScopeTable

log = logging.getLogger(__name__)

__all__ = ["Engine", "PutResult", "local_table"]


@dataclass(frozen=True)
class PutResult:
    stored: int  # pages written now
    skipped: int  # pages already stored (or being stored by another writer)
    medium: Medium | None
    reason: str


def local_table(c: EngineConfig) -> ScopeTable:
    return ScopeTable(
        node_id=c.node_id,
        layers=c.layers,
        page_bytes=c.page_bytes,
        file_bytes=c.ssd.file_bytes,
        files=c.ssd.file_count,
        dram_slots=c.dram_slots,
        high_watermark=c.ssd.high_watermark,
        low_watermark=c.ssd.low_watermark,
        adaptive=c.placement.mode == "adaptive",
        copies=c.placement.mode == "copies",
    )


Ints = npt.NDArray[np.int64]


class _Located:
    """A lease's locations as arrays: which pages are on SSD (where) and which in DRAM (which slot)."""

    def __init__(self, c: EngineConfig, locs: Sequence[Any], dst: Ints) -> None:
        gvas = np.fromiter((loc.gva for loc in locs), dtype=np.uint64, count=len(locs))
        strides = np.fromiter((loc.layer_stride for loc in locs), dtype=np.int64, count=len(locs))
        self.dst = dst
        self.on_ssd = gvas >= np.uint64(G.SSD_THRESHOLD)  # the medium is the top field: one compare
        self.offsets = (gvas & np.uint64(G.MAX_OFFSET)).astype(np.int64)
        self.ssd = np.flatnonzero(self.on_ssd)  # plans index pages of this subset
        self.file, self.base = np.divmod(self.offsets[self.ssd], c.ssd.file_bytes)
        self.ssd_stride = strides[self.ssd]
        self.ssd_dest = dst[self.ssd]
        self.slot = self.offsets // (c.layers * c.page_bytes)  # a DRAM page's pool slot (meaningless on SSD)
        self.dram_src = self.slot[~self.on_ssd]
        self.dram_dst = dst[~self.on_ssd]


def _runs(slots: npt.NDArray[np.int64], also: npt.NDArray[np.int64] | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges over which ``slots`` (and ``also``, when given) count up by one."""
    if not len(slots):
        return []
    step = np.diff(slots) != 1
    if also is not None:
        step |= np.diff(also) != 1
    cut = np.flatnonzero(step) + 1
    bounds = [0, *cut.tolist(), len(slots)]
    return list(itertools.pairwise(bounds))


class Engine:
    """The data path over a catalog.

    Alone (``catalog=None``) it creates the pools and keeps its own ``LocalCatalog``. As a client of a
    node agent (``client.connect``) it attaches to the agent's pools (``dram_path``: the agent's pool
    file) and asks the agent's catalog over the socket; bytes never pass through the agent.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        io: IOBackend | None = None,
        catalog: Catalog | None = None,
        dram_path: str | None = None,
    ) -> None:
        self.config = c = config
        self.stats = Stats()
        if catalog is None:
            self.pool = create_pool(c.ssd.dir, c.ssd.file_count, c.ssd.file_bytes, extent_policy=c.ssd.extent_policy)
        else:
            self.pool = PoolManifest.load(Path(c.ssd.dir))
            if (self.pool.count, self.pool.file_bytes) != (c.ssd.file_count, c.ssd.file_bytes):
                raise ValueError(f"{c.ssd.dir}: pool manifest does not match the agent's configuration")
        paths = [str(Path(c.ssd.dir) / name) for name in self.pool.files]
        if io is None:
            io, why = select_backend(paths, c.io.workers, c.io.backend, c.io.kvikio_pool())
            log.info("I/O backend %s: %s", io.name, why)
        self.io = io
        self._paths = paths
        # Host destinations (numpy) and host writes always go through O_DIRECT preadv/pwritev; with kvikio
        # that is a second backend over the same files, made on first use (``host_io``).
        self._posix: IOBackend | None = None
        self.dram = DramPool(
            c.layers * c.page_bytes,
            c.dram_slots,
            name=c.dram.name,
            want_huge_pages=c.dram.huge_pages,
            shm_dir=c.dram.shm_dir,
            hugetlbfs_dir=c.dram.hugetlbfs_dir,
            attach_path=dram_path,
        )
        self._owns_dram = dram_path is None
        if c.dram.huge_pages and not self.dram.info.huge_pages:
            self.stats.add("dram_hugepage_fallback")
        if c.dram.pinned:
            self.dram.register_with_cuda()
        # The pool as [slot][layer][page_bytes]: a DRAM page keeps its layers back to back.
        self._dram3 = self.dram.view[: c.dram_slots * c.layers * c.page_bytes].reshape(
            c.dram_slots, c.layers, c.page_bytes
        )
        self.catalog: Catalog = catalog if catalog is not None else LocalCatalog(local_table(c), c.placement)
        self.gap_bytes = c.io.gap_bytes  # Δgap; tunable while running
        # Whether a restore runs on the GPU is decided per call from its destination (``_on_gpu``), never
        # from the backend's name: a numpy destination on a kvikio node takes the host path. The GPU
        # path needs kvikio (reads land in device staging windows, a kernel scatters them).
        self._reads: ReadQueue | None = None
        self._reads_lock = threading.Lock()
        self._device_windows: WindowPool | None = None

    @property
    def table(self) -> ScopeTable:
        """The scope table of an engine with its own catalog."""
        if not isinstance(self.catalog, LocalCatalog):
            raise AttributeError("table: this engine uses a remote catalog (the node agent's)")
        return self.catalog.table

    # ---- write path ------------------------------------------------------------------------------
    def put(self, keys: Sequence[Key], kv: npt.NDArray[np.uint8], hints: Hints | None = None) -> PutResult:
        """Store pages ``keys`` from host buffer ``kv`` shaped ``[layers][len(keys)][page_bytes]`` (uint8,
        C order, 4 KiB aligned). Pages already stored are skipped; the rest are placed, written, then
        published with a checksum per page."""
        hints = hints or Hints()
        self._check_keys(keys, "keys")
        self._check_kv(kv, len(keys))
        alloc = self.catalog.allocate(keys, hints)
        if alloc is None:
            return PutResult(0, len(keys), None, "all stored")
        new = alloc.index
        lo, hi = new[0], new[-1] + 1
        if hi - lo == len(new):
            pages = kv[:, lo:hi]
        else:  # holes among the new pages: gather them into one aligned, layer-major buffer
            pages = aligned_empty((self.config.layers, len(new), self.config.page_bytes))
            pages[...] = kv[:, new]
        try:
            # An agent's allocation: held against a restart from the epoch check to the last byte.
            with E.held(self.config.state_dir) if alloc.epoch else contextlib.nullcontext(0) as now:
                self._fence(alloc, now)
                self._write(alloc, pages)
        except FencedError:
            with contextlib.suppress(FlatCakeError, ConnectionError, OSError):  # the old agent is gone
                self.catalog.abort(alloc.id)
            raise
        except OSError as exc:
            self.catalog.abort(alloc.id)
            self.stats.add("write_errors")
            raise StorageWriteError(exc.errno, f"put of {len(new)} pages failed, nothing published: {exc}") from exc
        except BaseException:
            self.catalog.abort(alloc.id)
            raise
        self.catalog.publish(alloc.id, [page_checksum(pages, j) for j in range(len(new))])
        self.stats.add("put_pages", len(new))
        self.stats.add("write_bytes_logical", pages.nbytes)
        return PutResult(len(new), len(keys) - len(new), alloc.medium, alloc.reason)

    def _fence(self, alloc: Allocation, now: int) -> None:
        """Refuse to write space allocated by an agent that has since restarted (the epoch is ``now``):
        the new agent may have given it to another writer, whose published pages these bytes would
        overwrite."""
        if alloc.epoch and now != alloc.epoch:
            self.stats.add("fenced_writes")
            raise FencedError(
                f"epoch: allocation {alloc.id} was made in agent epoch {alloc.epoch}, the agent is now in epoch "
                f"{now} (it restarted); nothing was written, reconnect and put the pages again"
            )

    def _write(self, alloc: Allocation, pages: npt.NDArray[np.uint8]) -> None:
        if alloc.slots:
            self._dram3[alloc.slots] = pages.transpose(1, 0, 2)
            self.stats.add("write_bytes_dram", pages.nbytes)
            return
        if alloc.copy_slots:  # clean DRAM copies of pages homed on SSD (copies mode)
            self._dram3[alloc.copy_slots] = pages.transpose(1, 0, 2)
            self.stats.add("copy_pages_written", len(alloc.copy_slots))
        futures: list[Future[int]] = []
        for i, seg in enumerate(alloc.segments):
            bufs = [pages[layer, seg.first_page : seg.first_page + seg.pages] for layer in range(pages.shape[0])]
            futures.append(self.host_io.submit_write(i, seg.file, seg.offset, bufs))
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        written = sum(f.result() for f in futures)
        self.stats.add("write_bytes_ssd", written)
        self.stats.add("write_commands", len(futures))

    # ---- read path -------------------------------------------------------------------------------
    def exists(self, keys: Sequence[Key]) -> int:
        """Length of the stored prefix of ``keys``."""
        return self.catalog.exists(keys)

    @property
    def gpu_io(self) -> bool:
        """Whether this engine can fill device memory (reads through kvikio)."""
        return self.io.name == "kvikio"

    @property
    def host_io(self) -> IOBackend:
        """The O_DIRECT reader host restores use (made on first use)."""
        if not self.gpu_io:
            return self.io
        if self._posix is None:
            self._posix = PosixDirectIO(self._paths, self.config.io.workers)
        return self._posix

    def _on_gpu(self, dest: Any) -> bool:
        """The path for one restore, from its destination: a numpy array is host memory; a cupy array or
        any object with ``__cuda_array_interface__`` (a CUDA torch tensor) is device memory, which only
        the kvikio path can fill. Anything else, or device memory without kvikio, is refused by name."""
        if isinstance(dest, np.ndarray | PagedTarget):
            return False
        if gpu.is_device_array(dest) or hasattr(dest, "__cuda_array_interface__"):
            if not self.gpu_io:
                raise TypeError(
                    f"dest: a device array ({type(dest).__name__}), but this engine's I/O backend {self.io.name} "
                    "reads into host memory only; restore into a numpy array, or set io.backend to kvikio on a "
                    "node where kvikio and a GPU are usable"
                )
            return True
        raise TypeError(
            f"dest: expected a numpy array (host) or a CUDA array (cupy, __cuda_array_interface__) shaped "
            f"[layers][slots][page_bytes], got {type(dest).__name__}; for a CPU torch tensor pass tensor.numpy()"
        )

    def get(self, keys: Sequence[Key], dest: Any, dest_pages: Sequence[int] | None = None) -> HostRestore | Restore:
        """Restore ``keys`` into ``dest[layer, dest_pages[i]]``; iterate the result for layers in order.

        ``dest`` is ``[layers][slots][page_bytes]`` uint8, in host memory (numpy) or, with kvikio, device
        memory (see ``_on_gpu``), or a ``PagedTarget``: host memory in the caller's own layout, written
        in place. Host destinations are read into directly where their rows are O_DIRECT-aligned
        (``HostRestore``); device memory streams through a bounded staging window (``Restore``).
        ``dest_pages`` (default ``0..n-1``) names the destination page of each key. Unknown keys are
        refused before any I/O (ask ``exists`` first); pages that fail to read or to match their checksum
        are reported in ``missing``.
        """
        self._check_keys(keys, "keys")
        on_gpu = self._on_gpu(dest)
        if on_gpu and not gpu.is_device_array(dest):
            dest = gpu.as_device_array(dest)  # a zero-copy cupy view of the caller's device memory
        paged = isinstance(dest, PagedTarget)
        checker = self._check_target if paged else self._check_dest
        pages = checker(dest, len(keys), dest_pages)
        # DRAM copies are filled from host destinations that keep whole pages (a device restore would need a
        # copy back; a target with limits keeps part of each page).
        lease = self.catalog.acquire(keys, copy=not on_gpu and not (paged and dest.limits is not None))
        hold = contextlib.ExitStack()
        try:
            self._hold_epoch(lease, hold)
            at = _Located(self.config, lease.locations, np.asarray(pages, dtype=np.int64))
            mode = "all" if lease.verify else self.config.io.verify_reads
            want = np.asarray(lease.checksums, dtype=np.int64) if mode != "off" and lease.checksums else None
            self.stats.add("restores")
            self.stats.add("restore_pages_dram", len(at.dram_src))
            self.stats.add("restore_pages_ssd", len(at.ssd))

            restore: list[HostRestore | Restore] = []  # set below: what the copies are filled from

            def release() -> None:
                host = restore[0] if restore and isinstance(restore[0], HostRestore) else None
                copied = self._fill_copies(lease, host, pages) if lease.copies and host is not None else None
                hold.close()  # the pages are copied: a restarted agent may begin
                # Pages whose bytes did not match: the agent checks them itself and stops serving the damaged.
                damaged = sorted(restore[0].damaged) if restore and restore[0].damaged else None
                try:
                    self.catalog.release(lease.id, copied, damaged)
                except (ConnectionError, UnknownHandleError):
                    if not lease.epoch:
                        raise
                    # The agent that granted the lease went away (a new one does not know it): its pins
                    # ended with it, and the epoch held above kept the pages ours while they were copied.

            late = self._epoch_check(lease, at)
            stream = (self._get_device if on_gpu else self._get_host)(dest, at, want, mode, release, late)
            restore.append(stream)
            return stream
        except FencedError:
            with hold, contextlib.suppress(FlatCakeError, ConnectionError, OSError):  # the old agent is gone
                self.catalog.release(lease.id)
            raise
        except BaseException:
            with hold:
                self.catalog.release(lease.id)
            raise

    def _fill_copies(self, lease: Lease, restore: HostRestore, pages: Sequence[int]) -> list[int]:
        """Copy each page the lease asked copies of from the destination, where it now lies whole and
        checked, into its DRAM slot; the crc32 of each copy, or -1 where the restore did not finish or the
        page is missing (nothing then serves that slot)."""
        want = [i for i, slot in enumerate(lease.copies) if slot >= 0]
        target = restore.target  # never one with limits: ``get`` asks no copies for those
        if not restore.complete:
            return [-1] * len(want)
        fill = [i for i in want if i not in restore.missing]
        crc = dict.fromkeys(want, -1)
        # Straight into each copy's slot: a gather buffer was fresh memory per call, and its page faults
        # cost 60x the copy itself (bench peers: copies mode restored at 0.35x Table 2's rate).
        dram3, raw = self._dram3, target.raw_bytes
        for i in fill:
            slot = dram3[lease.copies[i]]  # [layers][page_bytes], a view of the pool
            page = np.asarray([pages[i]], np.int64)
            for layer in range(self.config.layers):
                target.read_pages(layer, page, slot[layer : layer + 1])
            slot[:, raw:] = 0  # padding as a stored page has it (the checksum covers it)
            crc[i] = page_checksum(slot[:, None, :], 0)
        self.stats.add("copy_pages_written", len(fill))
        return [crc[i] for i in want]

    def _hold_epoch(self, lease: Lease, hold: contextlib.ExitStack) -> None:
        """A restore under an agent's lease holds the agent's epoch until it closes (catalog/epoch.py):
        a restarted agent, whose writers could reuse a page still being copied, begins only after it.
        A lease granted in an earlier epoch is refused before anything is read: its pins ended with the
        agent that granted it, so its pages may already hold other bytes."""
        if not lease.epoch:
            return
        now = hold.enter_context(E.held(self.config.state_dir))
        if now != lease.epoch:
            self.stats.add("fenced_reads")
            raise FencedError(
                f"epoch: lease {lease.id} was granted in agent epoch {lease.epoch}, the agent is now in epoch {now} "
                "(it restarted); nothing was read, look the keys up again"
            )

    def _epoch_check(self, lease: Lease, at: _Located) -> Callable[[], set[int]] | None:
        """What a restore of DRAM pages checks once it has copied them (``late``): if the agent restarted
        meanwhile, the new agent's writers may have reused a slot as it was copied, so every DRAM page of
        the restore is a miss (its bytes cannot be told from the new writer's without a checksum the
        caller may not have asked for). A restore holds the epoch, so this happens only when it outlived
        the new agent's wait for it (``agent.epoch_wait_s``; catalog/epoch.py). One 8-byte read per
        restore otherwise."""
        if not lease.epoch or not len(at.dram_src):
            return None
        directory, dram = self.config.ssd.dir, np.flatnonzero(~at.on_ssd).tolist()

        def check() -> set[int]:
            if E.current(directory) == lease.epoch:
                return set()
            self.stats.add("epoch_rechecks")
            log.warning("a restore outlived its agent (epoch %d is now %d): its %d DRAM pages are misses",
                        lease.epoch, E.current(directory), len(dram))  # fmt: skip
            return set(dram)

        return check

    def _get_host(
        self,
        dest: Any,
        at: _Located,
        want: Ints | None,
        mode: str,
        release: Callable[[], None],
        late: Callable[[], set[int]] | None = None,
    ) -> HostRestore:
        c = self.config
        target = dest if isinstance(dest, PagedTarget) else host_target(dest)
        direct = direct_ok(target, at.ssd_dest, c.page_bytes, ALIGN)
        # A staged command lands in its thread's scratch: bound it by the staging slot.
        cap = c.io.command_bytes if direct else min(c.io.command_bytes, c.io.staging_slot_bytes)
        plan = plan_host(at.file, at.base, at.ssd_stride, c.layers, c.page_bytes, self.gap_bytes, cap)
        dram3, runs = self._dram3, _runs(at.dram_src)

        def copy_dram(layer: int) -> None:  # one copy per run of consecutive pool slots
            for a, b in runs:
                s0 = int(at.dram_src[a])
                target.write(layer, at.dram_dst[a:b], dram3[s0 : s0 + b - a, layer])

        check = None
        if want is not None:
            ssd = np.flatnonzero(want[at.ssd] >= 0)
            dram = np.flatnonzero(~at.on_ssd & (want >= 0)) if mode == "all" else np.zeros(0, np.int64)
            if len(ssd) or len(dram):
                check = Check(ssd, want[at.ssd][ssd], dram, at.slot[dram], want[dram])
        return HostRestore(
            layers=c.layers,
            plan=plan,
            target=target,
            direct=direct,
            ssd_dest=at.ssd_dest,
            request_index=at.ssd,
            page_bytes=c.page_bytes,
            stream=self.reads.stream(c.io.restore_inflight_bytes),
            copy_dram=copy_dram,
            stats=self.stats,
            on_close=release,
            check=check,
            dram_rows=lambda slot: dram3[slot],
            late=late,
        )

    def _get_device(
        self,
        dest: Any,
        at: _Located,
        want: Ints | None,
        mode: str,
        release: Callable[[], None],
        late: Callable[[], set[int]] | None = None,
    ) -> Restore:
        c = self.config
        fills = plan_restore(at.file, at.base, at.ssd_stride, c.layers, c.page_bytes, self.gap_bytes,
                             c.io.staging_slot_bytes)  # fmt: skip
        dram3 = self._dram3
        # Runs consecutive in both the pool and the destination, each one 2-D copy per layer.
        pair_runs = _runs(at.dram_src, at.dram_dst)
        order = StreamOrder(gpu.cuda_api())

        def copy_dram(layer: int) -> None:  # straight from the pinned pool, on the restore's stream
            row, base = c.page_bytes, gpu.device_ptr(dest) + layer * dest.shape[1] * c.page_bytes
            for a, b in pair_runs:
                src = int(dram3[int(at.dram_src[a]), layer].ctypes.data)
                gpu.copy_rows_to_device(base + int(at.dram_dst[a]) * row, row, src, c.layers * row, row, b - a,
                                        order.stream)  # fmt: skip

        verify = None
        if want is not None:
            # Checked on the staging copy, as read (each slot brought back to the host before its scatter);
            # DRAM pages from the pinned pool.
            check = np.flatnonzero((at.on_ssd if mode == "ssd" else np.ones(len(at.on_ssd), bool)) & (want >= 0))
            if len(check):
                dram = dict(zip(at.dram_dst.tolist(), at.dram_src.tolist(), strict=True))
                verify = StagedVerifier(check, at.dst[check], want[check], c.page_bytes, c.layers, dram,
                                        lambda slot, layer: dram3[slot, layer], to_host=gpu.to_host)  # fmt: skip
        return Restore(
            layers=c.layers,
            fills=fills,
            dest_pages=at.ssd_dest,
            request_index=at.ssd,
            io=self.io,
            windows=self._gpu_windows(),
            scatter=cupy_scatter(dest, c.page_bytes, order.stream),
            copy_dram=copy_dram,
            stats=self.stats,
            on_close=release,
            verify=verify,
            order=order,
            late=late,
        )

    @property
    def reads(self) -> ReadQueue:
        """The read queue of host restores, made on the first one."""
        if self._reads is None:
            with self._reads_lock:
                if self._reads is None:
                    self._reads = ReadQueue(self._paths, self.config.io.read_threads)
        return self._reads

    @property
    def staging_bytes(self) -> int:
        """Staging memory held now: the read threads' scratch (host) and GPU windows in use."""
        host = self._reads.scratch_bytes if self._reads is not None else 0
        device = self._device_windows.in_use_bytes if self._device_windows is not None else 0
        return host + device

    def _gpu_windows(self) -> WindowPool:
        """Device staging windows, made on the first GPU restore (kvikio reads land in device memory)."""
        if self._device_windows is None:
            c = self.config.io
            # Each window is one allocation of its own, registered with cuFile where GDS is used (kvikio
            # deregisters it when the backend closes, after its last read).
            register = getattr(self.io, "register_buffer", None)
            self._device_windows = WindowPool(c.streams, c.staging_layers, c.staging_slot_bytes, self.stats,
                                              gpu.device_empty, register)  # fmt: skip
        return self._device_windows

    # ---- checks ----------------------------------------------------------------------------------
    def _check_keys(self, keys: Sequence[Key], field: str) -> None:
        if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
            raise TypeError(f"{field}: expected a sequence of page keys, got {type(keys).__name__}")
        for i, key in enumerate(keys):
            if not isinstance(key, str | bytes | int) or isinstance(key, bool):
                raise TypeError(f"{field}[{i}]: {key!r} is not a page key (str, bytes or int)")
        if len(set(keys)) != len(keys):
            raise ValueError(f"{field}: contains duplicate keys; each page key may appear once")

    def _check_kv(self, kv: npt.NDArray[np.uint8], n: int) -> None:
        c = self.config
        want = (c.layers, n, c.page_bytes)
        if not isinstance(kv, np.ndarray):
            raise TypeError(f"kv: expected a numpy array shaped {want}, got {type(kv).__name__}")
        if kv.dtype != np.uint8:
            raise TypeError(f"kv.dtype: {kv.dtype} is not uint8; pass kv.view(np.uint8) with page_bytes counting bytes")
        if kv.shape != want:
            raise ValueError(f"kv.shape: {kv.shape} != (layers, len(keys), page_bytes) = {want}")
        if not kv.flags.c_contiguous:
            raise ValueError("kv: not C-contiguous; pass np.ascontiguousarray(kv)")
        if not is_aligned(kv):
            raise ValueError(
                f"kv: buffer address {kv.ctypes.data:#x} is not {ALIGN}-byte aligned (O_DIRECT); "
                "allocate it with flatcake.node_agent.datapath.buffers.aligned_empty"
            )

    def _check_dest(self, dest: Any, n: int, dest_pages: Sequence[int] | None) -> list[int]:
        c = self.config
        if dest.dtype != np.uint8:
            raise TypeError(f"dest.dtype: {dest.dtype} is not uint8; pass dest.view(np.uint8)")
        if dest.ndim != 3 or dest.shape[0] != c.layers or dest.shape[2] != c.page_bytes:
            raise ValueError(f"dest.shape: {dest.shape} is not (layers={c.layers}, slots, page_bytes={c.page_bytes})")
        if not getattr(dest.flags, "writeable", True) or not dest.flags.c_contiguous:
            raise ValueError("dest: must be writeable and C-contiguous")
        pages = list(range(n)) if dest_pages is None else [int(p) for p in dest_pages]
        if len(pages) != n:
            raise ValueError(f"dest_pages: {len(pages)} entries for {n} keys; give one destination page per key")
        bad = [p for p in pages if not 0 <= p < dest.shape[1]]
        if bad:
            raise ValueError(f"dest_pages: {bad[:3]} outside 0..{dest.shape[1] - 1} (dest.shape[1])")
        return pages

    def _check_target(self, dest: PagedTarget, n: int, dest_pages: Sequence[int] | None) -> list[int]:
        c = self.config
        if dest.layers != c.layers or dest.raw_bytes > c.page_bytes:
            raise ValueError(f"dest: a target of {dest.layers} layers x {dest.raw_bytes} bytes; this pool holds "
                             f"{c.layers} layers x {c.page_bytes} bytes per page")  # fmt: skip
        pages = list(range(n)) if dest_pages is None else [int(p) for p in dest_pages]
        if len(pages) != n:
            raise ValueError(f"dest_pages: {len(pages)} entries for {n} keys; give one destination page per key")
        bad = [p for p in pages if not 0 <= p < dest.slots]
        if bad:
            raise ValueError(f"dest_pages: {bad[:3]} outside 0..{dest.slots - 1} (the target's pages)")
        if len(set(pages)) != n:  # checks and in-place writes are per destination page
            raise ValueError("dest_pages: a destination page appears twice; give each key its own page")
        return pages

    # ---- state -----------------------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """Used and total space and scopes per medium, as the catalog counts them."""
        return self.table.usage()

    def close(self) -> None:
        """Release the pools, the reader threads and the catalog (an in-process engine removes the DRAM pool
        it made; SSD pages stay in the pool files)."""
        self.io.close()  # waits for in-flight reads, then deregisters the staging windows from cuFile
        if self._reads is not None:
            self._reads.close()
        if self._posix is not None:
            self._posix.close()
        del self._dram3
        self.dram.close(unlink=self._owns_dram)
        self.catalog.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
