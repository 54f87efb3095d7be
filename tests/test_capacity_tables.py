"""The capacity tables (devtools/capacity_tables.py) are what the committed load sweeps say."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_capacity_tables_are_what_the_committed_sweeps_say() -> None:
    """The README's and docs/benchmarks.md's capacity tables are generated from docs/results' load sweeps:
    a rerun that changes a knee fails here until bin/generate writes the new table."""
    import sys

    sys.path.append(str(ROOT))
    from devtools import capacity_tables

    table = capacity_tables.markdown()
    assert table.count("\n| ") >= 8  # the sweeps are committed and each names its systems
    for page in (ROOT / "README.md", DOCS / "benchmarks.md"):
        assert f"{capacity_tables.BEGIN}\n{table}\n{capacity_tables.END}" in page.read_text(), (
            f"{page}: run bin/generate"
        )
