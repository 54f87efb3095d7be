"""Mooncake Store as a benchmark system: a real ``mooncake_master`` process and an embedded Mooncake
client (the "real client": this process contributes the DRAM segment and runs SSD offload), set up
as SGLang's Mooncake backend sets it up and driven as that backend drives it.

What SGLang does (``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``, 0.5.23):
``setup(local_hostname, metadata_server, global_segment_size, 16 MiB local buffer, protocol, device,
master, enable_ssd_offload=..., ssd_offload_path=...)``, ``register_buffer`` of its whole host KV pool
once, then zero-copy batches between host-pool pages and objects: ``batch_is_exist`` and
``batch_put_from`` for the pages not stored yet (``batch_set_v1``), ``batch_get_into`` to read
(``batch_get_v1``), ``STORAGE_BATCH_SIZE`` (128) pages a call. Objects are whole pages: with an MLA
model's ``page_first``/``page_first_direct`` host layout, one object per page (``{key}_{rank}_k``)
holding all its layers (``page_first_direct``: layer-major, ``[layers][tokens][dim]``, the layout of
the Mooncake authors' SSD-offload benchmark); an MHA page is two objects, K and V. Here each page key
is one object of ``[layers][page_bytes]`` (``page_first_direct``'s MLA object), written from and read
into a registered page-major staging buffer that plays SGLang's host pool: a restore fills it for
the whole request (``O(context)``), then copies each page out into the layer-major destination.

The deployment, after Mooncake's ``docs/source/deployment/ssd/ssd-offload.md``: the master runs
``--enable_offload=true --offload_on_evict=true`` ("SSD writes only under memory pressure"): a page
lives in the DRAM segment until eviction queues it for the SSD, as in the ``tiered`` baseline. The
client's offload directory is ``ssd_offload_path`` (it overrides ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``;
the master's ``--root_fs_dir`` is a legacy path that offload does not use), with the default
``bucket_storage_backend``. Eager persistence (``--enable_offload`` alone, which writes every put to
the SSD) lost pages under this benchmark's DRAM pressure in Mooncake 0.3.13.post1 (about 8% of them:
their DRAM copy was evicted before the SSD copy existed), so it is not used.

Scaled to this benchmark's small DRAM budget (the authors' runs use an 80 GB pool): offload heartbeat
1 s (default 10 s: puts into a full segment wait for it), at most 16 keys a bucket (default 500: a
bucket is written only once full, and its keys stay in DRAM until then), read lease 2 s (default
10 s: a leased object cannot be evicted, so puts into a full segment are refused for that long; put
throughput under pressure is about one segment per lease + heartbeat). Puts refused for space
(``NO_AVAILABLE_HANDLE``) are retried until eviction makes room, and counted (``refused_puts``);
SGLang would drop them. Transport: TCP on loopback; Mooncake copies to and from its own segment with
``memcpy`` in a TCP-only setup, and serves SSD replicas through its offload RPC and transfer engine
from a staging arena (``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES``, default 1.25 GiB, resident in this
process from setup on; left at its default). SSD I/O runs in this process; ``pids`` is the master's.

``prepare`` makes the next restores as cold as Mooncake allows. It first waits until offload has
settled (the master's count of objects with an SSD replica stops moving for three heartbeats); its
duration is ``flush_seconds``, time a durable-write figure should count. With ``flush_dram=False``
(the DRAM budget at work) what is then still in DRAM is served from DRAM (``dram_pages``). With
``flush_dram=True`` Mooncake has no call that moves a DRAM-only object to the SSD, so ``prepare``
applies sustained pressure, as the tiered baseline's flush does: it writes filler objects (a segment's
worth and more) until eviction has offloaded every page, drops the DRAM copies of pages that have an
SSD copy too (``batch_replica_clear`` on this client's segment, retried while a read lease lasts),
and removes the fillers.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from flatcake.loadgen.systems.base import Array, RequestTiming, RestoreCounters, SystemSpec
from flatcake.net import free_port
from flatcake.node_agent import ConfigError, Hints, Key, aligned_empty

MiB = 1 << 20
BATCH = 128  # pages per call: sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE
OFFLOAD_ARENA = int(os.environ.get("MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", 1280 * MiB))  # its default
LOCAL_BUFFER = 16 * MiB  # SGLang's DEFAULT_LOCAL_BUFFER_SIZE: the zero-copy calls do not use it
MIN_SEGMENT = 16 * MiB  # the client refuses a smaller DRAM segment
HEARTBEAT_S = 1
BUCKET_KEYS = 16
LEASE_TTL_MS = 2000
NO_AVAILABLE_HANDLE = -200  # no room in the DRAM segment (yet): eviction will make some
OBJECT_ALREADY_EXISTS = -705
START_TIMEOUT_S = 60.0
STALL_TIMEOUT_S = 120.0  # a put or a flush that makes no progress this long gives up
FILLER_ROUNDS = 4
INSTALL = "pip install --no-deps -r requirements/peers.txt (bin/test and bin/flatcake bench peers add it)"

# The embedded client reads these from the environment when it is set up.
# MOONCAKE_OFFLOAD_USE_URING=1: its offload reads go through io_uring with O_DIRECT (Mooncake's
# storage_backend.cpp adds O_DIRECT to reads only on that path; writes stay buffered either way), so reads of
# offloaded pages hit the device as every other system's do, not the page cache (its default is false).
CLIENT_ENV = {
    "MOONCAKE_OFFLOAD_USE_URING": "1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(HEARTBEAT_S),
}


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "mooncake_master").is_file():
            return Path(location)
    raise ConfigError(f"mooncake: not installed (no mooncake_master in a mooncake package); {INSTALL}")


def _store_class() -> Any:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise ConfigError(f"mooncake: not importable ({exc}); {INSTALL}") from None
    return module.MooncakeDistributedStore


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class MooncakeMaster:
    """A ``mooncake_master`` on loopback as this project deploys it (HTTP metadata server, metrics,
    offload on eviction, the scaled lease): ``rpc_address`` and ``metadata_url`` are what a client's
    ``setup`` (or SGLang's Mooncake backend's extra config) names. ``root`` is emptied first; the log
    is ``root/master.log``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.log_path = self.root / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.rpc_port = self.metadata_port = self.metrics_port = 0

    @property
    def rpc_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self, attempts: int = 3) -> MooncakeMaster:
        binary = _package_dir() / "mooncake_master"
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "offload").mkdir(parents=True)
        self._log = self.log_path.open("wb")
        for attempt in range(attempts):  # a free port can be taken before the master binds it
            self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
            args = [
                str(binary),
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--enable_offload=true",
                "--offload_on_evict=true",
                f"--default_kv_lease_ttl={LEASE_TTL_MS}",
                "--logtostderr=true",
                "--minloglevel=1",  # warnings and errors: its INFO lines report every eviction pass
            ]
            self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self.ready():
                if self.proc.poll() is not None and attempt + 1 < attempts:
                    break
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    why = "exited" if self.proc.poll() is not None else f"did not answer in {START_TIMEOUT_S:.0f} s"
                    self.close()
                    raise RuntimeError(f"mooncake_master {why}; its last log lines:\n{_tail(self.log_path)}")
                time.sleep(0.05)
            else:
                return self
        return self

    def ready(self) -> bool:
        """The RPC port accepts; the metadata server and the admin server answer /health."""
        try:
            socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5).close()
            for port in (self.metadata_port, self.metrics_port):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status != 200:
                        return False
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class MooncakeSystem:
    name = "mooncake"

    def __init__(
        self, directory: Path, spec: SystemSpec, *, segment_bytes: int | None = None, retry_refused: bool = True
    ) -> None:
        """``segment_bytes``: the DRAM segment (default: the others' DRAM budget, ``spec.dram_fraction``
        of the pages stored). ``retry_refused``: retry puts refused for space until eviction makes room
        (the store benchmarks: every page must land), or drop them as SGLang's backend does (an L3)."""
        self.span = spec.page_span
        self.flush_dram = spec.flush_dram
        self.retry_refused = retry_refused
        if segment_bytes is None:
            self.dram_bytes = int(spec.dram_fraction * spec.total_pages) * self.span  # the others' DRAM budget
            if self.dram_bytes < MIN_SEGMENT:
                raise ConfigError(
                    f"dram_fraction: {spec.dram_fraction} of {spec.total_pages} pages is a {self.dram_bytes} B "
                    f"DRAM segment; Mooncake's smallest is {MIN_SEGMENT} B (store more pages, or raise dram_fraction)"
                )
        elif segment_bytes < MIN_SEGMENT:
            raise ConfigError(f"segment_bytes: {segment_bytes} B is below Mooncake's smallest segment, {MIN_SEGMENT} B")
        else:
            self.dram_bytes = -(-segment_bytes // self.span) * self.span  # whole pages, never below the minimum
        self.dram_pages = self.dram_bytes // self.span
        # A bucket's keys stay in DRAM until it is full: at most an eighth of the segment.
        self.bucket_keys = max(1, min(BUCKET_KEYS, self.dram_pages // 8))
        self.root = Path(directory) / "mooncake"
        self.offload_dir = self.root / "offload"
        self.master = MooncakeMaster(self.root)
        self._store: Any = None
        self._registered = False
        self._stored: set[str] = set()
        self._fillers = 0
        self.refused_puts = 0  # puts refused for space (then retried, or dropped: see retry_refused)
        self.failed_puts = 0  # pages Mooncake did not store (another error, or no room in STALL_TIMEOUT_S)
        self.flush_seconds = 0.0  # the last prepare()'s wait for offload to settle
        self.flushed = True  # whether the last prepare() reached its goal
        session_pages = max(1, -(-spec.session_bytes // self.span))
        self.staging = aligned_empty((session_pages, spec.layers, spec.page_bytes))
        self._extra: list[Array] = []  # more registered buffers (register())
        self._c = RestoreCounters()
        self._hits_base = 0.0
        os.environ.update(CLIENT_ENV)
        os.environ["MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"] = str(self.bucket_keys)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # not a warning for every put refused for space
        store_class = _store_class()
        try:
            self.master.start()
            self._setup(store_class)
        except BaseException:
            self.close()
            raise

    # ---- processes -------------------------------------------------------------------------------
    def _setup(self, store_class: Any) -> None:
        store = store_class()
        self._store = store  # close() tears it down, whatever happens next
        code = store.setup(
            "127.0.0.1",
            self.master.metadata_url,
            self.dram_bytes,
            LOCAL_BUFFER,
            "tcp",
            "",
            self.master.rpc_address,
            None,
            True,  # enable_ssd_offload
            str(self.offload_dir),  # ssd_offload_path
        )
        if code != 0:
            raise RuntimeError(f"mooncake: client setup failed ({code}); master log:\n{_tail(self.master.log_path)}")
        self.segment = str(store.get_hostname())
        code = store.register_buffer(self.staging.ctypes.data, self.staging.nbytes)
        if code != 0:
            raise RuntimeError(f"mooncake: register_buffer of {self.staging.nbytes} B failed ({code})")
        self._registered = True

    def register(self, pages: int) -> Array:
        """Another registered page-major buffer of ``pages`` pages, for a second caller that must not
        share ``staging`` (SGLang registers its whole host pool: its prefetch and backup threads read
        and write it concurrently)."""
        buffer = aligned_empty((pages, *self.staging.shape[1:]))
        code = self._store.register_buffer(buffer.ctypes.data, buffer.nbytes)
        if code != 0:
            raise RuntimeError(f"mooncake: register_buffer of {buffer.nbytes} B failed ({code})")
        self._extra.append(buffer)
        return buffer

    def pids(self) -> list[int]:
        return [self.master.proc.pid] if self.master.proc is not None and self.master.alive() else []

    def _metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (reading them takes no lease)."""
        out: dict[str, float] = {}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.master.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if line and not line.startswith("#") and "{" not in name:
                    with contextlib.suppress(ValueError):
                        out[name] = float(value)
        return out

    # ---- writes ----------------------------------------------------------------------------------
    def _put_staged(self, names: list[str], slots: list[int], buffer: Array | None = None) -> list[str]:
        """``batch_put_from`` pages staged in ``buffer`` (default ``staging``), retrying those refused
        for space until eviction makes room (unless ``retry_refused`` is off); returns the names stored."""
        base, stored = (self.staging if buffer is None else buffer).ctypes.data, []
        pending = list(zip(names, slots, strict=True))
        stalled_since, backoff = time.monotonic(), 0.005
        while pending:
            batch = pending[:BATCH]
            codes = self._store.batch_put_from([n for n, _ in batch], [base + s * self.span for _, s in batch],
                                               [self.span] * len(batch))  # fmt: skip
            retry = []
            for item, code in zip(batch, codes, strict=True):
                if code in (0, OBJECT_ALREADY_EXISTS):
                    stored.append(item[0])
                elif code == NO_AVAILABLE_HANDLE:
                    retry.append(item)
                else:
                    self.failed_puts += 1
            if not self.retry_refused:  # dropped, as SGLang's backend drops what a batch_set did not store
                self.refused_puts += len(retry)
                pending = pending[len(batch) :]
                continue
            pending = retry + pending[len(batch) :]
            if len(retry) < len(batch):
                stalled_since, backoff = time.monotonic(), 0.005
                continue
            self.refused_puts += len(retry)
            if time.monotonic() - stalled_since > STALL_TIMEOUT_S:
                self.failed_puts += len(pending)
                break
            time.sleep(backoff)  # the segment is full: eviction frees some at each offload heartbeat
            backoff = min(backoff * 2, 0.1)
        return stored

    def put(self, keys: Sequence[Key], kv: Array, hints: Hints) -> None:
        self.store_pages(keys, kv)

    def store_pages(self, keys: Sequence[Key], kv: Array, buffer: Array | None = None) -> list[bool]:
        """One object per page: skip the stored ones (``batch_is_exist``), stage the rest page-major in
        ``buffer`` (default ``staging``), ``batch_put_from`` them (SGLang's ``batch_set_v1``). Returns
        which keys are stored now."""
        staging = self.staging if buffer is None else buffer
        names = [str(k) for k in keys]
        exists = self._store.batch_is_exist(names) if names else []
        stored = {n for n, e in zip(names, exists, strict=True) if e == 1}
        new = [i for i, e in enumerate(exists) if e != 1]
        room = staging.shape[0]
        for lo in range(0, len(new), room):
            chunk = new[lo : lo + room]
            staging[: len(chunk)] = kv[:, chunk].transpose(1, 0, 2)
            put = self._put_staged([names[i] for i in chunk], list(range(len(chunk))), staging)
            self._stored.update(put)
            stored.update(put)
        return [n in stored for n in names]

    # ---- prepare ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        started = time.monotonic()
        self.flushed = self._settle()
        self.flush_seconds = time.monotonic() - started
        if self.flush_dram:
            self.flushed = self._push_out_of_dram() and self.flushed
        self._c = RestoreCounters()
        self._hits_base = self._metrics().get("mem_cache_hit_nums_", 0.0)

    def _settle(self) -> bool:
        """Wait until the master's count of objects with an SSD replica stops moving."""
        deadline = time.monotonic() + STALL_TIMEOUT_S
        last, since = -1.0, time.monotonic()
        while time.monotonic() < deadline:
            now = self._metrics().get("file_cache_nums_", 0.0)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > 3 * HEARTBEAT_S:
                return True
            time.sleep(0.1)
        return False

    def _replicas(self, names: list[str]) -> tuple[set[str], set[str]]:
        """(names with a complete SSD replica, names with a complete DRAM replica); takes read leases."""
        disk, dram = set(), set()
        for name, replicas in (self._store.batch_get_replica_desc(names) if names else {}).items():
            for r in replicas:
                if str(r.status).endswith("COMPLETE"):
                    if r.is_local_disk_replica():
                        disk.add(name)
                    elif r.is_memory_replica():
                        dram.add(name)
        return disk, dram

    def _push_out_of_dram(self) -> bool:
        names = sorted(self._stored)
        fillers: list[str] = []
        try:
            for round_ in range(FILLER_ROUNDS):
                # Fillers a segment's worth and more: eviction offloads the oldest objects first.
                n = self.dram_pages + self.bucket_keys
                if round_:
                    disk, dram = self._replicas(names)
                    if not dram - disk:
                        break
                    time.sleep(LEASE_TTL_MS / 1000)  # that query leased them: evictable once it ends
                    n += len(dram - disk)
                batch = [f"flatcake-mooncake-filler-{self._fillers + i}" for i in range(n)]
                self._fillers += n
                fillers += self._put_staged(batch, [i % self.staging.shape[0] for i in range(n)])
                self._settle()
            disk, dram = self._replicas(names)
            todo = sorted(dram & disk)
            deadline = time.monotonic() + STALL_TIMEOUT_S
            while todo and time.monotonic() < deadline:  # refused while a read lease lasts
                cleared = set(self._store.batch_replica_clear(todo, self.segment))
                todo = [n for n in todo if n not in cleared]
                if todo:
                    time.sleep(0.1)
            return len(disk) == len(names) and not todo and not dram - disk
        finally:
            if fillers:
                self._store.batch_remove(fillers, True)

    # ---- restores --------------------------------------------------------------------------------
    def restore(self, keys: Sequence[Key], dest: Array, dest_pages: Sequence[int] | None = None) -> int:
        """``batch_get_into`` the staging buffer (the whole request, ``BATCH`` pages a call), then copy
        each page out into ``dest[:, dest_pages[i], :]``."""
        storage_s = 0.0  # the store's work; copying pages out for the benchmark's check is not timed
        names = [str(k) for k in keys]
        slots = np.arange(len(names)) if dest_pages is None else np.asarray(dest_pages, dtype=np.int64)
        c, room, missing = self._c, self.staging.shape[0], 0
        for lo in range(0, len(names), room):
            chunk = names[lo : lo + room]
            started = time.perf_counter()
            got = self.get_staged(chunk)
            storage_s += time.perf_counter() - started
            # The request's pages in the registered buffer, plus the SSD read arena resident since setup.
            c.staging_peak_bytes = max(c.staging_peak_bytes, len(chunk) * self.span + OFFLOAD_ARENA)
            ok = np.flatnonzero(got)
            dest[:, slots[lo + ok], :] = self.staging[ok].transpose(1, 0, 2)
            missing += len(chunk) - len(ok)
        c.bytes_requested += len(names) * self.span
        c.missing += missing
        c.requests.append(RequestTiming(storage_s, storage_s))  # a whole request: its first layer with its last
        return missing

    def get_staged(self, names: Sequence[str], buffer: Array | None = None) -> npt.NDArray[np.bool_]:
        """``batch_get_into`` the first ``len(names)`` pages of ``buffer`` (default ``staging``),
        ``BATCH`` pages a call (SGLang's ``batch_get_v1``); which arrived."""
        c, got = self._c, np.zeros(len(names), dtype=bool)
        base = (self.staging if buffer is None else buffer).ctypes.data
        for b in range(0, len(names), BATCH):
            part = names[b : b + BATCH]
            ptrs = [base + (b + i) * self.span for i in range(len(part))]
            results = self._store.batch_get_into(part, ptrs, [self.span] * len(part))
            c.read_commands += 1
            for i, r in enumerate(results):
                if r == self.span:
                    got[b + i] = True
                    c.bytes_read += r
        return got

    def counters(self) -> RestoreCounters:
        """``read_commands``: ``batch_get_into`` calls. ``dram_pages``: lookups since ``prepare`` that
        the master answered with a DRAM replica first (its ``mem_cache_hit_nums_``), which the client
        then reads."""
        c = self._c
        if self._store is not None:
            c.dram_pages = int(self._metrics().get("mem_cache_hit_nums_", 0.0) - self._hits_base)
        return RestoreCounters(c.read_commands, c.bytes_read, c.bytes_requested, c.staging_peak_bytes, c.missing,
                               c.dram_pages, list(c.requests))  # fmt: skip

    # ---- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """The client first (it unmounts its segment from the master), then the master, then the files."""
        store, self._store = self._store, None
        if store is not None:
            if self._registered:
                store.unregister_buffer(self.staging.ctypes.data)
                self._registered = False
            for buffer in self._extra:
                store.unregister_buffer(buffer.ctypes.data)
            self._extra.clear()
            store.close()
            del store  # its destructor unmounts and stops the offload threads, while the master is up
        self.master.close()
        shutil.rmtree(self.root, ignore_errors=True)


class MooncakePages:
    """Mooncake Store as the tiered cache's L3 (``TieredStore(l3=...)``, the emulator's ``--l3
    hicache-mooncake``): SGLang HiCache over its Mooncake backend. Pages go through ``MooncakeSystem``
    (a real master and embedded client) with the calls that backend makes, ``STORAGE_BATCH_SIZE`` pages
    a call: ``batch_is_exist`` + ``batch_put_from`` to write (``batch_set_v1``), ``batch_get_into`` to
    read (``batch_get_v1``); a put refused for space is dropped, as that backend reports it failed and
    HiCache does not retry it (``refused_puts``). ``segment_bytes`` is Mooncake's DRAM segment (the
    emulator gives it half the DRAM budget, the host tier the other half: a Mooncake deployment is
    DRAM plus SSD). Reads and writes have a registered buffer each and run concurrently, as SGLang's
    prefetch and backup threads do over its registered host pool."""

    def __init__(self, directory: Path, layers: int, page_bytes: int, segment_bytes: int = MIN_SEGMENT) -> None:
        span = layers * page_bytes
        spec = SystemSpec(layers=layers, page_bytes=page_bytes, page_tokens=1, sessions=1, session_bytes=BATCH * span,
                          flush_dram=False)  # fmt: skip
        self.system = MooncakeSystem(directory, spec, segment_bytes=max(segment_bytes, MIN_SEGMENT),
                                     retry_refused=False)  # fmt: skip
        self.layers, self.page_bytes = layers, page_bytes
        self._read, self._write = self.system.staging, self.system.register(BATCH)
        self._read_lock, self._write_lock = threading.Lock(), threading.Lock()

    def set(self, key: Key, page: Array) -> bool:
        return self.set_many([key], [page]) == [True]

    def exists(self, keys: Sequence[Key]) -> int:
        """SGLang's Mooncake backend's ``batch_exists``: ``batch_is_exist``, the leading run of hits."""
        found = self.system._store.batch_is_exist([str(k) for k in keys])
        n = 0
        while n < len(found) and found[n] == 1:
            n += 1
        return n

    def get(self, key: Key, into: Array) -> bool:
        return self.get_many([key], [into]) == [True]

    def set_many(self, keys: Sequence[Key], pages: Sequence[Array]) -> list[bool]:
        kv = np.stack([np.asarray(p).reshape(self.layers, self.page_bytes) for p in pages], axis=1)
        with self._write_lock:
            return self.system.store_pages(keys, kv, self._write)

    def get_many(self, keys: Sequence[Key], into: Sequence[Array]) -> list[bool]:
        ok: list[bool] = []
        with self._read_lock:
            for lo in range(0, len(keys), BATCH):  # the read buffer holds BATCH pages
                got = self.system.get_staged([str(k) for k in keys[lo : lo + BATCH]], self._read)
                for i in np.flatnonzero(got).tolist():
                    into[lo + i].reshape(self.layers, self.page_bytes)[...] = self._read[i]
                ok += got.tolist()
        return ok

    def close(self) -> None:
        self.system.close()
