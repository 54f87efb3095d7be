"""One simulated point (a system at a rate) and sweeps of points in parallel processes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.loadgen.models import gpu_profile, preset
from flatcake.loadgen.report import capacity
from flatcake.loadgen.simulate import devices, workload
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import Cluster, Record, System
from flatcake.loadgen.simulate.systems import SYSTEMS, make
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.loadgen.traces.formats import BUNDLED_TRACE
from flatcake.node_agent import PlacementConfig
from flatcake.node_agent.constants import SCHEDULER_POLICIES
from flatcake.node_agent.policy.offer import WAIT_RULES

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB, "p": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """Bytes from ``1TiB``, ``512GiB``, ``64Mi``, ``4TB`` (decimal) or ``4096``; ``1T`` is binary too."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{flag}: {text!r} is not a size; write e.g. 1TiB, 512GiB, 4TB or a byte count")
    number, prefix, binary, b = m.groups()
    prefix = prefix.lower()
    decimal = bool(b) and not binary and prefix != ""  # "4TB" is decimal; "4T", "4TiB" binary
    value = float(number) * (_UNITS[prefix] if decimal else _BINARY[prefix])
    if value <= 0:
        raise ConfigError(f"{flag}: {text!r} must be more than zero bytes")
    return int(value)


@dataclass(frozen=True)
class SimConfig:
    trace: str = str(BUNDLED_TRACE)
    limit: int | None = None
    nodes: int = 1
    gpus_per_node: int = 8
    dram_bytes: int = TiB
    ssd_bytes: int = 4 * TiB
    hbm_bytes: int | None = None  # one GPU's KV pool; None: the preset's share of the GPU's HBM
    model: str = "dsv4-flash"
    gpu: str = "h200"
    qps: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    systems: tuple[str, ...] = SYSTEMS
    device: str | devices.DeviceProfile = devices.DEFAULT_PROFILE
    # Ranks that share the node's devices; None: every rank of an instance (a node's GPUs read at once).
    # 1: each rank has the whole device, as the emulator's one process has this machine's disk.
    device_ranks: int | None = None
    scope_file_bytes: int = 256 * MiB  # per rank: SsdConfig's default file size
    scheduler: str = "mas"
    prefetch_policy: str = hicache.DEFAULT_PREFETCH_POLICY
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    gap_bytes: int = 64 * KiB
    staging_slot_bytes: int = 8 * MiB
    streams: int = 4
    cross_node_gbps: float = 0.0  # FlatCake's reads from other nodes: each node's NIC, Gb/s; 0: off
    storage_dram_share: float = 0.5  # flatcake (shipped): FlatCake's pool's share of DRAM (the emulator's too)
    wait_rule: str = "cost"  # flatcake-native: "cost" waits for a load only where computing costs more; "always"
    samples: int = 100  # occupancy samples per point
    workers: int = 2  # processes for a sweep

    def check(self) -> None:
        for name in ("nodes", "gpus_per_node", "samples", "workers", "streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: {getattr(self, name)} must be >= 1")
        if not self.systems:
            raise ConfigError(f"--systems: none given; choose from {','.join(SYSTEMS)}")
        if self.systems != names.resolve("simulate", self.systems, "--systems"):
            raise ConfigError(f"--systems: {self.systems} use earlier spellings")
        if not self.qps or min(self.qps) <= 0:
            raise ConfigError(f"--qps: {self.qps} must be rates > 0")
        if self.scheduler not in SCHEDULER_POLICIES:
            raise ConfigError(f"--scheduler: {self.scheduler!r} must be one of {', '.join(SCHEDULER_POLICIES)}")
        if self.prefetch_policy not in hicache.PREFETCH_POLICIES:
            raise ConfigError(f"--prefetch-policy: must be one of {', '.join(hicache.PREFETCH_POLICIES)}")
        if not 0 <= self.storage_dram_share < 1:
            raise ConfigError(f"--storage-dram-share: {self.storage_dram_share} must be in [0, 1): SGLang's host "
                              "tier keeps the rest, and it needs some to prefetch into")  # fmt: skip
        if self.wait_rule not in WAIT_RULES:
            raise ConfigError(f"--wait-rule: {self.wait_rule!r} must be one of {', '.join(WAIT_RULES)}")
        if self.cross_node_gbps < 0:
            raise ConfigError(f"--cross-node-gbps: {self.cross_node_gbps} must be >= 0 (0: no reads across nodes)")
        if self.device_ranks is not None and self.device_ranks < 1:
            raise ConfigError(f"device_ranks: {self.device_ranks} must be >= 1 (or None: an instance's ranks)")
        devices.profile(self.device)
        gpu_profile(self.gpu)
        cluster(self)


def cluster(cfg: SimConfig) -> Cluster:
    """The cluster in one rank's view: a page is one rank's bytes, so node DRAM, SSD and device rates
    are divided by the ranks of an instance (every rank of it stores and reads its share at once)."""
    p = preset(cfg.model)
    width = p.compute.ranks if p.compute is not None else 1
    if cfg.gpus_per_node % width:
        raise ConfigError(f"--gpus-per-node: {cfg.gpus_per_node} is not a multiple of {cfg.model}'s {width} ranks")
    span = p.span_bytes
    hbm = cfg.hbm_bytes if cfg.hbm_bytes is not None else p.hbm_kv_bytes(cfg.gpu)
    if hbm < span:
        raise ConfigError(f"--hbm: {hbm} bytes hold less than one page ({span} bytes per rank)")
    if cfg.dram_bytes // width < span:
        raise ConfigError(f"--dram: {cfg.dram_bytes} bytes hold less than one page over {width} ranks")
    if cfg.ssd_bytes // width < cfg.scope_file_bytes:
        need = cfg.scope_file_bytes
        raise ConfigError(f"--ssd: {cfg.ssd_bytes} bytes hold less than one {need}-byte scope file per rank")
    gpu = cfg.gpu

    def prefill(new: int, cached: int) -> float:
        return p.prefill_s(new, cached, gpu) if new > 0 else 0.0

    return Cluster(
        nodes=cfg.nodes, instances_per_node=cfg.gpus_per_node // width, width=width, layers=p.layers,
        page_tokens=p.page_tokens, page_layer_bytes=p.page_layer_bytes, hbm_pages=hbm // span,
        dram_bytes=cfg.dram_bytes // width, ssd_bytes=cfg.ssd_bytes // width, device=devices.profile(cfg.device),
        prefill_s=prefill, decode_s_per_token=p.decode_s_per_token(gpu), placement=cfg.placement,
        scheduler=cfg.scheduler, gap_bytes=cfg.gap_bytes, staging_slot_bytes=cfg.staging_slot_bytes,
        streams=cfg.streams, prefetch_policy=cfg.prefetch_policy, scope_file_bytes=cfg.scope_file_bytes,
        device_ranks=cfg.device_ranks or width, cross_node_bytes_per_s=cfg.cross_node_gbps * 1e9 / 8,
        storage_dram_share=cfg.storage_dram_share, wait_rule=cfg.wait_rule,
    )  # fmt: skip


def simulate(
    cfg: SimConfig, system: str, qps: float | None, progress: Callable[[int], None] | None = None
) -> tuple[dict[str, Any], System]:
    """Run one point; returns its summary and the system (for tests that inspect its state)."""
    c = cluster(cfg)
    t0 = time.perf_counter()
    reqs = workload.build(workload.load(cfg.trace, cfg.limit), c.page_tokens, qps)
    ideal_pages, _ = workload.ideal_hit_pages(reqs)
    loop = EventLoop()
    sim = make(system, c, loop)
    if progress is not None:
        sim.on_done = lambda _rec: progress(1)
    for r in reqs:
        loop.at(r.arrival, sim.arrive, r)
    samples: list[tuple[float, int, int]] = []
    step = max(reqs[-1].arrival, 1.0) / cfg.samples

    def sample() -> None:
        samples.append((loop.now, *sim.occupancy()))
        if len(sim.records) < len(reqs):
            loop.after(step, sample)

    loop.at(0.0, sample)
    loop.run()
    sample()
    wall = time.perf_counter() - t0
    return summarize(cfg, c, sim, reqs, ideal_pages, samples, qps, wall, loop.processed), sim


def _pct(values: np.ndarray[Any, Any], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(
    cfg: SimConfig,
    c: Cluster,
    sim: System,
    reqs: Sequence[workload.SimRequest],
    ideal_pages: int,
    samples: list[tuple[float, int, int]],
    qps: float | None,
    wall_s: float,
    events: int,
) -> dict[str, Any]:
    recs: list[Record] = sorted(sim.records, key=lambda r: r.index)
    if len(recs) != len(reqs):
        raise RuntimeError(f"{sim.name}: {len(reqs) - len(recs)} requests never finished (simulator stalled)")
    pt = c.page_tokens
    tokens = sum(r.prompt_tokens for r in recs)
    hits = {m: sum(r.hit[m] for r in recs) for m in ("hbm", "dram", "ssd", "remote")}
    ttft = np.array([r.first_token - r.arrival for r in recs])
    prefetch = np.array([r.prefetch_s for r in recs if r.prefetch_s is not None])
    span_s = max(r.done for r in recs) - min(r.arrival for r in recs)
    ssd_read = sum(d.read_bytes for d in sim.ssd) * c.width
    ssd_cmds = sum(d.read_commands for d in sim.ssd) * c.width
    useful = sim.useful_ssd_bytes * c.width
    out: dict[str, Any] = {
        "system": sim.name,
        "qps": qps,
        "requests": len(recs),
        "prompt_tokens": tokens,
        "ideal_hit_rate": ideal_pages * pt / tokens if tokens else 0.0,
        "delivered_hit_rate": sum(hits.values()) * pt / tokens if tokens else 0.0,
        "hit_share": {m: v * pt / tokens if tokens else 0.0 for m, v in hits.items()},
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "saturation": capacity.saturation([r.arrival for r in recs], [r.first_token for r in recs]),
        "throughput_tokens_per_s": (tokens + sum(r.output_tokens for r in recs)) / span_s if span_s > 0 else 0.0,
        "ssd_read_bytes": ssd_read,
        "ssd_read_commands": ssd_cmds,
        "ssd_write_bytes": sum(d.write_bytes for d in sim.ssd) * c.width,
        "ssd_useful_bytes": useful,
        "read_amplification": ssd_read / useful if useful else None,
        "read_commands_per_page": ssd_cmds / (sim.ssd_pages_read * c.width) if sim.ssd_pages_read else None,
        "mean_prefetch_s": float(prefetch.mean()) if len(prefetch) else None,
        "prefetches": len(prefetch),
        "declined_tokens": sum(r.declined_pages for r in recs) * pt,
        "not_prefetched_tokens": sum(r.unprefetched_pages for r in recs) * pt,
        "occupancy": {"t_s": [s[0] for s in samples], "dram_bytes": [s[1] for s in samples],
                      "ssd_bytes": [s[2] for s in samples]},
        "counters": sim.counters(),
        "dram_placed_share": _dram_share(sim.counters().get("placements_pages")),
        "sim_wall_s": round(wall_s, 3),
        "events": events,
    }  # fmt: skip
    return out


def _dram_share(placements: dict[str, int] | None) -> float | None:
    """FlatCake: the share of placed pages that went to DRAM (None for systems without placement)."""
    if not placements:
        return None
    total = sum(placements.values())
    return sum(v for k, v in placements.items() if k.startswith("dram/")) / total if total else None


def _point(cfg: SimConfig, system: str, qps: float) -> dict[str, Any]:
    return simulate(cfg, system, qps)[0]


Point = tuple[SimConfig, str, float]  # a configuration, a system, a rate


def run_points(points: Sequence[Point], workers: int, quiet: bool = False) -> list[dict[str, Any]]:
    """Simulate every point, in ``workers`` processes (each point its own simulation); results in order."""
    from tqdm import tqdm

    if workers == 1 or len(points) == 1:
        results = []
        for cfg, s, q in points:
            n = len(workload.load(cfg.trace, cfg.limit))
            with tqdm(total=n, desc=f"{s} @ {q} qps", disable=quiet, unit="req", mininterval=1.0) as bar:

                def tick(n: int, bar: Any = bar) -> None:
                    bar.update(n)

                results.append(simulate(cfg, s, q, progress=tick)[0])
        return results
    out: dict[int, dict[str, Any]] = {}
    with ProcessPoolExecutor(min(workers, len(points), os.cpu_count() or 1)) as pool, \
            tqdm(total=len(points), desc="points", disable=quiet) as bar:  # fmt: skip
        futures = {pool.submit(_point, *p): i for i, p in enumerate(points)}
        for fut in as_completed(futures):
            out[futures[fut]] = fut.result()
            bar.update(1)
    return [out[i] for i in range(len(points))]


def sweep(cfg: SimConfig, log: Callable[[str], None] | None = None, quiet: bool = False) -> dict[str, Any]:
    """Every system at every rate; points run in ``workers`` processes (each its own simulation)."""
    cfg.check()
    t0 = time.perf_counter()
    results = run_points([(cfg, s, q) for q in cfg.qps for s in cfg.systems], cfg.workers, quiet)
    if log is not None:
        log(f"simulated {len(results)} point(s) in {time.perf_counter() - t0:.1f} s")
    return {
        "config": {**asdict(replace(cfg)), "cluster": cluster_json(cfg)},
        "device_profile": asdict(devices.profile(cfg.device)),
        "model": preset(cfg.model).calibration(cfg.gpu),
        "results": results,
    }


def cluster_json(cfg: SimConfig) -> dict[str, Any]:
    c = cluster(cfg)
    return {
        "instances_per_node": c.instances_per_node, "ranks_per_instance": c.width,
        "hbm_pages_per_instance": c.hbm_pages, "page_bytes_per_rank": c.page_span,
        "dram_pages_per_node": c.dram_bytes // c.page_span, "ssd_files_per_node": c.ssd_bytes // c.scope_file_bytes,
    }  # fmt: skip
