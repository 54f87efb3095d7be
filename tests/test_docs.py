"""The docs name what the code defines."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from flatcake import metrics as M
from flatcake.node_agent.config import EngineConfig

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_metrics_page_holds_the_generated_catalogue() -> None:
    text = (DOCS / "metrics.md").read_text()
    assert M.markdown_table() in text, "docs/metrics.md is stale: run bin/generate"
    assert all(f"`{M.exposed_name(s)}`" in text for s in M.CATALOG.values())


def _fields(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (
            isinstance(f.default_factory, type) if f.default_factory is not dataclasses.MISSING else False
        ):
            out += _fields(f.default_factory, prefix + f.name + ".")  # type: ignore[arg-type]
        else:
            out.append(prefix + f.name)
    return out


def test_every_config_field_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    fields = _fields(EngineConfig)
    assert "agent.journal_fsync" in fields and "ssd.file_bytes" in fields
    undocumented = [f for f in fields if f"`{f}`" not in text]
    assert not undocumented


ROOTS = ("node_agent", "loadgen", "operator", "flatcake", "charts", "crds", "dashboards", "docs", "tests", "bin",
         "requirements")  # fmt: skip


def test_every_path_the_docs_name_exists() -> None:
    """A path in backticks under a top-level folder of the repository (`node_agent/service/server.py`,
    `charts/flatcake`) must exist: the docs follow the layout when it moves."""
    repo = DOCS.parent
    pages = [repo / "README.md", repo / "CONTRIBUTING.md", repo / "node_agent" / "sglang" / "README.md",
             *DOCS.glob("*.md")]  # fmt: skip
    named = {
        (page.name, path.rstrip("/"))
        for page in pages
        for path in re.findall(r"`([\w./-]+)`", page.read_text())
        if path.split("/")[0] in ROOTS and "/" in path and "*" not in path and "<" not in path
    }
    assert len(named) > 40  # the pattern finds the paths the docs do name
    missing = sorted(f"{page}: {path}" for page, path in named if not (repo / path).exists())
    assert not missing, missing
