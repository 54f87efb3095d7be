"""The GPU side of the data path (cupy, kvikio), imported lazily: CPU code never loads CUDA.

kvikio imports on machines without a driver but fails on its first I/O (``libcuda.so.1`` missing),
so usability is decided by asking the CUDA runtime for a device, never by a successful import.
"""

from __future__ import annotations

import functools
import threading
from typing import Any


@functools.cache
def _probe() -> tuple[bool, str]:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return False, f"cupy not importable: {exc.__class__.__name__}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return False, f"no CUDA device: {exc.__class__.__name__}: {exc}"
    return (count > 0), f"{count} CUDA device(s)"


def available() -> bool:
    return _probe()[0]


def why() -> str:
    return _probe()[1]


def kvikio_usable() -> tuple[bool, str]:
    if not available():
        return False, why()
    try:
        import kvikio  # noqa: F401
    except Exception as exc:
        return False, f"kvikio not importable: {exc.__class__.__name__}"
    return True, "kvikio with a CUDA device"


# Host regions this process has pinned, by (address, bytes): a count of the pools holding each, so a region
# is registered once however many engines of the process map it there, and unregistered with the last.
_pinned: dict[tuple[int, int], int] = {}
_pin_lock = threading.Lock()


def host_register(view: Any, runtime: Any = None) -> None:
    """cudaHostRegister the whole host region once per process, so H2D copies from it are DMA, not staged.
    ``runtime`` is ``cupy.cuda.runtime`` unless a test passes a stand-in."""
    key = (int(view.ctypes.data), int(view.nbytes))
    with _pin_lock:
        if _pinned.get(key, 0) == 0:
            (runtime or _runtime()).hostRegister(key[0], key[1], 0)
        _pinned[key] = _pinned.get(key, 0) + 1


def host_unregister(view: Any, runtime: Any = None) -> None:
    """Release one hold on a pinned region; the last one cudaHostUnregisters it (before the unmap: an
    unmapped but registered region stays page-locked, and the driver may fault on the stale range)."""
    key = (int(view.ctypes.data), int(view.nbytes))
    with _pin_lock:
        held = _pinned.get(key, 0)
        if held == 0:
            return
        if held == 1:
            del _pinned[key]
            (runtime or _runtime()).hostUnregister(key[0])
        else:
            _pinned[key] = held - 1


def pinned_regions() -> dict[tuple[int, int], int]:
    with _pin_lock:
        return dict(_pinned)


def _runtime() -> Any:
    import cupy

    return cupy.cuda.runtime


def cuda_api() -> Any:
    """``cupy.cuda``: streams and events for ``restore.StreamOrder``."""
    import cupy

    return cupy.cuda


def device_empty(nbytes: int) -> Any:
    """Device memory for a staging window, in a cudaMalloc of its own rather than carved from cupy's pool:
    cuFile registers whole allocations (``kvikio.memory_register``), so a window must share one with
    nothing else, or a second window's registration would find its allocation registered already."""
    import cupy

    memory = cupy.cuda.Memory(nbytes)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))


def is_device_array(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def as_device_array(x: Any) -> Any:
    """A cupy view (no copy) of any object exposing ``__cuda_array_interface__``."""
    import cupy

    return cupy.asarray(x)


def to_host(x: Any) -> Any:
    """A host copy of device array ``x`` (a host array as it is): where a GPU restore's staging bytes are
    checked. The copy is synchronous on the current stream, after the read that filled ``x``."""
    if not is_device_array(x):
        return x
    import cupy

    return cupy.asnumpy(x)


def device_ptr(x: Any) -> int:
    """The device address of a cupy array's first byte."""
    return int(x.data.ptr)


def copy_rows_to_device(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: Any) -> None:
    """``rows`` rows of ``width`` bytes from host ``src`` (rows ``src_pitch`` apart: a DRAM page's layer among
    its other layers) to device ``dst`` (rows ``dst_pitch`` apart), as one ``cudaMemcpy2DAsync`` on ``stream``.
    From the pinned pool this is one DMA straight from the pool: no host gather, no pageable staging."""
    import cupy

    rt = cupy.cuda.runtime
    rt.memcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, rt.memcpyHostToDevice, stream.ptr)


_SCATTER_SRC = r"""
extern "C" __global__
void scatter_pages(const unsigned char* src, unsigned char* dst,
                   const long long* src_off, const long long* dst_off, const long long* length, int n) {
    // One block per piece; threads stride over its bytes in 16-byte words where aligned.
    int i = blockIdx.x;
    if (i >= n) return;
    const unsigned char* s = src + src_off[i];
    unsigned char* d = dst + dst_off[i];
    long long len = length[i];
    if ((((unsigned long long)s | (unsigned long long)d | len) & 15) == 0) {
        const uint4* s4 = (const uint4*)s; uint4* d4 = (uint4*)d;
        for (long long k = threadIdx.x; k < len / 16; k += blockDim.x) d4[k] = s4[k];
    } else {
        for (long long k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
    }
}
"""


@functools.cache
def _scatter_kernel() -> Any:
    import cupy

    return cupy.RawKernel(_SCATTER_SRC, "scatter_pages")


def scatter(src: Any, dst: Any, src_off: Any, dst_off: Any, length: Any) -> None:
    """Copy byte runs of the staging slot ``src`` into the paged KV buffer ``dst`` on the GPU."""
    import cupy

    n = len(src_off)
    if n == 0:
        return
    args = [cupy.asarray(a, dtype=cupy.int64) for a in (src_off, dst_off, length)]
    _scatter_kernel()((n,), (256,), (src, dst, *args, cupy.int32(n)))
