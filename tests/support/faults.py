"""The fault campaign's tools: a small tmpfs to fill, and the audit every fault test ends with.

The audit reads back every acknowledged key through a fresh client and reports two numbers, both
of which must be 0: acknowledged keys lost, and wrong bytes served (a page handed over as good whose
bytes differ from what was put)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from flatcake.node_agent import EngineConfig, connect


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (root only, as the system tier's loop devices)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path, name: str = "filler") -> Path:
    """Take every free byte of ``directory``'s filesystem; returns the filler file (remove it to heal)."""
    path = directory / name
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            block = b"\0" * chunk
            while True:
                try:
                    if f.write(block) != chunk:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    return path


def audit(
    config: EngineConfig, acknowledged: list[str], expected: Callable[[str], np.ndarray], *, what: str = ""
) -> tuple[int, int]:
    """(acknowledged keys lost, wrong bytes served) over a fresh client of the agent; printed for the
    campaign's report. A page reported missing by the restore counts as lost, never as wrong."""
    lost = wrong = 0
    with connect(config.agent.socket) as e:
        present = [k for k in acknowledged if e.exists([k])]
        lost += len(acknowledged) - len(present)
        for i in range(0, len(present), 128):
            batch = present[i : i + 128]
            dest = np.zeros((config.layers, len(batch), config.page_bytes), np.uint8)
            with e.get(batch, dest) as restore:
                missing = restore.run()
            lost += len(missing)
            for j, key in enumerate(batch):
                if j not in missing and not np.array_equal(dest[:, j], expected(key)):
                    wrong += int(np.count_nonzero(dest[:, j] != expected(key)))
    print(f"fault audit {what}: {len(acknowledged)} acknowledged, {lost} lost, {wrong} wrong bytes served")
    return lost, wrong


def stat_mode(path: str | os.PathLike[str]) -> int:
    return os.stat(path).st_mode & 0o777
