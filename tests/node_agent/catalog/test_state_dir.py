"""The agent's state directory: the journal, the epoch and the owner lock apart from the pool files that
inference pods mount, and an agent of the old layout moved there without losing a page."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from flatcake.node_agent import EngineConfig
from flatcake.node_agent.catalog import state_dir as S
from flatcake.node_agent.catalog.epoch import current as current_epoch
from flatcake.node_agent.catalog.owner import LOCK_FILE
from flatcake.node_agent.constants import EPOCH_FILE, JOURNAL_FILE
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import connect
from tests.support.agents import AgentThread
from tests.support.engines import pages, small_config

SSD = Hints(context_tokens=1 << 30)  # an agent session: SSD


def put_and_check(config: EngineConfig, keys: list[str], kv: list[np.ndarray], put: bool) -> None:
    a = AgentThread(config)
    try:
        with connect(a.socket) as e:
            if put:
                for i, key in enumerate(keys):
                    e.put([key], kv[i], SSD)
            dest = np.zeros((4, len(keys), 4096), np.uint8)
            e.get(keys, dest).run()
            assert all(np.array_equal(dest[:, i], kv[i][:, 0]) for i in range(len(keys)))
    finally:
        a.stop()


@pytest.mark.integration
def test_the_journal_epoch_and_lock_live_apart_from_the_pool_files(tmp_path: Path) -> None:
    """What a pod mounting the pool directory could rewrite to mislead the next agent is not there."""
    config = small_config(tmp_path, agent={"state_dir": str(tmp_path / "state")})
    kv = [pages(4, 1, 4096, seed=i) for i in range(6)]
    keys = [f"k{i}" for i in range(6)]
    put_and_check(config, keys, kv, put=True)
    pool, state = Path(config.ssd.dir), tmp_path / "state"
    assert {JOURNAL_FILE, EPOCH_FILE, LOCK_FILE} <= {p.name for p in state.iterdir()}
    assert not {JOURNAL_FILE, EPOCH_FILE, LOCK_FILE} & {p.name for p in pool.iterdir()}
    put_and_check(config, keys, kv, put=False)  # restarted: served from the state directory's journal
    assert current_epoch(state) == 2


@pytest.mark.integration
def test_an_agent_of_the_old_layout_moves_its_journal_and_loses_no_page(tmp_path: Path) -> None:
    old = small_config(tmp_path)  # journal and epoch in ssd.dir
    kv = [pages(4, 1, 4096, seed=i) for i in range(6)]
    keys = [f"k{i}" for i in range(6)]
    put_and_check(old, keys, kv, put=True)
    assert (Path(old.ssd.dir) / JOURNAL_FILE).exists()
    new = dataclasses.replace(old, agent=dataclasses.replace(old.agent, state_dir=str(tmp_path / "state")))
    put_and_check(new, keys, kv, put=False)  # every page back, from the moved journal
    assert not (Path(old.ssd.dir) / JOURNAL_FILE).exists() and not (Path(old.ssd.dir) / EPOCH_FILE).exists()
    assert current_epoch(tmp_path / "state") == 2  # the epoch went on from the old one, never back to 1


@pytest.mark.unit
def test_a_move_across_filesystems_never_leaves_half_a_journal(tmp_path: Path, monkeypatch) -> None:
    """Across filesystems the journal is copied whole under another name, then renamed: a failure
    midway leaves the old journal where it was (moved again at the next start) and no new one."""
    pool, state = tmp_path / "pool", tmp_path / "state"
    pool.mkdir()
    state.mkdir()
    (pool / JOURNAL_FILE).write_bytes(b"j" * 10000)
    real_replace = os.replace

    def cross_device(src, dst):  # type: ignore[no-untyped-def]
        if Path(src).parent == pool:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(src, dst)

    monkeypatch.setattr(S.os, "replace", cross_device)

    def torn(src, dst):  # type: ignore[no-untyped-def]
        Path(dst).write_bytes(b"j" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(S.shutil, "copyfile", torn)
    with pytest.raises(OSError, match="No space"):
        S.adopt_legacy(pool, state)
    assert (pool / JOURNAL_FILE).stat().st_size == 10000 and not (state / JOURNAL_FILE).exists()
    monkeypatch.undo()
    monkeypatch.setattr(S.os, "replace", cross_device)
    assert S.adopt_legacy(pool, state) == [JOURNAL_FILE]
    assert (state / JOURNAL_FILE).read_bytes() == b"j" * 10000 and not (pool / JOURNAL_FILE).exists()
