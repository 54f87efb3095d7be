"""Huge pages for the DRAM pool: how many a configuration wants, how many sysfs says are reserved,
and reserving them (root only).

``nr_hugepages`` is one number per node, shared by every cache on it. Each cache records its own
share (``<prepare.hugepage_shares_dir>/<dram.name>.json``) and sets the node's count to the sum of
all recorded shares, under a lock: two caches add up instead of the last one setting the total to
its own need. The count is raised, never lowered (pages reserved ahead, at boot or by hand, stay).
The records live on the host's /run, a tmpfs, so they go with the reservations at reboot."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

from flatcake.errors import PrepareError
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import HUGEPAGE_BYTES

SYSFS_HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-{kb}kB/nr_hugepages"
_LOCK = ".lock"


def wanted_hugepages(c: EngineConfig) -> int:
    p = c.prepare
    if p.hugepage_size == "none" or not c.dram.huge_pages:  # a pool on tmpfs pages needs none reserved
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


def _share_path(c: EngineConfig) -> Path:
    # dram.name names the cache's pool file, so it is unique per cache on a node (the operator makes
    # it flatcake-<namespace>.<name>).
    return Path(c.prepare.hugepage_shares_dir) / f"{c.dram.name}.json"


def hugepage_shares(c: EngineConfig) -> dict[str, int]:
    """Every cache's recorded share on this node for ``c``'s page size: dram.name -> pages."""
    shares = {}
    folder = Path(c.prepare.hugepage_shares_dir)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            if record["size"] == c.prepare.hugepage_size:
                shares[path.stem] = int(record["pages"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PrepareError(f"hugepages: {path} is not a share record ({exc}); delete it (the next "
                               "prepare of its cache writes it again)") from None  # fmt: skip
    return shares


def node_total(c: EngineConfig, shares: dict[str, int]) -> int:
    """Pages all caches on the node need together, with ``c``'s share as it wants it now."""
    return sum(pages for name, pages in shares.items() if name != c.dram.name) + wanted_hugepages(c)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One cache at a time reads the shares and writes the count (init containers of two caches
    run at the same moment after a reboot)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise PrepareError(f"hugepages: cannot use {folder} for share records ({exc.strerror}); "
                           "fix prepare.hugepage_shares_dir or run privileged") from None  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def reserve_hugepages(c: EngineConfig) -> None:
    size = c.prepare.hugepage_size
    want = wanted_hugepages(c)
    path = Path(SYSFS_HUGEPAGES.format(kb=HUGEPAGE_BYTES[size] // 1024))
    record = _share_path(c)
    with _locked(record.parent):
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"size": size, "pages": want}))
        tmp.replace(record)  # recorded first: a cache preparing next counts this share even if we fail
        total = node_total(c, hugepage_shares(c))
        try:
            now = int(path.read_text())
            if now < total:
                path.write_text(str(total))
        except OSError as exc:
            raise PrepareError(f"hugepages: cannot write {path} ({exc.strerror}); run privileged") from None
        got = int(path.read_text())
    if got < total:
        raise PrepareError(f"hugepages: asked for {total} pages of {size} ({want} for this cache, the rest for "
                           f"other caches on this node), the kernel reserved {got} (memory is fragmented or "
                           "short); reserve them at boot on the kernel command line")  # fmt: skip


def release_share(c: EngineConfig) -> bool:
    """Forget this cache's share (reclaim). The pages stay reserved: lowering the count could take
    pages that another user of hugepages on the node holds."""
    record = _share_path(c)
    if not record.exists():
        return False
    with _locked(record.parent):
        record.unlink(missing_ok=True)
    return True


def reserved_bytes() -> int:
    """Bytes of huge pages reserved now, all sizes together."""
    return sum(count * HUGEPAGE_BYTES[size] for size, count in reserved_hugepages().items())
