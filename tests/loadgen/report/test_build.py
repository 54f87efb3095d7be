"""Report logic that needs no runs: saturation, spreads over repeats, verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from flatcake.loadgen.report import build as R

pytestmark = pytest.mark.unit


def _records(ttfts: list[float], gap: float = 0.5, ok: bool = True) -> list[dict[str, Any]]:
    return [{"sent": i * gap, "ttft_s": t, "ok": ok, "e2e_s": t + 0.1, "prompt_tokens": 1000, "cached_tokens": 500,
             "hit_tokens": {"hbm": 300, "dram": 100, "ssd": 100}, "output_tokens": 16} for i, t in enumerate(ttfts)]  # fmt: skip


def test_a_run_that_keeps_up_is_not_saturated_and_a_backlog_is() -> None:
    assert R.saturation(_records([0.2] * 40)) is None
    assert R.saturation(_records([0.2] * 39 + [0.9])) is None  # one slow request is not a backlog
    growing = _records([0.2 + 0.3 * i for i in range(40)])  # each request waits for all before it
    why = R.saturation(growing)
    assert why is not None and why.startswith("backlog")
    failed = _records([0.2] * 3) + _records([0.0], ok=False)
    assert R.saturation(failed) == "1 of 4 requests failed"


def _point(hits: list[float], ttft: list[float]) -> dict[str, Any]:
    reps = []
    for h, t in zip(hits, ttft, strict=True):
        recs = _records([t] * 10)
        for r in recs:
            r["cached_tokens"] = int(1000 * h)
        reps.append((recs, R.Path("/nonexistent")))
    return {"qps": 2.0, **R.summarize_point(reps)}


def test_repeats_give_spreads_and_overlapping_spreads_are_called_noise() -> None:
    a = _point([0.90, 0.88, 0.91], [1.0, 1.2, 1.1])
    b = _point([0.60, 0.62, 0.59], [1.15, 1.3, 1.05])
    assert a["spread"]["delivered_hit_rate"] == {"min": 0.88, "median": 0.90, "max": 0.91} and a["repeats"] == 3
    assert a["dram_hit_share"] == pytest.approx(0.2)
    lines = R.verdicts({"flatcake": {"2": a}, "tiered": {"2": b}})
    ttft = next(x for x in lines if "mean TTFT" in x)
    hits = next(x for x in lines if "delivered hits" in x)
    assert ttft.startswith("2 QPS, mean TTFT: flatcake 1.10 s") and "tiered 1.15 s (within noise)" in ttft
    assert "flatcake 90.0% vs tiered 60.0%" in hits and "noise" not in hits


def test_the_ideal_is_labelled_from_the_data_and_unknown_when_absent() -> None:
    assert R.ideal_text({}).startswith("unknown")
    assert R.ideal_text({"ideal_hit_rate_pages": 0.5, "page_tokens": 64}) == "50.0% with 64-token pages"
    both = R.ideal_text({"ideal_hit_rate_tokens": 0.61, "ideal_hit_rate_pages": 0.58})
    assert both == "61.0% by tokens (hash blocks), 58.0% with pages of unrecorded size"


@pytest.mark.parametrize("page", ["report.md", "report.html"])
def test_a_report_without_trace_metadata_says_unknown_not_zero(tmp_path: R.Path, page: str) -> None:
    import json

    for system, ttft in (("a", 0.2), ("b", 0.4)):
        run = tmp_path / system / "qps-2"
        run.mkdir(parents=True)
        (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records([ttft] * 4)))
    report = R.write(tmp_path)
    text = (tmp_path / page).read_text()
    assert "unknown (no trace metadata" in text and "0.0% with" not in text and "256-token" not in text
    assert report["verdicts"] and report["verdicts"][0] in text  # the verdict opens the page
    assert text.index(report["verdicts"][0]) < text.index("a</td>" if page.endswith("html") else "| a |")
    assert "trace ideal: unknown" in R.format_table(report)


def test_an_agents_copies_are_reported_by_event_beside_its_placements(tmp_path: R.Path) -> None:
    prom = tmp_path / "agent.prom"
    prom.write_text(
        "# TYPE flatcake_placements counter\n"
        'flatcake_placements_total{medium="ssd",reason="agent_session"} 7.0\n'
        'flatcake_placements_total{medium="dram",reason="shared_prompt"} 3.0\n'
        "# TYPE flatcake_copy_pages counter\n"
        'flatcake_copy_pages_total{event="admitted_write"} 5.0\n'
        'flatcake_copy_pages_total{event="declined"} 9.0\n'
    )
    got = R.agent_counters(prom)
    assert got is not None and got["placed_pages"] == {"dram": 3.0, "ssd": 7.0}
    assert got["copy_pages"] == {"admitted_write": 5.0, "declined": 9.0}
    prom.write_text('# TYPE flatcake_copy_pages counter\nflatcake_copy_pages_total{event="declined"} 0.0\n')
    got = R.agent_counters(prom)
    assert got is not None and "copy_pages" not in got  # Table 2: no copies, no field
