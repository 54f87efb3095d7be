"""The DRAM pool: one shared, file-backed mmap region cut into fixed-size slots.

The region is backed by a file (hugetlbfs when 2 MiB pages are wanted and available, else
``/dev/shm``) so that other processes on the node, the inference ranks, can map the same pool.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from flatcake.errors import CapacityError
from flatcake.node_agent.catalog.files import share_fd
from flatcake.node_agent.policy.slots import SlotAllocator

log = logging.getLogger(__name__)

HUGE_2M = 2 * 1024 * 1024


def hugetlbfs_mounts(page_bytes: int = HUGE_2M, mounts: str = "/proc/mounts") -> list[Path]:
    """Mount points of hugetlbfs with the given page size (the default size when none is stated)."""
    found: list[Path] = []
    try:
        text = Path(mounts).read_text()
    except OSError:
        return found
    default = _default_hugepage_bytes()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[2] != "hugetlbfs":
            continue
        size = default
        for opt in parts[3].split(","):
            if opt.startswith("pagesize="):
                size = _parse_size(opt.split("=", 1)[1])
        if size == page_bytes:
            found.append(Path(parts[1]))
    return found


def _default_hugepage_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return HUGE_2M


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


@dataclass(frozen=True)
class DramPoolInfo:
    path: str
    nbytes: int
    huge_pages: bool
    fallback_reason: str


class DramPool:
    """A shared mapping of ``slots * slot_bytes`` bytes with a slot allocator."""

    def __init__(
        self,
        slot_bytes: int,
        slots: int,
        *,
        name: str = "flatcake-dram",
        want_huge_pages: bool = True,
        shm_dir: str = "/dev/shm",
        hugetlbfs_dir: str | None = None,
        attach_path: str | None = None,
        gid: int = -1,
    ) -> None:
        if slot_bytes <= 0 or slots < 0:
            raise ValueError(f"dram pool: slot_bytes={slot_bytes}, slots={slots} must be positive")
        self.slot_bytes = slot_bytes
        self.allocator = SlotAllocator(slots)
        nbytes = max(slot_bytes * slots, mmap.PAGESIZE)
        if attach_path is not None:  # a client maps the agent's pool as it is
            self._mmap, self.info = _attach(attach_path, nbytes)
        else:
            self._mmap, self.info = _map_shared(nbytes, name, want_huge_pages, shm_dir, hugetlbfs_dir, gid)
        self.view: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8)
        self._registered = False

    def slot(self, index: int) -> npt.NDArray[np.uint8]:
        base = index * self.slot_bytes
        return self.view[base : base + self.slot_bytes]

    def register_with_cuda(self) -> bool:
        """Pin the whole region for DMA once, when a GPU is usable (cudaHostRegister)."""
        from flatcake.node_agent.datapath import gpu

        if not self._registered and gpu.available():
            gpu.host_register(self.view)
            self._registered = True
        return self._registered

    def close(self, unlink: bool = False) -> None:
        if self._registered:  # unpin before the unmap
            from flatcake.node_agent.datapath import gpu

            gpu.host_unregister(self.view)
            self._registered = False
        del self.view
        with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping goes with it
            self._mmap.close()
        if unlink:
            Path(self.info.path).unlink(missing_ok=True)


def _map_shared(
    nbytes: int, name: str, want_huge: bool, shm_dir: str, hugetlbfs_dir: str | None, gid: int = -1
) -> tuple[mmap.mmap, DramPoolInfo]:
    reason = "huge pages not requested"
    if want_huge:
        dirs = [Path(hugetlbfs_dir)] if hugetlbfs_dir else hugetlbfs_mounts()
        if not dirs:
            reason = "no hugetlbfs mount with 2 MiB pages"
        for d in dirs:
            huge_bytes = -(-nbytes // HUGE_2M) * HUGE_2M
            try:
                return _map_file(d / name, huge_bytes, gid), DramPoolInfo(str(d / name), huge_bytes, True, "")
            except OSError as exc:
                reason = f"hugetlbfs {d}: {exc.strerror or exc} (are enough 2 MiB pages reserved?)"
                (d / name).unlink(missing_ok=True)
        log.warning("DRAM pool falls back to normal pages: %s", reason)
    path = Path(shm_dir) / name
    try:
        return _map_file(path, nbytes, gid), DramPoolInfo(str(path), nbytes, False, reason)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shutil.disk_usage(shm_dir).free
        raise CapacityError(
            f"dram.bytes: the DRAM pool needs {nbytes} bytes but {shm_dir} has {free} free ({exc.strerror}); "
            "lower dram.bytes, enlarge that tmpfs, or use huge pages (dram.huge_pages with reserved 2 MiB pages)"
        ) from None


def _attach(path: str, nbytes: int) -> tuple[mmap.mmap, DramPoolInfo]:
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"dram pool {path}: {size} bytes, smaller than the {nbytes} the geometry needs")
        huge = any(str(path).startswith(str(m)) for m in hugetlbfs_mounts())
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), DramPoolInfo(path, size, huge, "")
    finally:
        os.close(fd)


def _map_file(path: Path, nbytes: int, gid: int = -1) -> mmap.mmap:
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o660)
    try:
        share_fd(fd, gid)
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
        # Reserve every page now. A sparse pool on a tmpfs smaller than it maps fine, then sends SIGBUS
        # to whichever process (an inference rank) first touches a page the tmpfs cannot supply.
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            if created:
                path.unlink(missing_ok=True)
            raise
        # MAP_POPULATE faults every page in now, so the first restore does not pay for it.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
