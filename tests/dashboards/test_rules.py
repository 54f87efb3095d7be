"""The shipped alerting rules: `promtool test rules` cases for every alert, and a runbook section of
docs/operations.md behind every alert's runbook_url."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from devtools import dashboards as D
from flatcake.operator import render

pytestmark = pytest.mark.system

RULES = D.ROOT / "prometheus-rules.yml"
CASES = Path(__file__).with_name("rules.test.yml")
OPERATIONS = D.ROOT.parent / "docs" / "operations.md"
HOME = yaml.safe_load((D.ROOT.parent / "charts" / "flatcake" / "Chart.yaml").read_text())["home"]


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: bin/test installs Debian's prometheus package (apt-get install prometheus)"
    return path


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    out = subprocess.run([promtool(), "test", "rules", CASES.name], cwd=CASES.parent, capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_firing_case_and_a_silent_one() -> None:
    """Each alert has a case that expects it to fire, with more input series than alerts expected (a
    healthy neighbour stays silent), and a case that expects nothing (before its `for` has passed)."""
    fired, silent = set(), set()
    for test in yaml.safe_load(CASES.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            if case["exp_alerts"]:
                assert len(test["input_series"]) > len(case["exp_alerts"]), test["name"]
                fired.add(case["alertname"])
            else:
                silent.add(case["alertname"])
    names = {a["alert"] for a in alerts()}
    assert len(names) == 8 and fired == names and silent == names, (names - fired, names - silent)


def test_every_alert_links_a_runbook_section_of_operations_md() -> None:
    anchors = github_anchors(OPERATIONS.read_text())
    prefix = f"{HOME}/blob/main/docs/operations.md#"
    for a in alerts():
        url = a["annotations"].get("runbook_url", "")
        assert url.startswith(prefix), (a["alert"], url)
        assert url.removeprefix(prefix) in anchors, f"{a['alert']}: no heading for #{url.removeprefix(prefix)}"
        assert a["alert"].lower() == url.removeprefix(prefix), a["alert"]  # the section is named after it
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]


def test_agent_down_watches_the_job_the_operator_gives_agents() -> None:
    down = next(a for a in alerts() if a["alert"] == "FlatCakeAgentDown")
    assert f'up{{job="{render.AGENT_JOB}"}} == 0' == down["expr"]


def test_promtool_accepts_the_rules() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 11 rules found" in out.stdout, out.stdout + out.stderr
