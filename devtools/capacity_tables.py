"""The README's and docs/benchmarks.md's capacity tables, generated from the committed load sweeps
(docs/results/*-load*.json, each a run's ``capacity`` section), so a rerun changes the text by
``bin/generate`` and a stale table fails ``tests/test_generate.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
BEGIN = "<!-- begin generated: devtools.capacity_tables.markdown -->"
END = "<!-- end generated -->"
# (the JSON, the bench and trace it ran, in the order the README lists them)
RUNS = (
    ("simulate-load.json", "simulate, paper shape (8x H200, 1 TiB DRAM, 4 TiB NVMe), 256 agentic users"),
    ("simulate-load-copies.json", "simulate, the same, FlatCake's placement.mode copies"),
    ("e2e-load.json", "bench e2e, bundled trace (DSV4-Flash on a modelled A100, storage real)"),
    ("e2e-load-trace2.json", "bench e2e, second trace (seed 31)"),
)


def capacity_of(report: dict[str, Any]) -> dict[str, Any]:
    """A run's capacity section: the simulator's and bench serve's at the top, bench e2e's in report.json."""
    return dict(report["capacity"])


def rows(name: str, bench: str, cap: dict[str, Any]) -> list[str]:
    ref = cap["reference"]
    out = []
    for system, c in cap["systems"].items():
        knee = (
            "below the ladder" if c["knee_qps"] is None else f"{c['knee_qps']:g}" + ("+" if c["beyond_ladder"] else "")
        )
        good = "-" if c["goodput_prompt_tokens_per_s"] is None else f"{c['goodput_prompt_tokens_per_s'] / 1e3:,.0f}K"
        ratio = (cap.get("vs_reference") or {}).get(system, {}).get("goodput")
        vs = "1.00" if system == ref else ("-" if ratio is None else f"{ratio:.2f}")
        ov = c["at_overload"]
        hits = " / ".join(f"{100 * ov[m]['delivered_hit_rate']:.1f}%" if m in ov else "-" for m in ("1.5x", "2x"))
        out.append(f"| {bench} | {system} | {knee} | {good} | {vs} | {c['failed_as'] or '-'} | {hits} | `{name}` |")
    return out


def markdown(results: Path = RESULTS) -> str:
    head = ("| bench | system | knee (req/s) | goodput (prompt tok/s) | ÷ tiered's | first failure | hits at "
            "1.5x / 2x tiered's knee | run |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for name, bench in RUNS:
        path = results / name
        if path.exists():
            lines += rows(name, bench, capacity_of(json.loads(path.read_text())))
    slos = sorted({json.loads((results / n).read_text())["capacity"]["slo_ttft_p90_s"] for n, _ in RUNS
                   if (results / n).exists()})  # fmt: skip
    lines.append("")
    lines.append("Knee: the highest rate whose P90 TTFT meets the objective (the cold prefill of the trace's P90 "
                 f"prompt: {', '.join(f'{s:g} s' for s in slos)}) before the first failure; saturated points "
                 "are never averaged into a number here.")  # fmt: skip
    return "\n".join(lines)
