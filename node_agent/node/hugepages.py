"""Huge pages for the DRAM pool: how many a configuration wants, how many sysfs says are reserved,
and reserving them (root only)."""

from __future__ import annotations

import math
from pathlib import Path

from flatcake.errors import PrepareError
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import HUGEPAGE_BYTES

SYSFS_HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-{kb}kB/nr_hugepages"


def wanted_hugepages(c: EngineConfig) -> int:
    p = c.prepare
    if p.hugepage_size == "none":
        return 0
    return p.hugepages or math.ceil(c.dram.bytes / HUGEPAGE_BYTES[p.hugepage_size])


def reserved_hugepages() -> dict[str, int]:
    """Pages reserved now, by size, from sysfs (sizes the kernel does not offer are absent)."""
    huge = {}
    for size, nbytes in HUGEPAGE_BYTES.items():
        path = Path(SYSFS_HUGEPAGES.format(kb=nbytes // 1024))
        if path.exists():
            huge[size] = int(path.read_text())
    return huge


def reserve_hugepages(c: EngineConfig) -> None:
    size = c.prepare.hugepage_size
    want = wanted_hugepages(c)
    path = Path(SYSFS_HUGEPAGES.format(kb=HUGEPAGE_BYTES[size] // 1024))
    try:
        path.write_text(str(want))
    except OSError as exc:
        raise PrepareError(f"hugepages: cannot write {path} ({exc.strerror}); run privileged") from None
    got = int(path.read_text())
    if got < want:
        raise PrepareError(f"hugepages: asked for {want} pages of {size}, the kernel reserved {got} (memory is "
                           "fragmented or short); reserve them at boot on the kernel command line")  # fmt: skip


def reserved_bytes() -> int:
    """Bytes of huge pages reserved now, all sizes together."""
    return sum(count * HUGEPAGE_BYTES[size] for size, count in reserved_hugepages().items())
