"""Grafana dashboards, rendered from ``dashboards/templates/*.json.j2`` (jinja2) to ``dashboards/*.json``.

The committed JSON is the artifact (the Helm chart ships it); templates are the source; tests check
that they agree and that every expression names only metrics of the catalogue (flatcake/metrics.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2

from flatcake import metrics as M

ROOT = Path(__file__).resolve().parent.parent / "dashboards"
NAMES = ("overview", "storage-io", "scheduler", "capacity")
_METRIC = re.compile(r"\bflatcake_[a-z0-9_]+")


def render(name: str, templates: Path = ROOT / "templates") -> dict[str, Any]:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates), undefined=jinja2.StrictUndefined)
    data: dict[str, Any] = json.loads(env.get_template(f"{name}.json.j2").render())
    return data


def render_all(out: Path = ROOT) -> list[Path]:
    paths = []
    for name in NAMES:
        path = out / f"{name}.json"
        path.write_text(json.dumps(render(name), indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def series_names() -> set[str]:
    """Every series name the catalogue's metrics expose (histograms as _bucket, _sum, _count)."""
    out = set()
    for spec in M.CATALOG.values():
        if spec.kind == "histogram":
            out |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
        else:
            out.add(M.exposed_name(spec))
    return out


def unknown_metrics(dashboard: dict[str, Any]) -> set[str]:
    known = series_names()
    return {m for e in expressions(dashboard) for m in _METRIC.findall(e)} - known
