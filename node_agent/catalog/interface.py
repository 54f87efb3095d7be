"""What the engine's data path asks of a catalog, and what a catalog answers: the contract between the
two. The data path (writing and restoring bytes) talks to a catalog through these calls. In one process
that is a ``local.LocalCatalog``; on a node, the agent owns the one ``LocalCatalog`` and clients reach it
over the control socket (``service/client.RemoteCatalog``), so every inference process shares one index,
one allocator and one reclaim policy while moving the bytes itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints, Key
from flatcake.node_agent.policy.scope import Location, Segment


@dataclass(frozen=True)
class Allocation:
    """Space for the new pages of a put. ``index`` are their positions in the put's key list; SSD
    segments count pages within ``index``; DRAM has one slot per page."""

    id: int
    index: list[int]
    medium: Medium
    reason: str
    segments: list[Segment] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    epoch: int = 0  # the agent's epoch when allocated (0: no agent, nothing to fence)
    # SSD, copies mode: a DRAM slot per new page that gets a clean copy of it too (written with the SSD
    # segments, published with them).
    copy_slots: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Lease:
    """Pinned locations of a get's pages, held until released, with each page's crc32 as published
    (empty when the catalog does not know them) so the reader can verify what it read."""

    id: int
    locations: list[Location]
    checksums: list[int] = field(default_factory=list)
    # Some page is not yet checked by the agent's post-restart scan: the reader checks every page it
    # reads (whatever io.verify_reads says), so a damaged page is a miss even before the scan finds it.
    verify: bool = False
    epoch: int = 0  # the agent epoch that granted it (0: no agent): its pins end with that epoch
    # Copies mode, asked for with ``acquire(copy=True)``: per location, a DRAM slot the reader copies the
    # page into once it has read (and checked) it, or -1. ``release(copied=...)`` says which it filled.
    copies: list[int] = field(default_factory=list)


class Catalog(Protocol):
    def allocate(self, keys: Sequence[Key], hints: Hints) -> Allocation | None: ...
    def publish(self, alloc_id: int, checksums: Sequence[int]) -> None: ...
    def abort(self, alloc_id: int) -> None: ...
    def exists(self, keys: Sequence[Key]) -> int: ...
    def acquire(self, keys: Sequence[Key], copy: bool = False) -> Lease: ...
    # ``damaged``: indexes of the lease's pages whose bytes the reader found not to match their checksum; the
    # catalog checks them itself (a reader is not trusted to drop pages) and stops serving those that fail.
    def release(
        self, lease_id: int, copied: Sequence[int] | None = None, damaged: Sequence[int] | None = None
    ) -> None: ...
    def close(self) -> None: ...
