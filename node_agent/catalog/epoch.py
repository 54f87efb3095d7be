"""The agent's epoch: a number in ``ssd.dir/epoch``, raised at every agent start before it serves.

Allocations carry the epoch they were made in. Clients write pool bytes themselves, so a client that
allocated before an agent restart could otherwise finish its write afterwards, into space the new
agent has handed to someone else. Instead it reads the epoch just before writing and refuses
(``FencedError``) when the agent has restarted since; the agent refuses to publish an allocation of
another epoch for the same reason.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from flatcake.node_agent.catalog.files import fsync_dir, share_fd

EPOCH_FILE = "epoch"
_EPOCH = struct.Struct("<Q")


def current(directory: str | os.PathLike[str]) -> int:
    """The epoch of the agent serving ``directory`` now (0: none has started)."""
    try:
        fd = os.open(Path(directory) / EPOCH_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        raw = os.pread(fd, _EPOCH.size, 0)
    finally:
        os.close(fd)
    return _EPOCH.unpack(raw)[0] if len(raw) == _EPOCH.size else 0


def advance(directory: str | os.PathLike[str], gid: int = -1) -> int:
    """Start a new epoch (one past the stored one) and make it durable; returns it. Written in place
    (8 bytes, one sector) so a reader never sees the file missing."""
    path = Path(directory) / EPOCH_FILE
    epoch = current(directory) + 1
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o660)
    try:
        share_fd(fd, gid)
        os.pwrite(fd, _EPOCH.pack(epoch), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)
    return epoch
