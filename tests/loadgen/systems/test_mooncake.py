import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from flatcake.loadgen.systems.base import SystemSpec
from flatcake.loadgen.systems.mooncake import OFFLOAD_ARENA, MooncakeSystem
from flatcake.node_agent import Hints, aligned_empty
from tests.support.engines import pages

pytestmark = pytest.mark.system

LAYERS, PAGE_BYTES, SESSIONS, TURNS, PER_TURN = 4, 64 * 1024, 4, 2, 16  # 128 pages of 256 KiB: 32 MiB


def _children() -> list[int]:
    """This process's live child processes."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize("flush_dram", [False, True])
def test_mooncake_round_trip_through_dram_and_ssd(tmp_path: Path, flush_dram: bool) -> None:
    assert importlib.util.find_spec("mooncake") is not None, (
        "Mooncake Store is not installed: pip install --no-deps -r requirements/peers.txt "
        "(bin/test installs it with FLATCAKE_EXTRAS='sglang peers')"
    )
    # Half the pages fit the DRAM segment (16 MiB, Mooncake's smallest): the rest go to the SSD.
    spec = SystemSpec(layers=LAYERS, page_bytes=PAGE_BYTES, page_tokens=16, sessions=SESSIONS,
                      session_bytes=TURNS * PER_TURN * LAYERS * PAGE_BYTES, dram_fraction=0.5, flush_dram=flush_dram)  # fmt: skip
    before = set(_children())
    system = MooncakeSystem(tmp_path, spec)
    try:
        (master,) = system.pids()
        assert master in _children()
        written = {}
        for turn in range(TURNS):
            for s in range(SESSIONS):
                keys = [f"s{s}-p{turn * PER_TURN + j}" for j in range(PER_TURN)]
                kv = pages(LAYERS, PER_TURN, PAGE_BYTES, seed=turn * SESSIONS + s)
                written.update({k: kv[:, j].copy() for j, k in enumerate(keys)})
                system.put(keys, kv, Hints(turn=turn + 1))
        system.put(["s0-p0"], pages(LAYERS, 1, PAGE_BYTES, seed=99), Hints())  # stored: skipped, not overwritten
        assert system.failed_puts == 0
        system.prepare()
        assert system.flushed
        assert list(system.offload_dir.glob("*.bucket")), "nothing was offloaded to the SSD"
        n = TURNS * PER_TURN
        dest = aligned_empty((LAYERS, n, PAGE_BYTES))
        for s in range(SESSIONS):
            keys = [f"s{s}-p{i}" for i in range(n)]
            dest[...] = 0
            order = list(range(n))[::-1] if s == 0 else None  # dest_pages: session 0 lands reversed
            assert system.restore(keys, dest, order) == 0
            for i, key in enumerate(keys):
                assert np.array_equal(dest[:, order[i] if order else i], written[key]), key
        assert system.restore(["s0-p0", "never-stored"], dest) == 1
        c = system.counters()
        total = SESSIONS * n + 2
        assert c.read_commands == SESSIONS + 1 and len(c.requests) == SESSIONS + 1
        assert c.bytes_requested == total * spec.page_span and c.bytes_read == (total - 1) * spec.page_span
        assert c.missing == 1 and c.staging_peak_bytes == n * spec.page_span + OFFLOAD_ARENA  # the SSD read arena too
        if flush_dram:
            assert c.dram_pages == 0  # every page came from the SSD
        else:
            assert 0 < c.dram_pages < SESSIONS * n  # the DRAM segment served some, the SSD the rest
    finally:
        system.close()
    assert set(_children()) <= before, "close() left a process behind"
    assert not (tmp_path / "mooncake").exists()
