"""``flatcake simulate --validate``: the simulator against the emulator on a case both can run.

One node, the emulator's small HBM/DRAM/SSD (``bench e2e``'s sizing of the slice's working set), the
same trace slice, preset, GPU and rate. The emulator side is ``bench e2e``'s own run (real storage on
this machine's disk, Locust's TTFT); the simulator side gets the same sizes in one rank's view and the
emulator's engine settings (prefetchers, staging slot, Δgap, scope file size).

The storage rate is the one thing the simulator cannot know: on this VM the emulator's stores restore
well below the disk's raw rate (fio's ``this-vm`` profile), and the virtual disk drifts by 2x between
minutes. So the verdict row simulates the read rate the emulator's own SSD restores saw during the run
(restored bytes over the time any restore was in flight: ``flatcake_ssd_restore_bytes`` /
``flatcake_ssd_restore_busy_seconds``), with write and host-copy rates measured right after through the
emulator's ``Storage``; rows with that separate measurement's read rate, and with ``this-vm``, are
printed beside it. Goals (issue 19): delivered hit within 2 points, TTFT (mean and median) within 15%.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flatcake.errors import ConfigError
from flatcake.loadgen.bench import e2e
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.storage import Storage, engine_config
from flatcake.loadgen.models import preset
from flatcake.loadgen.simulate import devices
from flatcake.loadgen.simulate.run import SimConfig, simulate
from flatcake.loadgen.traces.formats import BUNDLED_TRACE
from flatcake.node_agent import ChainSignals

# Simulated system -> the emulator mode that runs the same rules on real storage.
EMULATED = {"flatcake-native": "flatcake-native", "tiered": "tiered", "dram": "dram"}
SIZES = ("hbm_bytes", "dram_bytes", "ssd_bytes", "scope_file_bytes", "prefetchers")
HIT_POINTS = 2.0
TTFT_RATIO = 0.15


@dataclass(frozen=True)
class ValidateConfig:
    trace: str = str(BUNDLED_TRACE)
    requests: int = 100
    qps: float = 2.0
    model: str = "dsv4-flash"
    gpu: str = "a100"
    systems: tuple[str, ...] = ("flatcake-native",)

    def check(self) -> None:
        unknown = sorted(set(self.systems) - set(EMULATED))
        if unknown or not self.systems:
            raise ConfigError(f"--systems: {unknown or 'none'} given; --validate runs {','.join(EMULATED)}")
        if self.requests < 2:
            raise ConfigError(f"--limit: {self.requests} requests; the validation needs at least 2")
        if self.qps <= 0:
            raise ConfigError(f"--qps: {self.qps} must be one rate > 0")


def measure_storage(emu: EmulatorConfig, work: Path) -> devices.DeviceProfile:
    """The rates the emulator's store for ``emu.mode`` reaches on this machine: pages written through its
    ``store`` (FlatCake: placed on SSD; tiered: flushed to its log), then read back cold by as many
    concurrent restores as the emulator runs (FlatCake's prefetchers; tiered's one I/O thread), and DRAM
    hits: pages stored in DRAM (FlatCake: a shared prompt; tiered: the host tier) restored first."""
    cfg = dataclasses.replace(emu, data_dir=str(work), agent_socket=None)
    concurrency = cfg.prefetchers if cfg.mode == "flatcake-native" else 1
    n = 2 * concurrency
    ssd_pages = cfg.ssd_bytes // cfg.page_span
    pages = max(1, min(64, ssd_pages // (2 * n)))
    store = Storage(cfg)
    try:
        dram = [f"measure-dram-{i}" for i in range(max(1, min(pages, cfg.dram_bytes // cfg.page_span // 2)))]
        signals = ChainSignals()
        for branch in ("a", "b"):  # two requests continue the prompt: the backend derives a shared prompt, DRAM
            signals.observe([], [*dram, f"measure-branch-{branch}"])
        store.store([], dram, signals)
        copy_s = None
        if store.media(dram) == ["dram"] * len(dram):
            t0 = time.perf_counter()
            store.restore(dram)
            copy_s = time.perf_counter() - t0
        vm = devices.PROFILES["this-vm"]
        runs = [[f"measure-{r}-{i}" for i in range(pages)] for r in range(n)] if cfg.mode != "dram" else []
        t0 = time.perf_counter()
        for keys in runs:  # one request each, no parent: a one-shot context, placed on SSD (Table 2)
            store.store([], keys, signals)
        if store.tiered is not None:
            store.tiered.flush()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            got = sum(n for n, _ in pool.map(store.restore, runs))
        read_s = time.perf_counter() - t0
    finally:
        store.close()
    nbytes = len(runs) * pages * cfg.page_span
    if got < len(runs) * pages:
        raise RuntimeError(f"measuring {cfg.mode}'s storage: {len(runs) * pages - got} pages did not restore")
    copied = len(dram) * cfg.page_span
    if copy_s is None:  # no DRAM to place in: time one host copy of as many bytes
        src = np.ones((cfg.layers, len(dram), cfg.page_bytes), np.uint8)
        dst = np.empty_like(src)
        t0 = time.perf_counter()
        dst[...] = src
        copy_s = time.perf_counter() - t0
    return devices.DeviceProfile(  # no SSD behind the emulator's DRAM-only mode: this-vm's rates, unused
        f"measured-{cfg.mode}", read_bytes_per_s=nbytes / read_s if runs else vm.read_bytes_per_s,
        write_bytes_per_s=nbytes / write_s if runs else vm.write_bytes_per_s,
        command_s=vm.command_s, queue_depth=vm.queue_depth, h2d_bytes_per_s=copied / max(copy_s, 1e-9),
        source=f"measured in this run through the emulator's {cfg.mode} storage: {n} x {pages} pages written, then "
               f"restored cold by {concurrency} concurrent restore(s); DRAM hits as {len(dram)} DRAM pages restore; "
               "command cost and queue depth from this-vm",
    )  # fmt: skip


def run_read_rate(prom: Path, mode: str) -> float | None:
    """Bytes per second of the emulator's SSD restores while any was in flight, from its /metrics scrape."""
    values: dict[str, float] = {}
    for line in prom.read_text().splitlines():
        for name in ("flatcake_ssd_restore_bytes_total", "flatcake_ssd_restore_busy_seconds_total"):
            if line.startswith(f'{name}{{system="{mode}"}} '):
                values[name] = float(line.split()[-1])
    busy = values.get("flatcake_ssd_restore_busy_seconds_total", 0.0)
    nbytes = values.get("flatcake_ssd_restore_bytes_total", 0.0)
    return nbytes / busy if busy > 0 and nbytes > 0 else None


def sim_config(emu: EmulatorConfig, trace: str, qps: float, device: str | devices.DeviceProfile) -> SimConfig:
    """The emulator's one serving instance as a one-node cluster, in one rank's view: the emulator stores
    one rank's bytes with this machine's whole disk, so node DRAM/SSD are the emulator's times the
    preset's ranks, and each rank has the device to itself (``device_ranks=1``)."""
    p = preset(emu.model or "")
    width = p.compute.ranks if p.compute is not None else 1
    io = engine_config(emu, Path(emu.data_dir)).io
    return SimConfig(
        trace=trace, gpus_per_node=width, hbm_bytes=emu.hbm_bytes, dram_bytes=emu.dram_bytes * width,
        ssd_bytes=emu.ssd_bytes * width, model=emu.model or "", gpu=emu.gpu, qps=(qps,), device=device,
        device_ranks=1, prefetch_policy=emu.prefetch_policy, gap_bytes=io.gap_bytes,
        staging_slot_bytes=io.staging_slot_bytes, streams=emu.prefetchers, scope_file_bytes=emu.scope_file_bytes,
        workers=1,
    )  # fmt: skip


def _side(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("delivered_hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s")
    out = {k: r[k] for k in keys}
    out["hit_share"] = r.get("hit_share") or r.get("hit_composition")
    return out


def compare(emu: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Differences against the goals: hit in points, TTFT as simulated ÷ emulated."""
    hit = 100 * (sim["delivered_hit_rate"] - emu["delivered_hit_rate"])
    mean = sim["ttft_mean_s"] / emu["ttft_mean_s"] if emu["ttft_mean_s"] else None
    p50 = sim["ttft_p50_s"] / emu["ttft_p50_s"] if emu["ttft_p50_s"] else None

    def within(ratio: float | None) -> bool:
        return ratio is not None and abs(ratio - 1) <= TTFT_RATIO

    checks = {"hit": abs(hit) <= HIT_POINTS, "ttft_mean": within(mean), "ttft_p50": within(p50)}
    return {"hit_diff_points": hit, "ttft_mean_ratio": mean, "ttft_p50_ratio": p50, "checks": checks,
            "pass": all(checks.values())}  # fmt: skip


def run(cfg: ValidateConfig, out: str | Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    cfg.check()
    out = Path(out).resolve()
    e2e_cfg = e2e.E2EConfig(trace=cfg.trace, requests=cfg.requests, qps=(cfg.qps,), repeats=1, model=cfg.model,
                            gpu=cfg.gpu, systems=tuple(EMULATED[s] for s in cfg.systems))  # fmt: skip
    log(f"emulator: {len(cfg.systems)} system(s), {cfg.requests} requests at {cfg.qps:g} QPS (real time)")
    report = e2e.run(e2e_cfg, out / "emulator", log=log)
    emu_base = EmulatorConfig(**json.loads((out / "emulator" / "meta.json").read_text())["emulator"])
    trace = str(out / "emulator" / "trace.jsonl")
    results = []
    for system in cfg.systems:
        mode = EMULATED[system]
        emu = dataclasses.replace(emu_base, mode=mode)
        log(f"measuring {mode}'s storage rates on this machine")
        measured = measure_storage(emu, out / "measure" / mode)
        prom = out / "emulator" / mode / f"qps-{cfg.qps:g}" / "rep-0" / "emulator.prom"
        rate = run_read_rate(prom, mode)
        in_run = dataclasses.replace(
            measured, name=f"run-{mode}", read_bytes_per_s=rate or measured.read_bytes_per_s,
            source=("read: the emulator's SSD restores during the run, bytes over busy time; " if rate else
                    "read: no SSD restore in the run, so the separate measurement; ") + measured.source,
        )  # fmt: skip
        emulated = _side(report["systems"][mode][f"{cfg.qps:g}"])
        sims = {}
        for name, device in (("run", in_run), ("measured", measured), ("this-vm", "this-vm")):
            r, _ = simulate(sim_config(emu, trace, cfg.qps, device), system, cfg.qps)
            sims[name] = {**_side(r), "mean_prefetch_s": r["mean_prefetch_s"], "sim_wall_s": r["sim_wall_s"],
                          "device": dataclasses.asdict(devices.profile(device))}  # fmt: skip
        results.append({
            "system": system, "emulator_mode": mode, "emulator": emulated, "simulator": sims["run"],
            **compare(emulated, sims["run"]),
            "others": {name: {"simulator": sims[name], **compare(emulated, sims[name])}
                       for name in ("measured", "this-vm")},
        })  # fmt: skip
    return {
        "config": dataclasses.asdict(cfg),
        "goals": {"hit_points": HIT_POINTS, "ttft_ratio": TTFT_RATIO},
        "emulator_sizes": {k: getattr(emu_base, k) for k in SIZES},
        "emulator_report": str(out / "emulator" / "report.json"),
        "ttft_note": "emulator TTFT is Locust's (client side, over loopback HTTP); the simulator's is from arrival",
        "results": results,
        "pass": all(r["pass"] for r in results),
    }


def format_table(report: dict[str, Any]) -> str:
    head = ("system", "side", "hit", "Δ pts", "ttft mean", "ratio", "p50", "ratio", "p99", "verdict")
    rows = [head]
    for r in report["results"]:
        e = r["emulator"]
        rows.append(
            (
                r["system"],
                f"emulator ({r['emulator_mode']})",
                f"{100 * e['delivered_hit_rate']:.2f}%",
                "",
                f"{e['ttft_mean_s']:.3f}",
                "",
                f"{e['ttft_p50_s']:.3f}",
                "",
                f"{e['ttft_p99_s']:.3f}",
                "",
            )
        )
        o = r["others"]
        for label, side, cmp in (
            ("sim, run's read rate", r["simulator"], r),
            ("sim, measured after", o["measured"]["simulator"], o["measured"]),
            ("sim, this-vm (fio)", o["this-vm"]["simulator"], o["this-vm"]),
        ):
            failed = [k for k, ok in cmp["checks"].items() if not ok]
            rows.append((
                "", label, f"{100 * side['delivered_hit_rate']:.2f}%", f"{cmp['hit_diff_points']:+.2f}",
                f"{side['ttft_mean_s']:.3f}", _ratio(cmp["ttft_mean_ratio"]), f"{side['ttft_p50_s']:.3f}",
                _ratio(cmp["ttft_p50_ratio"]), f"{side['ttft_p99_s']:.3f}",
                "pass" if cmp["pass"] else "FAIL: " + ",".join(failed),
            ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]  # fmt: skip
    g = report["goals"]
    lines.append(
        f"goals: hit within {g['hit_points']:g} points, TTFT mean and median within "
        f"{100 * g['ttft_ratio']:.0f}%; verdict on the run's-rate row: "
        f"{'PASS' if report['pass'] else 'FAIL'}"
    )
    for r in report["results"]:
        d = r["simulator"]["device"]
        lines.append(f"{r['system']}: storage read {d['read_bytes_per_s'] / 1e9:.2f} GB/s in the run, "
                     f"{r['others']['measured']['simulator']['device']['read_bytes_per_s'] / 1e9:.2f} GB/s measured "
                     f"after, write {d['write_bytes_per_s'] / 1e9:.2f} GB/s")  # fmt: skip
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
