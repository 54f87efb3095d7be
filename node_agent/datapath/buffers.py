"""Aligned host buffers. ``O_DIRECT`` and libcufile DMA need 4 KiB-aligned addresses and lengths."""

from __future__ import annotations

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
