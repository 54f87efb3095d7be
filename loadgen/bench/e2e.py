"""``flatcake bench e2e``: the main job. Emulators on loopback, a trace slice replayed through Locust at
several rates for FlatCake as it ships (SGLang HiCache's rules over FlatCake's backend), the paper's
engine-integrated FlatCake (``flatcake-native``, a what-if: FC-MAS, or FCFS for the ablation), and the
baselines under SGLang's rules (tiered, SGLang's file and Mooncake backends, DRAM only), repeated, then
the report. Every summary row says whose rules it ran under (``rules``: ``sglang`` or ``native``).

Calibrated: the emulated GPU costs what the model preset says on the named GPU, and the KV bytes per
token are the preset's, through the real engines on this machine's disk. The emulator sizes HBM,
DRAM and SSD from the slice's working set (shares stated in the report), so any trace exercises
the storage rather than fitting in HBM. Each (system, rate, repeat) point starts cold: a fresh
emulator (and, for FlatCake, a fresh node agent that the emulator uses as its client) on fresh pools.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatcake.loadgen import names
from flatcake.loadgen.bench import emulated
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import page_keys, scheduler_policy
from flatcake.loadgen.models import preset
from flatcake.loadgen.replay.requests import prompt_tokens
from flatcake.loadgen.replay.run import LoadgenConfig
from flatcake.loadgen.replay.run import run as run_locust
from flatcake.loadgen.report import build as R
from flatcake.loadgen.report import capacity
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.loadgen.traces import slices
from flatcake.loadgen.traces import stats as trace_stats
from flatcake.loadgen.traces.formats import BUNDLED_TRACE, TraceRequest, read_trace
from flatcake.node_agent.constants import PLACEMENT_MODES

BUNDLED = BUNDLED_TRACE
SYSTEMS = names.names("e2e")
# system -> (emulator mode, L3), where not (system, log); hicache-file: tiered with SGLang's HiCacheFile as L3
EMULATE = {"hicache-file": ("tiered", "hicache-file"), "hicache-mooncake": ("tiered", "hicache-mooncake"),
           "recompute": ("none", "log")}  # fmt: skip
FLATCAKES = emulated.FLATCAKES  # the systems with a node agent underneath
LADDER_RESOLUTION = 1.12  # a load sweep bisects each knee once between its 25%-apart rungs


@dataclass(frozen=True)
class Sizing:
    """HBM, DRAM and SSD as shares of the slice's working set (its distinct pages). A short slice
    has few sessions in flight, where production has hundreds whose prefills push a session's
    previous turn out of HBM; a small HBM share stands in for that pressure. The defaults keep the
    paper's order (HBM < DRAM, SSD holding everything); docs/benchmarks.md explains them."""

    hbm_share: float = 0.125
    dram_share: float = 0.25
    ssd_share: float = 2.0

    def apply(self, emu: EmulatorConfig, working_set_pages: int, longest_prompt_pages: int) -> EmulatorConfig:
        span = emu.page_span
        hbm = max(1, int(working_set_pages * self.hbm_share))
        dram = max(1, int(working_set_pages * self.dram_share))
        ssd = max(int(working_set_pages * self.ssd_share), 64) * span
        return dataclasses.replace(emu, hbm_bytes=hbm * span, dram_bytes=dram * span, ssd_bytes=ssd,
                                   scope_file_bytes=max(emu.scope_file_bytes, 4 * span))  # fmt: skip


@dataclass(frozen=True)
class E2EConfig:
    trace: str = str(BUNDLED)
    offset: int = 0  # requests of the trace skipped
    requests: int | None = 100
    window_s: float | None = None  # at most this much trace time from the first kept request
    qps: tuple[float, ...] = (2.0, 4.0)  # below the modelled GPU's limit and near it (8 saturates every system)
    time_scale: tuple[float, ...] | None = None  # replay at the trace's own times x each factor, instead of qps
    systems: tuple[str, ...] = ("flatcake", "flatcake-native", "tiered", "dram")
    schedulers: tuple[str, ...] = ("mas",)  # flatcake-native's; two run the FC-MAS ablation
    placements: tuple[str, ...] = ("table2",)  # FlatCake's placement.mode; two run the placement ablation
    # flatcake: its pool's share of the DRAM budget (the rest SGLang's host pool); two or more run the split
    storage_dram_shares: tuple[float, ...] = (0.5,)
    repeats: int = 3
    model: str = "dsv4-flash"
    gpu: str = "a100"
    prefetch_policy: str = hicache.DEFAULT_PREFETCH_POLICY
    sizing: Sizing = field(default_factory=Sizing)
    max_output: int = 16
    use_agent: bool = True
    # A load sweep: climb the rungs from START to STOP (capacity.rungs) to each system's knee instead of ``qps``
    ladder: tuple[float, float] | None = None
    slo_ttft_s: float | None = None  # the P90 objective; None: the cold prefill of the slice's P90 prompt
    reference: str = "tiered"  # whose knee sets the overload points (1.5x, 2x); hicache-file when tiered is absent

    def __post_init__(self) -> None:
        if self.systems != names.resolve("e2e", self.systems):
            raise ValueError(
                f"systems: {self.systems} use earlier spellings; give {names.resolve('e2e', self.systems)}"
            )
        for mode in self.placements:
            if mode not in PLACEMENT_MODES:
                raise ValueError(f"placements: {mode!r} is not one of {', '.join(PLACEMENT_MODES)}")
        if self.repeats < 1:
            raise ValueError(f"repeats: {self.repeats} must be >= 1")
        if any(q <= 0 for q in self.qps) or any(t <= 0 for t in self.time_scale or ()):
            raise ValueError("qps / time_scale: every value must be > 0")
        if self.ladder is not None and not (len(self.ladder) == 2 and 0 < self.ladder[0] <= self.ladder[1]):
            raise ValueError(f"ladder: {self.ladder} must be START,STOP with 0 < START <= STOP")
        if self.slo_ttft_s is not None and self.slo_ttft_s <= 0:
            raise ValueError(f"slo_ttft: {self.slo_ttft_s} must be > 0 seconds")
        preset(self.model)
        EmulatorConfig(model=self.model, gpu=self.gpu, prefetch_policy=self.prefetch_policy)


# A slice where the systems differ within a minute or two: the bundled agentic trace's first 48
# requests, one repeat, a rate near the modelled GPU's limit and one past it.
QUICK = E2EConfig(requests=48, qps=(4.0, 8.0), repeats=1)


def page_ideal(requests: list[TraceRequest], page_tokens: int) -> float:
    """Delivered hit rate of an infinite cache of full pages: what an engine with pages can reach."""
    seen: set[str] = set()
    hit = total = 0
    for r in requests:
        tokens = prompt_tokens(r)
        keys = page_keys(tokens, page_tokens)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += n * page_tokens
        total += len(tokens)
        seen.update(keys)
    return hit / total if total else 0.0


def working_set(requests: list[TraceRequest], page_tokens: int) -> tuple[int, int]:
    """Distinct full pages of the slice, and the longest prompt in pages."""
    seen: set[str] = set()
    longest = 0
    for r in requests:
        keys = page_keys(prompt_tokens(r), page_tokens)
        seen.update(keys)
        longest = max(longest, len(keys))
    return len(seen), longest


def run_meta(trace: str, requests: int | None, page_tokens: int, qps: tuple[float, ...], systems: tuple[str, ...],
             context: str, description: str = "") -> dict[str, Any]:  # fmt: skip
    """What the report needs besides the records: the trace slice, its ideal hit rates, where it ran."""
    reqs = list(read_trace(trace, requests))
    stats = trace_stats.compute(iter(reqs), progress=False)
    return {
        "trace": trace, "requests": stats["requests"], "qps": list(qps), "systems": list(systems),
        "ideal_hit_rate_tokens": stats["ideal_hit_rate_tokens"],
        "ideal_hit_rate_pages": page_ideal(reqs, page_tokens), "page_tokens": page_tokens,
        "context": context, "description": description,
    }  # fmt: skip


@dataclass(frozen=True)
class Point:
    system: str
    scheduler: str | None  # FlatCake's; None for the others (FCFS as SGLang schedules)
    qps: float
    repeat: int
    placement: str = "table2"  # FlatCake's placement.mode
    storage_dram_share: float = 0.5  # flatcake: its pool's share of the DRAM budget

    @property
    def label(self) -> str:
        parts = [self.system]
        if self.scheduler not in (None, "mas"):
            parts.append(str(self.scheduler))
        if self.placement != "table2":
            parts.append(self.placement)
        if self.storage_dram_share != 0.5:
            parts.append(f"dram{round(100 * self.storage_dram_share)}")
        return "-".join(parts)


def points(cfg: E2EConfig, rates: tuple[float, ...]) -> list[Point]:
    """Repeats outermost, so a slow drift of the machine spreads over every system alike."""
    out = []
    for rep in range(cfg.repeats):
        for system in cfg.systems:
            native, flatcake = system == "flatcake-native", system in FLATCAKES
            for sched in cfg.schedulers if native else (None,):
                for placement in cfg.placements if flatcake else ("table2",):
                    for share in cfg.storage_dram_shares if system == "flatcake" else (0.5,):
                        out += [Point(system, sched, q, rep, placement, share) for q in rates]
    return out


def point_config(emu: EmulatorConfig, point: Point) -> EmulatorConfig:
    """The emulator's configuration for one point's system."""
    mode, l3 = EMULATE.get(point.system, (point.system, "log"))
    return dataclasses.replace(emu, mode=mode, scheduler=point.scheduler, l3=l3, placement=point.placement,
                               storage_dram_share=point.storage_dram_share)  # fmt: skip


def system_rules(emu: EmulatorConfig) -> dict[str, Any]:
    """What one system runs under, for the report: whose rules, its DRAM split, its L3, how its reads
    meet the page cache."""
    return {
        "rules": emu.rules, "mode": emu.mode, "l3": emu.storage, "scheduler": scheduler_policy(emu),
        "host_tier_bytes": emu.host_tier_bytes if emu.rules == "sglang" else 0,
        "storage_dram_bytes": emu.l3_dram_bytes, "dram_budget_bytes": emu.dram_bytes,
        "write_policy": "write_through (backup thread)" if emu.storage else None,
        "prefetch_policy": emu.prefetch_policy if emu.rules == "sglang" else "waits (never declines)",
        "late_pages": "recomputed" if emu.rules == "sglang" else "restored at dispatch",
        "page_cache": emu.page_cache,
    }  # fmt: skip


def run_point(cfg: E2EConfig, emu_base: EmulatorConfig, trace: Path, point: Point, out: Path, work: Path) -> None:
    """One cold run of one system at one rate; its records land in ``out/<label>/qps-<q>/rep-<i>/``."""
    run_dir = out / point.label / f"qps-{point.qps:g}" / f"rep-{point.repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # A short name: the agent's socket lives here, and a Unix socket's path has at most 107 bytes.
    data = work / f"{zlib.crc32(f'{point.label}-{point.qps:g}-{point.repeat}'.encode()):08x}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    emu = dataclasses.replace(point_config(emu_base, point), data_dir=str(data))
    try:
        with emulated.running(emu, data, run_dir, cfg.use_agent) as emulator:
            rc = run_locust(LoadgenConfig(host=emulator.url, trace=str(trace), qps=point.qps, system=point.label,
                                          results=str(run_dir / "results.jsonl"), csv_prefix=str(run_dir / "locust"),
                                          max_output=cfg.max_output))  # fmt: skip
            if rc not in (0, 1):  # 1: Locust saw failed requests, which the records show
                raise RuntimeError(f"locust exited with {rc}")
            emulator.save_metrics(run_dir)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def run(cfg: E2EConfig, out: str | Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    out = Path(out).resolve()  # the processes it starts run in their own directories
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    reqs = slices.select(cfg.trace, cfg.offset, cfg.requests, cfg.window_s)
    trace = slices.write(reqs, out / "trace.jsonl")
    native = slices.native_qps(reqs)
    if cfg.ladder:
        rates = capacity.rungs(*cfg.ladder)
    elif cfg.time_scale:
        if native <= 0:
            raise ValueError("time_scale: the slice has no time span; give --qps instead")
        rates = tuple(round(native / t, 4) for t in cfg.time_scale)
    else:
        rates = cfg.qps
    model = preset(cfg.model)
    emu = EmulatorConfig(model=cfg.model, gpu=cfg.gpu, prefetch_policy=cfg.prefetch_policy)
    pages, longest = working_set(reqs, emu.page_tokens)
    emu = cfg.sizing.apply(emu, pages, longest)
    meta = run_meta(
        str(trace), None, emu.page_tokens, rates, cfg.systems,
        context="local emulators on loopback (flatcake emulate)",
        description="Each point starts cold. Hits are delivered hits: KV in HBM before prefill starts. "
                    f"GPU modelled: {cfg.model} on {cfg.gpu}; storage real, on this machine's disk.",
    )  # fmt: skip
    meta.update({
        "source_trace": cfg.trace, "offset": cfg.offset, "window_s": cfg.window_s, "native_qps": native,
        "time_scale": list(cfg.time_scale) if cfg.time_scale else None, "repeats": cfg.repeats,
        "model": cfg.model, "gpu": cfg.gpu, "calibration": model.calibration(cfg.gpu),
        "prefetch_policy": cfg.prefetch_policy, "schedulers": list(cfg.schedulers),
        "placements": list(cfg.placements),
        "working_set_pages": pages, "longest_prompt_pages": longest, "sizing": dataclasses.asdict(cfg.sizing),
        "emulator": dataclasses.asdict(emu),
        "labels": {p.label: {"system": p.system, "scheduler": p.scheduler or "fcfs", "placement": p.placement,
                             "rules": point_config(emu, p).rules, "storage_dram_share": p.storage_dram_share}
                   for p in points(cfg, rates)},
        "systems_run": {p.label: system_rules(point_config(emu, p)) for p in points(cfg, rates)},
    })  # fmt: skip
    if cfg.ladder:
        meta["load_ladder"] = ladder_meta(cfg, reqs, rates)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    started = time.monotonic()
    if cfg.ladder:
        climb(cfg, emu, trace, out, work, meta, log)
    else:
        todo = points(cfg, rates)
        for i, point in enumerate(todo, 1):
            log(f"[{i}/{len(todo)}] {point.label} at {point.qps:g} QPS, repeat {point.repeat + 1}/{cfg.repeats}, "
                f"{len(reqs)} requests ({time.monotonic() - started:.0f}s elapsed)")  # fmt: skip
            run_point(cfg, emu, trace, point, out, work)
    shutil.rmtree(work, ignore_errors=True)
    return R.write(out)


def ladder_meta(cfg: E2EConfig, reqs: list[TraceRequest], rates: tuple[float, ...]) -> dict[str, Any]:
    """The load sweep's rungs, systems (point labels), reference and objective, for the report."""
    labels = tuple(dict.fromkeys(p.label for p in points(dataclasses.replace(cfg, repeats=1), rates[:1])))
    reference = cfg.reference if cfg.reference in labels else "hicache-file" if "hicache-file" in labels else None
    prompts = [r.input_length for r in reqs]
    model = preset(cfg.model)
    slo = cfg.slo_ttft_s or capacity.default_slo_s(prompts, lambda n: model.prefill_s(n, 0, cfg.gpu))
    return {
        "rates": list(rates), "systems": list(labels), "reference": reference, "slo_ttft_p90_s": slo,
        "slo_rule": "given (--slo-ttft)" if cfg.slo_ttft_s else "cold prefill of the slice's P90 prompt",
        "mean_prompt_tokens": sum(prompts) / len(prompts), "resolution": LADDER_RESOLUTION,
    }  # fmt: skip


def climb(cfg: E2EConfig, emu: EmulatorConfig, trace: Path, out: Path, work: Path, meta: dict[str, Any],
          log: Callable[[str], None]) -> None:  # fmt: skip
    """Run the load ladder: each round, every repeat of the points ``capacity.Ladder`` asks for (repeats
    outermost), then label them from their records as the report will."""
    lad = meta["load_ladder"]
    ladder = capacity.Ladder(tuple(lad["rates"]), tuple(lad["systems"]), lad["reference"], resolution=lad["resolution"])
    template = {p.label: p for p in points(dataclasses.replace(cfg, repeats=1), (lad["rates"][0],))}
    labels: dict[tuple[str, float], str] = {}
    started, n = time.monotonic(), 0
    while todo := ladder.plan(labels):
        for rep in range(cfg.repeats):
            for label, q in todo:
                n += 1
                log(f"[ladder {n}] {label} at {q:g} QPS, repeat {rep + 1}/{cfg.repeats} "
                    f"({time.monotonic() - started:.0f}s elapsed)")  # fmt: skip
                run_point(cfg, emu, trace, dataclasses.replace(template[label], qps=q, repeat=rep), out, work)
        systems = R.collect(out)["systems"]
        for label, q in todo:
            point = systems[label][f"{q:g}"]
            labels[(label, q)] = R.point_label(point, lad["slo_ttft_p90_s"])
            p90 = point["spread"]["ttft_p90_s"]
            log(f"  {label} at {q:g} QPS: {labels[(label, q)]}, P90 TTFT {p90['median']:.3f} s "
                f"({p90['min']:.3f}-{p90['max']:.3f}), hits {100 * point['delivered_hit_rate']:.1f}%")  # fmt: skip
    meta["qps"] = sorted({q for _, q in labels})
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
