"""Every `helm install` that docs/staging.md tells users to type renders with the real helm (a list
value given with `--set 'x={0.5,1}'` once failed there: helm reads those as strings)."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.support import ROOT
from tests.support.helm import helm

pytestmark = pytest.mark.system


def documented_installs() -> list[list[str]]:
    text = (ROOT / "docs" / "staging.md").read_text()
    commands = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        commands += [shlex.split(line) for line in joined.splitlines() if line.startswith("helm install ")]
    return commands


def test_the_documented_helm_commands_render() -> None:
    installs = documented_installs()
    assert len(installs) >= 2  # the FlatCake chart and the bench chart
    for argv in installs:
        args = ["template", *argv[2:]]  # what install would apply, rendered and checked against the schema
        out = helm(
            *[a.replace("charts/", str(ROOT / "charts") + "/", 1) if a.startswith("charts/") else a for a in args]
        )
        assert out.returncode == 0, (" ".join(argv), out.stderr)
