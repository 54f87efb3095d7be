"""The checksum published with every page: CRC-32 (zlib's polynomial and conditioning) over the page's
layers in order, computed with ISA-L (``isal``; bit-identical to ``zlib.crc32``, ~10x faster here, and
it releases the GIL, so I/O threads check what they read in parallel).

A restore hashes each page-layer on its own as it lands (in whichever thread read it) and folds the
layers into the page's checksum afterwards: ``crc(A || B) = shift_|B|(crc(A)) ^ crc(B)``, where
``shift_n`` (multiplication by x^(8n) modulo the CRC polynomial) is linear over GF(2), so for the
fixed row length of a pool it is four 256-entry tables (``LayerFold``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt
from isal import isal_zlib

U32 = npt.NDArray[np.uint32]


# ``zlib.crc32(data, value=0)``, at memory speed: ISA-L's own function, no wrapper (a restore calls it once
# per page-layer, tens of thousands of times).
crc32: Callable[..., int] = isal_zlib.crc32


def page_checksum(pages: Any, j: int) -> int:
    """CRC-32 of page ``j`` of a ``[layers][pages][page_bytes]`` buffer, layer 0 first."""
    crc = 0
    for layer in range(pages.shape[0]):
        crc = crc32(pages[layer, j], crc)
    return crc


class LayerFold:
    """Folds per-row CRCs of ``row_bytes``-long rows into the CRC of the rows back to back."""

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self._tables = _shift_tables(row_bytes)

    def shift(self, crc: U32) -> U32:
        """``crc`` as if ``row_bytes`` more bytes had followed, minus those bytes' own CRC."""
        t = self._tables
        out: U32 = t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24]
        return out

    def fold(self, rows: U32) -> U32:
        """``rows[layer][page]``, each one row's CRC (from 0): every page's CRC over its rows in layer order."""
        acc: U32 = rows[0].astype(np.uint32, copy=True)
        for layer in range(1, len(rows)):
            acc = self.shift(acc) ^ rows[layer]
        return acc


@lru_cache(maxsize=16)
def _shift_tables(row_bytes: int) -> tuple[U32, U32, U32, U32]:
    # shift(v) = crc32(zeros, v) ^ crc32(zeros, 0): the zeros' own contribution cancels, what is left is
    # linear in v. Its image of each bit spans the tables.
    zeros = bytes(row_bytes)
    z = zlib.crc32(zeros)
    basis = np.array([zlib.crc32(zeros, 1 << k) ^ z for k in range(32)], dtype=np.uint32)
    tables = []
    byte = np.arange(256, dtype=np.uint32)
    for part in range(4):
        table = np.zeros(256, dtype=np.uint32)
        for bit in range(8):
            table ^= np.where((byte >> bit) & 1, basis[8 * part + bit], 0).astype(np.uint32)
        tables.append(table)
    return tables[0], tables[1], tables[2], tables[3]
