"""``bench serve`` end to end, small: a real SGLang server (CPU) with FlatCake's backend, a trace slice
replayed through Locust, the probe back from L3, the report's fields (issue 28's JSON contract)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake.loadgen.bench import serve

pytestmark = pytest.mark.system


def test_a_slice_replayed_through_locust_against_a_real_sglang_server_on_flatcake(tmp_path: Path) -> None:
    cfg = serve.ServeConfig(systems=("flatcake",), qps=(1.0,), requests=8, repeats=1)
    report = serve.run(cfg, tmp_path, log=lambda _: None)
    (row,) = report["systems"]
    assert row["ran"] and row["why_not"] == "" and row["errors"] == 0, row
    assert row["logprobs_match_cold"] and row["probe_from_storage_tokens"] > 0  # the probe came back from FlatCake
    assert set(row["cached_tokens_by_tier"]) == {"device", "host", "storage"}
    assert row["ttft_mean_s"] > 0 and row["ttft_p99_s"] >= row["ttft_mean_s"] * 0.5
    assert (
        {"dram_hits", "ssd_hits"} <= set(row) and row["cpu_s"]["server"] > 0 and row["cpu_s"]["backend_processes"] > 0
    )
    records = (tmp_path / "flatcake" / "qps-1" / "rep-0" / "results.jsonl").read_text().splitlines()
    assert len(records) == 8 and all(json.loads(r)["ok"] for r in records)  # every request replayed and answered
    assert json.loads((tmp_path / "serve.json").read_text())["systems"] == report["systems"]
    assert "| flatcake | 1 | yes |" in (tmp_path / "serve.md").read_text()
