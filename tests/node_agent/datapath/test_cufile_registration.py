"""cuFile registration of the GPU path's staging windows, on the CPU: the engine's real GPU restore code runs
with a stand-in kvikio module (``CuFile`` reads the pool files with ``pread``; ``memory_register`` and
``memory_deregister`` are logged next to every read) and host memory standing in for the device (the
``gpu`` module's device allocation, kernel, stream and copies are patched to numpy). Nothing here runs on a
GPU or calls cuFile: the claim is the order of calls, not what the driver does with them. The DRAM pages'
copies to the device are checked the same way: ``copy_rows_to_device`` (``cudaMemcpy2DAsync``) is done with
``memmove`` on host memory, so the address arithmetic is what is tested."""

from __future__ import annotations

import ctypes
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flatcake.node_agent.datapath import gpu
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.datapath.io_backends import KvikioIO
from flatcake.node_agent.policy.placement import Hints
from tests.node_agent.datapath.test_stream_order import FakeCuda
from tests.support.engines import pages, small_config

pytestmark = pytest.mark.unit


def fake_kvikio(log: list[tuple[str, int]], compat: bool, old_api: bool = False) -> types.ModuleType:
    """kvikio as the engine uses it: ``CuFile``, ``defaults``, and the buffer (de)registration, either at
    the top level (26.06+) or in ``kvikio.buffer`` (before)."""
    mod = types.ModuleType("fake_kvikio")

    class CuFile:
        def __init__(self, path: str, flags: str = "r") -> None:
            self.fd = os.open(path, os.O_RDWR)

        def read(self, buf: np.ndarray, size: int, offset: int) -> int:
            log.append(("read", buf.ctypes.data))
            data = os.pread(self.fd, size, offset)
            buf.reshape(-1)[: len(data)] = np.frombuffer(data, np.uint8)
            return len(data)

        def write(self, buf: np.ndarray, size: int, offset: int) -> int:
            raise AssertionError("host pages are written through O_DIRECT, never kvikio")

        def close(self) -> None:
            log.append(("close_file", self.fd))
            os.close(self.fd)

    def register(buf: np.ndarray) -> None:
        log.append(("register", buf.ctypes.data))

    def deregister(buf: np.ndarray) -> None:
        log.append(("deregister", buf.ctypes.data))

    mod.CuFile = CuFile  # type: ignore[attr-defined]
    mod.defaults = types.SimpleNamespace(  # type: ignore[attr-defined]
        set=lambda name, value: None, is_compat_mode_preferred=lambda: compat
    )
    if old_api:
        buffer = types.ModuleType("fake_kvikio.buffer")
        buffer.memory_register, buffer.memory_deregister = register, deregister  # type: ignore[attr-defined]
        sys.modules["fake_kvikio.buffer"] = buffer
    else:
        mod.memory_register, mod.memory_deregister = register, deregister  # type: ignore[attr-defined]
    return mod


class DeviceArray:
    """Host memory posing as device memory: what ``Engine.get`` reads of a destination, nothing more."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.host = np.zeros(shape, np.uint8)
        self.dtype, self.ndim, self.shape, self.flags = self.host.dtype, 3, shape, self.host.flags

    def reshape(self, *shape: int) -> np.ndarray:
        return self.host.reshape(*shape)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.host[index] = value


@pytest.fixture
def on_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(gpu, "is_device_array", lambda x: isinstance(x, DeviceArray))
    monkeypatch.setattr(gpu, "cuda_api", lambda: cuda)
    monkeypatch.setattr(gpu, "device_empty", aligned_empty)
    monkeypatch.setattr(gpu, "device_ptr", lambda x: x.host.ctypes.data)

    def copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: Any) -> None:
        assert isinstance(stream, cuda.Stream), "a DRAM copy must run on the restore's stream"
        cuda.log.append(("h2d_rows", rows))
        for r in range(rows):  # what cudaMemcpy2DAsync does, on host memory
            ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)

    monkeypatch.setattr(gpu, "copy_rows_to_device", copy_rows)

    def scatter(src: np.ndarray, dst: np.ndarray, src_off: Any, dst_off: Any, length: Any) -> None:
        for s, d, n in zip(src_off.tolist(), dst_off.tolist(), length.tolist(), strict=True):
            dst[d : d + n] = src[s : s + n]

    monkeypatch.setattr(gpu, "scatter", scatter)
    return cuda


def _engine(tmp_path: Path, kvikio: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    config = small_config(tmp_path, io={"staging_layers": 2}, slot_bytes=2 * 4096, dram_bytes=0)
    pool = create_pool(config.ssd.dir, config.ssd.file_count, config.ssd.file_bytes)
    io = KvikioIO([str(Path(config.ssd.dir) / f) for f in pool.files], config.io.workers, 4)
    return Engine(config, io=io)


def _restore_twice(engine: Engine) -> np.ndarray:
    kv = pages(4, 6, 4096, seed=9)
    engine.put([f"k{i}" for i in range(6)], kv, Hints(turn=1))
    for _ in range(2):  # the second restore reuses the registered window: no second registration
        dest = DeviceArray((4, 6, 4096))
        with engine.get([f"k{i}" for i in range(6)], dest) as restore:
            assert restore.run() == set()
        assert np.array_equal(dest.host, kv)
    return kv


@pytest.mark.parametrize("old_api", [False, True], ids=["kvikio-26", "kvikio-25"])
def test_gds_registers_the_window_before_its_first_read_and_deregisters_after_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_fake_gpu: FakeCuda, old_api: bool
) -> None:
    log: list[tuple[str, int]] = []
    engine = _engine(tmp_path, fake_kvikio(log, compat=False, old_api=old_api), monkeypatch)
    assert engine.io.mode == "gds"  # type: ignore[attr-defined]
    _restore_twice(engine)
    engine.close()
    ops = [op for op, _ in log]
    assert ops.count("register") == ops.count("deregister") == 1  # one window, registered once
    window = log[ops.index("register")][1]
    reads = [i for i, (op, _) in enumerate(log) if op == "read"]
    assert len(reads) > 2 and all(ops.index("register") < i < ops.index("deregister") for i in reads)
    # Every read lands inside the registered window (its two slots), none elsewhere.
    assert all(0 <= log[i][1] - window < 2 * 2 * 4096 for i in reads)
    assert log[ops.index("deregister")][1] == window
    # Deregistered before the files close and after the I/O threads stopped (engine.close order).
    assert ops.index("deregister") < ops.index("close_file")


def test_compat_mode_registers_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_fake_gpu: FakeCuda) -> None:
    log: list[tuple[str, int]] = []
    engine = _engine(tmp_path, fake_kvikio(log, compat=True), monkeypatch)
    assert engine.io.mode == "compat"  # type: ignore[attr-defined]
    _restore_twice(engine)
    engine.close()
    ops = [op for op, _ in log]
    assert "read" in ops and "register" not in ops and "deregister" not in ops


def test_a_failed_registration_fails_the_restore_and_frees_the_window_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_fake_gpu: FakeCuda
) -> None:
    log: list[tuple[str, int]] = []
    kvikio = fake_kvikio(log, compat=False)

    def refuse(buf: np.ndarray) -> None:
        raise RuntimeError("cuFileBufRegister failed")

    kvikio.memory_register = refuse  # type: ignore[attr-defined]
    engine = _engine(tmp_path, kvikio, monkeypatch)
    engine.put(["a"], pages(4, 1, 4096), Hints(turn=1))
    for _ in range(engine.config.io.streams + 1):  # never leaks a window: no wait for one that never came
        with pytest.raises(RuntimeError, match="cuFileBufRegister"):
            engine.get(["a"], DeviceArray((4, 1, 4096))).run()
    engine.close()
    assert [op for op, _ in log].count("read") == 0


def test_dram_pages_reach_the_device_as_one_2d_copy_per_run_and_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_fake_gpu: FakeCuda
) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", fake_kvikio([], compat=True))
    config = small_config(tmp_path, dram_bytes=16 * 4 * 4096)
    pool = create_pool(config.ssd.dir, config.ssd.file_count, config.ssd.file_bytes)
    engine = Engine(config, io=KvikioIO([str(Path(config.ssd.dir) / f) for f in pool.files], 2, 4))
    kv = pages(4, 6, 4096, seed=5)
    assert engine.put([f"d{i}" for i in range(6)], kv, Hints(prefix_refcount=2)).medium is not None
    dest = DeviceArray((4, 9, 4096))
    # Pool slots 0..5 in order; destination pages 2,3,4 then 8, then 0,1: three runs in both.
    with engine.get([f"d{i}" for i in range(6)], dest, [2, 3, 4, 8, 0, 1]) as restore:
        assert restore.run() == set()
    assert engine.stats.get("restore_pages_dram") == 6
    for i, page in enumerate([2, 3, 4, 8, 0, 1]):
        assert np.array_equal(dest.host[:, page], kv[:, i]), page
    assert not dest.host[:, [5, 6, 7]].any()
    copies = [n for op, n in on_fake_gpu.log if op == "h2d_rows"]
    assert copies == [3, 1, 2] * 4  # per layer, one copy per run
    engine.close()
