"""``bench peers``: the same work for every system, every page checked, peers that fail reported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.loadgen.bench import peers as bp

TINY = bp.PeersConfig(layers=4, page_layer_bytes=8192, page_tokens=256, sessions=3, turns=2, pages_per_turn=4,
                      repeats=1, systems=("flatcake-engine", "tiered"))  # fmt: skip


@pytest.mark.integration
def test_sessions_come_from_the_trace_in_its_order() -> None:
    w = bp.workload(TINY)
    assert len(w.sessions) == 3 and all(1 <= len(s.turns) <= 2 for s in w.sessions)
    assert all(len(t) <= 4 for s in w.sessions for t in s.turns)
    turns = [t for _, t in w.order]
    assert turns == sorted(turns)  # turn t of every session before turn t+1 of any
    assert w.model.raw_page_layer_bytes == 8192 and w.raw_page_bytes == 4 * 8192


@pytest.mark.integration
@pytest.mark.parametrize("system", ["flatcake-engine", "flatcake", "hicache-file", "tiered", "tiered-naive"])
def test_every_page_is_checked_and_a_corrupted_one_is_caught(tmp_path: Path, system: str) -> None:
    w = bp.workload(TINY)
    victim = w.sessions[0].pages[-1]
    result = bp.run_system(system, tmp_path / system, w, TINY, corrupt=victim)
    restored = sum(len(s.pages) for s in w.sessions)
    assert result["ran"] and result["restored_pages"] == restored and result["missing_pages"] == 0
    assert result["corrupt_pages"] == 1 and result["verified_pages"] == restored - 1
    assert result["restore_bytes_per_s"] > 0 and result["durable_write_bytes_per_s"] > 0
    assert 0 < result["time_to_first_layer_s"] <= result["restore_p99_s"]
    assert result["peak_rss_bytes"] > 0


@pytest.mark.integration
def test_a_system_that_cannot_start_is_reported_and_the_others_run(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, systems=("flatcake-engine", "no_such_system", "tiered"))
    report = bp.run(cfg, tmp_path, quiet=True, log=lambda _: None)
    broken = report["systems"]["no_such_system"]
    assert broken["ran"] is False and "no_such_system" in broken["why_not"]
    assert report["systems"]["flatcake-engine"]["ran"] and report["systems"]["tiered"]["ran"]
    assert "not run" in bp.format_table(report)


@pytest.mark.integration
def test_quick_runs_the_ci_systems_and_ratios_come_from_the_same_medians(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["bench", "peers", "--quick", "--quiet", "--dir", str(tmp_path / "scratch"), "--out", str(out)]) == 0
    report = json.loads((out / "peers.json").read_text())
    systems = report["systems"]
    assert {"flatcake", "flatcake-engine", "hicache-file", "mooncake", "tiered", "tiered-naive"} == set(systems)
    for name, s in systems.items():
        assert s["ran"], (name, s["why_not"])
        assert s["corrupt_pages"] == 0 and s["verified_pages"] > 0
        for key in bp.METRICS:
            assert s[f"{key}_min"] <= s[key] <= s[f"{key}_max"]
    fc = systems["flatcake"]
    for name, s in systems.items():
        if name == "flatcake":
            continue
        ratios, key = report["ratios"], name.replace("-", "_")  # ratio keys keep their earlier spelling
        assert ratios[f"flatcake_vs_{key}_restore"] == pytest.approx(
            fc["restore_bytes_per_s"] / s["restore_bytes_per_s"]
        )
        assert ratios[f"flatcake_vs_{key}_ttfl"] == pytest.approx(
            s["time_to_first_layer_s"] / fc["time_to_first_layer_s"]
        )
    assert report["limit"]["read_bytes_per_s"] > 0 and report["limit"]["block_bytes"] % 4096 == 0
    # Beside fio at FlatCake's own command size: the device's ceiling, 1 MiB commands and a deep queue.
    top = report["ceiling"]
    assert top["read_bytes_per_s"] > 0 and top["block_bytes"] == 1 << 20 and top["iodepth"] == bp.CEILING_DEPTH > 1
    assert report["workload"]["model"] == "dsv4-flash" and report["workload"]["page_layer_bytes"] == 48 * 1024
    assert "## FlatCake against its peers" in (out / "peers.md").read_text()
    assert sorted(p.name for p in out.glob("*.png")) == [
        "peers_durable_write_bytes_per_s.png", "peers_restore_bytes_per_s.png", "peers_time_to_first_layer_s.png",
        "peers_timeline.png",
    ]  # fmt: skip


@pytest.mark.unit
def test_a_page_is_reused_when_a_later_request_asks_for_it_again() -> None:
    from flatcake.loadgen.traces.sessions import Session

    shared, a1, a2, b1 = "p", "a1", "a2", "b1"
    sessions = [Session(0, [[shared, a1], [a2]]), Session(1, [[shared, b1]])]
    # Trace order: session 0 turn 0, session 1 turn 0 (shares p), session 0 turn 1 (its prompt holds a1).
    w = bp.Workload(bp.preset("dsv4-flash"), sessions, [(0, 0), (1, 0), (0, 1)])
    assert bp.reused_later(w) == {"p": True, "a1": True, "b1": False, "a2": False}
    acc = bp.placement_accuracy(["dram", "ssd", "ssd", None], [True, True, False, False])
    assert acc == {"dram": [1, 1], "ssd": [2, 1]}


@pytest.mark.integration
@pytest.mark.parametrize("system", ["flatcake", "flatcake-engine"])
def test_placement_through_each_flatcake_path_covers_every_stored_page(tmp_path: Path, system: str) -> None:
    w = bp.workload(TINY)
    result = bp.run_system(system, tmp_path / system, w, TINY)
    placed = result["placement"]
    assert placed["dram"][0] + placed["ssd"][0] == w.unique_pages()  # every stored page, on one medium
    reused = sum(bp.reused_later(w).values())
    assert placed["dram"][1] + placed["ssd"][1] == reused
    # SGLang hands a storage backend whole pages (batch_get_v1): no layer is usable before the last.
    assert result["layers_streamed"] is (system == "flatcake-engine")
    summary = bp.summarize([result, result])
    for medium in ("dram", "ssd"):
        p = summary["placement"][medium]
        assert p["placed"] == 2 * placed[medium][0]
        assert p["reused_fraction"] == (placed[medium][1] / placed[medium][0] if placed[medium][0] else None)
    text = bp.format_table({"limit": {"read_bytes_per_s": 1e9}, "systems": {system: summary}, "ratios": {}})
    assert f"placement, {system}: DRAM" in text
    assert ("whole request (no layer streaming): flatcake" in text) is (system == "flatcake")
