from __future__ import annotations

import pytest

from flatcake.loadgen.bench import agent as ba

pytestmark = pytest.mark.integration


def test_agent_benchmark_measures_every_point_side_by_side() -> None:
    cfg = ba.AgentBenchConfig(batches=(16, 256), clients=(1, 2), seconds=0.2)
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
