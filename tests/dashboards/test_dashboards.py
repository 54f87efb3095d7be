"""Dashboards, catalogue and code agree."""

from __future__ import annotations

import json
import re

import pytest

from flatcake import dashboards as D
from flatcake import metrics as M
from tests.support import ROOT

pytestmark = pytest.mark.unit


def test_committed_dashboards_are_the_rendered_templates() -> None:
    for name in D.NAMES:
        committed = json.loads((D.ROOT / f"{name}.json").read_text())
        assert committed == D.render(name), f"dashboards/{name}.json is stale: run bin/generate"


def test_dashboards_name_only_catalogue_metrics_and_have_variables() -> None:
    uids = set()
    for name in D.NAMES:
        d = D.render(name)
        assert not D.unknown_metrics(d), name
        assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "system", "node"}
        assert all(
            p["datasource"]["uid"] == "${datasource}" and p["fieldConfig"]["defaults"]["unit"] for p in d["panels"]
        )
        assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
        uids.add(d["uid"])
    assert len(uids) == len(D.NAMES)


def test_every_catalogue_metric_is_updated_by_code_and_shown_on_a_dashboard() -> None:
    sources = "\n".join(p.read_text() for d in ("node_agent", "loadgen", "flatcake") for p in (ROOT / d).rglob("*.py")
                        if p.name not in ("metrics.py", "dashboards.py"))  # fmt: skip
    mapped = {name for name, _ in M.STATS_MAP.values()} | {"flatcake_io_errors"}
    unused = [s.name for s in M.CATALOG.values() if s.name not in mapped and f'"{s.name}"' not in sources]
    assert not unused, f"catalogue metrics no code updates: {unused}"
    shown = "\n".join(e for n in D.NAMES for e in D.expressions(D.render(n)))
    hidden = [s.name for s in M.CATALOG.values() if not re.search(rf"\b{s.name}(_total|_bucket|_sum|_count)?\b", shown)]
    assert not hidden, f"catalogue metrics on no dashboard: {hidden}"
