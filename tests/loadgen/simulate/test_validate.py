"""``flatcake simulate --validate``: the emulator and the simulator on the same small case, side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.loadgen.simulate import validate as V

pytestmark = pytest.mark.integration


def test_validation_runs_both_sides_and_reports_their_differences(tmp_path: Path) -> None:
    out = tmp_path / "val"
    cmd = [sys.executable, "-m", "flatcake.cli", "simulate", "--validate", "--limit", "8", "--qps", "4",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=os.environ.copy(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "emulator (flatcake-native)" in done.stdout and "sim, run's read rate" in done.stdout
    report = json.loads((out / "validate.json").read_text())
    assert report["goals"] == {"hit_points": 2.0, "ttft_ratio": 0.15}
    (row,) = report["results"]
    assert row["system"] == "flatcake-native" and row["emulator_mode"] == "flatcake-native"
    emu, sim = row["emulator"], row["simulator"]
    for side in (emu, sim):
        assert 0 < side["delivered_hit_rate"] < 1 and side["ttft_mean_s"] > 0 and side["ttft_p50_s"] > 0
    # The differences are computed from the two sides, whatever the verdict.
    assert row["hit_diff_points"] == pytest.approx(100 * (sim["delivered_hit_rate"] - emu["delivered_hit_rate"]))
    assert row["ttft_mean_ratio"] == pytest.approx(sim["ttft_mean_s"] / emu["ttft_mean_s"])
    assert row["ttft_p50_ratio"] == pytest.approx(sim["ttft_p50_s"] / emu["ttft_p50_s"])
    assert row["pass"] == all(row["checks"].values()) and report["pass"] == row["pass"]
    # The emulator's SSD restores were timed during the run, and that rate is what the verdict row simulates.
    assert sim["device"]["name"] == "run-flatcake-native" and sim["device"]["read_bytes_per_s"] > 0
    assert set(row["others"]) == {"measured", "this-vm"}
    assert row["others"]["this-vm"]["simulator"]["device"]["name"] == "this-vm"
    emulated = json.loads(Path(report["emulator_report"]).read_text())
    assert emulated["meta"]["requests"] == 8 and set(emulated["systems"]) == {"flatcake-native"}


def test_compare_against_the_goals() -> None:
    emu = {"delivered_hit_rate": 0.90, "ttft_mean_s": 1.0, "ttft_p50_s": 0.5}
    ok = V.compare(emu, {"delivered_hit_rate": 0.885, "ttft_mean_s": 1.1, "ttft_p50_s": 0.45})
    assert ok["pass"] and ok["hit_diff_points"] == pytest.approx(-1.5)
    bad = V.compare(emu, {"delivered_hit_rate": 0.87, "ttft_mean_s": 1.2, "ttft_p50_s": 0.5})
    assert bad["checks"] == {"hit": False, "ttft_mean": False, "ttft_p50": True} and not bad["pass"]


def test_the_runs_read_rate_comes_from_the_emulators_metrics(tmp_path: Path) -> None:
    prom = tmp_path / "emulator.prom"
    prom.write_text('flatcake_ssd_restore_bytes_total{system="flatcake-native"} 3e+09\n'
                    'flatcake_ssd_restore_busy_seconds_total{system="flatcake-native"} 6.0\n'
                    'flatcake_ssd_restore_bytes_total{system="tiered"} 0.0\n')  # fmt: skip
    assert V.run_read_rate(prom, "flatcake-native") == pytest.approx(5e8)
    assert V.run_read_rate(prom, "tiered") is None
