"""``flatcake report``: per-request records of replay runs -> report.json, a Markdown/HTML page and plots.

Input: a directory of runs, each ``<system>/qps-<q>/results*.jsonl`` or, with repeats,
``<system>/qps-<q>/rep-<i>/results*.jsonl`` (one JSON line per request, written by the Locust replay),
with an optional ``meta.json`` (the trace ideal, the system's settings) and, per run, the emulator's
``emulator.prom`` (placement counters). Output, the shape of the paper's Figures 6 and 7: mean and P50
TTFT against QPS per system, throughput against QPS, delivered hit rate against QPS with the trace's
ideal as a line, and hit composition by medium; with repeats, each headline number as
{min, median, max}, and a verdict per rate that says "within noise" where two systems' spreads overlap.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import jinja2
from prometheus_client.parser import text_string_to_metric_families

from flatcake.loadgen.report import capacity, plots

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
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0, "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9),
        "ttft_p99_s": pct(0.99),
        "e2e_mean_s": statistics.fmean(r["e2e_s"] for r in ok) if ok else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "delivered_hit_rate": cached / prompt if prompt else 0.0,
        "hit_composition": {m: (hits[m] / prompt if prompt else 0.0) for m in MEDIA},
        "throughput_tokens_per_s": (prompt + sum(r["output_tokens"] for r in ok)) / span if span > 0 else 0.0,
        "duration_s": span,
    }  # fmt: skip


def saturation(records: list[dict[str, Any]]) -> str | None:
    """Why a run was past capacity, or None (``capacity.saturation``: requests failed, or the backlog
    left at the last arrival outlasted a fifth of the arrival window). Such a point's numbers depend on
    how long it ran, so the report flags them instead of printing them as if they were fine."""
    ok = [r for r in records if r["ok"]]
    return capacity.saturation([r["sent"] for r in ok], [r["sent"] + r["ttft_s"] for r in ok], len(records) - len(ok))


def _counters(prom: Path, names: dict[str, str], label: str) -> dict[str, dict[str, float]] | None:
    """The named counters of a Prometheus text file (``names``: sample name -> field), each summed by one of
    its labels: ``{field: {label value: total}}``; None when the file is absent (no such process ran)."""
    if not prom.exists():
        return None
    out: dict[str, dict[str, float]] = {field: {} for field in names.values()}
    for family in text_string_to_metric_families(prom.read_text()):
        for sample in family.samples:
            field = names.get(sample.name)
            if field is not None and label in sample.labels:
                by = out[field]
                by[sample.labels[label]] = by.get(sample.labels[label], 0.0) + sample.value
    return out


def placement(prom: Path) -> dict[str, Any] | None:
    """Placement accuracy from an emulator's counters: pages placed per medium, the share of them a
    later prompt asked for again, and the share of those gone (reclaimed) by then."""
    c = _counters(prom, {"flatcake_placed_pages_total": "placed", "flatcake_placed_reused_pages_total": "reused",
                         "flatcake_placed_lost_pages_total": "lost"}, "medium")  # fmt: skip
    if c is None or not any(c["placed"].values()):
        return None
    placed, reused, lost = c["placed"], c["reused"], c["lost"]
    return {
        medium: {"placed": int(placed.get(medium, 0)), "reused": int(reused.get(medium, 0)),
                 "reused_share": reused.get(medium, 0) / placed[medium] if placed.get(medium) else None,
                 "lost": int(lost.get(medium, 0)),
                 "lost_share": lost.get(medium, 0) / reused[medium] if reused.get(medium) else None}
        for medium in ("dram", "ssd")
    }  # fmt: skip


def l3_writes(prom: Path) -> dict[str, Any] | None:
    """Pages written through to the L3 (SGLang's backup thread), stored and failed, from the emulator's
    counters; None where the system has no L3."""
    c = _counters(prom, {"flatcake_l3_write_pages_total": "pages"}, "result")
    counts = c["pages"] if c is not None else {}
    total = sum(counts.values())
    if not total:
        return None
    failed = counts.get("failed", 0)
    return {"stored": int(counts.get("stored", 0)), "failed": int(failed), "failed_share": failed / total}


AGENT_COUNTERS = {
    "flatcake_placements_total": "placed_pages",
    "flatcake_reclaimed_scopes_total": "reclaimed_scopes",
    "flatcake_reclaimed_bytes_total": "reclaimed_bytes",
    "flatcake_restore_pages_total": "restored_pages",
}


def agent_counters(prom: Path) -> dict[str, Any] | None:
    """A FlatCake point's node agent, from its /metrics: pages placed, scopes and bytes reclaimed and pages
    restored, by medium, and in copies mode its DRAM copies by event (``copy_pages``: admitted, served,
    evicted unread, declined); None where no agent ran."""
    c = _counters(prom, AGENT_COUNTERS, "medium")
    if c is None:
        return None
    fields = AGENT_COUNTERS.values()
    out: dict[str, dict[str, float]] = {f: {m: c[f].get(m, 0.0) for m in ("dram", "ssd")} for f in fields}
    copies = _counters(prom, {"flatcake_copy_pages_total": "copy_pages"}, "event")
    if copies is not None and any(copies["copy_pages"].values()):
        out.update(copies)
    return out


SPREAD_FIELDS = (
    "delivered_hit_rate",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "throughput_tokens_per_s",
)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize_point(reps: list[tuple[list[dict[str, Any]], Path]]) -> dict[str, Any]:
    """One (system, rate) point over its repeats: the median repeat's fields, the spread of the
    headline ones, the DRAM share of hits, placement accuracy and saturation."""
    runs = [summarize_run(records) for records, _ in reps]
    numeric = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    out: dict[str, Any] = {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in numeric}}
    out["hit_composition"] = {m: statistics.median(r["hit_composition"][m] for r in runs) for m in MEDIA}
    out["repeats"] = len(runs)
    out["spread"] = {f: _spread([r[f] for r in runs]) for f in SPREAD_FIELDS}
    hits = [sum(r["hit_composition"].values()) for r in runs]
    out["dram_hit_share"] = statistics.median(
        r["hit_composition"]["dram"] / h if h else 0.0 for r, h in zip(runs, hits, strict=True)
    )
    reasons = [why for records, _ in reps if (why := saturation(records))]
    out["saturated"] = bool(reasons)
    out["saturation"] = reasons
    placements = [p for _, run in reps if (p := placement(run / "emulator.prom"))]
    out["placement"] = placements[len(placements) // 2] if placements else None
    writes = sorted((w for _, run in reps if (w := l3_writes(run / "emulator.prom"))), key=lambda w: w["failed_share"])
    out["l3_writes"] = writes[len(writes) // 2] if writes else None
    agents = [a for _, run in reps if (a := agent_counters(run / "agent.prom"))]
    out["agent"] = (
        {f: {k: statistics.median(a[f].get(k, 0.0) for a in agents if f in a) for k in agents[0][f]} for f in agents[0]}
        if agents
        else None
    )
    return out


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(run.glob("results*.jsonl")) for line in f.read_text().splitlines()]


def collect(runs_dir: str | Path) -> dict[str, Any]:
    root = Path(runs_dir)
    systems: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    if (root / "meta.json").exists():
        meta = json.loads((root / "meta.json").read_text())
    for run in sorted(root.glob("*/qps-*")):
        reps = [(records, d) for d in [run, *sorted(run.glob("rep-*"))] if (records := _records(d))]
        if not reps:
            continue
        qps = float(run.name.removeprefix("qps-"))
        systems.setdefault(run.parent.name, {})[f"{qps:g}"] = {"qps": qps, **summarize_point(reps)}
    if not systems:
        raise ValueError(f"{root}: no runs found (expected <system>/qps-<q>/[rep-<i>/]results*.jsonl)")
    labels = meta.get("labels", {})
    summary = [
        {"system": labels.get(name, {}).get("system", name), "scheduler": labels.get(name, {}).get("scheduler"),
         "placement": labels.get(name, {}).get("placement"), "rules": labels.get(name, {}).get("rules"),
         "label": name, "qps": r["qps"], "repeats": r["repeats"],
         **{f: r["spread"][f] for f in ("delivered_hit_rate", "ttft_mean_s", "ttft_p99_s")},
         "dram_hit_share": r["dram_hit_share"], "saturated": r["saturated"]}
        for name, runs in systems.items() for r in sorted(runs.values(), key=lambda r: r["qps"])
    ]  # fmt: skip
    out = {
        "meta": meta, "systems": systems, "summary": summary, "verdicts": verdicts(systems),
        "ideal_hit_rate": meta.get("ideal_hit_rate_pages"), "model": meta.get("model"),
        "calibration": _calibration(meta), "systems_run": meta.get("systems_run", {}),
    }  # fmt: skip
    if meta.get("load_ladder"):
        out["capacity"] = load_capacity(systems, meta)
    return out


def point_label(point: dict[str, Any], slo_s: float) -> str:
    """A (system, rate) point over its repeats, as the load ladder reads it: the median repeat's P90 TTFT
    against the objective; saturated if any repeat was."""
    return capacity.label(point["spread"]["ttft_p90_s"]["median"], point["saturated"], slo_s)


def load_capacity(systems: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The ladder's verdict over the runs of a load sweep (``meta["load_ladder"]``: its rungs, systems,
    reference and objective, as the bench climbed them)."""
    lad = meta["load_ladder"]
    slo = lad["slo_ttft_p90_s"]
    ladder = capacity.Ladder(
        tuple(lad["rates"]), tuple(lad["systems"]), lad["reference"], resolution=lad.get("resolution")
    )
    points = [{"system": name, **r, "label": point_label(r, slo), "saturation": "; ".join(r["saturation"]) or None,
               "ttft_p90_s": r["spread"]["ttft_p90_s"]["median"]}
              for name, runs in systems.items() if name in ladder.systems for r in runs.values()]  # fmt: skip
    return capacity.analyse(points, ladder, slo, lad["mean_prompt_tokens"], meta.get("ideal_hit_rate_pages"))


def _calibration(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The model's calibration, with how each system's storage reads meet the OS page cache."""
    calibration = meta.get("calibration")
    run = meta.get("systems_run") or {}
    if run:
        calibration = {**(calibration or {}), "page_cache": {n: r.get("page_cache") for n, r in run.items()}}
    return calibration


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def verdicts(systems: dict[str, dict[str, Any]]) -> list[str]:
    """One line per rate comparing the systems' delivered hits and mean TTFT; where two spreads
    overlap the line says "within noise" rather than naming a winner."""
    lines = []
    rates = sorted({r["qps"] for runs in systems.values() for r in runs.values()})

    def fmt_s(v: float) -> str:
        return f"{v:.2f} s"

    def fmt_pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    for q in rates:
        at = {name: runs[f"{q:g}"] for name, runs in systems.items() if f"{q:g}" in runs}
        if len(at) < 2:
            continue
        for field, word, better in (("ttft_mean_s", "mean TTFT", min), ("delivered_hit_rate", "delivered hits", max)):
            best = better(at, key=lambda n: at[n]["spread"][field]["median"])
            fmt = fmt_s if field == "ttft_mean_s" else fmt_pct
            parts = []
            for name, r in at.items():
                if name == best:
                    continue
                noisy = _overlap(at[best]["spread"][field], r["spread"][field]) and r["repeats"] > 1
                parts.append(f"{name} {fmt(r['spread'][field]['median'])}" + (" (within noise)" if noisy else ""))
            sat = [n for n, r in at.items() if r["saturated"]]
            lines.append(f"{q:g} QPS, {word}: {best} {fmt(at[best]['spread'][field]['median'])} vs " + ", ".join(parts)
                         + (f"; saturated: {', '.join(sat)}" if sat else ""))  # fmt: skip
    return lines


def ideal_text(meta: dict[str, Any]) -> str:
    """The trace's ideal hit rate as the runs' metadata gives it; "unknown" where it gives none (a
    report of runs made elsewhere has no meta.json), never a made-up 0%."""
    parts = []
    if meta.get("ideal_hit_rate_tokens") is not None:
        parts.append(f"{100 * meta['ideal_hit_rate_tokens']:.1f}% by tokens (hash blocks)")
    if meta.get("ideal_hit_rate_pages") is not None:
        pages = meta.get("page_tokens")
        size = f"{pages}-token pages" if pages else "pages of unrecorded size"
        parts.append(f"{100 * meta['ideal_hit_rate_pages']:.1f}% with {size}")
    return ", ".join(parts) if parts else "unknown (no trace metadata with these runs)"


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    plt = plots.pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = report["systems"]
    names: list[str] = []

    def spread(ax: Any, system: str, key: str, scale: float = 1.0) -> None:
        """The median over repeats, with a bar from the lowest to the highest repeat."""
        runs = sorted(systems[system].values(), key=lambda r: r["qps"])
        mid = [r["spread"][key]["median"] * scale for r in runs]
        low = [m - r["spread"][key]["min"] * scale for m, r in zip(mid, runs, strict=True)]
        high = [r["spread"][key]["max"] * scale - m for m, r in zip(mid, runs, strict=True)]
        ax.errorbar([r["qps"] for r in runs], mid, yerr=[low, high], marker="o", capsize=3, label=system)

    def save(fig: Any, name: str) -> None:
        names.append(plots.save(fig, out_dir / name).name)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in systems:
        spread(axes[0], s, "ttft_mean_s")
        spread(axes[1], s, "ttft_p50_s")
    for ax, title in zip(axes, ("mean TTFT (bars: min-max over repeats)", "median TTFT"), strict=True):
        plots.label(ax, "QPS", "seconds", title, legend=True)
    save(fig, "ttft.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in systems:
        spread(ax, s, "throughput_tokens_per_s")
    plots.label(ax, "QPS", "tokens/s (prompt + output)", "throughput", legend=True)
    save(fig, "throughput.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in systems:
        spread(ax, s, "delivered_hit_rate", 100)
    ideal = report["meta"].get("ideal_hit_rate_pages")
    if ideal is not None:
        pages = report["meta"].get("page_tokens")
        ax.axhline(ideal * 100, linestyle="--", color="gray",
                   label=f"trace ideal ({pages}-token pages)" if pages else "trace ideal (pages)")  # fmt: skip
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
    if "capacity" in report:
        report["capacity_table"] = capacity.format_table(report["capacity"])
        report["plots"].append(Path(capacity.plot(report["capacity"], out / "capacity.png")).name)
    report["ideal_text"] = ideal_text(report["meta"])
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(_TEMPLATES.get_template("report.md.j2").render(**report))
    (out / "report.html").write_text(_TEMPLATES.get_template("report.html.j2").render(**report))
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'system':<14} {'QPS':>5} {'reps':>4} {'reqs':>5} {'err':>4} {'mean TTFT (min-max)':>22} "
             f"{'P99 TTFT':>9} {'hit % (min-max)':>18} {'hbm':>5} {'dram':>5} {'ssd':>5} {'tok/s':>8}"]  # fmt: skip
    for name, runs in report["systems"].items():
        for r in sorted(runs.values(), key=lambda r: r["qps"]):
            c = r["hit_composition"]
            t, h = r["spread"]["ttft_mean_s"], r["spread"]["delivered_hit_rate"]
            lines.append(
                f"{name:<14} {r['qps']:>5g} {r['repeats']:>4} {r['requests']:>5} {r['errors']:>4} "
                f"{t['median']:>8.3f} ({t['min']:.3f}-{t['max']:.3f}) {r['ttft_p99_s']:>9.3f} "
                f"{100 * h['median']:>6.1f} ({100 * h['min']:.1f}-{100 * h['max']:.1f}) {100 * c['hbm']:>5.1f} "
                f"{100 * c['dram']:>5.1f} {100 * c['ssd']:>5.1f} {r['throughput_tokens_per_s']:>8.0f}"
                f"  {'SATURATED' if r['saturated'] else ''}"
            )
    lines.append(f"trace ideal: {ideal_text(report['meta'])}")
    lines += report.get("verdicts", [])
    for name, runs in report["systems"].items():
        for r in sorted(runs.values(), key=lambda r: r["qps"]):
            p = r.get("placement")
            if p:
                lines.append(f"placement {name} {r['qps']:g} QPS: " + "; ".join(
                    f"{m} {v['placed']} pages placed, {100 * (v['reused_share'] or 0):.0f}% reused"
                    f" ({100 * (v.get('lost_share') or 0):.0f}% of those lost first)"
                    for m, v in p.items()) + f"; DRAM served {100 * r['dram_hit_share']:.1f}% of hits")  # fmt: skip
            a = r.get("agent")
            if a and (a["reclaimed_scopes"]["dram"] or a["reclaimed_scopes"]["ssd"]):
                lines.append(f"agent {name} {r['qps']:g} QPS: placed {a['placed_pages']['dram']:.0f} DRAM / "
                             f"{a['placed_pages']['ssd']:.0f} SSD pages; reclaimed {a['reclaimed_scopes']['dram']:.0f}"
                             f" DRAM scopes ({a['reclaimed_bytes']['dram'] / 2**20:.0f} MiB) and "
                             f"{a['reclaimed_scopes']['ssd']:.0f} SSD scopes (medians over repeats)")  # fmt: skip
            w = r.get("l3_writes")
            if w and w["failed"]:
                lines.append(f"L3 writes {name} {r['qps']:g} QPS: {w['stored']} pages stored, {w['failed']} failed "
                             f"({100 * w['failed_share']:.0f}%, dropped as SGLang drops them)")  # fmt: skip
    return "\n".join(lines)
