"""``flatcake simulate --sweep load``: every system on a load ladder to its knee, on the same trace.

Each rung's points run in ``--workers`` processes; ``capacity.Ladder`` decides what runs next (each
system until it fails the P90 objective or saturates, one rung past, then every system at 1.5x and
2x the reference's knee). Writes ``sweep-load.json`` and ``sweep-load.png`` in the output folder.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatcake.errors import ConfigError
from flatcake.loadgen.models import preset
from flatcake.loadgen.report import capacity
from flatcake.loadgen.simulate import devices, workload
from flatcake.loadgen.simulate.run import SimConfig, cluster, cluster_json, run_points

RESOLUTION = 1.06  # knees bisected to within 6% (points are cheap here; rungs are 25% apart)


def slo_for(cfg: SimConfig) -> float:
    """The default objective: the cold prefill of the trace's P90 prompt on the configured GPU."""
    c = cluster(cfg)
    prompts = [r.input_length for r in workload.load(cfg.trace, cfg.limit)]
    return capacity.default_slo_s(prompts, lambda n: c.prefill_s(n, 0))


def run(
    cfg: SimConfig,
    out: Path,
    slo_s: float | None = None,
    ladder: tuple[float, float] = capacity.DEFAULT_LADDER,
    reference: str = "tiered",
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    cfg.check()
    if slo_s is not None and slo_s <= 0:
        raise ConfigError(f"--slo-ttft: {slo_s} must be > 0 seconds")
    slo = slo_s if slo_s is not None else slo_for(cfg)
    lad = capacity.Ladder(capacity.rungs(*ladder), cfg.systems, reference if reference in cfg.systems else None,
                          resolution=RESOLUTION)  # fmt: skip
    trace = workload.load(cfg.trace, cfg.limit)
    mean_prompt = sum(r.input_length for r in trace) / len(trace)
    results: list[dict[str, Any]] = []
    labels: dict[tuple[str, float], str] = {}
    t0 = time.perf_counter()
    while todo := lad.plan(labels):
        if log is not None:
            log(f"load ladder: {len(todo)} point(s): " + ", ".join(f"{s}@{q:g}" for s, q in todo)
                + f" ({time.perf_counter() - t0:.0f} s elapsed)")  # fmt: skip
        done = run_points([(cfg, s, q) for s, q in todo], cfg.workers, quiet)
        for r in done:
            r["label"] = capacity.label(r["ttft_p90_s"], r["saturation"] is not None, slo)
            r.pop("occupancy", None)  # a ladder's points: the curves, not each one's timeline
            labels[(r["system"], float(r["qps"]))] = r["label"]
            results.append(r)
            if log is not None:
                log(f"  {r['system']} @ {r['qps']:g} QPS: {r['label']}, P90 TTFT {r['ttft_p90_s']:.3g} s, "
                    f"hits {100 * r['delivered_hit_rate']:.1f}%")  # fmt: skip
    ideal = results[0]["ideal_hit_rate"] if results else None
    cap = capacity.analyse(results, lad, slo, mean_prompt, ideal)
    report = {
        "sweep": "load",
        "config": {**dataclasses.asdict(cfg), "cluster": cluster_json(cfg)},
        "device_profile": dataclasses.asdict(devices.profile(cfg.device)),
        "model": preset(cfg.model).calibration(cfg.gpu),
        "slo": {"ttft_p90_s": slo, "given": slo_s is not None,
                "rule": "given (--slo-ttft)" if slo_s is not None else "cold prefill of the trace's P90 prompt"},
        "capacity": cap,
        "results": results,
        "sim_wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    report["plot"] = capacity.plot(
        cap, out / "sweep-load.png", title=f"{Path(cfg.trace).name}, {cfg.model} on {cfg.gpu}"
    )
    return report
