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
# overview: a deployment (SGLang's own series and the agents'); benchmark: the emulator and load generator.
NAMES = ("overview", "storage-io", "scheduler", "capacity", "benchmark")
# A series name and its selector, if any. Dashboard variable -> the label it filters: SGLang's series
# by `model_name` (`model`); catalogue metrics with a `system` label are counted by the benchmark's
# serving processes (emulator, load generator); every other one is served by the node agents, whose
# `node` label (the ServiceMonitor's relabeling of the pod's node name) is what `node` lists.
_SERIES = re.compile(r"(?<![\w:])((?:flatcake_|sglang_)[a-z0-9_]+)(\{[^}]*\})?")
_RANGE = re.compile(r"\[([^\]]*)\]")
VARIABLES = {"system": "system", "node": "node", "model": "model_name"}


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
    for spec in [*M.CATALOG.values(), *M.SGLANG_SPECS]:
        if spec.kind == "histogram":
            out |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
        else:
            out.add(M.exposed_name(spec))
    return out


def unknown_metrics(dashboard: dict[str, Any]) -> set[str]:
    known = series_names()
    return {s for e in expressions(dashboard) for s, _ in _SERIES.findall(e)} - known


def spec_of(series: str) -> M.Spec:
    """The catalogue entry behind a series name (counters add _total; histograms _bucket, _sum, _count)."""
    for suffix in ("", "_total", "_bucket", "_sum", "_count"):
        for catalog in (M.CATALOG, M.SGLANG):
            if series.endswith(suffix) and series.removesuffix(suffix) in catalog:
                return catalog[series.removesuffix(suffix)]
    raise KeyError(f"{series}: not a series of the catalogue in flatcake/metrics.py")


def applicable_variable(spec: M.Spec) -> str:
    """The dashboard variable that filters ``spec``'s series (see VARIABLES)."""
    if spec.name in M.SGLANG:
        return "model"
    return "system" if "system" in spec.labels else "node"


def unfiltered(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, series) for every series selector that lacks its variable's matcher,
    ``label=~"$variable"``: a panel that ignores the variables the viewer picked."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for series, selector in _SERIES.findall(target["expr"]):
                var = applicable_variable(spec_of(series))
                if f'{VARIABLES[var]}=~"${var}"' not in selector:
                    out.append((panel["title"], series))
    return out


def fixed_ranges(expr: str) -> list[str]:
    """Range selectors other than Grafana's ``$__rate_interval``, which follows the scrape interval
    and the panel's resolution (a fixed ``[5m]`` is too long when zoomed in, too short zoomed out)."""
    return [r for r in _RANGE.findall(expr) if r != "$__rate_interval"]


def rate_interval(scrape_interval_s: float, interval_s: float) -> float:
    """Grafana's ``$__rate_interval``: max($__interval + scrape interval, 4 x scrape interval), the
    scrape interval being the data source's setting (Grafana's default 15 s)."""
    return max(interval_s + scrape_interval_s, 4 * scrape_interval_s)


def concrete(expr: str, values: dict[str, str], rate_interval_s: float) -> str:
    """``expr`` as Grafana sends it to Prometheus: variables replaced (``values``: name -> regex,
    ``.*`` for All) and ``$__rate_interval`` in whole milliseconds."""
    out = expr.replace("$__rate_interval", f"{round(rate_interval_s * 1000)}ms")
    for name, value in values.items():
        out = out.replace(f"${name}", value)
    if "$" in out:
        raise ValueError(f"{expr}: a variable is left after substituting {sorted(values)}")
    return out
