"""``flatcake bench restore``: restore bandwidth of FlatCake against the tiered (whole-page and
page-layer readers) and per-block designs.

Workload: S sessions x T turns x B pages per turn x L layers. Turns of different sessions arrive
interleaved, as in serving; then each session's whole history is restored cold (``O_DIRECT``, tiered
DRAM flushed). The same run measures the device limit with fio on the same directory, so every
ratio comes from one run on one machine.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from flatcake.loadgen import names
from flatcake.loadgen.bench.fio import SequentialReadLimit
from flatcake.loadgen.models import DEFAULT, preset
from flatcake.loadgen.systems.base import System, SystemSpec
from flatcake.loadgen.systems.flatcake import FlatCakeSystem
from flatcake.node_agent import Hints, Key, aligned_empty

MiB = 1 << 20
PRESET = preset(DEFAULT)
Array = npt.NDArray[np.uint8]
GAPS = (0, 4096, 16384, 65536, 262144, 1 << 20)
CONTEXT_TURNS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Workload:
    sessions: int = 16
    turns: int = 4
    pages_per_turn: int = 16
    # The default model preset (loadgen/models.py, dsv4-flash): 43 layers, 256-token pages of 44.7 KB
    # per layer per rank, padded to 48 KiB for 4 KiB alignment.
    layers: int = PRESET.layers
    page_bytes: int = PRESET.page_layer_bytes
    page_tokens: int = PRESET.page_tokens
    seed: int = 0

    @property
    def turn_bytes(self) -> int:
        return self.layers * self.pages_per_turn * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.sessions * self.turns * self.turn_bytes

    def keys(self, session: int, turn: int) -> list[Key]:
        return [f"s{session}-t{turn}-p{j}" for j in range(self.pages_per_turn)]

    def history(self, session: int, turns: int | None = None) -> list[Key]:
        return [k for t in range(self.turns if turns is None else turns) for k in self.keys(session, t)]

    def arrivals(self) -> list[tuple[int, int]]:
        """Turn t of every session, in a shuffled order, before turn t+1 of any: sessions interleave."""
        rng = np.random.default_rng(self.seed)
        return [(int(s), t) for t in range(self.turns) for s in rng.permutation(self.sessions)]

    def stamps(self, session: int, turn: int) -> npt.NDArray[np.uint64]:
        """A unique id per page-layer, written into its first 8 bytes so restores can be checked."""
        base = (session * self.turns + turn) * self.pages_per_turn
        pages = np.arange(base, base + self.pages_per_turn, dtype=np.uint64)
        return pages[None, :] * np.uint64(self.layers) + np.arange(self.layers, dtype=np.uint64)[:, None] + 1


@dataclass(frozen=True)
class BenchConfig:
    workload: Workload = field(default_factory=Workload)
    workers: int = 4  # reads in flight, for every system and fio alike
    gap_bytes: int = 64 * 1024
    staging_layers: int = 2
    staging_slot_bytes: int = 8 * MiB
    tiered_dram_fraction: float = 0.25


QUICK = BenchConfig(workload=Workload(sessions=4))


def spec(cfg: BenchConfig, name: str, sessions: int, turns: int) -> SystemSpec:
    """Every system restores from SSD here: the tiered cache is flushed before restoring, and FlatCake
    gets no DRAM (so no page is placed there)."""
    w = cfg.workload
    return SystemSpec(
        layers=w.layers, page_bytes=w.page_bytes, page_tokens=w.page_tokens, sessions=sessions,
        session_bytes=turns * w.turn_bytes, workers=cfg.workers, gap_bytes=cfg.gap_bytes,
        staging_layers=cfg.staging_layers, staging_slot_bytes=cfg.staging_slot_bytes,
        dram_fraction=0.0 if name == "flatcake-engine" else cfg.tiered_dram_fraction,
    )  # fmt: skip


def hints(w: Workload, session: int, turn: int) -> Hints:
    """What a serving engine would know when writing this turn: later turns extend the session."""
    parent = w.keys(session, turn - 1)[-1] if turn else None
    tokens = w.pages_per_turn * w.page_tokens
    return Hints(turn=turn + 1, context_tokens=(turn + 1) * tokens, parent_key=parent)


def _bar(desc: str, total: int, quiet: bool) -> tqdm[Any]:
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=quiet, leave=False)


def _turn_buffers(w: Workload) -> Iterator[tuple[int, int, Array]]:
    rng = np.random.default_rng(w.seed)
    base = rng.integers(0, 256, size=(w.layers, w.pages_per_turn, w.page_bytes), dtype=np.uint8)
    kv = aligned_empty(base.shape)
    for session, turn in w.arrivals():
        kv[...] = base
        kv[:, :, :8] = w.stamps(session, turn).view(np.uint8).reshape(w.layers, w.pages_per_turn, 8)
        yield session, turn, kv


def _check(w: Workload, session: int, turns: int, dest: Array) -> None:
    got = np.ascontiguousarray(dest[:, : turns * w.pages_per_turn, :8]).view(np.uint64)[..., 0]
    want = np.concatenate([w.stamps(session, t) for t in range(turns)], axis=1)
    if not np.array_equal(got, want):
        raise AssertionError(f"session {session}: restored bytes differ from written bytes")


def write_all(system: System, w: Workload, quiet: bool, after_put: Callable[[int], object] | None = None) -> None:
    """Write every turn in arrival order; ``after_put(i)`` runs after the i-th arrival."""
    with _bar(f"{system.name}: write", w.sessions * w.turns, quiet) as bar:
        for i, (session, turn, kv) in enumerate(_turn_buffers(w)):
            system.put(w.keys(session, turn), kv, hints(w, session, turn))
            if after_put is not None:
                after_put(i)
            bar.update()
    system.prepare()


def restore_all(
    system: System,
    w: Workload,
    dest: Array,
    quiet: bool,
    turns: int | None = None,
    between: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Restore every session's history (its first ``turns`` turns), timed; ``between(session)`` runs
    untimed after each session."""
    turns = w.turns if turns is None else turns
    missing = 0
    seconds = 0.0
    with _bar(f"{system.name}: restore", w.sessions, quiet) as bar:
        for session in range(w.sessions):
            keys = w.history(session, turns)
            t0 = time.perf_counter()
            missing += system.restore(keys, dest)
            seconds += time.perf_counter() - t0
            _check(w, session, turns, dest)
            if between is not None:
                between(session)
            bar.update()
    c = system.counters()
    return {
        "read_bytes_per_s": c.bytes_requested / seconds if seconds else 0.0,
        "read_commands": c.read_commands,
        "bytes_read": c.bytes_read,
        "bytes_requested": c.bytes_requested,
        "staging_peak_bytes": c.staging_peak_bytes,
        "restore_seconds": seconds,
        "pages_missing": missing,
    }


def run(
    cfg: BenchConfig,
    directory: Path,
    *,
    sweep: str | None = None,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    w = cfg.workload
    directory.mkdir(parents=True, exist_ok=True)
    log(
        f"workload: {w.sessions} sessions x {w.turns} turns x {w.pages_per_turn} pages x {w.layers} layers x "
        f"{w.page_bytes} B = {w.total_bytes / MiB:.0f} MiB per system, in {directory}"
    )
    # fio writes and reads as many bytes as FlatCake, interleaved with it: a chunk laid out after each
    # turn FlatCake writes, and read after each session it restores (see SequentialReadLimit).
    chunks = w.sessions * w.turns
    fio = SequentialReadLimit(directory, cfg.workers, max(w.total_bytes, cfg.workers * chunks * MiB), chunks)
    by_session: dict[int, list[int]] = {}
    for i, (session, _) in enumerate(w.arrivals()):
        by_session.setdefault(session, []).append(i)

    def read_chunks(session: int) -> None:  # the chunks laid out beside this session's turns
        for chunk in by_session[session]:
            fio.measure(chunk)

    dest = aligned_empty((w.layers, w.turns * w.pages_per_turn, w.page_bytes))
    results: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    limit: dict[str, Any] = {}
    try:
        for name in names.names("restore"):
            where = directory / name
            shutil.rmtree(where, ignore_errors=True)
            system = names.implementation("system", name)(where, spec(cfg, name, w.sessions, w.turns))
            try:
                after_put = between = None
                if isinstance(system, FlatCakeSystem):
                    log(f"fio: sequential O_DIRECT read, 1 MiB blocks, {cfg.workers} jobs, interleaved")
                    after_put = fio.prepare
                    between = read_chunks

                write_all(system, w, quiet, after_put)
                results[name] = restore_all(system, w, dest, quiet, between=between)
                if isinstance(system, FlatCakeSystem):
                    limit = fio.result()
                    extra["segments"] = system.segments()
                    extra["host_paths"] = host_paths(system, w, dest, quiet)
                    if sweep == "gap":
                        extra["gap_sweep"] = gap_sweep(system, w, dest, quiet)
            finally:
                system.close()
                shutil.rmtree(where, ignore_errors=True)
            log(
                f"{name}: {results[name]['read_bytes_per_s'] / 1e9:.3f} GB/s, "
                f"{results[name]['read_commands']} read commands"
            )
    finally:
        fio.close()
    report: dict[str, Any] = {
        "config": {**dataclasses.asdict(cfg), "directory": str(directory)},
        "limit": limit,
        "systems": results,
        "ratios": ratios(results, limit, extra["segments"], w.layers),
    }
    report["host_paths"] = extra["host_paths"]
    if "gap_sweep" in extra:
        report["gap_sweep"] = extra["gap_sweep"]
    if sweep == "context":
        report["context_sweep"] = context_sweep(cfg, directory, quiet)
    return report


def ratios(results: dict[str, dict[str, Any]], limit: dict[str, Any], segments: int, layers: int) -> dict[str, float]:
    fc = results["flatcake-engine"]
    return {  # keys kept from before the registry's names, so reports compare across commits
        "flatcake_vs_limit": fc["read_bytes_per_s"] / limit["read_bytes_per_s"],
        "flatcake_vs_tiered": fc["read_bytes_per_s"] / results["tiered"]["read_bytes_per_s"],
        "flatcake_vs_tiered_naive": fc["read_bytes_per_s"] / results["tiered-naive"]["read_bytes_per_s"],
        "flatcake_vs_per_block": fc["read_bytes_per_s"] / results["per-block"]["read_bytes_per_s"],
        "commands_per_segment_layer": fc["read_commands"] / (segments * layers),
        "read_amplification": fc["bytes_read"] / fc["bytes_requested"],
    }


def host_paths(system: FlatCakeSystem, w: Workload, dest: Array, quiet: bool, rounds: int = 3) -> dict[str, Any]:
    """The same restores read in place (a 4 KiB-aligned destination) and staged (rows 512 bytes off: read
    into the threads' scratch, then copied), alternated ``rounds`` times. Staged is also what every restore
    would be without the per-page-layer padding (docs/architecture.md): its rate per stored byte bounds an
    unpadded layout's rate per useful byte, to compare with in-place reads' ``raw / padded`` share."""
    raw = aligned_empty(dest.nbytes + 512)
    staged = raw[512:].reshape(dest.shape)
    staged.fill(0)
    seconds = {"direct": 0.0, "staged": 0.0}
    requested = 0
    for _ in range(rounds):
        for path, target in (("direct", dest), ("staged", staged)):
            system.prepare()
            out = restore_all(system, w, target, quiet)
            seconds[path] += out["restore_seconds"]
            requested = out["bytes_requested"]
    rate = {k: requested * rounds / v for k, v in seconds.items()}
    useful = PRESET.raw_page_layer_bytes / PRESET.page_layer_bytes if w.page_bytes == PRESET.page_layer_bytes else 1.0
    return {
        "rounds": rounds,
        "direct_bytes_per_s": rate["direct"],
        "staged_bytes_per_s": rate["staged"],
        "direct_vs_staged": rate["direct"] / rate["staged"],
        "useful_fraction_padded": useful,
        # In-place reads of padded rows, per useful byte, against the best an unpadded (staged) layout could do.
        "padded_direct_vs_unpadded_staged": rate["direct"] * useful / rate["staged"],
    }


def gap_sweep(system: FlatCakeSystem, w: Workload, dest: Array, quiet: bool) -> list[dict[str, Any]]:
    """Partial restores (a quarter of the pages already present, so holes of one page or more) at each
    Δgap: commands saved against bytes read for nothing."""
    rng = np.random.default_rng(w.seed + 1)
    wanted = [[k for k in w.history(s) if rng.random() >= 0.25] for s in range(w.sessions)]
    rows = []
    for gap in GAPS:
        system.engine.gap_bytes = gap
        system.prepare()
        t0 = time.perf_counter()
        missing = sum(system.restore(keys, dest) for keys in wanted)
        seconds = time.perf_counter() - t0
        c = system.counters()
        rows.append(
            {
                "gap_bytes": gap,
                "read_commands": c.read_commands,
                "bytes_read": c.bytes_read,
                "bytes_requested": c.bytes_requested,
                "read_amplification": c.bytes_read / c.bytes_requested,
                "read_bytes_per_s": c.bytes_requested / seconds,
                "restore_seconds": seconds,
                "pages_missing": missing,
            }
        )
    system.engine.gap_bytes = system.engine.config.io.gap_bytes
    return rows


def context_sweep(cfg: BenchConfig, directory: Path, quiet: bool) -> list[dict[str, Any]]:
    """One long session restored at growing context: FlatCake's window is bounded, tiered staging is not."""
    w = dataclasses.replace(cfg.workload, sessions=1, turns=CONTEXT_TURNS[-1])
    dest = aligned_empty((w.layers, w.turns * w.pages_per_turn, w.page_bytes))
    points = list(CONTEXT_TURNS)
    rows: dict[int, dict[str, Any]] = {
        t: {"turns": t, "context_tokens": t * w.pages_per_turn * w.page_tokens, "context_bytes": t * w.turn_bytes}
        for t in points
    }
    for name in ("flatcake-engine", "tiered"):
        where = directory / f"context-{name}"
        shutil.rmtree(where, ignore_errors=True)
        system = names.implementation("system", name)(where, spec(cfg, name, 1, w.turns))
        try:
            write_all(system, w, quiet)
            for t in points:
                system.prepare()
                restore_all(system, w, dest, True, turns=t)
                rows[t][f"{name.removesuffix('-engine')}_staging_peak_bytes"] = system.counters().staging_peak_bytes
        finally:
            system.close()
            shutil.rmtree(where, ignore_errors=True)
    return list(rows.values())


def format_table(report: dict[str, Any]) -> str:
    lim = report["limit"]["read_bytes_per_s"]
    lines = [
        f"{'system':<10} {'GB/s':>7} {'x limit':>8} {'commands':>9} {'bytes read':>12} "
        f"{'requested':>12} {'staging peak':>13} {'seconds':>8}",
        f"{'fio limit':<10} {lim / 1e9:>7.3f} {1.0:>8.2f}",
    ]
    for name, s in report["systems"].items():
        lines.append(
            f"{name:<10} {s['read_bytes_per_s'] / 1e9:>7.3f} {s['read_bytes_per_s'] / lim:>8.2f} "
            f"{s['read_commands']:>9} {s['bytes_read']:>12} {s['bytes_requested']:>12} "
            f"{s['staging_peak_bytes']:>13} {s['restore_seconds']:>8.2f}"
        )
    lines.append("")
    lines.extend(f"{k:<28} {v:.3f}" for k, v in report["ratios"].items())
    hp = report["host_paths"]
    lines += ["", f"host paths ({hp['rounds']} alternations): in place {hp['direct_bytes_per_s'] / 1e9:.3f} GB/s, "
              f"staged {hp['staged_bytes_per_s'] / 1e9:.3f} GB/s ({hp['direct_vs_staged']:.2f}x); per useful byte, "
              f"padded in place / unpadded staged = {hp['padded_direct_vs_unpadded_staged']:.2f}"]  # fmt: skip
    if "gap_sweep" in report:
        lines += ["", f"{'Δgap':>8} {'commands':>9} {'read amp':>9} {'GB/s':>7}"]
        lines += [
            f"{r['gap_bytes']:>8} {r['read_commands']:>9} {r['read_amplification']:>9.3f} "
            f"{r['read_bytes_per_s'] / 1e9:>7.3f}"
            for r in report["gap_sweep"]
        ]
    if "context_sweep" in report:
        lines += ["", f"{'turns':>5} {'context MiB':>12} {'flatcake staging':>17} {'tiered staging':>15}"]
        lines += [
            f"{r['turns']:>5} {r['context_bytes'] / MiB:>12.0f} {r['flatcake_staging_peak_bytes']:>17} "
            f"{r['tiered_staging_peak_bytes']:>15}"
            for r in report["context_sweep"]
        ]
    return "\n".join(lines)
