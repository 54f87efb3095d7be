"""The benches' one-process-per-measurement protocol (loadgen/bench/worker.py), shared by context and peers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flatcake.loadgen.bench import worker
from flatcake.loadgen.bench.context import ContextConfig
from flatcake.loadgen.bench.peers import PeersConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cfg", [ContextConfig(tokens=(1024, 2048), systems=("flatcake",)), PeersConfig(sessions=3)])
def test_a_config_survives_the_json_job(cfg: ContextConfig | PeersConfig) -> None:
    fields = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert worker.config(type(cfg), fields) == cfg  # tuples came back as tuples: equal and hashable
    hash(worker.config(type(cfg), fields))


def test_a_worker_that_dies_is_reported_and_its_directory_goes(tmp_path: Path) -> None:
    directory = tmp_path / "job"
    result = worker.run("flatcake.loadgen.bench.no_such_module", directory, {"system": "x"}, timeout=60)
    assert result["ran"] is False and result["why_not"].startswith("worker exited 1")
    assert "No module named" in result["why_not"] and not directory.exists()
