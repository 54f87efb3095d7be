"""The agent's state directory (``agent.state_dir``): the journal, the epoch file and the pool's owner
lock. It used to be the pool directory itself, which inference pods mount to read and write pages; a
pod could then rewrite the journal the next agent trusts. An agent given a state directory apart moves
the journal and the epoch file there from the pool directory once, so an upgrade loses no page."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from flatcake.node_agent.catalog.files import fsync_dir
from flatcake.node_agent.constants import EPOCH_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)

MOVED = (JOURNAL_FILE, EPOCH_FILE)  # the owner lock is taken anew where it belongs


def adopt_legacy(pool_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str]) -> list[str]:
    """Move the journal and the epoch file from ``pool_dir`` into ``state_dir`` where only the pool
    directory has them (the owner lock is held: no agent writes either meanwhile); the names moved."""
    pool, state = Path(pool_dir), Path(state_dir)
    if pool.resolve() == state.resolve():
        return []
    moved = []
    for name in MOVED:
        old, new = pool / name, state / name
        if old.exists() and not new.exists():
            _move(old, new)
            moved.append(name)
    if moved:
        fsync_dir(state)
        fsync_dir(pool)
        log.warning("moved %s from %s to agent.state_dir %s, out of inference pods' reach", ", ".join(moved),
                    pool, state)  # fmt: skip
    return moved


def _move(old: Path, new: Path) -> None:
    """A rename; across filesystems a copy made whole under another name first, so a kill midway leaves
    the old file (moved again at the next start), never half a journal under the new name."""
    try:
        os.replace(old, new)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = new.with_name(f".{new.name}.moving")
    shutil.copyfile(old, tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, new)
    old.unlink()
