"""Which path a restore takes is decided per call from its destination, not from the I/O backend's
name (issue 15: a numpy destination on a kvikio node was a TypeError, answered as a miss). No GPU
here: kvikio is a stand-in that must never see a host buffer; nothing GPU-only is claimed tested."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from flatcake.errors import ConfigError
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.gpu import available
from tests.support.engines import pages, small_config

pytestmark = pytest.mark.unit
Make = Callable[..., Engine]


class KvikioStandIn:
    """Named like the GPU backend; any I/O through it fails the test (host data must go elsewhere)."""

    name, workers = "kvikio", 2

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        raise AssertionError(f"a host buffer ({type(buf).__name__}) was handed to the GPU backend")

    def submit_write(self, worker: int, file: int, offset: int, bufs: Sequence[Any]) -> Future[int]:
        raise AssertionError("host pages were written through the GPU backend")

    def close(self) -> None:
        pass


class DeviceArrayStandIn:
    """Device memory as SGLang or torch would hand it: only ``__cuda_array_interface__``."""

    __cuda_array_interface__: ClassVar[dict[str, Any]] = {
        "shape": (4, 2, 4096),
        "typestr": "|u1",
        "data": (0, False),
        "version": 3,
    }


def test_numpy_destinations_take_the_host_path_on_a_kvikio_engine(make_engine: Make) -> None:
    engine = make_engine(KvikioStandIn())
    kv = pages(4, 6, 4096, seed=3)
    keys = [f"k{i}" for i in range(6)]
    engine.put(keys[:3], _aligned(kv[:, :3]))
    engine.put(keys[3:], _aligned(kv[:, 3:]))
    dest = np.zeros((4, 6, 4096), np.uint8)
    with engine.get(keys, dest) as restore:
        assert not restore.run()
    assert np.array_equal(dest, kv)
    assert engine.host_io is not engine.io and engine.host_io.name == "posix"


def _aligned(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape)
    out[...] = a
    return out


@pytest.mark.skipif(available(), reason="a GPU is usable here: auto picks kvikio")
def test_auto_without_a_gpu_restores_into_numpy(make_engine: Make) -> None:
    engine = make_engine(io={"backend": "auto"})
    assert engine.io.name == "posix" and not engine.gpu_io
    kv = pages(4, 2, 4096, seed=4)
    engine.put(["a", "b"], kv)
    dest = np.zeros_like(kv)
    with engine.get(["a", "b"], dest) as restore:
        restore.run()
    assert np.array_equal(dest, kv)


@pytest.mark.skipif(available(), reason="a GPU is usable here: kvikio is")
def test_kvikio_configured_but_unusable_is_a_config_error(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"io\.backend: kvikio requested but not usable"):
        Engine(small_config(tmp_path, io={"backend": "kvikio"}))


def test_a_device_destination_without_kvikio_is_refused_by_name(make_engine: Make) -> None:
    engine = make_engine()
    engine.put(["a"], pages(4, 1, 4096))
    with pytest.raises(TypeError, match=r"dest: a device array .*io\.backend to kvikio"):
        engine.get(["a"], DeviceArrayStandIn())


def test_a_cpu_tensor_destination_names_the_fix(make_engine: Make) -> None:
    engine = make_engine()
    engine.put(["a"], pages(4, 1, 4096))
    with pytest.raises(TypeError, match=r"tensor\.numpy\(\)"):
        engine.get(["a"], torch.zeros((4, 1, 4096), dtype=torch.uint8))
