"""examples/ stays true (issue 46): each FlatCakeCache passes `flatcake operator render` (the CRD's schema
offline, then the operator's checks) and its kv is what `flatcake geometry` derives for the model; the
agent configuration starts an agent, and the client round trip runs against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flatcake.cli import main
from flatcake.node_agent import geometry
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.service.main import spawn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CONFIGS = ROOT / "tests" / "node_agent" / "model_configs"
MODELS = {  # example -> (the model's config.json, tensor-parallel ranks)
    "cache-qwen2.5-7b.yaml": ("qwen2.5-7b-instruct", 1),
    "cache-llama-3.1-70b-tp4.yaml": ("llama-3.1-70b-instruct", 4),
    "cache-deepseek-v3-tp8.yaml": ("deepseek-v3", 8),
    "cache-gpt-oss-20b.yaml": ("gpt-oss-20b", 1),
}


def test_every_example_cache_is_listed_and_checked() -> None:
    assert {p.name for p in EXAMPLES.glob("cache-*.yaml")} == set(MODELS)
    listed = (EXAMPLES / "README.md").read_text()
    assert all(f"`{name}`" in listed for name in [*MODELS, "agent.json", "round_trip.py"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_cache_renders_and_matches_its_models_geometry(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "render", str(EXAMPLES / name)]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert any(o["kind"] == "DaemonSet" for o in objects)
    kv = yaml.safe_load((EXAMPLES / name).read_text())["spec"]["kv"]
    model, tp = MODELS[name]
    g = geometry.load(CONFIGS / f"{model}.json", tp=tp, page_tokens=kv["pageTokens"])
    assert (kv["layers"], kv["pageBytes"]) == (g.layers, g.page_bytes)


def test_the_agent_config_serves_the_round_trip(tmp_path: Path) -> None:
    config = EngineConfig.load(EXAMPLES / "agent.json")  # every field checked, the required ones given
    # The example's paths, moved under this test's directory (the file names /tmp/flatcake-example).
    text = (EXAMPLES / "agent.json").read_text().replace("/tmp/flatcake-example", str(tmp_path))
    (tmp_path / "agent.json").write_text(text)
    config = EngineConfig.load(tmp_path / "agent.json")
    with (tmp_path / "agent.log").open("wb") as log:
        agent = spawn(config, tmp_path, log)
        try:
            done = subprocess.run([sys.executable, str(EXAMPLES / "round_trip.py"), config.agent.socket],
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        finally:
            agent.terminate()
            agent.wait(30)
    assert done.returncode == 0, done.stderr
    assert "4 pages stored and read back bit-exact" in done.stdout
