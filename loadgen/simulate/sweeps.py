"""``flatcake simulate --sweep NAME``: the questions the paper leaves open, one knob at a time.

Every knob reaches the agent's own code through its configuration, never a copy of it: placement
thresholds through ``PlacementConfig`` (read by ``decide`` inside ``LocalCatalog``), Δgap and the staging
slot through the arguments the simulator passes to ``plan_restore``, streams through the FC-MAS
prefetch concurrency. Points run in ``--workers`` processes; each sweep writes ``sweep-NAME.json`` and
``sweep-NAME.png``.

- ``dram-ssd``: DRAM's share of a fixed storage budget (the base config's DRAM and SSD at the prices
  below), the rest buying SSD.
- ``placement``: Table 2's thresholds (L_agent, τ, short reply) scaled together by 1/8 .. 8.
- ``gap``: Δgap from 0 to 1 MiB.
- ``staging``: the staging slot (1-32 MiB) against restore streams (1-8): the window per instance is
  streams x staging layers (2) x slot.
- ``long-sessions``: a generated trace of 8 interleaved sessions, each turn appending 1,024 tokens to a
  16K-token start, from 25 to 200 turns per session.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake.errors import ConfigError
from flatcake.loadgen.report import plots
from flatcake.loadgen.simulate import devices
from flatcake.loadgen.simulate.run import GiB, KiB, MiB, SimConfig, cluster, run_points
from flatcake.loadgen.traces.formats import TraceRequest, write_trace
from flatcake.node_agent import PlacementConfig

# Prices per GiB, assumed (not quotes): server DDR5 RDIMMs at about $3/GiB against enterprise TLC NVMe
# at about $0.15/GiB, so DRAM costs 20x NVMe per GiB. Only the ratio matters for the sweep.
DRAM_USD_PER_GIB = 3.0
NVME_USD_PER_GIB = 0.15
STAGING_LAYERS = 2  # IOConfig.staging_layers: slots per restore stream


@dataclass(frozen=True)
class SweepPoint:
    series: str  # one line on the plot
    x: float
    cfg: SimConfig
    system: str


@dataclass(frozen=True)
class Sweep:
    name: str
    xlabel: str
    systems: tuple[str, ...]  # default systems (the CLI's --systems overrides)
    panels: tuple[tuple[str, str], ...]  # (result key, y label)
    points: Callable[[SimConfig, tuple[str, ...], Path], list[SweepPoint]]
    log_x: bool = False


def _dram_ssd(base: SimConfig, systems: tuple[str, ...], work: Path) -> list[SweepPoint]:
    budget = base.dram_bytes / GiB * DRAM_USD_PER_GIB + base.ssd_bytes / GiB * NVME_USD_PER_GIB
    out = []
    for share in (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85):
        dram = int(share * budget / DRAM_USD_PER_GIB * GiB)
        ssd = int((1 - share) * budget / NVME_USD_PER_GIB * GiB)
        cfg = dataclasses.replace(base, dram_bytes=dram, ssd_bytes=ssd)
        try:
            cluster(cfg)
        except ConfigError:  # too little of one medium for the layout: not a buildable node
            continue
        out += [SweepPoint(s, 100 * share, cfg, s) for s in systems]
    return out


def _placement(base: SimConfig, systems: tuple[str, ...], work: Path) -> list[SweepPoint]:
    d = PlacementConfig()
    out = []
    for scale in (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0):
        placement = PlacementConfig(
            agent_context_tokens=max(1, int(d.agent_context_tokens * scale)),
            agent_reply_tokens=max(1, int(d.agent_reply_tokens * scale)),
            short_reply_tokens=max(1, int(d.short_reply_tokens * scale)),
        )
        out += [SweepPoint(s, scale, dataclasses.replace(base, placement=placement), s) for s in systems]
    return out


def _gap(base: SimConfig, systems: tuple[str, ...], work: Path) -> list[SweepPoint]:
    return [SweepPoint(s, kib, dataclasses.replace(base, gap_bytes=kib * KiB), s)
            for kib in (0, 4, 16, 64, 256, 1024) for s in systems]  # fmt: skip


def _staging(base: SimConfig, systems: tuple[str, ...], work: Path) -> list[SweepPoint]:
    out = []
    for streams in (1, 2, 4, 8):
        for mib in (1, 2, 4, 8, 16, 32):
            cfg = dataclasses.replace(base, staging_slot_bytes=mib * MiB, streams=streams)
            out += [SweepPoint(f"{s}, {streams} streams", mib, cfg, s) for s in systems]
    return out


def long_sessions_trace(path: Path, turns: int, sessions: int = 8, start_tokens: int = 16_384,
                        append_tokens: int = 1_024, reply_tokens: int = 256, gap_ms: float = 1e3) -> str:  # fmt: skip
    """``sessions`` interleaved sessions of ``turns`` turns, each turn resending the history plus
    ``append_tokens`` (512-token blocks, prefix-chained ids, as ``trace synth`` writes them)."""
    block = 512
    reqs, next_id, t = [], 1, 0.0
    history: dict[int, list[int]] = {}
    for turn in range(1, turns + 1):
        for s in range(sessions):
            tokens = start_tokens + (turn - 1) * append_tokens
            ids = history.setdefault(s, [])
            need = -(-tokens // block) - len(ids)
            ids += range(next_id, next_id + need)
            next_id += need
            reqs.append(TraceRequest(t, tokens, reply_tokens, tuple(ids), f"s{s}", turn, block))
            t += gap_ms
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, reqs)
    return str(path)


def _long_sessions(base: SimConfig, systems: tuple[str, ...], work: Path) -> list[SweepPoint]:
    out = []
    for turns in (25, 50, 100, 200):
        trace = long_sessions_trace(work / f"long-sessions-{turns}.jsonl", turns)
        cfg = dataclasses.replace(base, trace=trace, limit=None)
        out += [SweepPoint(s, turns, cfg, s) for s in systems]
    return out


_HIT = ("delivered_hit_rate", "delivered hit rate")
_TTFT = ("ttft_mean_s", "mean TTFT (s)")
_PREFETCH = ("mean_prefetch_s", "mean prefetch (s)")
_CMDS = ("read_commands_per_page", "SSD commands per restored page")
SWEEPS = {
    "dram-ssd": Sweep("dram-ssd", "DRAM share of the storage budget (%)", ("flatcake-native", "tiered"),
                      (_HIT, _TTFT, ("ttft_p99_s", "P99 TTFT (s)")), _dram_ssd),
    "placement": Sweep("placement", "threshold scale (L_agent, τ, short reply x this)", ("flatcake-native",),
                       (("dram_placed_share", "pages placed in DRAM (share)"), _HIT, _TTFT), _placement, log_x=True),
    "gap": Sweep("gap", "Δgap (KiB)", ("flatcake-native",), (_CMDS, ("read_amplification", "SSD read amplification"),
                                                         _PREFETCH, _TTFT), _gap),
    "staging": Sweep("staging", "staging slot (MiB)", ("flatcake-native",), (_CMDS, _PREFETCH, _TTFT), _staging,
                     log_x=True),
    "long-sessions": Sweep("long-sessions", "turns per session", ("flatcake-native", "tiered"),
                           (_CMDS, _PREFETCH, _TTFT, _HIT), _long_sessions, log_x=True),
}  # fmt: skip


def run(name: str, base: SimConfig, out: Path, systems: tuple[str, ...] | None = None, quiet: bool = False,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """All of one sweep's points at ``base.qps[0]``; returns the report (points in order)."""
    if name not in SWEEPS:
        raise ConfigError(f"--sweep: {name!r} is not a sweep; choose one of {', '.join(SWEEPS)}")
    sw = SWEEPS[name]
    base.check()
    qps = base.qps[0]
    points = sw.points(base, systems or sw.systems, out)
    t0 = time.perf_counter()
    results = run_points([(p.cfg, p.system, qps) for p in points], base.workers, quiet)
    if log is not None:
        log(f"sweep {name}: {len(points)} point(s) in {time.perf_counter() - t0:.1f} s")
    rows = []
    for p, r in zip(points, results, strict=True):
        r.pop("occupancy")
        rows.append({"series": p.series, "x": p.x, "dram_bytes": p.cfg.dram_bytes, "ssd_bytes": p.cfg.ssd_bytes,
                     "placement": dataclasses.asdict(p.cfg.placement), "gap_bytes": p.cfg.gap_bytes,
                     "staging_slot_bytes": p.cfg.staging_slot_bytes, "streams": p.cfg.streams, **r})  # fmt: skip
    return {
        "sweep": name,
        "xlabel": sw.xlabel,
        "qps": qps,
        "base": dataclasses.asdict(base),
        "device_profile": dataclasses.asdict(devices.profile(base.device)),
        "prices_usd_per_gib": {"dram": DRAM_USD_PER_GIB, "nvme": NVME_USD_PER_GIB} if name == "dram-ssd" else None,
        "points": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    sw = SWEEPS[report["sweep"]]
    head = ("series", "x", *(key for key, _ in sw.panels), "sim s")
    rows = [head]
    for p in report["points"]:
        cells = [p["series"], f"{p['x']:g}"]
        for key, _ in sw.panels:
            v = p[key]
            cells.append("-" if v is None else f"{v:.4g}")
        cells.append(f"{p['sim_wall_s']:.1f}")
        rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def plot(report: dict[str, Any], path: Path) -> str:
    sw = SWEEPS[report["sweep"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(sw.panels), figsize=(4.6 * len(sw.panels), 3.8))
    series = list(dict.fromkeys(p["series"] for p in report["points"]))
    for ax, (key, ylabel) in zip(axes, sw.panels, strict=True):
        for s in series:
            pts = [(p["x"], p[key]) for p in report["points"] if p["series"] == s and p[key] is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=s)
        if key == "delivered_hit_rate" and report["points"]:
            ax.axhline(report["points"][0]["ideal_hit_rate"], linestyle="--", color="gray")
        if sw.log_x:
            ax.set_xscale("log", base=2)
        plots.label(ax, sw.xlabel, ylabel, ylabel, legend=len(series) > 1)
    fig.suptitle(f"simulate --sweep {report['sweep']} at {report['qps']:g} QPS")
    return str(plots.save(fig, path))
