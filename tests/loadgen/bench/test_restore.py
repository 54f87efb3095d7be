"""The restore benchmark on a tiny workload: real files, real fio, every number from the run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.loadgen.bench import restore as br

pytestmark = pytest.mark.integration

TINY = br.Workload(sessions=3, turns=3, pages_per_turn=8, layers=4, page_bytes=8192)


def test_run_measures_every_system_and_derives_ratios(tmp_path: Path) -> None:
    cfg = dataclasses.replace(br.BenchConfig(workload=TINY), staging_slot_bytes=64 * 1024)
    report = br.run(cfg, tmp_path, sweep="gap", quiet=True, log=lambda _: None)
    assert set(report["systems"]) == {"flatcake-engine", "tiered", "tiered-naive", "per-block"}
    pages = TINY.sessions * TINY.turns * TINY.pages_per_turn
    for s in report["systems"].values():
        assert s["bytes_requested"] == pages * TINY.layers * TINY.page_bytes
        assert s["pages_missing"] == 0 and s["read_bytes_per_s"] > 0
    fc, tiered = report["systems"]["flatcake-engine"], report["systems"]["tiered"]
    # Two commands per segment (each turn is one): layer 0 alone, then its other layers back to back;
    # nothing read twice.
    assert fc["read_commands"] == 2 * TINY.sessions * TINY.turns
    assert report["ratios"]["commands_per_segment_layer"] == 2 / TINY.layers
    assert report["ratios"]["read_amplification"] == 1.0
    assert tiered["read_commands"] == pages  # whole pages, one command each
    assert report["systems"]["tiered-naive"]["read_commands"] == pages * TINY.layers  # page-layer by page-layer
    assert tiered["staging_peak_bytes"] == TINY.turns * TINY.pages_per_turn * TINY.layers * TINY.page_bytes
    assert fc["staging_peak_bytes"] == 0  # read in place: the destination is aligned
    hp = report["host_paths"]  # the same restores, in place and staged, alternated
    assert hp["direct_bytes_per_s"] > 0 and hp["staged_bytes_per_s"] > 0
    assert report["limit"]["tool"] == "fio" and report["limit"]["read_bytes_per_s"] > 0
    ratio = report["ratios"]["flatcake_vs_tiered"]
    assert ratio == pytest.approx(fc["read_bytes_per_s"] / tiered["read_bytes_per_s"])
    # Δgap: more bridging never means more commands; bridged bytes show up as read amplification.
    sweep = report["gap_sweep"]
    assert [r["gap_bytes"] for r in sweep] == list(br.GAPS)
    commands = [r["read_commands"] for r in sweep]
    assert commands == sorted(commands, reverse=True) and commands[0] > commands[-1]
    assert sweep[0]["read_amplification"] == 1.0 and sweep[-1]["read_amplification"] > 1.0
    assert all(r["pages_missing"] == 0 for r in sweep)
    text = br.format_table(report)
    assert "flatcake_vs_limit" in text and "Δgap" in text and "host paths" in text


def test_context_sweep_bounds_flatcake_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(br, "CONTEXT_TURNS", (1, 2, 4, 8))
    cfg = dataclasses.replace(br.BenchConfig(workload=TINY), staging_slot_bytes=64 * 1024)
    rows = br.context_sweep(cfg, tmp_path, quiet=True)
    tiered = [r["tiered_staging_peak_bytes"] for r in rows]
    flat = [r["flatcake_staging_peak_bytes"] for r in rows]
    assert tiered == [r["context_bytes"] for r in rows]  # grows with the context
    assert flat == [0] * len(rows)  # read in place into the aligned destination: nothing staged at any length


def test_cli_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r" / "restore.json"
    args = ["bench", "restore", "--quiet", "--dir", str(tmp_path / "work"), "--json", str(out)]
    args += ["--sessions", "2", "--turns", "2", "--pages-per-turn", "4", "--layers", "2", "--page-bytes", "4096"]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"config", "limit", "systems", "ratios"}
    assert data["config"]["workload"]["sessions"] == 2
    assert "flatcake_vs_per_block" in capsys.readouterr().out


def test_cli_reports_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "restore", "--quiet", "--dir", str(tmp_path), "--page-bytes", "1000"]
    assert main(args) == 2
    assert "page_bytes" in capsys.readouterr().err
