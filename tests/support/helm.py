"""The real helm (v4, from PyPI; bin/_bootstrap puts it in .venv/bin) for the chart tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from devtools.chart import CHART

KUBERNETES = "1.34.0"  # the kubectl shipped with our helm; the chart declares kubeVersion >=1.27
HELM = shutil.which("helm") or shutil.which("helm", path=str(Path(sys.prefix) / "bin"))


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None, "helm is missing: bin/test installs it (FLATCAKE_K8S_TOOLS=1 bin/test)"
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def render(*values: str, chart: Path = CHART, release: str = "fc", namespace: str = "flatcake") -> list[dict[str, Any]]:
    out = helm("template", release, str(chart), "--namespace", namespace, "--include-crds", *values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]
