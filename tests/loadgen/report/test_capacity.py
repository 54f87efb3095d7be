"""Load ladders, knees and goodput (loadgen/report/capacity.py), on systems whose capacity is known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.report import capacity as C

pytestmark = pytest.mark.unit


def queue(rate: float, service_s: float, requests: int = 200, extra_s: float = 0.0) -> tuple[list[float], list[float]]:
    """A single server with a fixed service time (capacity 1/service_s) fed at an even ``rate``: the
    arrivals and first-token times. ``extra_s`` adds a fixed delay to every request (not queueing)."""
    arrivals = [i / rate for i in range(requests)]
    free, firsts = 0.0, []
    for a in arrivals:
        start = max(a, free)
        free = start + service_s
        firsts.append(free + extra_s)
    return arrivals, firsts


def point(system: str, rate: float, service_s: float, slo: float, extra_s: float = 0.0) -> dict[str, Any]:
    arrivals, firsts = queue(rate, service_s, extra_s=extra_s)
    ttft = [f - a for a, f in zip(arrivals, firsts, strict=True)]
    sat = C.saturation(arrivals, firsts)
    p90 = C.percentile(ttft, 90)
    return {"system": system, "qps": rate, "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p90_s": p90,
            "ttft_p50_s": C.percentile(ttft, 50), "ttft_p99_s": C.percentile(ttft, 99), "saturation": sat,
            "label": C.label(p90, sat is not None, slo), "delivered_hit_rate": 0.9 if sat is None else 0.6,
            "throughput_tokens_per_s": min(rate, 1 / service_s) * 1000}  # fmt: skip


def climb(
    ladder: C.Ladder, services: dict[str, float], slo: float, extra: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Run the ladder to the end as a bench does: plan, run, label, again."""
    labels: dict[tuple[str, float], str] = {}
    results = []
    rounds = 0
    while todo := ladder.plan(labels):
        rounds += 1
        assert rounds < 50, "the ladder never finished"
        for s, q in todo:
            r = point(s, q, services[s], slo, (extra or {}).get(s, 0.0))
            labels[(s, q)] = r["label"]
            results.append(r)
    return results


def test_rungs_follow_the_series_across_decades() -> None:
    assert C.rungs(0.5, 16) == (0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.5, 15.0)
    assert C.rungs(3, 3) == (3.0,)
    with pytest.raises(ValueError, match="start"):
        C.rungs(4, 2)


def test_a_queue_past_its_capacity_is_saturated_and_one_below_is_not() -> None:
    a, f = queue(rate=12.5, service_s=0.1)  # capacity 10/s
    assert C.saturation(a, f) is not None and "backlog" in C.saturation(a, f)  # type: ignore[operator]
    a, f = queue(rate=8.0, service_s=0.1)
    assert C.saturation(a, f) is None
    assert C.saturation([0.0], [0.1], failed=3) == "3 of 4 requests failed"


def test_the_ladder_finds_the_knee_of_a_system_with_a_known_capacity() -> None:
    slo = 0.5
    # fast: capacity 1/0.11 = 9.1/s, so 8 is its last rung; at 10 it queues (P90 past the objective) and
    # at 12.5 (1.4x its capacity) it saturates. slow: capacity 4.5/s.
    ladder = C.Ladder(C.rungs(1, 40), ("fast", "slow"), reference="slow")
    results = climb(ladder, {"fast": 0.11, "slow": 0.22}, slo)
    cap = C.analyse(results, ladder, slo, mean_prompt_tokens=1000.0)
    fast, slow = cap["systems"]["fast"], cap["systems"]["slow"]
    assert (fast["knee_qps"], fast["first_failed_qps"], fast["failed_as"]) == (8.0, 10.0, C.OVER_SLO)
    assert (slow["knee_qps"], slow["first_failed_qps"]) == (4.0, 5.0)
    assert fast["goodput_prompt_tokens_per_s"] == 8000.0
    assert cap["reference_knee_qps"] == 4.0
    assert cap["vs_reference"]["fast"]["goodput"] == 2.0
    # one rung past each knee, and nothing further up the ladder than that or the overload points
    rates = {s: sorted(p["qps"] for p in cap["systems"][s]["points"]) for s in ("fast", "slow")}
    assert max(rates["fast"]) == 12.5 and max(rates["slow"]) == 8.0
    # every system ran at 1.5x and 2x the reference's knee, and says what it held there
    for s in ("fast", "slow"):
        assert {6.0, 8.0} <= set(rates[s])
        assert set(cap["systems"][s]["at_overload"]) == {"1.5x", "2x"}
    assert cap["systems"]["slow"]["at_overload"]["2x"]["label"] == C.SATURATED
    assert next(p for p in fast["points"] if p["qps"] == 12.5)["label"] == C.SATURATED
    assert cap["systems"]["fast"]["at_overload"]["1.5x"]["label"] == C.OK


def test_slow_but_keeping_up_is_over_the_objective_not_saturated() -> None:
    slo = 0.5
    ladder = C.Ladder(C.rungs(1, 4), ("late",), reference=None)
    results = climb(ladder, {"late": 0.01}, slo, extra={"late": 0.6})  # never queues, always 0.61 s
    cap = C.analyse(results, ladder, slo, 100.0)
    late = cap["systems"]["late"]
    assert late["knee_qps"] is None and late["first_failed_qps"] == 0.25 and late["failed_as"] == C.OVER_SLO
    assert late["goodput_prompt_tokens_per_s"] is None
    # its first rung and one past, and down the series to a quarter of the first rung, failing all the way
    assert [p["qps"] for p in late["points"]] == [0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25]


def test_a_system_that_never_fails_is_marked_beyond_the_ladder() -> None:
    ladder = C.Ladder(C.rungs(1, 2), ("fast",), reference=None)
    cap = C.analyse(climb(ladder, {"fast": 0.01}, 0.5), ladder, 0.5, 10.0)
    fast = cap["systems"]["fast"]
    assert fast["beyond_ladder"] and fast["knee_qps"] == 2.0 and fast["first_failed_qps"] is None
    assert "2+" in C.format_table(cap)


def test_the_table_marks_saturated_points_and_the_plot_is_drawn(tmp_path: Path) -> None:
    slo = 0.5
    ladder = C.Ladder(C.rungs(2, 20), ("fast", "slow"), reference="slow")
    cap = C.analyse(climb(ladder, {"fast": 0.11, "slow": 0.22}, slo), ladder, slo, 1000.0, ideal_hit_rate=0.9)
    text = C.format_table(cap)
    assert "saturated" in text and "P90 TTFT <= 0.5 s" in text
    png = Path(C.plot(cap, tmp_path / "load.png"))
    assert png.stat().st_size > 10_000
    json.dumps(cap)  # the analysis is what the benches write as JSON


def test_the_default_objective_is_the_cold_prefill_of_the_p90_prompt() -> None:
    prompts = list(range(1, 101))  # P90 = 90.1 tokens
    assert C.default_slo_s(prompts, lambda n: n * 0.0123) == pytest.approx(1.2)  # 90 x 0.0123 = 1.107 -> 1.2
    assert C.default_slo_s([1000], lambda n: 0.0314) == pytest.approx(0.032)
    with pytest.raises(ValueError, match="no prompts"):
        C.default_slo_s([], lambda n: 1.0)


def test_ladder_refuses_rates_out_of_order() -> None:
    with pytest.raises(ValueError, match="ascending"):
        C.Ladder((2.0, 1.0), ("a",))
    with pytest.raises(ValueError, match="no systems"):
        C.Ladder((1.0,), ())


def test_bisection_sharpens_a_knee_between_rungs_before_the_overload_points() -> None:
    slo = 0.5
    ladder = C.Ladder(C.rungs(1, 40), ("fast", "slow"), reference="slow", resolution=1.06)
    labels: dict[tuple[str, float], str] = {}
    results = []
    while todo := ladder.plan(labels):
        ref_knee, ref_fail = ladder.bracket("slow", labels)
        overload = [q for s, q in todo if q not in ladder.rates and s == "fast" and q > 8]
        if overload:  # the overload points are only planned once the reference's knee is resolved
            assert ref_knee is not None and ref_fail is not None and ref_fail / ref_knee <= 1.06
        for s, q in todo:
            r = point(s, q, {"fast": 0.11, "slow": 0.22}[s], slo)
            labels[(s, q)] = r["label"]
            results.append(r)
    cap = C.analyse(results, ladder, slo, 1000.0)
    fast, slow = cap["systems"]["fast"], cap["systems"]["slow"]
    # capacities 9.1/s and 4.5/s: the rungs alone said 8 and 4
    assert 8.5 < fast["knee_qps"] < 9.6 and fast["first_failed_qps"] / fast["knee_qps"] <= 1.06
    assert 4.2 < slow["knee_qps"] < 4.8
    assert set(slow["at_overload"]) == {"1.5x", "2x"}
    with pytest.raises(ValueError, match="resolution"):
        C.Ladder((1.0,), ("a",), resolution=1.0)


def test_a_system_failing_on_the_first_rung_steps_down_to_find_its_knee() -> None:
    slo = 0.5
    ladder = C.Ladder(C.rungs(4, 10), ("slow",), reference=None)  # capacity 2.5/s, below the first rung
    cap = C.analyse(climb(ladder, {"slow": 0.4}, slo), ladder, slo, 1.0)
    slow = cap["systems"]["slow"]
    assert slow["knee_qps"] == 2.5 and slow["first_failed_qps"] == 3.0
    hopeless = C.Ladder(C.rungs(4, 10), ("stuck",), reference=None)
    stuck = C.analyse(climb(hopeless, {"stuck": 5.0}, slo), hopeless, slo, 1.0)["systems"]["stuck"]
    assert stuck["knee_qps"] is None and min(p["qps"] for p in stuck["points"]) == 1.0  # a quarter of 4, no lower
