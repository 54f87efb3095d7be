"""``flatcake simulate`` end to end: a small sweep in worker processes, its table, JSON and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_simulate_writes_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "flatcake.cli", "simulate", "--dram", "4GiB", "--ssd", "64GiB", "--hbm", "256MiB",
           "--qps", "0.5,2", "--workers", "2", "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert "tiered" in done.stdout and "prefetch s" in done.stdout
    report = json.loads((out / "simulate.json").read_text())
    assert [(r["system"], r["qps"]) for r in report["results"]] == [
        (s, q)
        for q in (0.5, 2.0)
        for s in ("flatcake", "flatcake-native", "tiered", "hicache-file", "hicache-mooncake", "dram")
    ]
    assert all(0 < r["delivered_hit_rate"] <= r["ideal_hit_rate"] + 1e-9 for r in report["results"])
    assert (out / "simulate.png").stat().st_size > 0 and (out / "occupancy.png").stat().st_size > 0


def test_bad_size_is_a_config_error_naming_the_flag(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "flatcake.cli", "simulate", "--ssd", "lots", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert done.returncode == 2 and "--ssd" in done.stderr


def test_a_sweep_writes_its_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "flatcake.cli", "simulate", "--sweep", "gap", "--limit", "40", "--dram", "4GiB",
           "--ssd", "64GiB", "--hbm", "256MiB", "--qps", "2", "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "sweep-gap.json").read_text())
    assert report["sweep"] == "gap" and report["qps"] == 2.0
    assert [p["gap_bytes"] for p in report["points"]] == [k << 10 for k in (0, 4, 16, 64, 256, 1024)]
    assert (out / "sweep-gap.png").read_bytes()[:4] == b"\x89PNG"


def test_the_sweep_flag_offers_every_sweep() -> None:
    from flatcake.cli import build_parser
    from flatcake.loadgen.simulate.sweeps import SWEEPS

    simulate = build_parser()._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    (flag,) = [a for a in simulate._actions if a.dest == "sweep"]
    assert list(flag.choices or ()) == ["load", *SWEEPS]  # load: the ladder of loadgen/simulate/load.py
