"""A connector's transfers off the engine's step: loads streamed layer by layer under the forward, loads a
request waits for outside the step, and saves stored after it. No engine import (tested without a server);
shared by the vLLM connector (``vllm/connector.py``) and the SGLang linker (``sglang/linker.py``), which
pass their own logger (an engine prints only its own logger tree) and thread names. The terms below are
vLLM's; the SGLang linker's are in its module doc.

- ``LayerLoads``: one step's loads, restored on a thread while the forward runs; ``wait(layer)`` (vLLM's
  ``wait_for_layer_load``, called by each attention layer) returns once that layer's bytes of every load
  have landed, so layer ``l + 1`` is read while layer ``l`` computes (FC-CIO's window, in vLLM's terms).
- ``AsyncLoads``: loads of requests vLLM parks until they finish (``WAITING_FOR_REMOTE_KVS``), one thread,
  in order; finished requests are collected for ``get_finished``.
- ``SaveQueue``: saves stored on one thread, in order, after the step. A save is queued as a reference to
  vLLM's blocks; the thread copies them out (``gather``) and stores the copy. A request's blocks stay
  vLLM's until it finishes or is preempted; then vLLM may hand them to another request, whose next
  forward writes them. ``release(req_ids)`` (called before that forward: vLLM's ``handle_preemptions``)
  copies out, on the caller, whatever of those requests the thread has not yet, so the step waits only
  for that. At most ``max_bytes`` of blocks wait; a save beyond that waits for room (the step stalls, and
  says so). A save whose agent went away is retried until it answers again (a restarted agent), for at
  most ``retry_s``; then it is dropped: a miss later, never a wrong page.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from flatcake.errors import FlatCakeError

log = logging.getLogger(__name__)  # the default; each connector passes a logger under its engine's tree

# What a storage call may meet in normal operation: a miss (vLLM computes), never an engine crash.
STORAGE_FAULTS = (FlatCakeError, ConnectionError, TimeoutError, OSError)


class Restore(Protocol):
    """What ``Engine.get`` returns: yields each layer once its bytes landed; ``missing`` page indexes."""

    missing: set[int]

    def __iter__(self) -> Iterator[int]: ...
    def __enter__(self) -> Restore: ...
    def __exit__(self, *exc: object) -> None: ...


class LayerLoads:
    """One step's synchronous loads as one restore, run on a thread from ``start_load_kv`` on. ``open``
    starts the restore; ``on_layer(layer)``, if given, runs as each layer lands (the copying path moves
    it into vLLM's blocks there); ``on_end(missing, failed)``, if given, runs on the thread once the restore
    ended, before ``wait`` returns for the layers it never yielded (the SGLang linker releases its forward's
    last layer there, once ``missing`` is final). ``pages`` is how many pages the restore holds."""

    def __init__(self, open_restore: Callable[[], Restore], layers: int, pages: int,
                 on_layer: Callable[[int], None] | None = None,
                 on_end: Callable[[set[int], BaseException | None], None] | None = None, *,
                 logger: logging.Logger = log, name: str = "flatcake-layers") -> None:  # fmt: skip
        self.layers, self.pages = layers, pages
        self._open, self._on_layer, self._on_end, self._log = open_restore, on_layer, on_end, logger
        self._landed = -1  # the last layer whose bytes are in place (layers land in order)
        self._cond = threading.Condition()
        self.missing: set[int] = set()
        self.failed: BaseException | None = None
        self.landed_at: list[float] = []  # monotonic time each layer landed (tests, the stall report)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._open() as restore:
                for layer in restore:
                    if self._on_layer is not None:
                        self._on_layer(layer)
                    with self._cond:
                        self.landed_at.append(time.monotonic())
                        self._landed = layer
                        self._cond.notify_all()
                self.missing = set(restore.missing)
        except Exception as exc:  # never leave the forward waiting: every page is a miss
            self.failed = exc
            self.missing = set(range(self.pages))
            if not isinstance(exc, STORAGE_FAULTS):
                self._log.exception("FlatCake connector: a layer-wise load failed unexpectedly")
        finally:
            if self._on_end is not None:
                try:
                    self._on_end(self.missing, self.failed)
                except Exception:  # the waiters below are released whatever the hook did
                    self._log.exception("FlatCake connector: ending a layer-wise load failed")
            with self._cond:
                self._landed = self.layers
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Return once ``layer``'s bytes landed (or the restore ended: its misses are reported after)."""
        with self._cond:
            while self._landed < layer:
                self._cond.wait()

    def join(self) -> set[int]:
        """Wait for the restore to end; the page indexes that did not arrive (all of them if it failed)."""
        self._thread.join()
        return self.missing


class _InOrder:
    """Jobs run in order on one daemon thread, started with the first job. A job stays queued while it runs
    (``drain`` waits for it); ``_do`` runs one, ``_done`` records its result, under ``_cond``."""

    def __init__(self, name: str, logger: logging.Logger = log) -> None:
        self._name, self._log = name, logger
        self._cond = threading.Condition()
        self._jobs: deque[Any] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _queue(self, job: Any) -> None:
        """Append ``job`` (the caller holds ``_cond``)."""
        self._jobs.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            result = self._do(job)
            with self._cond:
                self._jobs.popleft()
                self._done(job, result)
                self._cond.notify_all()

    def _do(self, job: Any) -> Any:
        raise NotImplementedError

    def _done(self, job: Any, result: Any) -> None:
        raise NotImplementedError

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job ended; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 60.0) -> None:
        """Run what is queued (for at most ``timeout``), then end the thread."""
        self.drain(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._thread.join(timeout)


class AsyncLoads(_InOrder):
    """Loads of parked requests, run in order on one thread; ``done()`` gives the requests that finished
    since the last call, each with the page indexes it lacks."""

    def __init__(self, *, logger: logging.Logger = log, name: str = "flatcake-loads") -> None:
        super().__init__(name, logger)
        self._finished: list[tuple[str, set[int]]] = []

    def submit(self, req_id: str, pages: int, load: Callable[[], set[int]]) -> None:
        """Run ``load`` (returns the missing page indexes of ``pages``) for ``req_id``, after those before it."""
        with self._cond:
            self._queue((req_id, pages, load))

    def _do(self, job: tuple[str, int, Callable[[], set[int]]]) -> set[int]:
        req_id, pages, load = job
        try:
            return load()
        except Exception as exc:  # a failed load is a miss: vLLM recomputes
            if not isinstance(exc, STORAGE_FAULTS):
                self._log.exception("FlatCake connector: an asynchronous load failed unexpectedly")
            else:
                self._log.warning("FlatCake connector: load of %d blocks for %s failed: %s", pages, req_id, exc)
            return set(range(pages))

    def _done(self, job: tuple[str, int, Callable[[], set[int]]], result: set[int]) -> None:
        self._finished.append((job[0], result))

    def done(self) -> list[tuple[str, set[int]]]:
        with self._cond:
            done, self._finished = self._finished, []
            return done


@dataclass(eq=False)
class SaveJob:
    """One step's save of one request's blocks: ``gather()`` copies them out of vLLM's buffer (once: on the
    save thread, or on the step by ``release``); ``data`` is that copy, what ``store`` is given."""

    req_id: str
    nbytes: int
    gather: Callable[[], Any]
    pages: int = 0
    data: Any = None
    gathering: bool = False  # the save thread is copying it now (``release`` waits for that)
    failed: bool = False


class SaveQueue(_InOrder):
    """Saves stored off the step, in order, on one thread (module doc). ``store(data)`` stores a job's copy:
    it raises what the agent raised; a ``ConnectionError`` is retried for ``retry_s``."""

    def __init__(self, store: Callable[[Any], None], max_bytes: int, retry_s: float = 30.0, *,
                 logger: logging.Logger = log, name: str = "flatcake-saves") -> None:  # fmt: skip
        super().__init__(name, logger)
        self._store, self.max_bytes, self.retry_s = store, max_bytes, retry_s
        self.pending_bytes = 0
        self.stored = self.dropped = 0  # jobs
        self.gathered_on_release = 0  # jobs the step had to copy out itself (their blocks were released)

    def submit(self, job: SaveJob) -> float:
        """Queue ``job``; the seconds spent waiting for room (a stall)."""
        started = time.monotonic()
        with self._cond:
            # One job larger than the bound still goes, alone: waiting for room it can never have would hang.
            while self.pending_bytes and self.pending_bytes + job.nbytes > self.max_bytes:
                self._cond.wait()
            self.pending_bytes += job.nbytes
            self._queue(job)
        return time.monotonic() - started

    def release(self, req_ids: Collection[str]) -> tuple[float, int]:
        """vLLM is about to reuse the blocks of ``req_ids`` (finished, preempted): copy out every queued job of
        theirs the thread has not copied yet, waiting for one it is copying now; the seconds it took and the
        pages it copied."""
        started = time.monotonic()
        pages = 0
        if not req_ids:
            return 0.0, 0
        with self._cond:
            for job in list(self._jobs):
                if job.req_id not in req_ids:
                    continue
                while job.gathering:
                    self._cond.wait()
                if job.data is None and not job.failed:
                    self._gather(job)  # under the lock: the thread, if it reaches this job, finds it copied
                    self.gathered_on_release += 1
                    pages += job.pages
        return time.monotonic() - started, pages

    def _gather(self, job: SaveJob) -> None:
        try:
            job.data = job.gather()
        except Exception:  # a save that cannot be copied is a miss later, never a crash of the step
            self._log.exception("FlatCake connector: copying a save's blocks failed")
            job.failed = True

    def _done(self, job: SaveJob, ok: bool) -> None:
        self.pending_bytes -= job.nbytes
        if ok:
            self.stored += 1
        else:
            self.dropped += 1

    def _do(self, job: SaveJob) -> bool:
        """Copy the job's blocks out (unless ``release`` did), then store them, retrying while the agent is
        away; whether it was stored."""
        with self._cond:
            mine = job.data is None and not job.failed
            job.gathering = mine
        if mine:
            self._gather(job)
            with self._cond:
                job.gathering = False
                self._cond.notify_all()
        if job.failed:
            return False
        deadline = time.monotonic() + self.retry_s
        pause = 0.05
        while True:
            try:
                self._store(job.data)
                return True
            except ConnectionError as exc:  # the agent went away: a restarted one takes the save
                if time.monotonic() + pause > deadline or self._stopping:
                    self._log.warning("FlatCake connector: a save was dropped, the agent did not come back: %s", exc)
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
            except Exception as exc:  # a save that fails is a miss later, never a crash
                if not isinstance(exc, STORAGE_FAULTS):
                    self._log.exception("FlatCake connector: a save failed unexpectedly")
                else:
                    self._log.warning("FlatCake connector: a save failed: %s", exc)
                return False
