"""FC-GVA addresses: one 64-bit space in which DRAM and SSD are peer media.

Layout: ``MediaType[63:60] | NodeID[59:48] | Offset[47:0]``. Media is the top field, so whether a
request needs the SSD at all is a single integer compare against ``1 << 60`` on the largest GVA.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import NamedTuple

from flatcake.node_agent.constants import MAX_NODE_ID

MEDIA_SHIFT = 60
NODE_SHIFT = 48
OFFSET_BITS = 48
MAX_OFFSET = (1 << OFFSET_BITS) - 1
SSD_THRESHOLD = 1 << MEDIA_SHIFT


class Medium(IntEnum):
    DRAM = 0
    SSD = 1


class GVA(NamedTuple):
    medium: Medium
    node_id: int
    offset: int


def encode(medium: Medium, node_id: int, offset: int) -> int:
    """Pack a medium, node and byte offset into a GVA, refusing values that do not fit their field."""
    if not isinstance(medium, Medium):
        raise ValueError(f"medium: {medium!r} is not a Medium (DRAM=0, SSD=1)")
    if not 0 <= node_id <= MAX_NODE_ID:
        raise ValueError(f"node_id: {node_id} is outside 0..{MAX_NODE_ID} (12 bits of the GVA)")
    if not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"offset: {offset} is outside 0..{MAX_OFFSET} (48 bits, 256 TiB per node)")
    return (int(medium) << MEDIA_SHIFT) | (node_id << NODE_SHIFT) | offset


def decode(gva: int) -> GVA:
    """Split a GVA into its fields; reserved media types (2..15) are an error."""
    if not 0 <= gva < 1 << 64:
        raise ValueError(f"gva: {gva} is not a 64-bit unsigned value")
    media = gva >> MEDIA_SHIFT
    if media not in (Medium.DRAM, Medium.SSD):
        raise ValueError(f"gva: media type {media} is reserved (only 0=DRAM and 1=SSD are defined)")
    return GVA(Medium(media), (gva >> NODE_SHIFT) & MAX_NODE_ID, gva & MAX_OFFSET)


def needs_ssd(gvas: Iterable[int]) -> bool:
    """True when any address lies on SSD: the slowest medium decides how a request is scheduled."""
    return max(gvas, default=0) >= SSD_THRESHOLD
