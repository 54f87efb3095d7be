"""Small engine configurations, page buffers and an I/O backend that injects faults."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from flatcake.node_agent import AgentConfig, DramConfig, EngineConfig, IOConfig, SsdConfig, aligned_empty
from flatcake.node_agent.datapath.io_backends import IOBackend

_names = itertools.count()


def small_config(tmp: Path, **kw: Any) -> EngineConfig:
    layers = kw.pop("layers", 4)
    page_bytes = kw.pop("page_bytes", 4096)
    ssd = dict(dir=str(tmp / "pool"), file_bytes=kw.pop("file_bytes", 256 * 1024), file_count=kw.pop("files", 8))
    ssd.update(kw.pop("ssd", {}))
    dram = dict(
        bytes=kw.pop("dram_bytes", 16 * layers * page_bytes),
        huge_pages=False,
        name=f"flatcake-test-{os.getpid()}-{next(_names)}",
        shm_dir=str(tmp),
    )
    tmp.mkdir(parents=True, exist_ok=True)
    io = dict(backend="posix", workers=2, staging_slot_bytes=kw.pop("slot_bytes", 64 * 1024))
    io.update(kw.pop("io", {}))
    agent = dict(socket=str(tmp / "agent.sock"), metrics_host="127.0.0.1", metrics_port=0)
    agent.update(kw.pop("agent", {}))
    return EngineConfig(
        layers=layers,
        page_bytes=page_bytes,
        ssd=SsdConfig(**ssd),
        dram=DramConfig(**dram),
        io=IOConfig(**io),
        agent=AgentConfig(**agent),
        **kw,
    )


def pages(layers: int, n: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    """A random, aligned ``[layers][n][page_bytes]`` buffer."""
    kv = aligned_empty((layers, n, page_bytes))
    kv[...] = np.random.default_rng(seed).integers(0, 256, size=kv.shape, dtype=np.uint8)
    return kv


class FaultyIO:
    """Wraps a real backend and injects faults: ``rule(kind, file, offset, length)`` returns ``None``
    (pass through), ``"eio"`` (raise EIO), ``"short"`` (return half the bytes) or ``"enospc"``."""

    def __init__(self, inner: IOBackend, rule: Callable[[str, int, int, int], str | None]) -> None:
        self.inner, self.rule = inner, rule
        self.name, self.workers = "faulty", inner.workers

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        fault = self.rule("read", file, offset, len(buf))
        if fault is None:
            return self.inner.submit_read(worker, file, offset, buf)
        fut: Future[int] = Future()
        if fault == "short":
            half = (len(buf) // 2) // 4096 * 4096
            got = self.inner.submit_read(worker, file, offset, buf[:half]).result() if half else 0
            fut.set_result(got)
        else:
            fut.set_exception(OSError(5, "Input/output error (injected)"))
        return fut

    def submit_write(self, worker: int, file: int, offset: int, bufs: Any) -> Future[int]:
        fault = self.rule("write", file, offset, sum(len(memoryview(b).cast("B")) for b in bufs))
        if fault is None:
            return self.inner.submit_write(worker, file, offset, bufs)
        fut: Future[int] = Future()
        fut.set_exception(OSError(28 if fault == "enospc" else 5, f"{fault} (injected)"))
        return fut

    def close(self) -> None:
        self.inner.close()


class FaultyReads:
    """Injects faults into an engine's host restores (its ``ReadQueue``): ``rule("read", file, offset,
    length)`` as for ``FaultyIO``. A context manager; the queue reads normally again afterwards."""

    def __init__(self, engine: Any, rule: Callable[[str, int, int, int], str | None]) -> None:
        self.queue, self.rule = engine.reads, rule
        self.inner = self.queue.readv

    def readv(self, file: int, offset: int, iovecs: list[memoryview]) -> int:
        length = sum(len(v) for v in iovecs)
        fault = self.rule("read", file, offset, length)
        if fault is None:
            return int(self.inner(file, offset, iovecs))
        if fault == "short":  # the first half (whole 4 KiB blocks) lands, then the file "ends"
            half, out = (length // 2) // 4096 * 4096, []
            for v in iovecs:
                if half <= 0:
                    break
                out.append(v[:half])
                half -= len(out[-1])
            return int(self.inner(file, offset, out)) if out else 0
        raise OSError(5, "Input/output error (injected)")

    def __enter__(self) -> FaultyReads:
        self.queue.readv = self.readv
        return self

    def __exit__(self, *exc: object) -> None:
        self.queue.readv = self.inner
