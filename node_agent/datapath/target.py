"""A restore destination laid out the way its owner wants: pages written in place, with no staging copy.

The engine's own destination is ``[layers][slots][page_bytes]``. A caller whose memory has another
layout (SGLang's host KV pool: ``layer_first``, ``page_first``, ``page_first_direct``) would have to
restore into such a buffer and copy again. A ``PagedTarget`` instead describes where each stored
page-layer goes in the caller's memory, and the restore's scatter writes there straight from the
staging slot (SSD pages) or the DRAM pool (DRAM pages): one copy per byte, as for the engine's own
destination.

A stored page-layer is ``raw_bytes = len(piece_offsets) * piece_bytes`` bytes (then padding up to
``page_bytes``, never written). Piece ``k`` of destination page ``p``'s layer ``l`` is the bytes
``page_offsets[p] + l * layer_stride + piece_offsets[k]`` .. ``+ piece_bytes`` of ``memory``. With
``limits``, destination page ``p`` owns only the ``limits[p]`` bytes from ``page_offsets[p]``: bytes a
page-layer would put past them are dropped (a flat sidecar page cut into chunks of the pool's geometry
ends inside its last chunk, and what follows it belongs to the next page).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]


class PagedTarget:
    """Destination pages ``0..len(page_offsets)-1`` in ``memory`` (1-D uint8, host)."""

    def __init__(
        self,
        memory: npt.NDArray[np.uint8],
        layers: int,
        page_offsets: Sequence[int] | Ints,
        layer_stride: int,
        piece_offsets: Sequence[int] | Ints,
        piece_bytes: int,
        limits: Sequence[int] | Ints | None = None,
    ) -> None:
        if not isinstance(memory, np.ndarray) or memory.dtype != np.uint8 or memory.ndim != 1:
            raise TypeError("memory: expected a 1-D uint8 numpy array over the destination's buffer")
        if not memory.flags.c_contiguous or not memory.flags.writeable:
            raise ValueError("memory: must be writeable and contiguous")
        self.memory = memory
        self.layers = int(layers)
        self.page_offsets = np.asarray(page_offsets, dtype=np.int64)
        self.layer_stride = int(layer_stride)
        self.piece_offsets = np.asarray(piece_offsets, dtype=np.int64)
        self.piece_bytes = int(piece_bytes)
        if self.layers < 1 or self.piece_bytes < 1 or len(self.piece_offsets) < 1:
            raise ValueError("layers, piece_bytes and piece_offsets must be positive and non-empty")
        self.raw_bytes = len(self.piece_offsets) * self.piece_bytes
        self.limits = None if limits is None else np.asarray(limits, dtype=np.int64)
        if self.limits is not None:
            if len(self.limits) != len(self.page_offsets) or (self.limits <= 0).any():
                raise ValueError("limits: one positive byte count per destination page")
            if self.layer_stride < 0 or (self.piece_offsets < 0).any():
                raise ValueError("limits: only for layouts that grow upward (layer_stride, piece_offsets >= 0)")
        if len(self.page_offsets):
            span = (self.layers - 1) * self.layer_stride
            lo = int(self.page_offsets.min()) + min(0, span) + int(self.piece_offsets.min())
            ends = self.page_offsets + max(0, span) + int(self.piece_offsets.max()) + self.piece_bytes
            if self.limits is not None:
                ends = np.minimum(ends, self.page_offsets + self.limits)
            hi = int(ends.max())
            if lo < 0 or hi > memory.nbytes:
                raise ValueError(f"page_offsets: pages reach bytes {lo}..{hi} outside memory (0..{memory.nbytes})")
        # Rows of ``unit`` bytes: every piece starts on a row and spans whole rows, so a layer of many pages is
        # one numpy row gather (numpy copies a contiguous row per index; a void dtype per piece is ~60x slower).
        unit = math.gcd(self.piece_bytes, abs(self.layer_stride), *map(int, self.piece_offsets))
        if len(self.page_offsets):
            unit = math.gcd(unit, int(np.gcd.reduce(self.page_offsets)))
            if self.limits is not None:
                unit = math.gcd(unit, int(np.gcd.reduce(self.limits)))
        self.unit = unit
        self._rows = memory[: memory.nbytes // unit * unit].reshape(-1, unit)
        per_piece = np.arange(self.piece_bytes // unit, dtype=np.int64)
        self._piece_rows = (self.piece_offsets[:, None] // unit + per_piece[None, :]).reshape(-1)
        self._page_rows = self.page_offsets // unit
        self._end_rows = None if self.limits is None else self._page_rows + self.limits // unit

    @property
    def slots(self) -> int:
        return len(self.page_offsets)

    def write(self, layer: int, pages: Ints, rows: npt.NDArray[np.uint8]) -> None:
        """Layer ``layer`` of destination pages ``pages`` from ``rows`` (``[len(pages)][>= raw_bytes]``, each
        row contiguous; the rows may be strided, e.g. pages of a staging slot or of the DRAM pool)."""
        n = len(pages)
        if n == 0:
            return
        at = self._page_rows[pages][:, None] + (layer * self.layer_stride) // self.unit + self._piece_rows[None, :]
        src = rows[:, : self.raw_bytes].reshape(n, -1, self.unit)
        if self._end_rows is None:
            self._rows[at] = src
            return
        mine = at < self._end_rows[pages][:, None]
        self._rows[at[mine]] = src[mine]

    def read_pages(self, layer: int, pages: Ints, out: npt.NDArray[np.uint8]) -> None:
        """Layer ``layer`` of destination pages ``pages`` into ``out[i, :raw_bytes]`` (the reverse of
        ``write``: a DRAM copy of what a restore put here). Not for targets with ``limits``, whose pages
        keep only part of what was stored."""
        if self._end_rows is not None:
            raise ValueError("read_pages: this target keeps only part of each stored page (limits)")
        at = self._page_rows[pages][:, None] + (layer * self.layer_stride) // self.unit + self._piece_rows[None, :]
        out[:, : self.raw_bytes].reshape(len(pages), -1, self.unit)[...] = self._rows[at]

    def read(self, layer: int, page: int) -> npt.NDArray[np.uint8]:
        """Layer ``layer`` of destination page ``page`` as its stored bytes (a copy; for checks and tests)."""
        at = self._page_rows[page] + (layer * self.layer_stride) // self.unit + self._piece_rows
        if self._end_rows is not None:
            at = at[at < self._end_rows[page]]
        out: npt.NDArray[np.uint8] = self._rows[at].reshape(-1)
        return out

    def head(self, n: int) -> PagedTarget:
        """The same target for its first ``n`` destination pages (a restore of a stored prefix)."""
        limits = None if self.limits is None else self.limits[:n]
        return PagedTarget(self.memory, self.layers, self.page_offsets[:n], self.layer_stride, self.piece_offsets,
                           self.piece_bytes, limits)  # fmt: skip


def host_target(dest: npt.NDArray[np.uint8]) -> PagedTarget:
    """The engine's own ``[layers][slots][page_bytes]`` destination as a target: page ``p`` of layer ``l``
    is the row at ``(l * slots + p) * page_bytes``."""
    layers, slots, page_bytes = dest.shape
    return PagedTarget(dest.reshape(-1), layers, np.arange(slots, dtype=np.int64) * page_bytes, slots * page_bytes,
                       [0], page_bytes)  # fmt: skip
