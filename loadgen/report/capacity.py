"""Capacity: a load ladder raised to each system's knee, and goodput at a TTFT objective.

Pure decisions over point summaries; the benches run the points (``simulate``, ``bench e2e``, ``bench
serve``), this module says which to run next and what they mean. A point is one system at one offered
rate (repeats pooled by the bench), labelled:

- ``ok``: its P90 TTFT is within the objective and it keeps up with arrivals;
- ``over_slo``: it keeps up, but its P90 TTFT passes the objective;
- ``saturated``: it cannot keep up (``saturation``: requests failed, or the backlog left at the last
  arrival took more than a fifth of the arrival window to clear: work arrived at least 1.2x faster
  than it was done). Such a point's TTFT depends on how long the run lasted, so it is never averaged
  into a headline.

The knee is the highest rung below a system's first failed one; goodput is the knee's rate, in
requests/s and prompt tokens/s. The objective defaults to the cold prefill of the trace's P90 prompt
(``default_slo_s``): at P90 a cache must serve no slower than recomputing on an idle GPU would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, OVER_SLO, SATURATED = "ok", "over_slo", "saturated"
# Rungs per decade, about 1.25x apart: fine enough that a 1.4x goodput ratio spans a rung or more.
DECADE = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
DEFAULT_LADDER = (0.5, 16.0)  # requests/s: the simulator's default climb
SATURATION_DRAIN = 0.2  # the backlog's drain, as a share of the arrival window, that marks saturation
OVERLOAD = (1.5, 2.0)  # multiples of the reference's knee where every system runs (hits held at overload)


def rungs(start: float, stop: float) -> tuple[float, ...]:
    """The ladder's rates from ``start`` to ``stop`` inclusive, on the 1-1.25-1.5-2-2.5-3-4-5-6-8 series."""
    if not 0 < start <= stop:
        raise ValueError(f"ladder: start {start} and stop {stop} must satisfy 0 < start <= stop")
    out = []
    for exp in range(math.floor(math.log10(start)) - 1, math.ceil(math.log10(stop)) + 1):
        for m in DECADE:
            r = round(m * 10.0**exp, 6)
            if start * (1 - 1e-9) <= r <= stop * (1 + 1e-9):
                out.append(r)
    return tuple(sorted(set(out)))


def percentile(values: Sequence[float], q: float) -> float:
    import numpy as np  # here, so the CLI's help can name this module's defaults without loading numpy

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def saturation(arrivals: Sequence[float], first_tokens: Sequence[float], failed: int = 0) -> str | None:
    """Why a run could not keep up, or None: requests failed, or the backlog left when the last request
    arrived took more than a fifth of the arrival window (and over a second) to clear. A server fed
    at rho x its capacity drains for (rho - 1) x the window, so this flags rho > 1.2; below that the P90
    objective is what fails. ``arrivals`` and ``first_tokens``: the finished requests', any order."""
    if failed:
        return f"{failed} of {len(arrivals) + failed} requests failed"
    if not arrivals:
        return None
    span = max(arrivals) - min(arrivals)
    drain = max(first_tokens) - max(arrivals)
    if drain > max(1.0, SATURATION_DRAIN * span):
        return f"backlog: last first token {drain:.1f} s after the last arrival (arrivals spanned {span:.1f} s)"
    return None


def label(ttft_p90_s: float, saturated: bool, slo_s: float) -> str:
    if saturated:
        return SATURATED
    return OK if ttft_p90_s <= slo_s else OVER_SLO


def default_slo_s(prompt_tokens: Sequence[int], prefill_s: Callable[[int], float]) -> float:
    """The cold prefill of the P90 prompt (``prefill_s(tokens)``, the model's rate on its GPU), rounded up
    to two significant figures: the P90 TTFT a system without any cache would give on an idle GPU."""
    if not prompt_tokens:
        raise ValueError("default_slo_s: no prompts")
    s = prefill_s(int(percentile(prompt_tokens, 90)))
    if s <= 0:
        raise ValueError(f"default_slo_s: prefill time {s} must be > 0")
    scale = 10.0 ** (math.floor(math.log10(s)) - 1)
    return math.ceil(s / scale - 1e-9) * scale


@dataclass(frozen=True)
class Ladder:
    """Which points to run next, from the labels of those run: every system climbs the rungs until it
    fails, then ``past_knee`` rungs more (its collapse on the plot), or steps down below the first rung
    where it fails there; once the reference has a knee K, every system also runs at each of
    ``overload`` x K (hits and throughput held at overload)."""

    rates: tuple[float, ...]
    systems: tuple[str, ...]
    reference: str | None = "tiered"
    past_knee: int = 1
    overload: tuple[float, ...] = OVERLOAD
    # Bisect between a knee and its first failure (geometric midpoints, three significant figures) until
    # they are at most this ratio apart; None: the rungs alone. The overload points wait for the
    # reference's knee to be resolved.
    resolution: float | None = None

    def __post_init__(self) -> None:
        if not self.rates or list(self.rates) != sorted(set(self.rates)) or self.rates[0] <= 0:
            raise ValueError(f"ladder rates: {self.rates} must be positive, distinct and ascending")
        if not self.systems:
            raise ValueError("ladder: no systems")
        if self.past_knee < 0:
            raise ValueError(f"ladder past_knee: {self.past_knee} must be >= 0")
        if self.resolution is not None and self.resolution <= 1:
            raise ValueError(f"ladder resolution: {self.resolution} must be a ratio > 1")

    def plan(self, labels: Mapping[tuple[str, float], str]) -> list[tuple[str, float]]:
        """The (system, rate) points still to run; empty once the ladder is done."""
        todo: list[tuple[str, float]] = []
        for s in self.systems:
            failed_at = None
            for i, r in enumerate(self.rates):
                got = labels.get((s, r))
                if got is None:
                    if failed_at is None or i <= failed_at + self.past_knee:
                        todo.append((s, r))
                    break
                if got != OK and failed_at is None:
                    failed_at = i
                if failed_at is not None and i >= failed_at + self.past_knee:
                    break
            mid = self._midpoint(s, labels)
            if mid is not None and (s, mid) not in todo:
                todo.append((s, mid))
            low = self._below(s, labels)
            if low is not None and (s, low) not in todo:
                todo.append((s, low))
        ref = self.knee_of(self.reference, labels) if self.reference in self.systems else None
        if ref is not None and self.reference is not None and self._midpoint(self.reference, labels) is None:
            for m in self.overload:
                rate = round(m * ref, 6)
                todo += [(s, rate) for s in self.systems if (s, rate) not in labels and (s, rate) not in todo]
        return sorted(todo, key=lambda p: (p[1], self.systems.index(p[0])))

    def bracket(self, system: str | None, labels: Mapping[tuple[str, float], str]) -> tuple[float | None, float | None]:
        """(the highest passing rate below ``system``'s first failure, that failure), over every rate it ran:
        rungs, midpoints and overload points alike. (None, None) before any failure is known."""
        knee = None
        for r in sorted(q for s, q in labels if s == system):
            if labels[(system, r)] != OK:  # type: ignore[index]
                return knee, r
            knee = r
        return None, None

    def knee_of(self, system: str | None, labels: Mapping[tuple[str, float], str]) -> float | None:
        """The highest rate below ``system``'s first failure, once that failure is known (None before,
        and when it fails on its lowest rate)."""
        return self.bracket(system, labels)[0]

    def _below(self, system: str, labels: Mapping[tuple[str, float], str]) -> float | None:
        """A system that failed at the lowest rate it ran steps down the series, to a quarter of the first
        rung, until a rate passes: its knee may lie below where the ladder starts."""
        ran = sorted(q for s, q in labels if s == system)
        if not ran or labels[(system, ran[0])] == OK:
            return None
        below = [r for r in rungs(self.rates[0] / 4, ran[0]) if r < ran[0] * (1 - 1e-9)]
        return below[-1] if below else None

    def _midpoint(self, system: str, labels: Mapping[tuple[str, float], str]) -> float | None:
        """The next bisection between ``system``'s knee and first failure, or None when resolved."""
        knee, fail = self.bracket(system, labels)
        if self.resolution is None or knee is None or fail is None or fail / knee <= self.resolution:
            return None
        mid = float(f"{math.sqrt(knee * fail):.3g}")
        return mid if knee < mid < fail and (system, mid) not in labels else None


@dataclass
class SystemCapacity:
    system: str
    knee_qps: float | None  # None: failed at the first rung, or never on the ladder (``beyond_ladder``)
    beyond_ladder: bool
    first_failed_qps: float | None
    failed_as: str | None
    goodput_prompt_tokens_per_s: float | None
    points: list[dict[str, Any]] = field(default_factory=list)
    at_overload: dict[str, dict[str, Any]] = field(default_factory=dict)


POINT_FIELDS = ("qps", "label", "saturation", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "delivered_hit_rate", "throughput_tokens_per_s")  # fmt: skip


def analyse(
    results: Iterable[Mapping[str, Any]],
    ladder: Ladder,
    slo_s: float,
    mean_prompt_tokens: float,
    ideal_hit_rate: float | None = None,
) -> dict[str, Any]:
    """Per system: its points in rate order (labelled), knee, goodput and what it holds at overload;
    then goodput and overload ratios against the reference. ``results``: point summaries with ``system``,
    ``qps``, ``label`` and the ``POINT_FIELDS`` they have."""
    by: dict[str, dict[float, Mapping[str, Any]]] = {}
    for r in results:
        by.setdefault(str(r["system"]), {})[float(r["qps"])] = r
    labels = {(s, q): str(r["label"]) for s, pts in by.items() for q, r in pts.items()}
    ref_knee = ladder.knee_of(ladder.reference, labels) if ladder.reference in by else None
    systems: dict[str, SystemCapacity] = {}
    for s in ladder.systems:
        pts = by.get(s, {})
        knee, first_bad = ladder.bracket(s, labels)
        beyond = first_bad is None and ladder.rates[-1] in pts
        if beyond:
            knee = ladder.rates[-1]
        cap = SystemCapacity(
            system=s, knee_qps=knee, beyond_ladder=beyond, first_failed_qps=first_bad,
            failed_as=str(pts[first_bad]["label"]) if first_bad is not None else None,
            goodput_prompt_tokens_per_s=knee * mean_prompt_tokens if knee is not None else None,
            points=[{f: pts[q].get(f) for f in POINT_FIELDS} for q in sorted(pts)],
        )  # fmt: skip
        if ref_knee is not None:
            for m in ladder.overload:
                rate = round(m * ref_knee, 6)
                if rate in pts:
                    cap.at_overload[f"{m:g}x"] = {f: pts[rate].get(f) for f in POINT_FIELDS}
        systems[s] = cap
    out: dict[str, Any] = {
        "slo_ttft_p90_s": slo_s, "reference": ladder.reference, "reference_knee_qps": ref_knee,
        "ladder_qps": list(ladder.rates), "mean_prompt_tokens": mean_prompt_tokens, "ideal_hit_rate": ideal_hit_rate,
        "systems": {s: vars(c) for s, c in systems.items()},
    }  # fmt: skip
    ref = systems.get(ladder.reference or "")
    if ref is not None:
        out["vs_reference"] = {s: _ratios(c, ref) for s, c in systems.items() if s != ref.system}
    return out


def _ratios(c: SystemCapacity, ref: SystemCapacity) -> dict[str, Any]:
    out: dict[str, Any] = {
        "goodput": c.knee_qps / ref.knee_qps if c.knee_qps is not None and ref.knee_qps else None,
    }
    for m, p in c.at_overload.items():
        r = ref.at_overload.get(m)
        if r and r.get("throughput_tokens_per_s"):
            out[f"throughput_at_{m}"] = p["throughput_tokens_per_s"] / r["throughput_tokens_per_s"]
            out[f"hits_at_{m}"] = p["delivered_hit_rate"]
    return out


def format_table(cap: dict[str, Any]) -> str:
    """Goodput per system, then every point (saturated ones marked, never averaged)."""
    slo = cap["slo_ttft_p90_s"]
    head = ("system", "knee qps", "goodput tok/s", "fails at", "as", *(f"hits@{m:g}x" for m in OVERLOAD),
            *(f"tok/s@{m:g}x" for m in OVERLOAD))  # fmt: skip
    rows = [head]
    for s, c in cap["systems"].items():
        knee = "-" if c["knee_qps"] is None else f"{c['knee_qps']:g}" + ("+" if c["beyond_ladder"] else "")
        ov = c["at_overload"]
        rows.append((
            s, knee, "-" if c["goodput_prompt_tokens_per_s"] is None else f"{c['goodput_prompt_tokens_per_s']:,.0f}",
            "-" if c["first_failed_qps"] is None else f"{c['first_failed_qps']:g}", c["failed_as"] or "-",
            *(f"{100 * ov[f'{m:g}x']['delivered_hit_rate']:.1f}%" if f"{m:g}x" in ov else "-" for m in OVERLOAD),
            *(f"{ov[f'{m:g}x']['throughput_tokens_per_s']:,.0f}" if f"{m:g}x" in ov else "-" for m in OVERLOAD),
        ))  # fmt: skip
    lines = [f"Goodput: the highest rate with P90 TTFT <= {slo:g} s before the first failure "
             f"(reference {cap['reference']}, knee {cap['reference_knee_qps']})", _grid(rows), "",
             "Points (saturated: TTFT depends on the run's length; never a headline):"]  # fmt: skip
    rows = [("system", "qps", "label", "mean s", "p50 s", "p90 s", "p99 s", "hits", "tok/s")]
    for s, c in cap["systems"].items():
        for p in c["points"]:
            rows.append((
                s, f"{p['qps']:g}", p["label"], *(_s(p.get(k)) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                                                                       "ttft_p99_s")),
                "-" if p.get("delivered_hit_rate") is None else f"{100 * p['delivered_hit_rate']:.1f}%",
                "-" if p.get("throughput_tokens_per_s") is None else f"{p['throughput_tokens_per_s']:,.0f}",
            ))  # fmt: skip
    return "\n".join([*lines, _grid(rows)])


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _grid(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def plot(cap: dict[str, Any], path: Path, title: str = "") -> str:
    """Mean and P90 TTFT against offered load (the objective dashed, each knee marked, saturated points
    hollow) and delivered hits against load (the trace's ideal dashed)."""
    from flatcake.loadgen.report import plots

    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (s, c) in enumerate(cap["systems"].items()):
        color = colors[i % len(colors)]
        pts = c["points"]
        for ax, key in zip(axes, ("ttft_mean_s", "ttft_p90_s", "delivered_hit_rate"), strict=True):
            xs = [p["qps"] for p in pts if p.get(key) is not None]
            ys = [p[key] for p in pts if p.get(key) is not None]
            ax.plot(xs, ys, color=color, label=s)
            for p in pts:
                if p.get(key) is not None:
                    hollow = p["label"] == SATURATED
                    ax.plot(p["qps"], p[key], "o", color=color, mfc="none" if hollow else color)
        if c["knee_qps"] is not None:
            for ax in axes[:2]:
                ax.axvline(c["knee_qps"], color=color, linestyle=":", alpha=0.8)
    axes[1].axhline(cap["slo_ttft_p90_s"], color="black", linestyle="--", linewidth=1, label="P90 objective")
    for ax in axes[:2]:
        ax.set_yscale("log")
    if cap.get("ideal_hit_rate") is not None:
        axes[2].axhline(cap["ideal_hit_rate"], color="gray", linestyle="--", label="ideal")
    plots.label(axes[0], "offered load (requests/s)", "mean TTFT (s)", "Mean TTFT (knees dotted)", legend=True)
    plots.label(axes[1], "offered load (requests/s)", "P90 TTFT (s)", "P90 TTFT against the objective (dashed)")
    plots.label(axes[2], "offered load (requests/s)", "delivered hit rate", "Delivered hits (hollow: saturated)")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(plots.save(fig, path))
