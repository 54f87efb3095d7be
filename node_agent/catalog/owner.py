"""One agent per pool. A second ``flatcake agent serve`` on a serving pool used to advance the pool's epoch and
replace the shared index before it failed to bind, leaving the first agent fenced while it still said ready.
Now the agent first takes an exclusive lock on a file in the pool directory and one beside the DRAM pool's
file, before it touches either, and writes its pid there: a second agent is refused at once, naming the
holder's pid and the pool. The kernel drops the locks with the process, so a killed agent never leaves one
behind. The lock files are the agent's alone (mode 0600, not the pool's group): an inference pod given the
group could otherwise hold one and keep the agent from starting."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from flatcake.errors import ConfigError

LOCK_FILE = "agent.lock"


def lock_paths(pool_dir: str | os.PathLike[str], shm_dir: str | os.PathLike[str], dram_name: str) -> list[Path]:
    """The pool's owner lock and the DRAM pool's (beside its file: two pools may share one shm_dir)."""
    return [Path(pool_dir) / LOCK_FILE, Path(shm_dir) / f"{dram_name}.agent.lock"]


class PoolOwner:
    """The owner locks of one agent's pools, held until ``release`` (or the process ends)."""

    def __init__(self, fds: list[int], paths: list[Path], created: list[Path]) -> None:
        self._fds, self.paths, self._created = fds, paths, created

    @classmethod
    def take(cls, paths: list[Path]) -> PoolOwner:
        """Lock every path (mode 0600), or refuse naming the agent that holds one."""
        fds: list[int] = []
        created: list[Path] = []
        try:
            for path in paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    created.append(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    field = "agent.state_dir (ssd.dir when unset)" if path.name == LOCK_FILE else "dram.name"
                    raise ConfigError(
                        f"{field}: {path.parent} is served by another flatcake agent (pid {holder}, lock {path}); "
                        "stop that agent first, or give this one its own ssd.dir (and agent.state_dir) and dram.name"
                    ) from None
            for fd in fds:  # every lock held: only now say who holds them
                os.fchmod(fd, 0o600)  # also a file an older agent made 0660
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            cls(fds, paths, created).release(remove_created=True)
            raise
        return cls(fds, paths, created)

    def release(self, remove_created: bool = False) -> None:
        """Drop the locks (closing drops them; the files stay for the next agent), or, for an agent that
        failed to start, also remove the lock files it created: it leaves nothing half-made behind."""
        fds, self._fds = self._fds, []
        if remove_created:
            for path in self._created:
                path.unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)
