"""Placement accuracy as the emulator counts it and the report reads it: stored pages asked for again
(the first time) by their placed medium, and those already gone (reclaimed) when asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import Emulator
from flatcake.loadgen.report.build import placement

pytestmark = pytest.mark.integration


def test_reused_and_lost_pages_are_counted_once_per_page(tmp_path: Path) -> None:
    emu = Emulator(EmulatorConfig(mode="flatcake-native", data_dir=str(tmp_path / "emu"), dram_bytes=1 << 20,
                                  ssd_bytes=32 << 20, scope_file_bytes=4 << 20))  # fmt: skip
    try:
        emu.placed.update({"a": "dram", "b": "ssd", "c": "dram", "d": "ssd"})
        for medium, n in (("dram", 4), ("ssd", 2)):  # as _store counts what it placed
            emu.m["flatcake_placed_pages"].labels("flatcake-native", medium).inc(n)
        emu._mark_reused(["a", "b", "c", "x"], found=2)  # c was reclaimed: the stored prefix ends at b
        emu._mark_reused(["a", "b", "c", "d"], found=4)  # asked again: counted once; d is new and found
        prom = tmp_path / "emulator.prom"
        prom.write_bytes(generate_latest(emu.registry))
        got = placement(prom)
    finally:
        asyncio.run(emu.stop())
    assert got is not None
    assert got["dram"] == {"placed": 4, "reused": 2, "reused_share": 0.5, "lost": 1, "lost_share": 0.5}
    assert got["ssd"] == {"placed": 2, "reused": 2, "reused_share": 1.0, "lost": 0, "lost_share": 0.0}
