"""I/O backends behind one interface: POSIX O_DIRECT on a thread pool (CPU) or kvikio CuFile (GPU).

Each worker is a single thread with its own file handles, so commands handed to different workers
run in parallel and one worker's commands never contend for a descriptor.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from flatcake.errors import ConfigError
from flatcake.node_agent.datapath.file_pool import open_direct

log = logging.getLogger(__name__)

IOV_MAX = 1024


class IOBackend(Protocol):
    name: str
    workers: int

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        """Read ``len(buf)`` bytes at ``offset`` of pool file ``file``; the result is the byte count,
        smaller than asked on a short read; an I/O error raises OSError from the future."""
        ...

    def submit_write(self, worker: int, file: int, offset: int, bufs: Sequence[Any]) -> Future[int]:
        """Write the buffers back to back at ``offset``; raises OSError (ENOSPC, EIO) from the future."""
        ...

    def close(self) -> None: ...


class PosixDirectIO:
    """``preadv``/``pwritev`` on ``O_DIRECT`` descriptors; buffers must be 4 KiB aligned."""

    name = "posix"

    def __init__(self, paths: Sequence[str], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"io.workers: {workers} must be >= 1")
        self.paths = list(paths)
        self.workers = workers
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"flatcake-io-{i}") for i in range(workers)]
        # Descriptors per worker, touched only by that worker's thread.
        self._fds: list[dict[int, int]] = [{} for _ in range(workers)]

    def _fd(self, worker: int, file: int) -> int:
        fds = self._fds[worker]
        fd = fds.get(file)
        if fd is None:
            fd = fds[file] = open_direct(self.paths[file])
        return fd

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        return self._pools[worker % self.workers].submit(self._read, worker % self.workers, file, offset, buf)

    def submit_write(self, worker: int, file: int, offset: int, bufs: Sequence[Any]) -> Future[int]:
        return self._pools[worker % self.workers].submit(self._write, worker % self.workers, file, offset, bufs)

    def _read(self, worker: int, file: int, offset: int, buf: Any) -> int:
        fd = self._fd(worker, file)
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:  # end of file: a short read, reported by the count
                break
            done += n
        return done

    def _write(self, worker: int, file: int, offset: int, bufs: Sequence[Any]) -> int:
        fd = self._fd(worker, file)
        views = [memoryview(b).cast("B") for b in bufs]
        total = 0
        while views:
            batch = views[:IOV_MAX]
            n = os.pwritev(fd, batch, offset + total)
            if n == 0:
                raise OSError(28, "no progress writing pool file (device full?)")
            total += n
            # Drop what was written; keep the tail of a partly written buffer.
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
        return total

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
        for fds in self._fds:
            for fd in fds.values():
                os.close(fd)
            fds.clear()


class KvikioIO:
    """kvikio ``CuFile`` per worker: GPUDirect Storage into device buffers (or kvikio's compat mode).

    Only built when a GPU is usable: kvikio imports without one but fails on its first I/O.
    """

    name = "kvikio"

    def __init__(self, paths: Sequence[str], workers: int, threads: int = 0) -> None:
        import kvikio

        self._kvikio = kvikio
        if threads:
            set_kvikio_threads(kvikio, threads)
        self.mode = kvikio_mode(kvikio)
        try:  # whether cuFile's driver offers GDS here (compat mode reads through host bounce buffers)
            self.gds_available: bool | None = bool(submodule(kvikio, "cufile_driver").get("is_gds_available"))
        except Exception:  # an older kvikio without the module or property, or no cuFile driver at all
            self.gds_available = None
        self._registered: list[Any] = []  # buffers registered with cuFile, deregistered on close
        self.paths = list(paths)
        self.workers = workers
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"flatcake-gds-{i}") for i in range(workers)]
        self._files: list[dict[int, Any]] = [{} for _ in range(workers)]

    def _file(self, worker: int, file: int) -> Any:
        files = self._files[worker]
        handle = files.get(file)
        if handle is None:
            handle = files[file] = self._kvikio.CuFile(self.paths[file], "r+")
        return handle

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        w = worker % self.workers
        return self._pools[w].submit(lambda: int(self._file(w, file).read(buf, buf.nbytes, offset)))

    def submit_write(self, worker: int, file: int, offset: int, bufs: Sequence[Any]) -> Future[int]:
        w = worker % self.workers

        def run() -> int:
            handle, total = self._file(w, file), 0
            for b in bufs:
                total += int(handle.write(b, b.nbytes, offset + total))
            return total

        return self._pools[w].submit(run)

    def register_buffer(self, buf: Any) -> None:
        """Register a staging window (one device allocation, reused by every read of the restores that
        hold it) with cuFile, so GDS DMAs into it without pinning it per read. Compat mode moves bytes
        through kvikio's bounce buffers instead: nothing to register there."""
        if self.mode != "gds":
            return
        memory_api(self._kvikio)[0](buf)
        self._registered.append(buf)

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)  # every read has landed: the windows may be deregistered
        deregister = memory_api(self._kvikio)[1] if self._registered else None
        while self._registered:
            deregister(self._registered.pop())  # type: ignore[misc]
        for files in self._files:
            for handle in files.values():
                handle.close()
            files.clear()


def memory_api(kvikio: Any) -> tuple[Any, Any]:
    """kvikio's cuFile buffer (de)registration: ``kvikio.memory_register`` / ``memory_deregister`` (26.06+,
    the pinned 26.10), ``kvikio.buffer.memory_register`` / ``memory_deregister`` before that. Each takes a
    device array and (de)registers the whole CUDA allocation holding it."""
    if hasattr(kvikio, "memory_register"):
        return kvikio.memory_register, kvikio.memory_deregister
    buffer = submodule(kvikio, "buffer")
    return buffer.memory_register, buffer.memory_deregister


def submodule(kvikio: Any, name: str) -> Any:
    """``kvikio.<name>``, imported when ``import kvikio`` did not bind it: 26.10 leaves ``defaults`` and
    ``cufile_driver`` unimported (``kvikio.defaults`` raised AttributeError on the first H200 run)."""
    found = getattr(kvikio, name, None)
    return found if found is not None else importlib.import_module(f"{kvikio.__name__}.{name}")


def set_kvikio_threads(kvikio: Any, threads: int) -> None:
    """kvikio's thread pool size, through whichever API this kvikio has: ``defaults.set`` (25.x) or
    ``defaults.num_threads_reset`` (24.x). kvikio splits each read into ``task_size`` chunks run on this
    pool; its default of one thread leaves one chunk in flight, far from what an NVMe queue needs."""
    defaults = submodule(kvikio, "defaults")
    if hasattr(defaults, "set"):
        defaults.set("num_threads", threads)
    else:
        defaults.num_threads_reset(threads)


def kvikio_mode(kvikio: Any) -> str:
    """``gds`` or ``compat``: how kvikio will move bytes, as kvikio itself resolves it. 25.06+:
    ``defaults.is_compat_mode_preferred()`` (``compat_mode`` AUTO resolved against the cuFile driver);
    24.x: ``defaults.compat_mode()`` (a bool in 24.10; a ``CompatMode`` from 24.12, AUTO left unresolved)."""
    defaults = submodule(kvikio, "defaults")
    if hasattr(defaults, "is_compat_mode_preferred"):
        return "compat" if defaults.is_compat_mode_preferred() else "gds"
    value = defaults.compat_mode()
    if isinstance(value, bool):
        return "compat" if value else "gds"
    return {"ON": "compat", "OFF": "gds"}.get(getattr(value, "name", ""), "auto (unresolved)")


def select_backend(
    paths: Sequence[str], workers: int, prefer: str = "auto", kvikio_threads: int = 0
) -> tuple[IOBackend, str]:
    """The backend to use and why; ``prefer`` is ``auto``, ``posix`` or ``kvikio``."""
    from flatcake.node_agent.datapath import gpu

    if prefer not in ("auto", "posix", "kvikio"):
        raise ValueError(f"io.backend: {prefer!r} must be 'auto', 'posix' or 'kvikio'")
    if prefer == "posix":
        return PosixDirectIO(paths, workers), "posix requested"
    usable, why = gpu.kvikio_usable()
    if usable:
        return KvikioIO(paths, workers, kvikio_threads), f"GPU and kvikio usable ({kvikio_threads} kvikio threads)"
    if prefer == "kvikio":
        raise ConfigError(f"io.backend: kvikio requested but not usable: {why}; use 'auto' or 'posix'")
    return PosixDirectIO(paths, workers), f"posix O_DIRECT ({why})"
