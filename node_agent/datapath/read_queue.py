"""One work-conserving read queue per process, served by a pool of threads (``preadv`` releases the GIL).

Every restore into host memory opens a ``Stream`` and hands it all its commands at once. Threads take
commands from the streams in turn (round-robin), and a stream never has more than ``cap_bytes`` in
flight while another stream waits, so two concurrent restores share the device and neither starves;
a restore alone has every thread. Each thread keeps its own scratch buffers (bridged holes, staged
reads), so staging memory is bounded by the thread count, not by the number of restores.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.file_pool import open_direct

log = logging.getLogger(__name__)

IOV_MAX = 1024
Preadv = Callable[[int, Sequence[Any], int], int]


class Worker:
    """What a command sees of the thread running it: the pool files and its scratch buffers."""

    def __init__(self, queue: ReadQueue) -> None:
        self.queue = queue
        self._scratch = aligned_empty(0)
        self._sink = aligned_empty(0)

    @property
    def held(self) -> int:
        return len(self._scratch) + len(self._sink)

    def scratch(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """This thread's staging buffer, at least ``nbytes`` (a command's bytes land here when the
        destination cannot take them directly)."""
        if len(self._scratch) < nbytes:
            self._scratch = aligned_empty(nbytes)
        return self._scratch[:nbytes]

    def sink(self, nbytes: int) -> memoryview:
        """Where bridged holes are read to (never looked at; every hole may share it)."""
        if len(self._sink) < nbytes:
            self._sink = aligned_empty(max(nbytes, 64 * 1024))
        return self._sink[:nbytes].data

    def read(self, file: int, offset: int, iovecs: list[memoryview]) -> int:
        """``preadv`` of ``iovecs`` (any number) at ``offset`` of pool file ``file``; returns the bytes
        read, fewer only at the end of the file. An I/O error raises ``OSError``."""
        return self.queue.readv(file, offset, iovecs)


class Stream:
    """One restore's commands in the queue."""

    def __init__(self, queue: ReadQueue, cap_bytes: int) -> None:
        self._queue = queue
        self.cap_bytes = cap_bytes
        self.pending: deque[tuple[int, Callable[[Worker], None]]] = deque()
        self.inflight_bytes = 0
        self.inflight = 0

    def submit(self, nbytes: int, job: Callable[[Worker], None]) -> None:
        """Queue ``job`` (a command of ``nbytes``); it runs in an I/O thread and must not raise."""
        self._queue._submit(self, nbytes, job)

    def cancel(self) -> int:
        """Drop the commands not yet started; returns how many were dropped."""
        return self._queue._cancel(self)

    def wait_idle(self) -> None:
        """Until no command of this stream is running (a read may still land in the destination until then)."""
        self._queue._wait_idle(self)


class ReadQueue:
    def __init__(self, paths: Sequence[str], threads: int, preadv: Preadv = os.preadv) -> None:
        if threads < 1:
            raise ValueError(f"io.read_threads: {threads} must be >= 1")
        self.paths = list(paths)
        self.threads = threads
        self.preadv = preadv
        self._fds: dict[int, int] = {}  # positional reads share one descriptor per file across threads
        self._cond = threading.Condition()
        self._active: deque[Stream] = deque()  # streams with pending commands, in serving order
        self._closed = False
        self._serving: list[Worker] = []
        self._workers = [
            threading.Thread(target=self._serve, name=f"flatcake-read-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._workers:
            t.start()

    def stream(self, cap_bytes: int) -> Stream:
        return Stream(self, cap_bytes)

    @property
    def scratch_bytes(self) -> int:
        """Host memory the threads hold for staged reads and bridged holes (bounded by threads x command)."""
        return sum(w.held for w in list(self._serving))

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._cond:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = open_direct(self.paths[file])
        return fd

    def readv(self, file: int, offset: int, iovecs: list[memoryview]) -> int:
        fd, done, at = self._fd(file), 0, 0
        while at < len(iovecs):
            batch = iovecs[at : at + IOV_MAX]
            want = sum(len(v) for v in batch)
            n = self.preadv(fd, batch, offset + done)
            done += n
            if n == want:
                at += len(batch)
                continue
            if n == 0:
                break  # end of file: a short read, reported by the count
            # A partial read (a signal, a split command): go on from the byte where it stopped.
            rest, k = n, at
            while rest >= len(iovecs[k]):
                rest -= len(iovecs[k])
                k += 1
            iovecs = [iovecs[k][rest:], *iovecs[k + 1 :]]
            at = 0
        return done

    # ---- scheduling ------------------------------------------------------------------------------
    def _submit(self, s: Stream, nbytes: int, job: Callable[[Worker], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("read queue closed")
            s.pending.append((nbytes, job))
            if len(s.pending) == 1 and s not in self._active:
                self._active.append(s)
            self._cond.notify()

    def _cancel(self, s: Stream) -> int:
        with self._cond:
            n = len(s.pending)
            s.pending.clear()
            if s in self._active:
                self._active.remove(s)
            return n

    def _wait_idle(self, s: Stream) -> None:
        with self._cond:
            self._cond.wait_for(lambda: s.inflight == 0)

    def _next(self) -> tuple[Stream, int, Callable[[Worker], None]] | None:
        """The next command, round-robin over streams; a stream at its cap waits unless it has nothing
        in flight (a command larger than the cap still runs, alone)."""
        for _ in range(len(self._active)):
            s = self._active[0]
            self._active.rotate(-1)
            nbytes, job = s.pending[0]
            if s.inflight and s.inflight_bytes + nbytes > s.cap_bytes:
                continue
            s.pending.popleft()
            if not s.pending:
                self._active.remove(s)
            s.inflight += 1
            s.inflight_bytes += nbytes
            return s, nbytes, job
        return None

    def _serve(self) -> None:
        worker = Worker(self)
        with self._cond:
            self._serving.append(worker)
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    picked = self._next()
                    if picked is not None:
                        break
                    self._cond.wait()
            s, nbytes, job = picked
            try:
                job(worker)
            except BaseException:  # a job reports its own failures; this is a bug, never a lost thread
                log.exception("read command failed unexpectedly")
            finally:
                with self._cond:
                    s.inflight -= 1
                    s.inflight_bytes -= nbytes
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for s in self._active:
                s.pending.clear()
            self._active.clear()
            self._cond.notify_all()
        for t in self._workers:
            t.join()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
