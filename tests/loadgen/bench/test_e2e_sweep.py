"""``bench e2e --sweep``: the ladder's rounds, repeats and labels, and the report's capacity section, with
each point's replay replaced by a queue of known capacity (the replay itself runs in test_loadgen)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.bench import e2e

pytestmark = pytest.mark.unit

SERVICE_S = {"tiered": 0.2, "dram": 0.4}  # capacities 5/s and 2.5/s


def fake_run_point(cfg: e2e.E2EConfig, emu: Any, trace: Path, point: e2e.Point, out: Path, work: Path) -> None:
    """What Locust would record for a single server of fixed service time fed at the point's rate."""
    run_dir = out / point.label / f"qps-{point.qps:g}" / f"rep-{point.repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    free, lines = 0.0, []
    for i in range(60):
        sent = i / point.qps
        free = max(sent, free) + SERVICE_S[point.system] * (1 - 0.01 * point.repeat)
        lines.append(json.dumps({"sent": sent, "ttft_s": free - sent, "e2e_s": free - sent + 0.01, "ok": True,
                                 "prompt_tokens": 1000, "cached_tokens": 800, "output_tokens": 4,
                                 "hit_tokens": {"hbm": 800}}))  # fmt: skip
    (run_dir / "results.jsonl").write_text("\n".join(lines) + "\n")


def test_the_sweep_climbs_each_system_to_its_knee_and_reports_goodput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[str, float, int]] = []

    def record(cfg: e2e.E2EConfig, emu: Any, trace: Path, point: e2e.Point, out: Path, work: Path) -> None:
        runs.append((point.label, point.qps, point.repeat))
        fake_run_point(cfg, emu, trace, point, out, work)

    monkeypatch.setattr(e2e, "run_point", record)
    cfg = e2e.E2EConfig(requests=12, systems=("tiered", "dram"), repeats=2, ladder=(1.0, 10.0), slo_ttft_s=0.5)
    report = e2e.run(cfg, tmp_path, log=lambda _: None)
    cap = report["capacity"]
    assert cap["slo_ttft_p90_s"] == 0.5 and cap["reference"] == "tiered"
    assert cap["systems"]["tiered"]["knee_qps"] == 5.0  # 6/s queues past the objective
    assert cap["systems"]["dram"]["knee_qps"] == 2.5
    assert cap["reference_knee_qps"] == 5.0
    assert set(cap["systems"]["dram"]["at_overload"]) == {"1.5x", "2x"}  # 7.5 and 10 QPS
    assert cap["vs_reference"]["dram"]["goodput"] == 0.5
    # every point ran twice, and nothing ran past one rung beyond a knee but one bisection (2.74, between
    # dram's knee and its first failure) and the overload points
    assert {rep for *_, rep in runs} == {0, 1}
    assert max(q for s, q, _ in runs if s == "tiered") == 10.0
    assert sorted({q for s, q, _ in runs if s == "dram"}) == [1.0, 1.25, 1.5, 2.0, 2.5, 2.74, 3.0, 4.0, 7.5, 10.0]
    md = (tmp_path / "report.md").read_text()
    assert "## Capacity" in md and "| tiered | 5.0 |" in md
    assert (tmp_path / "capacity.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "meta.json").read_text())["qps"][-1] == 10.0


def test_the_default_objective_comes_from_the_model_and_the_slice() -> None:
    cfg = e2e.E2EConfig(requests=40, systems=("tiered",), ladder=(1.0, 4.0))
    reqs = e2e.slices.select(cfg.trace, 0, 40, None)
    lad = e2e.ladder_meta(cfg, reqs, (1.0, 2.0))
    prompts = sorted(r.input_length for r in reqs)
    cold_p90 = e2e.preset(cfg.model).prefill_s(prompts[int(0.9 * (len(prompts) - 1))], 0, cfg.gpu)
    assert lad["slo_ttft_p90_s"] >= cold_p90 * 0.9 and lad["slo_rule"].startswith("cold prefill")
    with pytest.raises(ValueError, match="ladder"):
        e2e.E2EConfig(ladder=(4.0, 1.0))


def test_bench_serve_climbs_its_ladder_over_the_rows_its_points_write(tmp_path: Path) -> None:
    from flatcake.loadgen.bench import serve, serve_capacity

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 2048, "output_length": 4,
                                         "hash_ids": [i]}) + "\n" for i in range(20)))  # fmt: skip
    service = {"hicache-file": 0.5, "flatcake": 0.25}  # capacities 2/s and 4/s
    rows: list[dict[str, Any]] = []

    def one(system: str, qps: float, rep: int) -> None:
        free, records = 0.0, []
        for i in range(40):
            sent = i / qps
            free = max(sent, free) + service[system]
            records.append({"ok": True, "sent": sent, "ttft_s": free - sent, "prompt_tokens": 2048,
                            "output_tokens": 4, "hit_tokens": {"storage": 1024}})  # fmt: skip
        rows.append({**serve.summarize(system, qps, records, 40 / qps, True, 0, None), "repeat": rep})

    cfg = serve.ServeConfig(systems=("flatcake", "hicache-file"), ladder=(0.5, 8.0), slo_ttft_s=1.0, repeats=2)
    lad = serve_capacity.climb(cfg, trace, one, rows, serve.summary, lambda _: None)
    cap = serve_capacity.ladder_capacity(serve.summary(rows), lad)
    assert lad["reference"] == "hicache-file"
    assert cap["systems"]["hicache-file"]["knee_qps"] == 2.0 and cap["systems"]["flatcake"]["knee_qps"] == 4.0
    assert cap["vs_reference"]["flatcake"]["goodput"] == 2.0
    assert {r["repeat"] for r in rows} == {0, 1}


def test_bench_serve_refuses_a_gpu_ratio_the_calibration_does_not_hold() -> None:
    from flatcake.errors import ConfigError
    from flatcake.loadgen.bench import serve, serve_capacity

    with pytest.raises(ConfigError, match="llama3-70b-tp4-h200"):
        serve_capacity.testbed_plan(serve.ServeConfig(gpu_ratio="llama3-70b-tp4-a100"))
    plan = serve_capacity.testbed_plan(serve.ServeConfig(gpu_ratio="llama3-70b-tp4-h200"))
    assert plan is not None and plan["shape"] == "mha-small-mlp" and 1e8 < plan["read_bytes_per_s"] < 1e9
