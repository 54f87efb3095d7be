"""Dashboards, catalogue and code agree."""

from __future__ import annotations

import json
import re

import pytest

from devtools import dashboards as D
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
        assert {v["name"] for v in d["templating"]["list"]} == {"datasource", *D.VARIABLES}
        assert all(p["datasource"]["uid"] == "${datasource}" for p in d["panels"])
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


def committed() -> list[tuple[str, dict]]:
    return [(n, json.loads((D.ROOT / f"{n}.json").read_text())) for n in D.NAMES]


def test_every_panel_has_a_unit_and_a_description() -> None:
    """Every panel of the generated JSON: a Grafana unit, a description of a sentence or more (what it
    shows, what to do when it looks wrong), and units on its overrides."""
    for name, d in committed():
        for p in d["panels"]:
            where = f"{name}: {p['title']}"
            assert p["fieldConfig"]["defaults"]["unit"], where
            assert len(p.get("description", "").split()) >= 8 and p["description"].endswith("."), where
            for o in p["fieldConfig"]["overrides"]:
                assert o["matcher"]["options"] in {t["refId"] for t in p["targets"]}, where
                assert [x["id"] for x in o["properties"]] == ["unit"] and o["properties"][0]["value"], where


def test_queries_use_rate_interval_and_the_variables() -> None:
    """Every range selector (inside rate, increase, irate, histogram rates) is ``[$__rate_interval]``,
    never a fixed ``[5m]``. The variables rule: each ``flatcake_*`` series selector carries the
    matcher of the dashboard variable for its metric: ``system=~"$system"`` when the catalogue gives
    the metric a ``system`` label (serving processes), else ``node=~"$node"`` (node agents)."""
    exprs = 0
    for name, d in committed():
        for p in d["panels"]:
            for t in p["targets"]:
                exprs += 1
                assert not D.fixed_ranges(t["expr"]), (name, p["title"], t["expr"])
        assert not D.unfiltered(d), (name, D.unfiltered(d))
    assert exprs > 50


def test_the_checks_catch_what_they_forbid() -> None:
    panel = {"title": "t", "targets": [{"expr": 'sum(rate(flatcake_requests_total{node=~"$node"}[5m]))'}]}
    assert D.fixed_ranges(panel["targets"][0]["expr"]) == ["5m"]
    assert D.unfiltered({"panels": [panel]}) == [("t", "flatcake_requests_total")]  # system metric, no $system
    fixed = 'sum(rate(flatcake_io_errors_total{node=~"$node"}[$__rate_interval])) / flatcake_agent_ready'
    assert D.unfiltered({"panels": [{"title": "u", "targets": [{"expr": fixed}]}]}) == [("u", "flatcake_agent_ready")]


def test_concrete_substitutes_as_grafana_does() -> None:
    assert D.rate_interval(15, 2) == 60  # 4 x the scrape interval
    assert D.rate_interval(15, 60) == 75  # $__interval + the scrape interval
    expr = 'rate(flatcake_requests_total{system=~"$system"}[$__rate_interval])'
    assert D.concrete(expr, {"system": ".*"}, 4.0) == 'rate(flatcake_requests_total{system=~".*"}[4000ms])'
    with pytest.raises(ValueError, match="node"):
        D.concrete('flatcake_agent_ready{node=~"$node"}', {"system": ".*"}, 4.0)
