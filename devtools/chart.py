"""The Helm chart ships copies of artifacts whose single source lives elsewhere in the repository
(Helm reads only files inside the chart). ``bin/generate`` writes them; a test fails when one is stale."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "flatcake"


def copies() -> dict[Path, Path]:
    """source -> copy in the chart: the CRDs (Helm installs crds/ before templates), the Grafana
    dashboards and the Prometheus rules (rendered into ConfigMaps and a PrometheusRule)."""
    pairs = {p: CHART / "crds" / p.name for p in sorted((REPO / "crds").glob("*.yaml"))}
    pairs |= {p: CHART / "files" / "dashboards" / p.name for p in sorted((REPO / "dashboards").glob("*.json"))}
    pairs[REPO / "dashboards" / "prometheus-rules.yml"] = CHART / "files" / "prometheus-rules.yml"
    return pairs


def header(source: Path) -> bytes:
    if source.suffix in (".yaml", ".yml"):
        return f"# Generated from {source.relative_to(REPO)} by bin/generate: edit that file, not this one.\n".encode()
    return b""  # JSON has no comments


def stale() -> list[Path]:
    """Chart copies that differ from their source (or are missing), and chart files with no source."""
    pairs = copies()
    wrong = [
        dst for src, dst in pairs.items() if not dst.exists() or dst.read_bytes() != header(src) + src.read_bytes()
    ]
    expected = set(pairs.values())
    orphans = [p for d in ("crds", "files/dashboards") for p in (CHART / d).glob("*") if p not in expected]
    return wrong + orphans


def write() -> list[Path]:
    written = []
    for src, dst in copies().items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(header(src) + src.read_bytes())
        written.append(dst)
    return written
