"""The simulator's table, JSON and plots (in the report format: loadgen/report/plots.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flatcake.loadgen.report import plots

GB = 1e9


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(report: dict[str, Any]) -> str:
    head = ("system", "qps", "hit", "ideal", "ttft mean", "p50", "p99", "tok/s", "SSD GB", "cmds/page", "read amp",
            "prefetch s")  # fmt: skip
    rows = [head]
    for r in report["results"]:
        rows.append((
            r["system"], _f(r["qps"], "g"), _f(100 * r["delivered_hit_rate"], ".2f") + "%",
            _f(100 * r["ideal_hit_rate"], ".2f") + "%", _f(r["ttft_mean_s"], ".3f"), _f(r["ttft_p50_s"], ".3f"),
            _f(r["ttft_p99_s"], ".3f"), _f(r["throughput_tokens_per_s"], ",.0f"), _f(r["ssd_read_bytes"] / GB, ".1f"),
            _f(r["read_commands_per_page"], ".3f"), _f(r["read_amplification"], ".3f"), _f(r["mean_prefetch_s"], ".3f"),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """Hit rate, TTFT, prefetch time and SSD commands against rate, and occupancy over time."""
    out.mkdir(parents=True, exist_ok=True)
    plt = plots.pyplot()
    results = report["results"]
    systems = list(dict.fromkeys(r["system"] for r in results))
    made = []
    panels = (
        ("delivered_hit_rate", "delivered hit rate", "Delivered hit rate (ideal dashed)"),
        ("ttft_mean_s", "mean TTFT (s)", "Mean TTFT"),
        ("mean_prefetch_s", "mean prefetch (s)", "Mean prefetch time"),
        ("read_commands_per_page", "SSD commands per page read", "Read commands per restored page"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, ylabel, title) in zip(axes, panels, strict=True):
        for s in systems:
            pts = [(r["qps"], r[key]) for r in results if r["system"] == s and r[key] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        if key == "delivered_hit_rate" and results:
            ax.axhline(results[0]["ideal_hit_rate"], linestyle="--", color="gray")
        plots.label(ax, "QPS", ylabel, title, legend=True)
    made.append(str(plots.save(fig, out / "simulate.png")))
    top = max(r["qps"] or 0 for r in results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("dram_bytes", "ssd_bytes"), strict=True):
        for r in results:
            if r["qps"] == top:
                occ = r["occupancy"]
                ax.plot(occ["t_s"], [b / GB for b in occ[key]], label=r["system"])
        plots.label(ax, "simulated time (s)", "GB used (all ranks)", f"{key[:4].upper()} occupancy at {top} QPS", True)
    made.append(str(plots.save(fig, out / "occupancy.png")))
    return made
