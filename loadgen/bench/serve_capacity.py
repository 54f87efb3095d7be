"""``bench serve``'s load sweep and storage-bound testbed: the objective, the ladder over real servers and
its verdict (``capacity``), and the testbed's shape and limit from the calibration (``testbed``)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flatcake.errors import ConfigError
from flatcake.loadgen.bench import serve_calibration
from flatcake.loadgen.report import capacity
from flatcake.loadgen.serve import testbed

if TYPE_CHECKING:
    from flatcake.loadgen.bench.serve import ServeConfig

RESOLUTION = 1.12  # one bisection between 25%-apart rungs: real-server points take minutes
TESTBED_SHAPE = "mha-small-mlp"  # the calibrated shape the testbed runs (serve_calibration.SHAPES)


def testbed_plan(cfg: ServeConfig) -> dict[str, Any] | None:
    """The testbed's shape and read limit from the calibration, checked against ``gpu_ratio``; None without one."""
    if cfg.gpu_ratio is None:
        return None
    cal = json.loads(Path(cfg.calibration).read_text())
    ref = cal["reference"]["where"]  # "llama3-70b-tp4 on h200"
    if cfg.gpu_ratio != ref.replace(" on ", "-"):
        raise ConfigError(f"--gpu-ratio: {cfg.gpu_ratio!r} is not the calibration's reference ({ref}: give "
                          f"{ref.replace(' on ', '-')}, or run bench serve --calibrate for another)")  # fmt: skip
    plan = testbed.read_limit(cal, TESTBED_SHAPE)
    plan["write_bytes_per_s"] = plan["read_bytes_per_s"]  # the same drive writes no faster than it reads here
    plan["bias"] = ("DRAM copies and page-cache hits are not throttled, so systems keeping more in DRAM or the page "
                    "cache (SGLang's host tier, vLLM's CPU tier) gain next to SSD reads; cgroup v1 does not throttle "
                    "buffered writeback")  # fmt: skip
    return plan


def serve_slo_s(cfg: ServeConfig, trace: Path) -> tuple[float, str]:
    """The default objective: this server's cold prefill of the slice's P90 prompt, from the calibration's
    two cold prefills for the shape it runs (a line through them)."""
    if cfg.slo_ttft_s is not None:
        return cfg.slo_ttft_s, "given (--slo-ttft)"
    cal = json.loads(Path(cfg.calibration).read_text())
    shape = TESTBED_SHAPE if cfg.gpu_ratio else "slice"
    row = next(r for r in cal["here"] if r["where"] == serve_calibration.where_here(shape))
    (n0, t0), (n1, t1) = sorted((int(n), t) for n, t in row["ttft_s"].items())
    prompts = [json.loads(line)["input_length"] for line in trace.read_text().splitlines() if line.strip()]
    slo = capacity.default_slo_s(prompts, lambda n: t0 + (n - n0) * (t1 - t0) / (n1 - n0))
    return slo, f"cold prefill of the slice's P90 prompt on this CPU ({shape} shape, from the calibration)"


def climb(cfg: ServeConfig, trace: Path, one: Callable[[str, float, int], None], rows: list[dict[str, Any]],
          summary: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
          log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The load ladder over real servers: each round every repeat of the points ``capacity.Ladder`` asks
    for (systems reversed every other repeat), then each labelled from its rows as the report will."""
    slo, rule = serve_slo_s(cfg, trace)
    reference = next((s for s in ("hicache-file", "vllm-offload-disk", "vllm") if s in cfg.systems), None)
    assert cfg.ladder is not None, "climb runs a load sweep"
    ladder = capacity.Ladder(
        capacity.rungs(*cfg.ladder),
        cfg.systems,
        reference,
        resolution=RESOLUTION,
    )
    labels: dict[tuple[str, float], str] = {}
    while todo := ladder.plan(labels):
        for rep in range(cfg.repeats):
            for system, qps in todo if rep % 2 == 0 else list(reversed(todo)):
                one(system, qps, rep)
        for r in summary(rows):
            key = (r["system"], r["qps"])
            if key in todo:
                labels[key] = point_label(r, slo)
                log(f"  {key[0]} at {key[1]:g} QPS: {labels[key]} (P90 TTFT {r.get('ttft_p90_s') or 0:.3f} s)")
    return {"slo_ttft_p90_s": slo, "slo_rule": rule, "rates": list(ladder.rates), "reference": reference,
            "systems": list(cfg.systems), "resolution": RESOLUTION,
            "labels": {f"{s}@{q:g}": v for (s, q), v in labels.items()}}  # fmt: skip


def point_label(row: dict[str, Any], slo_s: float) -> str:
    """A summary row as the ladder reads it: a point that did not run, or has no TTFT, counts as saturated."""
    if not row["ran"] or row.get("ttft_p90_s") is None:
        return capacity.SATURATED
    return capacity.label(row["ttft_p90_s"], row.get("saturated", False), slo_s)


def ladder_capacity(systems: list[dict[str, Any]], lad: dict[str, Any]) -> dict[str, Any]:
    ladder = capacity.Ladder(
        tuple(lad["rates"]), tuple(lad["systems"]), lad["reference"], resolution=lad.get("resolution")
    )
    points = []
    for r in systems:
        if r["system"] not in ladder.systems:
            continue
        points.append({**r, "label": point_label(r, lad["slo_ttft_p90_s"]),
                       "saturation": "; ".join(r.get("saturation") or []) or (None if r["ran"] else r["why_not"]),
                       "ttft_p50_s": None, "delivered_hit_rate": r.get("storage_hit_share")})  # fmt: skip
    rows = [r for r in systems if r["ran"]]
    mean_prompt = (
        statistics.fmean(r["prompt_tokens"] / r["requests"] for r in rows if r.get("requests")) if rows else 0.0
    )
    out = capacity.analyse(points, ladder, lad["slo_ttft_p90_s"], mean_prompt)
    out["slo_rule"] = lad["slo_rule"]
    out["hit_field"] = "delivered_hit_rate here is the share of prompt tokens served from storage (L3)"
    return out
