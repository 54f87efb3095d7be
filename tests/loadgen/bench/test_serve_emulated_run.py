"""``bench serve`` with an emulated system, end to end on a tiny slice: the emulator mirrors the real
deployment (a node agent beneath it), Locust replays the slice through SGLang's /generate, and the row has
the real systems' fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake.loadgen.bench import serve

pytestmark = pytest.mark.integration


def test_one_emulated_point_runs_end_to_end(tmp_path: Path) -> None:
    cfg = serve.ServeConfig(systems=("emu-flatcake",), qps=(2.0,), requests=6, users=2, repeats=1)
    report = serve.run(cfg, tmp_path, log=lambda _: None)
    (row,) = report["systems"]
    assert row["ran"], row.get("why_not")
    assert row["system"] == "emu-flatcake" and row["errors"] == 0
    assert row["ttft_mean_s"] > 0 and row["ttft_p99_s"] >= row["ttft_mean_s"]
    assert row["logprobs_match_cold"] is None  # no model behind the emulator: n/a, never "matches"
    (run,) = report["runs"]
    assert run["requests"] == 6
    tiers = run["cached_tokens_by_tier"]
    assert set(tiers) == {"device", "host", "storage"} and sum(tiers.values()) <= run["prompt_tokens"]
    assert sum(tiers.values()) > 0  # the users' later turns find their earlier ones
    assert "dram_hits" in run and "ssd_hits" in run  # the agent's restores by medium
    assert run["emulated"]["counterpart"] == "flatcake" and run["emulated"]["storage_dram_bytes"] > 0
    where = tmp_path / "emu-flatcake" / "qps-2" / "rep-0"
    assert (where / "emulator.prom").exists() and (where / "agent.prom").exists()
    assert json.loads((tmp_path / "serve.json").read_text())["meta"]["server_python"] is None
    assert "| emu-flatcake | 2 | yes |" in (tmp_path / "serve.md").read_text()
