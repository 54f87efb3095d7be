"""How the agent creates the files it shares, and how it makes a rename durable.

One permission policy for everything the agent creates (control socket, DRAM pool, pool files,
manifest, journal, epoch): mode 0660, owned by the agent, group ``agent.group`` when set. Inference
pods run in that group (``supplementalGroups``) and get exactly what they need; other users get
nothing. The mode is re-applied at every start, so files made by older versions converge.
"""

from __future__ import annotations

import errno
import grp
import os
from pathlib import Path

from flatcake.errors import ConfigError

SHARED_MODE = 0o660


def resolve_gid(group: str) -> int:
    """The gid of ``agent.group`` (a name or a number); -1 (leave the group alone) when empty."""
    if not group:
        return -1
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"agent.group: no group named {group!r} on this node; create it or give a numeric gid"
        ) from None


def share_fd(fd: int, gid: int = -1) -> None:
    """Apply the policy to an open file."""
    os.fchmod(fd, SHARED_MODE)
    if gid >= 0:
        os.fchown(fd, -1, gid)


def share_path(path: str | os.PathLike[str], gid: int = -1) -> None:
    """Apply the policy to a path (a socket cannot be opened to fchmod it)."""
    os.chmod(path, SHARED_MODE)
    if gid >= 0:
        os.chown(path, -1, gid)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a create, rename or unlink in ``directory`` durable: without it a power loss can bring
    back the old name (a compacted journal reverting to its long form, or losing the new one)."""
    fd = os.open(Path(directory), os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem does not sync directories
                raise
    finally:
        os.close(fd)
