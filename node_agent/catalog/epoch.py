"""The agent's epoch: a number in ``agent.state_dir/epoch`` (``ssd.dir`` when unset), raised at every
agent start before it serves.

Allocations carry the epoch they were made in. Clients write pool bytes themselves, so a client that
allocated before an agent restart could otherwise finish its write afterwards, into space the new
agent has handed to someone else. Instead it reads the epoch just before writing and refuses
(``FencedError``) when the agent has restarted since; the agent refuses to publish an allocation of
another epoch for the same reason.

A write that passed that check and is still in flight when the agent restarts is fenced too: each
write holds the epoch file shared (``flock``) from its check to its last byte (``held``), and a new
agent takes it exclusively before it raises the epoch (``advance``), so it begins only once the
previous epoch's writes have landed; no later allocation can be overwritten by one.

Restores are fenced the same way: a lease pins its pages only while the agent that granted it lives,
so a restore holds the epoch from its start to its close. A new agent (whose writers may reuse a
page the restore is still copying: a DRAM page is not checksummed by default) begins only once it
has ended, and a lease of an earlier epoch is refused before anything is read.

A write or restore that does not finish within ``wait_s`` (``agent.epoch_wait_s``: a hung device, a
restore never closed) is logged and the agent starts anyway. Such a restore, when it ends, finds the
epoch moved and counts every DRAM page it copied as a miss (``Engine._epoch_check``): the new agent's
writers may have reused those slots. Its SSD pages are guarded by the read-side checksums where reads
are checked (``io.verify_reads``, ``ssd`` by default).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
from pathlib import Path

from flatcake.node_agent.catalog.files import fsync_dir, share_fd
from flatcake.node_agent.constants import EPOCH_FILE

log = logging.getLogger(__name__)

_EPOCH = struct.Struct("<Q")


def current(directory: str | os.PathLike[str]) -> int:
    """The epoch of the agent serving ``directory`` now (0: none has started)."""
    try:
        fd = os.open(Path(directory) / EPOCH_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _read(fd: int) -> int:
    raw = os.pread(fd, _EPOCH.size, 0)
    return _EPOCH.unpack(raw)[0] if len(raw) == _EPOCH.size else 0


class Held:
    """The epoch held for one write or one restore (``held``): a context manager whose value is the
    epoch now (0: no agent has started). One open file each: ``flock`` belongs to the open file, so
    threads sharing one would release each other's hold. A plain object, not a generator: a restore
    dropped unclosed is finalized in any order with what it holds, and its hold ends with it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = Path(directory) / EPOCH_FILE
        self._fd = -1

    def __enter__(self) -> int:
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            epoch = _read(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return epoch

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # releases the hold

    __del__ = release


def held(directory: str | os.PathLike[str]) -> Held:
    """Hold the epoch for one write or one restore: no new agent begins its epoch until the block has
    ended (``advance`` takes the file exclusively)."""
    return Held(directory)


def advance(directory: str | os.PathLike[str], gid: int = -1, wait_s: float = 30.0) -> int:
    """Start a new epoch (one past the stored one) and make it durable; returns it. Waits (up to
    ``wait_s``) for the writes and restores of the previous epoch that are still in flight. Written in place
    (8 bytes, one sector) so a reader never sees the file missing."""
    path = Path(directory) / EPOCH_FILE
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o660)
    try:
        share_fd(fd, gid)
        _exclusive(fd, path, wait_s)
        epoch = _read(fd) + 1
        os.pwrite(fd, _EPOCH.pack(epoch), 0)
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock: writers from here on see the new epoch
    if created:
        fsync_dir(path.parent)
    return epoch


def _exclusive(fd: int, path: Path, wait_s: float) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    log.warning("epoch %s: waiting up to %.0f s for the previous agent's writes and restores in flight to end",
                path, wait_s)  # fmt: skip
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.01)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            log.info("epoch %s: the previous agent's writes and restores have ended", path)
            return
        except BlockingIOError:
            continue
    log.error("epoch %s: writes or restores of the previous agent still in flight after %.0f s (a hung device, a "
              "restore never closed?); starting anyway: a page they overwrite or misread is caught by its checksum "
              "where reads are checked (io.verify_reads)", path, wait_s)  # fmt: skip
