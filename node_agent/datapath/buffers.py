"""Aligned host buffers. ``O_DIRECT`` and libcufile DMA need 4 KiB-aligned addresses and lengths."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from flatcake.node_agent.constants import ALIGN


def aligned_empty(shape: int | tuple[int, ...], align: int = ALIGN) -> npt.NDArray[np.uint8]:
    """An uninitialised uint8 array whose first byte is ``align``-aligned."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) if dims else 1
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skew = (-raw.ctypes.data) % align
    return raw[skew : skew + nbytes].reshape(dims)


def is_aligned(array: npt.NDArray[np.generic], align: int = ALIGN) -> bool:
    return array.ctypes.data % align == 0


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class ThreadBuffers:
    """One aligned, pre-faulted buffer per thread, grown on demand and reused: a restore destination that
    costs no page faults after the first use (a serving engine's host pool is allocated once, too). A
    view is valid until the same thread asks again."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, shape: tuple[int, ...]) -> npt.NDArray[np.uint8]:
        """This thread's buffer, as an aligned uint8 array of ``shape`` (grown when too small, reused otherwise)."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        buf: npt.NDArray[np.uint8] | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = aligned_empty(max(nbytes, 2 * len(buf) if buf is not None else 0))
            buf.fill(0)  # touch every page now, not inside a timed restore
            self._local.buf = buf
        return buf[:nbytes].reshape(shape)
