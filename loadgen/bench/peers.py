"""``flatcake bench peers``: FlatCake against the systems users would pick instead, on the same work.

Every system stores the same sessions (turns of appended pages recovered from a trace, at a real
model's page geometry), in the trace's order, then restores each session's whole history cold;
every restored page is checked against a checksum of what was written. Each system runs in a process
of its own (``worker``), so its peak RSS, its device reads and a crash are its own; the device limit
(fio, ``O_DIRECT``, FlatCake's read size and queue depth) is measured between systems, ABAB, beside the
device's ceiling (fio at 1 MiB and queue depth ``CEILING_DEPTH`` a job): "at the limit" holds only where
nothing beats the system.

Systems (``PEERS``): ``flatcake`` (FlatCake's SGLang backend built by SGLang's factory, over a node
agent process), ``flatcake-engine`` (the engine directly: layers stream as they land),
``hicache-file`` (SGLang's file backend), ``mooncake`` (Mooncake Store: master process, DRAM segment,
SSD offload), ``tiered`` (DRAM LRU evicting to an SSD log, whole-page reads), ``tiered-naive`` (the
same, one read per page-layer). A system that cannot be built or started is reported as not run,
with the reason; the others still run.

What "durable" means: bytes are on the device when the call returns, or after one ``sync`` at the
end of the write phase and the system's ``prepare`` (Mooncake settles its SSD offload there);
``durable_write_bytes_per_s`` counts both for every system.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from flatcake.loadgen import names
from flatcake.loadgen.bench import worker
from flatcake.loadgen.bench.agent import percentile
from flatcake.loadgen.bench.fio import SequentialReadLimit
from flatcake.loadgen.models import DEFAULT, ModelPreset, custom, preset
from flatcake.loadgen.systems.base import RestoreCounters, System, SystemSpec, pids
from flatcake.loadgen.traces.formats import MOONCAKE_TRACE, read_trace
from flatcake.loadgen.traces.sessions import Session, pick, sessions
from flatcake.node_agent import ChainSignals, ConfigError, aligned_empty
from flatcake.node_agent.datapath.buffers import round_up

MiB = 1 << 20
CEILING_DEPTH = 32  # commands in flight per fio job for the device's ceiling
PEERS = names.names("peers")
METRICS = (
    "restore_bytes_per_s", "time_to_first_layer_s", "restore_p50_s", "restore_p99_s", "durable_write_bytes_per_s",
    "ack_write_bytes_per_s", "dram_hit_fraction", "peak_rss_bytes", "peak_staging_bytes", "read_amplification",
)  # fmt: skip


@dataclass(frozen=True)
class PeersConfig:
    model: str = DEFAULT
    layers: int | None = None  # with page_layer_bytes and page_tokens: a geometry given by hand
    page_layer_bytes: int | None = None
    page_tokens: int | None = None
    trace: str = str(MOONCAKE_TRACE)
    sessions: int = 12
    turns: int = 4
    pages_per_turn: int | None = None  # default: as many as fit budget_bytes
    budget_bytes: int = 1600 * MiB  # the most a system stores (sessions x turns x pages x page bytes)
    repeats: int = 3
    systems: tuple[str, ...] = PEERS
    dram_fraction: float = 0.25
    workers: int = 4  # reads in flight, for every system and fio alike
    placement: str = "table2"  # FlatCake's placement.mode (its DRAM pool's use: homes, or copies too)

    def geometry(self) -> ModelPreset:
        given = (self.layers, self.page_layer_bytes, self.page_tokens)
        if any(v is not None for v in given):
            if not all(v is not None for v in given):
                raise ConfigError("--layers, --page-layer-bytes, --page-tokens: give all three, or a --model preset")
            return custom(*given)  # type: ignore[arg-type]
        return preset(self.model)

    def per_turn(self, model: ModelPreset) -> int:
        if self.pages_per_turn is not None:
            return self.pages_per_turn
        return max(1, self.budget_bytes // (self.sessions * self.turns * model.span_bytes))


QUICK = PeersConfig(sessions=4, turns=3, budget_bytes=200 * MiB, repeats=1)


@dataclass
class Workload:
    model: ModelPreset
    sessions: list[Session]
    order: list[tuple[int, int]] = field(default_factory=list)  # (session index, turn) in trace order

    @property
    def raw_page_bytes(self) -> int:
        """The KV payload of one page of all layers (what throughput counts; padding is not counted)."""
        return self.model.layers * self.model.raw_page_layer_bytes

    def spec(self, cfg: PeersConfig) -> SystemSpec:
        longest = max(len(s.pages) for s in self.sessions)
        return SystemSpec(
            layers=self.model.layers, page_bytes=self.model.page_layer_bytes, page_tokens=self.model.page_tokens,
            sessions=len(self.sessions), session_bytes=longest * self.model.span_bytes, workers=cfg.workers,
            dram_fraction=cfg.dram_fraction, flush_dram=False, mla=self.model.mla, placement=cfg.placement,
        )  # fmt: skip

    def unique_pages(self) -> int:
        return len({k for s in self.sessions for k in s.pages})


def workload(cfg: PeersConfig) -> Workload:
    model = cfg.geometry()
    found = sessions(read_trace(cfg.trace), model.page_tokens)
    chosen = pick(found, cfg.sessions, cfg.turns, cfg.per_turn(model))
    if not chosen:
        raise ConfigError(f"trace: {cfg.trace} holds no session")
    # Turn t of every session before turn t+1 of any, as arrivals interleave in serving.
    order = [(i, t) for t in range(cfg.turns) for i, s in enumerate(chosen) if t < len(s.turns)]
    return Workload(model, chosen, order)


def page_bytes_for(key: str, layers: int, raw: int, page_bytes: int) -> np.ndarray:
    """A page's bytes, a pure function of its key (zero padding past ``raw`` in each layer)."""
    out = np.zeros((layers, page_bytes), np.uint8)
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    out[:, :raw] = np.frombuffer(rng.bytes(layers * raw), np.uint8).reshape(layers, raw)
    return out


def reused_later(w: Workload) -> dict[str, bool]:
    """For every stored page, whether a later request (in the workload's order) asks for it again: its own
    session's next turns (whose prompts hold every earlier turn) or another session sharing it. What a
    placement decision at write time bets on: DRAM for pages read again soon, SSD for the rest."""
    first: set[str] = set()
    reused: dict[str, bool] = {}
    for i, t in w.order:
        session = w.sessions[i]
        for key in (k for turn in session.turns[: t + 1] for k in turn):
            if key in first:
                reused[key] = True
        for key in session.turns[t]:
            if key not in first:
                first.add(key)
                reused.setdefault(key, False)
    return reused


def placement_accuracy(media: Sequence[str | None], reused: Sequence[bool]) -> dict[str, list[int]]:
    """``{medium: [pages placed there, of which reused later]}`` over the stored pages."""
    out = {"dram": [0, 0], "ssd": [0, 0]}
    for medium, again in zip(media, reused, strict=True):
        if medium is not None:
            out[medium][0] += 1
            out[medium][1] += int(again)
    return out


def _crc(page: np.ndarray) -> int:
    crc = 0
    for layer in page:
        crc = zlib.crc32(np.ascontiguousarray(layer).data, crc)
    return crc


# ---- the worker: one system, in its own process ------------------------------------------------------
def make_system(name: str, directory: Path, spec: SystemSpec) -> System:
    """A peer by name, built through the registry (names.IMPLEMENTATIONS): SGLang's and Mooncake's systems
    import their packages only when run."""
    (name,) = names.resolve("peers", [name])
    system: System = names.implementation("system", name)(directory, spec)
    return system


def _proc(pid: int | str, field_name: str, table: str = "status") -> int:
    """A number from /proc/PID/status (kB, returned in bytes) or /proc/PID/io (bytes); 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/{table}").read_text().splitlines():
            if line.startswith(field_name + ":"):
                value = int(line.split()[1])
                return value * 1024 if table == "status" else value
    except (OSError, ValueError):
        pass
    return 0


def _device_reads(processes: Sequence[int | str]) -> int:
    return sum(_proc(p, "read_bytes", "io") for p in processes)


def drop_caches() -> bool:
    """Drop the page cache (root only), so restores read the device; False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_system(
    name: str, directory: Path, w: Workload, cfg: PeersConfig, *, corrupt: str | None = None
) -> dict[str, Any]:
    """Write, sync, drop caches, restore, check: one system's measurements (in this process)."""
    m, spec = w.model, w.spec(cfg)
    raw, span = m.raw_page_layer_bytes, m.page_layer_bytes
    base_rss = _proc("self", "VmRSS")
    system = make_system(name, directory, spec)
    try:
        crcs: dict[str, int] = {}
        put_seconds = 0.0
        put_bytes = 0
        arrive = getattr(system, "arrive", None)  # a system that sees requests before their writes
        # The hints a put carries are what SGLang's backend derives from the same chains (systems that
        # are the backend, `flatcake`, derive them themselves).
        signals = ChainSignals()
        for n, (i, t) in enumerate(w.order):
            if n == 0 or w.order[n - 1][1] != t:
                # A round's requests arrive together: each is looked up before any of them is written,
                # as SGLang's hit query runs at arrival and its write-back after prefill.
                for j, u in w.order:
                    if u == t:
                        before = [k for turn in w.sessions[j].turns[:u] for k in turn]
                        signals.observe(before, w.sessions[j].turns[u])
                        if arrive is not None:
                            arrive(w.sessions[j].turns[u], before[-1] if before else None)
            session = w.sessions[i]
            keys = session.turns[t]
            kv = aligned_empty((m.layers, len(keys), span))
            for j, key in enumerate(keys):
                kv[:, j] = page_bytes_for(key, m.layers, raw, span)
                crcs[key] = _crc(kv[:, j, :raw])
            before = [k for turn in session.turns[:t] for k in turn]
            runs = signals.write(before, keys, m.page_tokens)
            started = time.perf_counter()
            for run in runs:  # a prompt shared by live requests is put apart from the session's own pages
                part = kv
                if len(runs) > 1:  # a slice of a layer-major buffer is strided: puts take aligned C order
                    part = aligned_empty((m.layers, run.stop - run.start, span))
                    part[...] = kv[:, run.start : run.stop]
                system.put(keys[run.start : run.stop], part, run.hints())
            put_seconds += time.perf_counter() - started
            signals.record(keys, runs)
            put_bytes += len(keys) * m.layers * raw
        placement = None
        placed = getattr(system, "placement", None)  # systems that place pages by medium (FlatCake)
        if placed is not None:
            reused = reused_later(w)
            placement = placement_accuracy(placed(list(reused)), list(reused.values()))
        started = time.perf_counter()
        os.sync()  # what is not on the device yet gets there now
        system.prepare()  # a system that settles writes in the background (Mooncake's offload) ends here
        sync_seconds = time.perf_counter() - started
        dropped = drop_caches()
        processes: list[int | str] = ["self", *pids(system)]
        reads_before = _device_reads(processes)
        dest = aligned_empty((m.layers, spec.session_pages, span))
        walls: list[float] = []
        verified = corrupt_pages = missing = 0
        for session in w.sessions:
            keys = session.pages
            dest[:, : len(keys)] = 0
            started = time.perf_counter()
            lost = system.restore(keys, dest)
            missing += lost
            walls.append(time.perf_counter() - started)
            if corrupt is not None and corrupt in keys:  # the check must catch a wrong byte (tests)
                dest[0, keys.index(corrupt), 0] ^= 0xFF
            wrong = sum(_crc(dest[:, j, :raw]) != crcs[key] for j, key in enumerate(keys))
            # A page the system reported missing (evicted, failed to read) was never served as good: it is a
            # miss, not corruption. Any other mismatch is a corrupt page.
            verified += len(keys) - wrong
            corrupt_pages += max(0, wrong - lost)
        device_reads = _device_reads(processes) - reads_before
        c: RestoreCounters = system.counters()
        timings = c.requests if len(c.requests) == len(walls) else []
        seconds = [t.seconds for t in timings] or walls
        first = [t.first_layer_seconds for t in timings] or walls
        restored = sum(len(s.pages) for s in w.sessions)
        requested = (restored - missing) * m.layers * raw  # delivered bytes: a missed page is not restore work
        rss = _proc("self", "VmHWM") + sum(_proc(p, "VmHWM") for p in pids(system))
        return {
            "ran": True, "why_not": None,
            "restore_bytes_per_s": requested / sum(seconds), "restore_seconds": sum(seconds),
            "time_to_first_layer_s": statistics.median(first), "restore_p50_s": percentile(seconds, 0.5),
            "restore_p99_s": percentile(seconds, 0.99),
            "ack_write_bytes_per_s": put_bytes / put_seconds,
            "durable_write_bytes_per_s": put_bytes / (put_seconds + sync_seconds),
            "dram_hit_fraction": c.dram_pages / restored, "peak_rss_bytes": rss, "worker_base_rss_bytes": base_rss,
            "peak_staging_bytes": c.staging_peak_bytes, "read_amplification": device_reads / requested,
            "device_read_bytes": device_reads, "read_commands": c.read_commands, "verified_pages": verified,
            "corrupt_pages": corrupt_pages, "missing_pages": missing, "restored_pages": restored,
            "written_bytes": put_bytes, "dropped_caches": dropped, "placement": placement,
            # Whether a request's first layer was usable before its last: only systems that yield layers.
            "layers_streamed": bool(timings) and all(t.layer_seconds for t in timings),
        }  # fmt: skip
    finally:
        system.close()


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """One system, run by ``python -m flatcake.loadgen.bench.peers`` (loadgen/bench/worker.py)."""
    cfg = worker.config(PeersConfig, job["config"])
    return run_system(job["system"], Path(job["directory"]), workload(cfg), cfg, corrupt=job.get("corrupt"))


# ---- the orchestrator ----------------------------------------------------------------------------------
def run_worker(name: str, directory: Path, cfg: PeersConfig, corrupt: str | None = None,
               timeout: float = 3600) -> dict[str, Any]:  # fmt: skip
    job = {"system": name, "config": dataclasses.asdict(cfg), "corrupt": corrupt}
    return worker.run("flatcake.loadgen.bench.peers", directory, job, timeout)


def run(
    cfg: PeersConfig, directory: Path, *, quiet: bool = False, log: Callable[[str], None] = print
) -> dict[str, Any]:
    w = workload(cfg)
    m = w.model
    directory.mkdir(parents=True, exist_ok=True)
    pages = sum(len(s.pages) for s in w.sessions)
    log(
        f"workload: {len(w.sessions)} sessions, {pages} pages restored ({w.unique_pages()} stored) of {m.layers} x "
        f"{m.page_layer_bytes} B ({m.name}), {pages * m.span_bytes / MiB:.0f} MiB per system, in {directory}"
    )
    # fio reads as FlatCake does: commands of FlatCake's mean read size, `workers` at a time. That size is
    # known once a FlatCake system has run (FC-CIO merges a segment's layers as far as a slot allows);
    # until then, one turn's pages of one layer.
    fio = SequentialReadLimit(directory, cfg.workers, pages * m.span_bytes, cfg.repeats * len(cfg.systems),
                              round_up(cfg.per_turn(m) * m.page_layer_bytes))  # fmt: skip
    ceiling = SequentialReadLimit(directory, cfg.workers, pages * m.span_bytes, cfg.repeats * len(cfg.systems),
                                  MiB, iodepth=CEILING_DEPTH)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.systems}
    chunk = 0
    try:
        with tqdm(total=cfg.repeats * len(cfg.systems), desc="bench peers", unit="run", file=sys.stderr,
                  disable=quiet) as bar:  # fmt: skip
            for _ in range(cfg.repeats):
                for name in cfg.systems:  # ABAB: the limit is measured between every two systems
                    bar.set_postfix_str(name)
                    result = run_worker(name, directory / name, cfg)
                    runs[name].append(result)
                    bar.update()
                    if not result["ran"]:
                        log(f"{name}: not run: {result['why_not']}")
                    elif name.startswith("flatcake") and result["read_commands"]:
                        fio.block_bytes = round_up(result["device_read_bytes"] // result["read_commands"])
                    for f in (fio, ceiling):
                        f.prepare(chunk)
                        f.measure(chunk)
                    chunk += 1
        limit, top = fio.result(), ceiling.result()
    finally:
        fio.close()
        ceiling.close()
    systems = {name: summarize(results) for name, results in runs.items()}
    return {
        "workload": {
            "model": m.name, "layers": m.layers, "page_tokens": m.page_tokens,
            "page_layer_bytes": m.page_layer_bytes, "raw_page_layer_bytes": m.raw_page_layer_bytes,
            "sessions": len(w.sessions), "turns": [len(s.turns) for s in w.sessions], "restored_pages": pages,
            "stored_pages": w.unique_pages(), "restored_bytes": pages * w.raw_page_bytes,
            "dram_budget_bytes": int(cfg.dram_fraction * w.spec(cfg).total_pages) * m.span_bytes,
            "dropped_caches": any(r.get("dropped_caches") for rs in runs.values() for r in rs),
            "trace": cfg.trace, "repeats": cfg.repeats, "source": m.source, "placement": cfg.placement,
        },
        "limit": limit,
        "ceiling": top,
        "systems": systems,
        "ratios": ratios(systems),
    }  # fmt: skip


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats, with ``<field>_min``/``_max``; counts summed; not run if any run failed."""
    failed = [r for r in results if not r["ran"]]
    if failed or not results:
        return {"ran": False, "why_not": failed[0]["why_not"] if failed else "no run"}
    out: dict[str, Any] = {"ran": True, "why_not": None, "repeats": len(results)}
    for key in METRICS:
        values = [float(r[key]) for r in results]
        out[key], out[f"{key}_min"], out[f"{key}_max"] = statistics.median(values), min(values), max(values)
    for key in ("verified_pages", "corrupt_pages", "missing_pages", "read_commands", "device_read_bytes"):
        out[key] = sum(int(r[key]) for r in results)
    out["layers_streamed"] = all(r.get("layers_streamed", False) for r in results)
    if all(r.get("placement") for r in results):
        out["placement"] = {}
        for medium in ("dram", "ssd"):
            placed = sum(r["placement"][medium][0] for r in results)
            again = sum(r["placement"][medium][1] for r in results)
            out["placement"][medium] = {"placed": placed, "reused": again,
                                        "reused_fraction": again / placed if placed else None}  # fmt: skip
    return out


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """FlatCake over each peer, from the medians of this run: restore and write rates (higher is better
    for FlatCake above 1), time to first layer (the peer's time over FlatCake's)."""
    fc = systems.get("flatcake", {})
    out: dict[str, float] = {}
    if not fc.get("ran"):
        return out
    for name, s in systems.items():
        if name == "flatcake" or not s.get("ran"):
            continue
        name = name.replace("-", "_")  # keys as before the registry's names, to compare across commits
        out[f"flatcake_vs_{name}_restore"] = fc["restore_bytes_per_s"] / s["restore_bytes_per_s"]
        out[f"flatcake_vs_{name}_ttfl"] = s["time_to_first_layer_s"] / fc["time_to_first_layer_s"]
        out[f"flatcake_vs_{name}_write"] = fc["durable_write_bytes_per_s"] / s["durable_write_bytes_per_s"]
    return out


def format_table(report: dict[str, Any]) -> str:
    lim = report["limit"]["read_bytes_per_s"]
    head = (
        f"{'system':<16} {'restore GB/s':>12} {'x limit':>7} {'1st layer ms':>12} {'p99 ms':>8} {'write GB/s':>10} "
        f"{'DRAM hits':>9} {'RSS MiB':>8} {'staging MiB':>11} {'read amp':>8} {'corrupt':>7} {'missed':>6}"
    )
    lines = [head, f"{'fio limit':<16} {lim / 1e9:>12.3f} {1.0:>7.2f}"]
    if report.get("ceiling"):  # the device's ceiling: fio at 1 MiB, a deep queue
        top = report["ceiling"]["read_bytes_per_s"]
        lines.append(f"{'fio ceiling':<16} {top / 1e9:>12.3f} {top / lim if lim else 0:>7.2f}")
    for name, s in report["systems"].items():
        if not s["ran"]:
            lines.append(f"{name:<16} not run: {s['why_not']}")
            continue
        lines.append(
            f"{name:<16} {s['restore_bytes_per_s'] / 1e9:>12.3f} {s['restore_bytes_per_s'] / lim:>7.2f} "
            f"{s['time_to_first_layer_s'] * 1e3:>12.1f} {s['restore_p99_s'] * 1e3:>8.1f} "
            f"{s['durable_write_bytes_per_s'] / 1e9:>10.3f} {s['dram_hit_fraction']:>9.2f} "
            f"{s['peak_rss_bytes'] / MiB:>8.0f} {s['peak_staging_bytes'] / MiB:>11.1f} "
            f"{s['read_amplification']:>8.2f} {s['corrupt_pages']:>7} {s['missing_pages']:>6}"
        )
    lines.append("")
    lines.extend(f"{k:<36} {v:.3f}" for k, v in report["ratios"].items())
    whole = [n for n, s in report["systems"].items() if s["ran"] and not s.get("layers_streamed")]
    if whole:
        lines += ["", f"1st layer = whole request (no layer streaming): {', '.join(whole)}"]
    for name, s in report["systems"].items():
        if s.get("placement"):
            parts = [f"{m.upper()} {p['placed']} placed, {_share(p['reused_fraction'])} reused later"
                     for m, p in s["placement"].items()]  # fmt: skip
            lines.append(f"placement, {name}: {'; '.join(parts)}")
    return "\n".join(lines)


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def markdown(report: dict[str, Any], plots: Sequence[str]) -> str:
    """The report's section: what ran on what, the table, where FlatCake wins and where it does not."""
    w = report["workload"]
    lines = [
        "## FlatCake against its peers (`flatcake bench peers`)", "",
        f"Model `{w['model']}`: {w['layers']} layers x {w['page_layer_bytes']} B page-layers "
        f"({w['raw_page_layer_bytes']} B of KV), {w['page_tokens']}-token pages. {w['sessions']} sessions from "
        f"`{Path(w['trace']).name}`, {w['restored_pages']} pages restored per repeat, {w['repeats']} repeat(s); "
        f"DRAM tiers get {w['dram_budget_bytes'] / MiB:.0f} MiB; page cache "
        f"{'dropped' if w['dropped_caches'] else 'NOT dropped (not root): restores may be served by it'}.",
        "", "```", format_table(report), "```", "",
    ]  # fmt: skip
    wins = [k for k, v in report["ratios"].items() if v > 1.05]
    losses = [k for k, v in report["ratios"].items() if v < 0.95]
    if wins:
        lines.append("FlatCake ahead (ratio > 1.05): " + ", ".join(f"`{k}` {report['ratios'][k]:.2f}" for k in wins))
    if losses:
        lines.append("FlatCake behind (ratio < 0.95): " + ", ".join(f"`{k}` {report['ratios'][k]:.2f}" for k in losses))
    not_run = {n: s["why_not"] for n, s in report["systems"].items() if not s["ran"]}
    lines += [f"- `{n}` not run: {why}" for n, why in not_run.items()]
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots], ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Bars (median, min/max whiskers) of restore rate, first-layer time and write rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {n: s for n, s in report["systems"].items() if s["ran"]}
    if not ran:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, scale in (("restore_bytes_per_s", "restore GB/s", 1e-9),
                              ("time_to_first_layer_s", "time to first layer (ms)", 1e3),
                              ("durable_write_bytes_per_s", "durable write GB/s", 1e-9)):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(ran)
        med = [ran[n][key] * scale for n in names]
        lo = [med[i] - ran[n][f"{key}_min"] * scale for i, n in enumerate(names)]
        hi = [ran[n][f"{key}_max"] * scale - med[i] for i, n in enumerate(names)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
        if key == "restore_bytes_per_s":
            ax.axhline(report["limit"]["read_bytes_per_s"] * scale, color="#c44e52", linestyle="--", label="fio limit")
            ax.legend()
        ax.set_ylabel(label)
        ax.set_title(f"{label}, {report['workload']['model']}")
        fig.autofmt_xdate()
        path = out_dir / f"peers_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    # One request's timeline per system (medians): when its first layer is usable, when all of it is.
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(ran) + 1.2))
    for row, s in enumerate(ran.values()):
        ax.barh(row, s["restore_p50_s"] * 1e3, color="#b3c6e6")
        ax.plot([s["time_to_first_layer_s"] * 1e3], [row], marker="|", markersize=18, color="#c44e52")
    ax.set_yticks(range(len(ran)), list(ran))
    ax.set_xlabel("ms from the restore call (bar: whole request, P50; red tick: first usable layer)")
    ax.set_title(f"restore timeline, {report['workload']['model']}")
    fig.tight_layout()
    path = out_dir / "peers_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))
    return paths


if __name__ == "__main__":
    sys.exit(worker.main(_measure))
