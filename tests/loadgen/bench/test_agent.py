from __future__ import annotations

import dataclasses

import pytest

from flatcake.loadgen.bench import agent as ba

pytestmark = pytest.mark.integration


def test_agent_benchmark_measures_every_point_side_by_side() -> None:
    # The latency part only: the others run in the quick test below, at CI sizes (their defaults are
    # the full run's: 4 + 16 GiB of writes and 22M keys published).
    cfg = ba.AgentBenchConfig(batches=(16, 256), clients=(1, 2), seconds=0.2, parts=("latency",))
    report = ba.run(cfg, log=lambda _: None)
    rows = report["rows"]
    assert {(r["op"], r["batch"], r["clients"]) for r in rows} == {
        (op, b, c) for op in ("lookup", "lookup_socket", "allocate_publish") for b in (16, 256) for c in (1, 2)
    }
    for r in rows:
        assert r["calls"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["in_process_p50_ms"] > 0
        # Lookups read the shared index: the agent serves none of them.
        assert (r["agent_service_ms"] == 0) if r["op"] == "lookup" else (r["agent_service_ms"] > 0)
        assert r["agent_vs_in_process_p50"] == pytest.approx(r["p50_ms"] / r["in_process_p50_ms"])
    publishes = [r for r in rows if r["op"] == "allocate_publish"]
    assert all(r["journal_records"] >= r["calls"] for r in publishes)  # every publish journaled (+ reclaims)
    assert report["goal"]["lookup_4096_p99_ms"] is None  # no 4,096-key point was asked for
    assert "lookup" in ba.format_table({**report, "goal": {"lookup_4096_p99_ms": 0.0, "target_ms": 2.0}})


def test_quick_mode_reports_every_summary_field_with_sane_values() -> None:
    """The issue's summary, every field measured (smaller than ``--quick``); values sane, not fast."""
    cfg = dataclasses.replace(ba.QUICK, seconds=0.2, index_keys=20_000, restart_bytes=(32 << 20, 64 << 20),
                              restart_keys=(("dsv4-flash", 3000), ("llama3-70b-tp4", 2000)), soak_puts=1500)  # fmt: skip
    report = ba.run(cfg, log=lambda _: None)
    s = report["summary"]
    assert set(ba.GOALS) <= set(s), set(ba.GOALS) - set(s)
    for name in ("lookup_4096_p99_ms_1c", "lookup_4096_p99_ms_8c", "publish_4096_p50_ms_1c", "publish_4096_p50_ms_8c"):
        assert 0 < s[name] < 60_000
    assert 0.9 <= s["usable_capacity_fraction"] <= 1.0  # one-page scopes share files: nearly all of the pool
    # At the default watermarks the first reclaim comes at the high watermark (0.9): just below it, never above.
    high = report["capacity_at_defaults"]["high_watermark"]
    assert high < 1.0 and high - 0.05 <= s["usable_capacity_fraction_at_defaults"] <= high
    assert report["capacity"]["one_page_scopes"] == report["capacity"]["scopes_held"] > 8  # more scopes than files
    for r, size in zip(report["restart"], cfg.restart_bytes, strict=True):
        assert r["stored_bytes"] == size and r["scan_done"] and r["dropped_pages"] == 0
        assert r["scan_bytes"] == size  # the background scan checked every stored page
        assert 0 < r["restart_to_serving_s"] < 120
    assert s["restart_full_verify_bytes_per_s"] > 0
    # Each restart point is named by what it measured, and each has the restart goal.
    assert {n for n in s if n.startswith(ba.RESTART_PREFIX)} == {
        "restart_to_serving_s_32mib", "restart_to_serving_s_64mib",
        "restart_to_serving_s_3k_keys_dsv4_flash", "restart_to_serving_s_2k_keys_llama3_70b_tp4",
    }  # fmt: skip
    for r, (model, keys) in zip(report["restart_keys"], cfg.restart_keys, strict=True):
        assert r["model"] == model and r["keys"] == r["recovered_pages"] == keys  # every key back
        assert r["page_tokens"] == 64 and r["pool_bytes"] == keys * r["layers"] * r["page_layer_bytes"]
        assert 0 < r["restart_to_serving_s"] < 120 and r["journal_bytes"] > keys * 16 and r["agent_rss_bytes"] > 0
    assert report["restart_keys"][1]["page_layer_bytes"] == 64 * 1024  # Llama-3-70B, TP4: 1 KiB/token/layer
    assert 16 < s["index_bytes_per_key"] < 10_000 and report["index"]["keys"] == 20_000
    j = report["journal"]
    assert j["live_records"] > 0 and j["compacted_bytes"] < j["journal_bytes"]  # the soak churned
    assert s["journal_bytes_per_live_record"] == j["journal_bytes"] / j["live_records"]
    for name, g in report["goals"].items():
        assert g["value"] == s[name] and (g["met"] is None) == (ba.goal_of(name) is None)
    table = ba.format_table(report)
    assert all(name in table for name in s)
