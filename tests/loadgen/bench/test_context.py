"""``bench context``: the TTFT model's pure functions, the checks on its options, and real runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from flatcake.cli import main
from flatcake.loadgen.bench import context as bc
from flatcake.loadgen.models import preset
from flatcake.node_agent import ConfigError


# ---- the TTFT model ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_layer_pipeline_is_bounded_by_the_first_and_the_last_arrival() -> None:
    rng = np.random.default_rng(14)
    for _ in range(200):
        layers = int(rng.integers(1, 100))
        arrivals = np.sort(rng.exponential(rng.uniform(0.001, 1.0), layers)).tolist()
        per_layer = float(rng.uniform(0.0, 0.1))
        t = bc.layer_pipeline_s(arrivals, per_layer)
        # Never before all layers' compute after the first arrival, nor before one layer's after the last;
        # never later than waiting for everything, then computing.
        assert t >= max(arrivals[0] + layers * per_layer, arrivals[-1] + per_layer) - 1e-12
        assert t <= arrivals[-1] + layers * per_layer + 1e-12


@pytest.mark.unit
def test_instant_arrivals_cost_exactly_the_prefill_and_late_ones_only_the_last_layer() -> None:
    model = preset("llama3-70b-tp4")
    prefill = model.prefill_s(512, 65536, "a100")
    assert bc.layer_pipeline_s([0.0] * model.layers, prefill / model.layers) == pytest.approx(prefill)
    # I/O-bound: the GPU waits for each layer; only the last layer's compute is left after the last arrival.
    arrivals = [10.0 * (layer + 1) for layer in range(model.layers)]
    assert bc.layer_pipeline_s(arrivals, prefill / model.layers) == pytest.approx(arrivals[-1] + prefill / model.layers)


@pytest.mark.unit
def test_tiled_arrivals_scale_the_total_and_keep_the_first_layer() -> None:
    measured = [0.01, 0.03, 0.04, 0.06, 0.10]
    tiled = bc.tile_arrivals(measured, 20)
    assert len(tiled) == 20 and tiled[0] == measured[0]
    assert tiled[-1] == pytest.approx(measured[-1] * 4)
    assert all(a <= b for a, b in itertools.pairwise(tiled))
    assert bc.tile_arrivals(measured, 5) == measured
    with pytest.raises(ValueError, match="do not divide"):
        bc.tile_arrivals(measured, 12)
    linear = bc.linear_arrivals(0.02, 1.0, 80)
    assert linear[0] == 0.02 and linear[-1] == pytest.approx(1.0) and len(linear) == 80


@pytest.mark.unit
def test_whole_request_systems_add_the_scaled_restore_and_streaming_overlaps_it() -> None:
    cfg = bc.ContextConfig(measured_layers=10)
    model = cfg.geometry()
    prefill = model.prefill_s(cfg.suffix, 32768, "a100")
    result = {"tokens": 32768, "restore_s": 0.2, "first_layer_s": 0.02,
              "layer_arrivals_s": [0.02 * (i + 1) for i in range(10)]}  # fmt: skip
    whole = bc.ttft_of("tiered", result, model, cfg)
    assert whole["ttft_s"] == pytest.approx(0.2 * 8 + prefill) and whole["restore_s"] == pytest.approx(1.6)
    streamed = bc.ttft_of("flatcake-engine", result, model, cfg)
    assert streamed["arrivals"] == "measured per layer"
    assert 1.6 < streamed["ttft_s"] < whole["ttft_s"]
    assert streamed["ttft_s"] >= 1.6 + prefill / model.layers - 1e-12
    interpolated = bc.ttft_of("flatcake-engine", dict(result, layer_arrivals_s=None), model, cfg)
    assert interpolated["arrivals"] == "interpolated between first layer and total"


@pytest.mark.unit
def test_bad_options_name_the_option_and_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--tokens: 1000: .*multiple of .*256-token page"):
        bc.ContextConfig(tokens=(8192, 1000)).geometry()
    with pytest.raises(ConfigError, match=r"--measured-layers: 3 must divide .*80 layers"):
        bc.ContextConfig(measured_layers=3).geometry()
    with pytest.raises(ConfigError, match=r"--systems: 'gds' is not a system of context; choose from flatcake-engine,"):
        bc.ContextConfig(systems=("flatcake-engine", "gds")).geometry()
    with pytest.raises(ConfigError, match="gpu"):
        bc.ContextConfig(gpu="b200").geometry()
    scratch = tmp_path / "scratch"
    for args, option in ((["--tokens", "8192,1000"], "--tokens"), (["--tokens", "8k"], "--tokens"),
                         (["--measured-layers", "7"], "--measured-layers")):  # fmt: skip
        assert main(["bench", "context", "--dir", str(scratch), *args]) == 2
        assert option in capsys.readouterr().err
    assert not scratch.exists()  # refused before anything was written


# ---- real runs -------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_quick_measures_every_length_and_the_ratios_are_the_medians(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", "context", "--quick", "--dir", str(tmp_path / "scratch"), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "measured on 2 of 80 layers, x40" in table and "paper 2.3-4.9x" in table
    report = json.loads((out / "context.json").read_text())
    assert [row["tokens"] for row in report["rows"]] == [2048, 8192]
    assert report["scaling"] == {"layers": 80, "measured_layers": 2, "factor": 40,
                                 "note": "measured on 2 of 80 layers, x40"}  # fmt: skip
    model = preset("llama3-70b-tp4")
    for row in report["rows"]:
        systems = row["systems"]
        assert set(systems) == {"recompute", "tiered", "flatcake-engine"}
        for name, s in systems.items():
            assert s["ran"], (name, s["why_not"])
            assert s["ttft_s"]["min"] <= s["ttft_s"]["median"] <= s["ttft_s"]["max"]
        assert systems["recompute"]["ttft_s"]["median"] == pytest.approx(
            model.prefill_s(row["tokens"] + 512, 0, "a100")
        )
        for name in ("tiered", "flatcake-engine"):
            s = systems[name]
            assert s["dram_pages"] == 0 and s["read_commands"] > 0  # every page came from the SSD
        tiered, fc, prefill = systems["tiered"], systems["flatcake-engine"], row["prefill_suffix_s"]
        assert tiered["ttft_s"]["median"] == pytest.approx(tiered["restore_s"]["median"] + prefill)
        # Streamed: no sooner than the first layer plus all the compute, no later than waiting for it all.
        assert fc["first_layer_s"]["median"] + prefill - 1e-9 <= fc["ttft_s"]["median"]
        assert fc["ttft_s"]["median"] <= fc["restore_s"]["median"] + prefill + 1e-9
        assert systems["flatcake-engine"]["arrivals"] == "measured per layer"
        for name in ("recompute", "tiered"):
            assert row["ratios"][f"flatcake_vs_{name}"] == pytest.approx(
                systems[name]["ttft_s"]["median"] / systems["flatcake-engine"]["ttft_s"]["median"]
            )
    assert report["paper"]["flatcake_vs_mooncake"] == [1.5, 2.4]
    assert [Path(p).name for p in report["plots"]] == ["context_ttft.png"] and (out / "context_ttft.png").stat().st_size
    assert not any((tmp_path / "scratch").iterdir())  # each measurement's files are gone


@pytest.mark.integration
def test_mooncake_restores_from_its_ssd_offload(tmp_path: Path) -> None:
    assert importlib.util.find_spec("mooncake") is not None, (
        "Mooncake Store is not installed: pip install --no-deps -r requirements/peers.txt "
        "(bin/test installs it with FLATCAKE_EXTRAS='sglang peers')"
    )
    cfg = dataclasses.replace(bc.QUICK, tokens=(2048,), systems=("mooncake", "flatcake-engine"))
    report = bc.run(cfg, tmp_path, log=lambda _: None)
    row = report["rows"][0]
    mooncake = row["systems"]["mooncake"]
    assert mooncake["ran"], mooncake["why_not"]
    assert mooncake["dram_pages"] == 0 and mooncake["arrivals"] == "whole request"
    assert row["ratios"]["flatcake_vs_mooncake"] > 0
