"""``flatcake bench context``: time to first token of one request whose prefix of N tokens is cached,
against context length (the paper's Figure 10 question: Llama-3.1-70B, TP4, A100, 8K-128K).

Compute is modelled, storage is measured. The request prefills a short new ``suffix`` after N cached
tokens; ``recompute`` prefills all N + suffix tokens (``ModelPreset.prefill_s``). The storage systems
are ``bench peers``' own (``peers.make_system``): each stores one session of N tokens, makes it cold
(``prepare`` with DRAM flushed, page cache dropped), restores it into a host buffer, and the restore
is timed:

- ``tiered`` and ``mooncake`` hand over a whole request: an SGLang prefetch must finish before the
  host->GPU load starts, so TTFT = restore + prefill(suffix after N cached).
- ``flatcake-engine`` streams layers: layer l's prefill can start once layer l's KV is in place, so TTFT is
  the layer pipeline over the measured per-layer arrivals (``layer_pipeline_s``).

One rank's KV is measured, as if the rank had the device to itself. To fit this disk, only
``measured_layers`` of the model's layers are stored (page-layer size unchanged, so FlatCake's
commands per layer keep their size) and the restore is scaled by layers / measured_layers; FlatCake's
arrival pattern is repeated that many times back to back (``tile_arrivals``). The session is alone in
every store (no eviction-order fragmentation). The host->GPU copy (25-32 GB/s on PCIe 4/5 x16) is
not modelled. Each measurement runs in a process of its own, as in ``bench peers``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flatcake.loadgen import names
from flatcake.loadgen.bench import worker
from flatcake.loadgen.bench.peers import _device_reads, drop_caches, make_system
from flatcake.loadgen.models import ModelPreset, gpu_profile, preset
from flatcake.loadgen.systems.base import SystemSpec, pids
from flatcake.loadgen.systems.mooncake import MIN_SEGMENT
from flatcake.node_agent import ConfigError, Hints, aligned_empty

SYSTEMS = names.names("context")
STORED = ("tiered", "mooncake", "flatcake-engine")  # the systems that store (peers' make_system builds them)
STREAMS_LAYERS = ("flatcake-engine",)
FLATCAKE = "flatcake-engine"  # the system the ratios compare against (keys keep "flatcake_vs_...")
CHUNK_TOKENS = 8192  # the session is stored as a chunked prefill stores it: one put per chunk
HOST_TO_GPU = "host->GPU copy not modelled (25-32 GB/s on PCIe 4/5 x16)"
# The paper's Figure 10 (Llama-3.1-70B TP4 on A100, 8K-128K inputs), as docs/benchmarks.md quotes it.
PAPER: dict[str, Any] = {
    "setup": "Llama-3.1-70B, TP4, A100; 8K-128K inputs",
    "flatcake_vs_recompute": [2.3, 4.9],
    "flatcake_vs_mooncake": [1.5, 2.4],
    "mooncake_gds_ttft_s": {"16384": 2.32, "65536": 6.60},
    "flatcake_ttft_s": {"16384": 2.31, "65536": 3.74},
}


@dataclass(frozen=True)
class ContextConfig:
    model: str = "llama3-70b-tp4"
    gpu: str = "a100"
    tokens: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
    suffix: int = 512
    systems: tuple[str, ...] = SYSTEMS
    measured_layers: int = 10
    repeats: int = 3

    def geometry(self) -> ModelPreset:
        """The preset, once every field is checked against it (a ConfigError names the option)."""
        model = preset(self.model)
        gpu_profile(self.gpu)
        if not self.systems:
            raise ConfigError(f"--systems: none given; choose from {names.choices('context')}")
        names.resolve("context", self.systems, "--systems")
        bad = [n for n in self.tokens if n <= 0 or n % model.page_tokens]
        if bad or not self.tokens:
            raise ConfigError(
                f"--tokens: {','.join(map(str, bad)) or '(none)'}: each must be a positive multiple of "
                f"{model.name}'s {model.page_tokens}-token page (e.g. 8192,16384)"
            )
        if self.suffix <= 0:
            raise ConfigError(f"--suffix: {self.suffix}: the request needs at least one new token")
        if self.repeats <= 0:
            raise ConfigError(f"--repeats: {self.repeats}: must be at least 1")
        if not 0 < self.measured_layers <= model.layers or model.layers % self.measured_layers:
            raise ConfigError(
                f"--measured-layers: {self.measured_layers} must divide {model.name}'s {model.layers} layers "
                "(e.g. 10 or 20), so the restore scales by a whole factor"
            )
        return model

    @property
    def stored(self) -> list[str]:
        return [s for s in self.systems if s in STORED]


# Mooncake is left out: its cold prepare (offload settling, then eviction by fillers) takes ~17 s a length.
QUICK = ContextConfig(
    tokens=(2048, 8192), measured_layers=2, repeats=1, systems=("recompute", "tiered", "flatcake-engine")
)


# ---- the TTFT model: pure functions ---------------------------------------------------------------------
def layer_pipeline_s(arrivals: Sequence[float], compute_per_layer: float) -> float:
    """When the last layer's prefill ends, if layer l's prefill starts once its KV has arrived
    (``arrivals[l]``, from the request's start) and layer l-1's prefill has ended."""
    t = 0.0
    for arrival in arrivals:
        t = max(t, arrival) + compute_per_layer
    return t


def tile_arrivals(measured: Sequence[float], layers: int) -> list[float]:
    """Arrivals of ``layers`` layers from those measured on the first ``len(measured)``: the measured
    pattern repeated back to back, as if the request were read as layers / measured restores in a row.
    Its last arrival is the measured restore time x layers / measured; each repeat keeps the measured
    first-layer latency, a little pessimistic for a stream that pays it once."""
    m = len(measured)
    if not m or layers % m:
        raise ValueError(f"tile_arrivals: {m} measured layers do not divide {layers}")
    return [(layer // m) * measured[-1] + measured[layer % m] for layer in range(layers)]


def linear_arrivals(first_s: float, total_s: float, layers: int) -> list[float]:
    """Arrivals interpolated between the first layer's and the last's (a system that reports only those)."""
    if layers == 1:
        return [total_s]
    return [first_s + (total_s - first_s) * layer / (layers - 1) for layer in range(layers)]


def whole_request_ttft(restore_s: float, prefill_s: float) -> float:
    """A whole-request store: the prefix is all in host memory before the prefill starts."""
    return restore_s + prefill_s


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# ---- one measurement, in its own process -----------------------------------------------------------------
def stamp_ids(first_page: int, pages: int, layers: int) -> np.ndarray:
    """An id for each page-layer, written in its first 8 bytes, to check a restore put it back."""
    page = np.arange(first_page, first_page + pages, dtype=np.uint64)
    return page[None, :] * np.uint64(layers) + np.arange(layers, dtype=np.uint64)[:, None] + np.uint64(1)


def measure(system: str, directory: Path, cfg: ContextConfig, tokens: int) -> dict[str, Any]:
    """Store one session of ``tokens`` on ``measured_layers`` layers, make it cold, restore it, time it."""
    model = cfg.geometry()
    m, span = cfg.measured_layers, model.page_layer_bytes
    pages = tokens // model.page_tokens
    session_bytes = pages * m * span
    # No DRAM share: FlatCake places nothing in DRAM, tiered's is flushed. Mooncake has no SSD-only
    # mode: its DRAM segment (at least MIN_SEGMENT) holds the session and the warm-up page, and
    # prepare pushes them all out.
    fraction = max((pages + 1.5) / pages, MIN_SEGMENT / session_bytes) if system == "mooncake" else 0.0
    spec = SystemSpec(layers=m, page_bytes=span, page_tokens=model.page_tokens, sessions=1,
                      session_bytes=session_bytes, dram_fraction=fraction, flush_dram=True, mla=model.mla,
                      host_pool=True)  # fmt: skip
    store = make_system(system, directory, spec)
    try:
        keys = [f"ctx-{tokens}-{i}" for i in range(pages)]
        chunk = max(1, CHUNK_TOKENS // model.page_tokens)
        filler = np.frombuffer(np.random.default_rng(tokens).bytes(span), np.uint8)
        # A one-page session of its own, restored cold before the measured one: a fresh process's first
        # restore also pays for thread start-up, file opens and its first staging buffers, which a
        # serving process paid long before (FlatCake's first restore measured 3x its second here).
        warm = aligned_empty((m, 1, span))
        warm[...] = filler
        store.put([f"warm-{tokens}"], warm, Hints(turn=1, context_tokens=model.page_tokens))
        started = time.perf_counter()
        for turn, lo in enumerate(range(0, pages, chunk)):
            part = keys[lo : lo + chunk]
            kv = aligned_empty((m, len(part), span))
            kv[...] = filler
            kv[..., :8].view(np.uint64)[..., 0] = stamp_ids(lo, len(part), m)
            hints = Hints(turn=turn + 1, context_tokens=(lo + len(part)) * model.page_tokens,
                          parent_key=keys[lo - 1] if lo else None)  # fmt: skip
            store.put(part, kv, hints)
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        os.sync()
        store.prepare()
        prepare_s = time.perf_counter() - started
        drop_caches()
        store.restore([f"warm-{tokens}"], warm)
        dropped = drop_caches()
        processes: list[int | str] = ["self", *pids(store)]
        reads_before = _device_reads(processes)
        c = store.counters()  # the warm-up's reads are not the measured restore's (a live object for some)
        commands_before, dram_before = c.read_commands, c.dram_pages
        dest = aligned_empty((m, pages, span))
        dest.fill(0)  # a host pool is allocated before a request: no page faults inside the timing
        started = time.perf_counter()
        missing = store.restore(keys, dest)
        wall = time.perf_counter() - started
        device_reads = _device_reads(processes) - reads_before
        c = store.counters()
        timing = c.requests[-1] if c.requests else None
        ids = dest[..., :8].view(np.uint64)[..., 0]
        return {
            "ran": True, "why_not": None, "tokens": tokens, "pages": pages,
            # A system that reports its storage part (Mooncake: without copying out for the check) is
            # timed by it; the others by the call.
            "restore_s": timing.seconds if timing else wall, "restore_wall_s": wall,
            "first_layer_s": timing.first_layer_seconds if timing else wall,
            "layer_arrivals_s": list(timing.layer_seconds) if timing and timing.layer_seconds else None,
            "write_s": write_s, "prepare_s": prepare_s, "dropped_caches": dropped,
            "missing_pages": missing, "wrong_page_layers": int((ids != stamp_ids(0, pages, m)).sum()),
            "dram_pages": c.dram_pages - dram_before, "device_read_bytes": device_reads,
            "read_commands": c.read_commands - commands_before,
            "restored_bytes": session_bytes,
        }  # fmt: skip
    finally:
        store.close()


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement, run by ``python -m flatcake.loadgen.bench.context`` (loadgen/bench/worker.py)."""
    return measure(job["system"], Path(job["directory"]), worker.config(ContextConfig, job["config"]), job["tokens"])


def run_worker(system: str, directory: Path, cfg: ContextConfig, tokens: int, timeout: float = 3600) -> dict[str, Any]:
    job = {"system": system, "config": dataclasses.asdict(cfg), "tokens": tokens}
    result = worker.run("flatcake.loadgen.bench.context", directory, job, timeout)
    if result["ran"] and (result["missing_pages"] or result["wrong_page_layers"]):
        result.update(ran=False, why_not=f"restore lost data: {result['missing_pages']} pages missing, "
                                         f"{result['wrong_page_layers']} page-layers wrong")  # fmt: skip
    return result


# ---- the sweep -------------------------------------------------------------------------------------------
def ttft_of(system: str, result: dict[str, Any], model: ModelPreset, cfg: ContextConfig) -> dict[str, Any]:
    """One measured restore, scaled to the model's layers, turned into a TTFT."""
    scale = model.layers // cfg.measured_layers
    prefill = model.prefill_s(cfg.suffix, result["tokens"], cfg.gpu)
    restore = result["restore_s"] * scale
    if system in STREAMS_LAYERS:
        measured = result["layer_arrivals_s"]
        if measured and len(measured) == cfg.measured_layers:
            arrivals, how = tile_arrivals(measured, model.layers), "measured per layer"
        else:
            arrivals = linear_arrivals(result["first_layer_s"], restore, model.layers)
            how = "interpolated between first layer and total"
        ttft = layer_pipeline_s(arrivals, prefill / model.layers)
        return {"ttft_s": ttft, "restore_s": restore, "first_layer_s": arrivals[0], "arrivals": how,
                "gpu_wait_s": ttft - prefill}  # fmt: skip
    return {"ttft_s": whole_request_ttft(restore, prefill), "restore_s": restore, "first_layer_s": restore,
            "arrivals": "whole request", "gpu_wait_s": restore}  # fmt: skip


def run(cfg: ContextConfig, directory: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    model = cfg.geometry()
    scale = model.layers // cfg.measured_layers
    directory.mkdir(parents=True, exist_ok=True)
    measured_note = f"measured on {cfg.measured_layers} of {model.layers} layers, x{scale}"
    stored = ",".join(cfg.stored) or "no stored system"
    log(f"bench context: {model.name} on {cfg.gpu}, {cfg.suffix}-token suffix after {cfg.tokens} cached tokens; "
        f"{measured_note}; {cfg.repeats} repeat(s) of {stored} in {directory}")  # fmt: skip
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(n, s): [] for n in cfg.tokens for s in cfg.stored}
    total, done = cfg.repeats * len(runs), 0
    for repeat in range(cfg.repeats):  # repeats outermost: a slow minute of a shared disk hits every system
        for n in cfg.tokens:
            for system in cfg.stored:
                started = time.monotonic()
                result = run_worker(system, directory / system, cfg, n)
                runs[n, system].append(result)
                done += 1
                if result["ran"]:
                    what = (f"restore {result['restore_s']:.3f} s (x{scale} = {result['restore_s'] * scale:.2f} s), "
                            f"first layer {result['first_layer_s'] * 1e3:.1f} ms")  # fmt: skip
                else:
                    what = f"not run: {result['why_not']}"
                log(f"[{done}/{total}] {n} tokens, {system}, repeat {repeat + 1}: {what} "
                    f"({time.monotonic() - started:.0f} s)")  # fmt: skip
    rows = []
    for n in cfg.tokens:
        row: dict[str, Any] = {"tokens": n, "pages": n // model.page_tokens,
                               "prefill_suffix_s": model.prefill_s(cfg.suffix, n, cfg.gpu), "systems": {}}  # fmt: skip
        for system in cfg.systems:
            if system == "recompute":
                t = model.prefill_s(n + cfg.suffix, 0, cfg.gpu)
                row["systems"][system] = {"ran": True, "why_not": None, "ttft_s": spread([t])}
                continue
            results = runs[n, system]
            failed = [r for r in results if not r["ran"]]
            if failed:
                row["systems"][system] = {"ran": False, "why_not": failed[0]["why_not"]}
                continue
            modelled = [ttft_of(system, r, model, cfg) for r in results]
            entry: dict[str, Any] = {"ran": True, "why_not": None, "arrivals": modelled[0]["arrivals"]}
            for key in ("ttft_s", "restore_s", "first_layer_s", "gpu_wait_s"):
                entry[key] = spread([x[key] for x in modelled])
            entry["measured_restore_s"] = spread([r["restore_s"] for r in results])
            entry["restore_bytes_per_s"] = statistics.median(r["restored_bytes"] / r["restore_s"] for r in results)
            for key in ("dram_pages", "device_read_bytes", "read_commands"):
                entry[key] = max(int(r[key]) for r in results)
            entry["dropped_caches"] = all(r["dropped_caches"] for r in results)
            row["systems"][system] = entry
        row["ratios"] = ratios(row["systems"])
        rows.append(row)
    return {
        "model": model.calibration(cfg.gpu),
        "config": dataclasses.asdict(cfg),
        "scaling": {
            "layers": model.layers,
            "measured_layers": cfg.measured_layers,
            "factor": scale,
            "note": measured_note,
        },
        "assumptions": assumptions(cfg, model),
        "rows": rows,
        "ratio_ranges": ratio_ranges(rows),
        "paper": PAPER,
    }


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each other system's median TTFT over FlatCake's (above 1: FlatCake is faster)."""
    fc = systems.get(FLATCAKE, {})
    if not fc.get("ran"):
        return {}
    return {f"flatcake_vs_{name}": s["ttft_s"]["median"] / fc["ttft_s"]["median"]
            for name, s in systems.items() if name != FLATCAKE and s.get("ran")}  # fmt: skip


def ratio_ranges(rows: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row["ratios"].items():
            lo, hi = out.get(key, [value, value])
            out[key] = [min(lo, value), max(hi, value)]
    return out


def assumptions(cfg: ContextConfig, model: ModelPreset) -> list[str]:
    scale = model.layers // cfg.measured_layers
    return [
        f"one rank's KV ({model.name}: {model.page_layer_bytes} B page-layers, {model.page_tokens}-token pages), "
        "on a device of its own: ranks that share one device would each take up to (ranks)x longer to restore",
        "one session alone: its pages lie together in every store (no other session's evictions between them)",
        f"measured on {cfg.measured_layers} of {model.layers} layers, x{scale}: restore time x{scale}; FlatCake's "
        f"measured per-layer arrivals repeated {scale} times back to back",
        "each session is cold: written in 8K-token puts, synced, DRAM tier flushed (FlatCake: no DRAM share; "
        "Mooncake: pushed to its SSD offload), page cache dropped when root",
        "tiered, mooncake: whole prefix in host memory before prefill (SGLang's prefetch completes before the "
        "host->GPU load); TTFT = restore + prefill(suffix after N cached)",
        "flatcake: layer l's prefill starts when layer l has arrived and layer l-1's prefill ended; prefill "
        "split evenly across layers",
        f"compute modelled: {model.name} on {cfg.gpu} (models.py: FLOPs / (peak x MFU)); {HOST_TO_GPU}",
    ]


# ---- output ----------------------------------------------------------------------------------------------
def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    if not s["ran"]:
        return "not run"
    t = s["ttft_s"]
    if t["min"] == t["max"]:
        return f"{t['median']:.2f}"
    return f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]"


def format_table(report: dict[str, Any]) -> str:
    """TTFT in seconds per context length (median [min-max] over repeats), and FlatCake's ratios."""
    shown = [s for s in SYSTEMS if s in report["config"]["systems"]]
    peers = [s for s in shown if s != FLATCAKE]
    head = f"{'tokens':>7} " + " ".join(f"{n:>19}" for n in shown)
    head += "".join(f" {'FC vs ' + p:>17}" for p in peers)
    lines = [f"TTFT (s), median [min-max]; {report['scaling']['note']}; {HOST_TO_GPU}", head]
    for row in report["rows"]:
        line = f"{row['tokens']:>7} " + " ".join(f"{_cell(row['systems'].get(n)):>19}" for n in shown)
        line += "".join(f" {row['ratios'].get(f'flatcake_vs_{p}', float('nan')):>16.2f}x" for p in peers)
        lines.append(line)
    lines.append("")
    here = report["ratio_ranges"]
    paper = report["paper"]
    for peer, key in (("recompute", "flatcake_vs_recompute"), ("mooncake", "flatcake_vs_mooncake"),
                      ("tiered", "flatcake_vs_tiered")):  # fmt: skip
        if key in here:
            ref = paper.get(key)
            ref_text = f"paper {ref[0]:.1f}-{ref[1]:.1f}x" if ref else "paper: no such baseline"
            lines.append(f"FlatCake vs {peer:<9}: here {here[key][0]:.2f}-{here[key][1]:.2f}x; {ref_text}")
    gds, fc = paper["mooncake_gds_ttft_s"], paper["flatcake_ttft_s"]
    lines.append("paper, Mooncake with GDS vs FlatCake: " + ", ".join(
        f"{int(n) // 1024}K {gds[n]:.2f} vs {fc[n]:.2f} s" for n in gds))  # fmt: skip
    return "\n".join(lines)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    """TTFT against context length (log x), median with min/max bars, and the paper's points."""
    from flatcake.loadgen.report import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [row["tokens"] for row in report["rows"]]
    for name in (s for s in SYSTEMS if s in report["config"]["systems"]):
        xs, med, lo, hi = [], [], [], []
        for n, row in zip(tokens, report["rows"], strict=True):
            s = row["systems"].get(name)
            if s and s["ran"]:
                t = s["ttft_s"]
                xs.append(n)
                med.append(t["median"])
                lo.append(t["median"] - t["min"])
                hi.append(t["max"] - t["median"])
        if xs:
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
    paper = report["paper"]
    for key, label, marker in (("flatcake_ttft_s", "paper: FlatCake", "*"),
                               ("mooncake_gds_ttft_s", "paper: Mooncake GDS", "x")):  # fmt: skip
        points = paper[key]
        ax.scatter([int(n) for n in points], list(points.values()), marker=marker, s=80, color="black", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # recompute grows ~30x over the sweep, the stores ~10x
    ax.set_xticks(tokens, [f"{n // 1024}K" for n in tokens])
    m = report["model"]
    plots.label(ax, "cached prefix (tokens)", "TTFT (s)",
                f"TTFT vs context, {m['model']} on {m['gpu']} ({report['scaling']['note']})", legend=True)  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    return [str(plots.save(fig, out_dir / "context_ttft.png"))]


if __name__ == "__main__":
    sys.exit(worker.main(_measure))
