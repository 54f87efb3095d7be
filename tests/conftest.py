from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from flatcake.node_agent.buffers import aligned_empty
from flatcake.node_agent.config import AgentConfig, DramConfig, EngineConfig, IOConfig, SsdConfig
from flatcake.node_agent.engine import Engine
from flatcake.node_agent.io_backends import IOBackend

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


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(backend: IOBackend | None = None, sub: str = "", **kw: Any) -> Engine:
        engine = Engine(small_config(tmp_path / sub if sub else tmp_path, **kw), io=backend)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


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


class AgentThread:
    """A real agent serving its socket from a thread of the test process."""

    def __init__(self, config: EngineConfig) -> None:
        import asyncio
        import threading

        from flatcake.node_agent.agent import Agent

        self.config = config
        self.agent = Agent(config)
        self.port = self.agent.start_http()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self.agent.serve(self._stop),))
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.agent.ready:
            assert time.monotonic() < deadline, "agent did not become ready"
            time.sleep(0.01)

    @property
    def socket(self) -> str:
        return self.config.agent.socket

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()
        self.agent.close()


@pytest.fixture
def agent_thread(tmp_path: Path) -> Iterator[Callable[..., AgentThread]]:
    made: list[AgentThread] = []

    def start(**kw: Any) -> AgentThread:
        a = AgentThread(small_config(tmp_path / "node", **kw))
        made.append(a)
        return a

    yield start
    for a in made:
        a.stop()


class Server:
    """The emulator app served on a loopback port from a background thread."""

    def __init__(self, cfg: Any) -> None:
        from flatcake.loadgen.emulator import make_app

        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(make_app(cfg))
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
