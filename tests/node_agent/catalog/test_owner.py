"""One agent per pool (issue 45): the owner locks, pure file-level behaviour (the agent's use of them is
tested with real agents in tests/faults/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.errors import ConfigError
from flatcake.node_agent.catalog.owner import PoolOwner, lock_paths

pytestmark = pytest.mark.unit


def test_a_second_owner_is_refused_naming_the_first_and_the_pool(tmp_path: Path) -> None:
    paths = lock_paths(tmp_path / "pool", tmp_path / "shm", "kv")
    paths[1].parent.mkdir()
    paths[1].touch(mode=0o660)  # as an older agent left it, open to the pool's group
    first = PoolOwner.take(paths)
    try:
        assert paths[0].read_text().strip() == str(os.getpid()) and paths[1].exists()
        # The agent's alone: a pod given the pool's group cannot open a lock file to hold it.
        assert [p.stat().st_mode & 0o777 for p in paths] == [0o600, 0o600]
        held_by = rf"pool is served by another flatcake agent \(pid {os.getpid()}"
        with pytest.raises(ConfigError, match=rf"agent.state_dir \(ssd.dir when unset\): .*{held_by}"):
            PoolOwner.take(paths)
        # Another pool sharing the DRAM file's name in the same shm_dir is refused by the DRAM lock.
        other = lock_paths(tmp_path / "pool2", tmp_path / "shm", "kv")
        with pytest.raises(ConfigError, match="dram.name: "):
            PoolOwner.take(other)
        assert not (tmp_path / "pool2" / "agent.lock").exists()  # the refused one left nothing behind
    finally:
        first.release()
    second = PoolOwner.take(paths)  # released: taken again
    second.release()


def test_a_killed_owner_leaves_no_lock_behind(tmp_path: Path) -> None:
    paths = lock_paths(tmp_path / "pool", tmp_path / "shm", "kv")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from flatcake.node_agent.catalog.owner import PoolOwner; "
        f"PoolOwner.take([Path(p) for p in {[str(p) for p in paths]!r}]); print('held', flush=True); time.sleep(600)"
    )], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            PoolOwner.take(paths)
    finally:
        holder.kill()
        holder.wait(30)
    PoolOwner.take(paths).release()  # the kernel dropped the dead holder's locks
