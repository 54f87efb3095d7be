"""The NVMe file pool: N preallocated files of one size, ideally one extent each, opened O_DIRECT.

An SSD GVA offset is ``file_index * file_bytes + offset_in_file``. The pool's geometry is written to a
manifest (``pool.json``) that the engine (and later the agent and its clients) read back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from flatcake.errors import ConfigError
from flatcake.node_agent.catalog.files import fsync_dir, share_fd, share_path
from flatcake.node_agent.constants import ALIGN

log = logging.getLogger(__name__)

MANIFEST = "pool.json"
MANIFEST_VERSION = 1
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_HEADER = struct.Struct("=QQLLLL")
_FIEMAP_EXTENT = struct.Struct("=QQQQQLLLL")


class ExtentError(RuntimeError):
    """A pool file is fragmented and the pool's policy refuses fragmented files."""


def fiemap_extents(fd: int) -> list[tuple[int, int, int]]:
    """The file's extents as ``(logical, physical, length)``, from the FIEMAP ioctl."""
    header = bytearray(_FIEMAP_HEADER.pack(0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, 0, 0))
    fcntl.ioctl(fd, FS_IOC_FIEMAP, header, True)
    count = _FIEMAP_HEADER.unpack(header)[3]
    if count == 0:
        return []
    buf = bytearray(_FIEMAP_HEADER.size + count * _FIEMAP_EXTENT.size)
    buf[: _FIEMAP_HEADER.size] = _FIEMAP_HEADER.pack(0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, count, 0)
    fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
    mapped = _FIEMAP_HEADER.unpack_from(buf)[3]
    out = []
    for i in range(mapped):
        logical, physical, length, *_ = _FIEMAP_EXTENT.unpack_from(buf, _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size)
        out.append((logical, physical, length))
    return out


def contiguous_runs(extents: list[tuple[int, int, int]]) -> int:
    """Physically contiguous runs. ext4 caps one extent record at 128 MiB, so a contiguous file can
    report several records; what matters for large sequential reads is how many runs there are."""
    runs = 0
    prev_end: tuple[int, int] | None = None
    for logical, physical, length in extents:
        if prev_end != (logical, physical):
            runs += 1
        prev_end = (logical + length, physical + length)
    return runs


def count_extents(path: str | os.PathLike[str]) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return contiguous_runs(fiemap_extents(fd))
    finally:
        os.close(fd)


@dataclass
class PoolManifest:
    file_bytes: int
    files: list[str]
    extents: list[int] = field(default_factory=list)
    alignment: int = ALIGN
    version: int = MANIFEST_VERSION

    @property
    def count(self) -> int:
        return len(self.files)

    @property
    def total_bytes(self) -> int:
        return self.file_bytes * self.count

    def save(self, directory: Path, gid: int = -1) -> None:
        tmp = directory / (MANIFEST + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            share_fd(fd, gid)
            with os.fdopen(fd, "w", closefd=False) as f:
                f.write(json.dumps(asdict(self), indent=1) + "\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / MANIFEST)
        fsync_dir(directory)

    @classmethod
    def load(cls, directory: Path) -> PoolManifest:
        """The manifest; a missing or damaged one is a ``ConfigError`` naming the file and the fix."""
        path = directory / MANIFEST
        fix = "remove the pool directory to rebuild it (its cached KV is lost)"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no pool manifest; create the pool first (flatcake agent prepare)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: manifest is not valid JSON ({exc}); {fix}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: manifest must be a JSON object, got {type(data).__name__}; {fix}")
        if data.get("version") != MANIFEST_VERSION:
            raise ConfigError(f"{path}: manifest version {data.get('version')!r} != {MANIFEST_VERSION}; {fix}")
        ok = (
            set(data) <= {f.name for f in fields(cls)}
            and _is_int(data.get("file_bytes")) and data["file_bytes"] > 0
            and isinstance(data.get("files"), list) and all(isinstance(n, str) and n and "/" not in n
                                                            for n in data["files"])
            and isinstance(data.get("extents", []), list) and all(map(_is_int, data.get("extents", [])))
            and _is_int(data.get("alignment", ALIGN))
        )  # fmt: skip
        if not ok:
            raise ConfigError(f"{path}: manifest is damaged (fields {sorted(data)}); {fix}")
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def create_pool(
    directory: str | os.PathLike[str],
    count: int,
    file_bytes: int,
    *,
    extent_policy: str = "warn",
    progress: Callable[[int, int], None] | None = None,
    gid: int = -1,
    allocate: bool = True,
) -> PoolManifest:
    """Create (or verify and reuse) a pool of ``count`` files of ``file_bytes`` each.

    Idempotent: an existing pool with the same geometry is reused; a different geometry is refused
    (shrinking or resizing a pool would drop stored data). ``allocate=False`` sizes the files without
    allocating them (sparse): only for measuring metadata at pool sizes the disk does not have (a
    write into a sparse pool can fail for want of space); the agent reuses such a pool as it is.
    """
    if extent_policy not in ("warn", "refuse"):
        raise ValueError(f"extent_policy: {extent_policy!r} must be 'warn' or 'refuse'")
    if count <= 0:
        raise ValueError(f"file_count: {count} must be > 0")
    if file_bytes <= 0 or file_bytes % ALIGN:
        raise ValueError(f"file_bytes: {file_bytes} must be a positive multiple of {ALIGN}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if (root / MANIFEST).exists():
        old = PoolManifest.load(root)
        if (old.file_bytes, old.count) != (file_bytes, count):
            raise ValueError(
                f"{root}: existing pool has {old.count} files of {old.file_bytes} bytes, not {count} of "
                f"{file_bytes}; remove the pool directory to rebuild it (its cached KV is lost)"
            )
    manifest = PoolManifest(file_bytes=file_bytes, files=[f"pool-{i:05d}.dat" for i in range(count)])
    for i, name in enumerate(manifest.files):
        path = root / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o660)
        try:
            share_fd(fd, gid)
            if os.fstat(fd).st_size != file_bytes:
                if allocate:
                    os.posix_fallocate(fd, 0, file_bytes)
                else:
                    os.ftruncate(fd, file_bytes)
            try:
                runs = contiguous_runs(fiemap_extents(fd))
            except OSError as exc:  # no FIEMAP here (tmpfs, some network filesystems): extents unknown
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY):
                    raise
                runs = 0
        finally:
            os.close(fd)
        manifest.extents.append(runs)
        if runs > 1 and extent_policy == "refuse":
            raise ExtentError(
                f"{path}: {runs} discontiguous extents after fallocate (want 1); use a fresh XFS "
                "filesystem or set ssd.extent_policy=warn"
            )
        if progress:
            progress(i + 1, count)
    fragmented = [n for n in manifest.extents if n > 1]
    if fragmented:
        log.warning(
            "%s: %d of %d pool files have more than one extent (up to %d); reads of a scope may split "
            "at extent boundaries",
            root, len(fragmented), count, max(fragmented),
        )  # fmt: skip
    if not (root / MANIFEST).exists() or PoolManifest.load(root) != manifest:  # no write on a full disk when unchanged
        manifest.save(root, gid)
    else:
        with contextlib.suppress(OSError):
            share_path(root / MANIFEST, gid)
    return manifest


def open_direct(path: str | os.PathLike[str]) -> int:
    """Open a pool file for direct I/O (no page cache): the restore measures the device, not RAM."""
    return os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
