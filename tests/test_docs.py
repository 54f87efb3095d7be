"""The docs name what the code defines."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from devtools import crd_docs as crds
from flatcake import metrics as M
from flatcake.node_agent.config import EngineConfig

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_metrics_page_holds_the_generated_catalogue() -> None:
    text = (DOCS / "metrics.md").read_text()
    assert M.markdown_table() in text, "docs/metrics.md is stale: run bin/generate"
    assert all(f"`{M.exposed_name(s)}`" in text for s in M.CATALOG.values())


def test_the_configuration_page_holds_the_generated_crd_table() -> None:
    text = (DOCS / "configuration.md").read_text()
    table = crds.markdown_table()
    assert f"{crds.TABLE_BEGIN}\n{table}\n{crds.TABLE_END}" in text, "docs/configuration.md is stale: run bin/generate"
    assert "| `ssd.devices` | array of string |" in table and "| `wipePolicy` | Refuse \\| Wipe |" in table


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


# The docs also name a module by its sub-package where the package is clear from the text
# (`datapath/restore.py`, `replay/requests.py`): such a path is checked under its package.
SUBPACKAGES = [(init.parent.name, top) for top in ("node_agent", "loadgen") for init in (DOCS.parent / top).glob("*/__init__.py")]  # fmt: skip


def test_every_path_the_docs_name_exists() -> None:
    """A path in backticks under a top-level folder of the repository (`node_agent/service/server.py`,
    `charts/flatcake`, `flatcake/metrics.py:STATS_MAP`) or under a sub-package (`datapath/engine.py`)
    must exist: the docs follow the layout when it moves."""
    repo = DOCS.parent
    pages = [repo / "README.md", repo / "CONTRIBUTING.md", repo / "node_agent" / "sglang" / "README.md",
             repo / "tests" / "e2e" / "README.md", *DOCS.glob("*.md")]  # fmt: skip
    package_of = dict(SUBPACKAGES)
    assert len(package_of) == len(SUBPACKAGES) > 10  # each sub-package name says which package it is in
    named = {
        (page.name, path.rstrip("/"))
        for page in pages
        for path in re.findall(r"`([\w./-]+)(?::\w+)?`", page.read_text())
        if path.split("/")[0] in (*ROOTS, *package_of) and "/" in path
    }
    assert len(named) > 40  # the pattern finds the paths the docs do name
    assert any(path.split("/")[0] in package_of for _, path in named)  # and the short ones

    def exists(path: str) -> bool:
        top = path.split("/")[0]
        return (repo / (f"{package_of[top]}/{path}" if top in package_of else path)).exists()

    missing = sorted(f"{page}: {path}" for page, path in named if not exists(path))
    assert not missing, missing


def test_the_benchmark_page_holds_the_generated_system_names() -> None:
    from flatcake.loadgen import names

    text = (DOCS / "benchmarks.md").read_text()
    assert names.markdown_table() in text, "docs/benchmarks.md is stale: run bin/generate"
