"""bin/generate, run as a developer runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_bin_generate_runs_and_the_committed_artifacts_are_what_it_writes() -> None:
    """bin/generate itself (it imports devtools/ from the checkout, which PYTHONSAFEPATH keeps off the
    path): it succeeds, and the files it writes are byte for byte the committed ones."""
    root = DOCS.parent
    written = [DOCS / "metrics.md", DOCS / "configuration.md", DOCS / "benchmarks.md", root / "CONTRIBUTING.md",
               root / "README.md",
               *sorted((root / "dashboards").glob("*.json")), *sorted((root / "charts" / "flatcake").rglob("*.y*ml"))]  # fmt: skip
    before = {p: p.read_bytes() for p in written}
    run = subprocess.run([str(root / "bin" / "generate")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [str(p) for p in written if p.read_bytes() != before[p]] == []


def test_contributings_layer_line_is_the_contracts() -> None:
    """The line CONTRIBUTING.md shows is the import-linter contract's layers (devtools/layers.py writes it)."""
    import sys

    sys.path.append(str(ROOT))  # devtools/ is a checkout's tools, not in the wheel
    from devtools import layers

    got = layers.node_agent_layers()
    assert got[0] == "sglang | vllm" and got[-1] == "constants"
    assert layers.markdown() in (ROOT / "CONTRIBUTING.md").read_text()
