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
    assert "tiered-l3" in done.stdout and "prefetch s" in done.stdout
    report = json.loads((out / "simulate.json").read_text())
    assert [(r["system"], r["qps"]) for r in report["results"]] == [
        (s, q) for q in (0.5, 2.0) for s in ("flatcake", "tiered-l2", "tiered-l3")
    ]
    assert all(0 < r["delivered_hit_rate"] <= r["ideal_hit_rate"] + 1e-9 for r in report["results"])
    assert (out / "simulate.png").stat().st_size > 0 and (out / "occupancy.png").stat().st_size > 0


def test_bad_size_is_a_config_error_naming_the_flag(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "flatcake.cli", "simulate", "--ssd", "lots", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert done.returncode == 2 and "--ssd" in done.stderr
