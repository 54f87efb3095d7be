"""FlatCake as a benchmark system: an in-process ``Engine`` over its own pools, the SSD pool sized as
one file per session so that nothing is reclaimed during a benchmark."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

from flatcake.loadgen.systems.base import Array, MiB, RequestTiming, RestoreCounters, SystemSpec
from flatcake.node_agent import DramConfig, Engine, EngineConfig, Hints, IOConfig, Key, PlacementConfig, SsdConfig
from flatcake.node_agent.datapath.buffers import round_up
from flatcake.node_agent.policy.gva import SSD_THRESHOLD


def engine_config(spec: SystemSpec, pool_dir: Path, dram: DramConfig, streams: int = 1) -> EngineConfig:
    """The engine configuration every FlatCake system of the benchmarks runs with. DRAM is the spec's
    share of all pages (what lands there is placement's decision); the SSD pool as one file per
    session, each large enough for its whole history, plus room under the high watermark (0.9), so
    nothing is reclaimed during a benchmark (scopes share files now: this is room to spare)."""
    return EngineConfig(
        layers=spec.layers,
        page_bytes=spec.page_bytes,
        page_tokens=spec.page_tokens,
        dram=dataclasses.replace(dram, bytes=int(spec.dram_fraction * spec.total_pages) * spec.page_span),
        placement=PlacementConfig(mode=spec.placement),
        ssd=SsdConfig(
            dir=str(pool_dir),
            file_bytes=round_up(spec.session_bytes, MiB),
            file_count=math.ceil(spec.sessions / 0.85) + 1,
        ),
        io=IOConfig(
            backend="posix",
            workers=spec.workers,
            read_threads=spec.workers,
            gap_bytes=spec.gap_bytes,
            staging_layers=spec.staging_layers,
            staging_slot_bytes=spec.staging_slot_bytes,
            streams=streams,
        ),
    )


class FlatCakeSystem:
    name = "flatcake-engine"

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        dram = DramConfig(huge_pages=False, name=f"flatcake-bench-{directory.name}-{os.getpid()}")
        self.engine = Engine(engine_config(spec, directory, dram))
        self._base = self.engine.stats.snapshot()
        self._peak = 0
        self._timings: list[RequestTiming] = []

    def put(self, keys: Sequence[Key], kv: Array, hints: Hints) -> None:
        self.engine.put(keys, kv, hints)

    def prepare(self) -> None:
        self._base = self.engine.stats.snapshot()
        self._peak = 0
        self._timings = []

    def restore(self, keys: Sequence[Key], dest: Array, dest_pages: Sequence[int] | None = None) -> int:
        started = time.perf_counter()
        arrivals: list[float] = []
        # Only the stored prefix is restored, as a serving engine asks: a page evicted since it was written
        # (a DRAM scope reclaimed to make room) is a miss to recompute, like one that failed to read.
        hit = self.engine.exists(keys)
        pages = None if dest_pages is None else list(dest_pages)[:hit]
        with self.engine.get(list(keys[:hit]), dest, pages) as restore:
            for _layer in restore:  # a consumer would run layer l here while l+1 is read
                arrivals.append(time.perf_counter() - started)
            self._peak = max(self._peak, restore.staging_peak_bytes)
            missing = len(restore.missing) + len(keys) - hit
        took = time.perf_counter() - started
        self._timings.append(RequestTiming(took, arrivals[0] if arrivals else took, tuple(arrivals)))
        return missing

    def counters(self) -> RestoreCounters:
        now, base = self.engine.stats.snapshot(), self._base
        d = {k: now.get(k, 0) - base.get(k, 0) for k in now}
        return RestoreCounters(
            d.get("read_commands", 0),
            d.get("read_bytes", 0),
            d.get("requested_bytes", 0),
            self._peak,
            d.get("pages_missing", 0),
            d.get("restore_pages_dram", 0),
            list(self._timings),
        )

    def placement(self, keys: Sequence[Key]) -> list[str | None]:
        """The medium each stored page was placed on (``None``: not stored)."""
        return [None if loc is None else medium_of(loc.gva) for loc in self.engine.table.lookup_many(keys)]

    def segments(self) -> int:
        return sum(s.segments for s in self.engine.table.scopes.values())

    def close(self) -> None:
        self.engine.close()


def medium_of(gva: int) -> str:
    """``dram`` or ``ssd``: the medium is the GVA's top field (``policy/gva.py``)."""
    return "ssd" if gva >= SSD_THRESHOLD else "dram"
