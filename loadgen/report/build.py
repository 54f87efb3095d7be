"""``flatcake report``: per-request records of replay runs -> report.json, a Markdown/HTML page and plots.

Input: a directory of runs, each ``<system>/qps-<q>/results*.jsonl`` (one JSON line per request, written
by the Locust replay) with an optional ``meta.json`` (the trace ideal, the system's settings). Output,
the shape of the paper's Figures 6 and 7: mean and P50 TTFT against QPS per system, throughput against
QPS, delivered hit rate against QPS with the trace's ideal as a line, and hit composition by medium.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import jinja2

from flatcake.loadgen.report import plots

MEDIA = ("hbm", "dram", "ssd")


def summarize_run(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    ttft = sorted(r["ttft_s"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    hits = {m: sum(r["hit_tokens"].get(m, 0) for r in ok) for m in MEDIA}
    span = max((r["sent"] + (r["e2e_s"] or 0) for r in ok), default=0.0) - min((r["sent"] for r in ok), default=0.0)

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else 0.0

    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0, "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99),
        "e2e_mean_s": statistics.fmean(r["e2e_s"] for r in ok) if ok else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "delivered_hit_rate": cached / prompt if prompt else 0.0,
        "hit_composition": {m: (hits[m] / prompt if prompt else 0.0) for m in MEDIA},
        "throughput_tokens_per_s": (prompt + sum(r["output_tokens"] for r in ok)) / span if span > 0 else 0.0,
        "duration_s": span,
    }  # fmt: skip


def collect(runs_dir: str | Path) -> dict[str, Any]:
    root = Path(runs_dir)
    systems: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    if (root / "meta.json").exists():
        meta = json.loads((root / "meta.json").read_text())
    for run in sorted(root.glob("*/qps-*")):
        records = [json.loads(line) for f in sorted(run.glob("results*.jsonl")) for line in f.read_text().splitlines()]
        if not records:
            continue
        qps = float(run.name.removeprefix("qps-"))
        systems.setdefault(run.parent.name, {})[f"{qps:g}"] = {"qps": qps, **summarize_run(records)}
    if not systems:
        raise ValueError(f"{root}: no runs found (expected <system>/qps-<q>/results*.jsonl)")
    return {"meta": meta, "systems": systems}


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    plt = plots.pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = report["systems"]
    names: list[str] = []

    def series(system: str, key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        runs = sorted(systems[system].values(), key=lambda r: r["qps"])
        return [r["qps"] for r in runs], [r[key] * scale for r in runs]

    def save(fig: Any, name: str) -> None:
        names.append(plots.save(fig, out_dir / name).name)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in systems:
        axes[0].plot(*series(s, "ttft_mean_s"), marker="o", label=s)
        axes[1].plot(*series(s, "ttft_p50_s"), marker="o", label=s)
    for ax, title in zip(axes, ("mean TTFT", "median TTFT"), strict=True):
        plots.label(ax, "QPS", "seconds", title, legend=True)
    save(fig, "ttft.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in systems:
        ax.plot(*series(s, "throughput_tokens_per_s"), marker="o", label=s)
    plots.label(ax, "QPS", "tokens/s (prompt + output)", "throughput", legend=True)
    save(fig, "throughput.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in systems:
        ax.plot(*series(s, "delivered_hit_rate", 100), marker="o", label=s)
    ideal = report["meta"].get("ideal_hit_rate_pages")
    if ideal is not None:
        ax.axhline(ideal * 100, linestyle="--", color="gray", label="trace ideal (256-token pages)")
    ax.set_ylim(0, 100)
    plots.label(ax, "QPS", "delivered hit rate (%)", "delivered hit rate", legend=True)
    save(fig, "hit_rate.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, bottoms = [], None
    rows = [(s, r) for s in systems for r in sorted(systems[s].values(), key=lambda r: r["qps"])]
    labels = [f"{s}\n{r['qps']:g} qps" for s, r in rows]
    bottoms = [0.0] * len(rows)
    for medium in MEDIA:
        vals = [r["hit_composition"][medium] * 100 for _, r in rows]
        ax.bar(labels, vals, bottom=bottoms, label=medium)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set(ylabel="% of prompt tokens", title="where hits came from")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    save(fig, "hit_composition.png")
    return names


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")), autoescape=jinja2.select_autoescape(["html"])
)


def write(runs_dir: str | Path, out_dir: str | Path | None = None, context: str | None = None) -> dict[str, Any]:
    report = collect(runs_dir)
    if context:
        report["meta"]["context"] = context
    out = Path(out_dir or runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(_TEMPLATES.get_template("report.md.j2").render(**report))
    (out / "report.html").write_text(_TEMPLATES.get_template("report.html.j2").render(**report))
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'system':<9} {'QPS':>5} {'reqs':>5} {'err':>4} {'mean TTFT':>10} {'P50 TTFT':>9} "
             f"{'hit %':>6} {'hbm':>5} {'dram':>5} {'ssd':>5} {'tok/s':>8}"]  # fmt: skip
    for name, runs in report["systems"].items():
        for r in sorted(runs.values(), key=lambda r: r["qps"]):
            c = r["hit_composition"]
            lines.append(
                f"{name:<9} {r['qps']:>5g} {r['requests']:>5} {r['errors']:>4} {r['ttft_mean_s']:>10.3f} "
                f"{r['ttft_p50_s']:>9.3f} {100 * r['delivered_hit_rate']:>6.1f} {100 * c['hbm']:>5.1f} "
                f"{100 * c['dram']:>5.1f} {100 * c['ssd']:>5.1f} {r['throughput_tokens_per_s']:>8.0f}"
            )
    ideal = report["meta"].get("ideal_hit_rate_pages")
    if ideal is not None:
        lines.append(f"trace ideal with 256-token pages: {100 * ideal:.1f}%")
    return "\n".join(lines)
