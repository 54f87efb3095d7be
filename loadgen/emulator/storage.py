"""What each emulator mode stores and restores behind HBM: FlatCake's engine (in process, or a node
agent's client), the tiered baselines, or nothing; real bytes on this machine's disk."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from flatcake.loadgen import names
from flatcake.loadgen.emulator.config import EmulatorConfig, MiB
from flatcake.loadgen.overlap import even_arrivals
from flatcake.loadgen.systems.flatcake_pages import FlatCakePages
from flatcake.loadgen.systems.tiered import ChainPageStore, PageStore, TieredStore
from flatcake.node_agent import (
    ChainSignals,
    DramConfig,
    Engine,
    EngineConfig,
    IOConfig,
    PlacementConfig,
    SsdConfig,
    ThreadBuffers,
    aligned_empty,
)
from flatcake.node_agent.policy.gva import SSD_THRESHOLD

log = logging.getLogger(__name__)


class Storage:
    """What each mode stores and restores behind HBM."""

    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        root = Path(cfg.data_dir) / cfg.mode
        root.mkdir(parents=True, exist_ok=True)
        self.engine: Engine | None = None
        self.tiered: TieredStore | None = None
        # The bytes written for new pages: a few pages' worth, reused (their content is irrelevant).
        chunk = max(1, min(64, (64 * MiB) // cfg.page_span))
        self._kv = aligned_empty((cfg.layers, chunk, cfg.page_bytes))
        self._kv[...] = np.random.default_rng(0).integers(0, 256, size=self._kv.shape, dtype=np.uint8)
        self._dests = ThreadBuffers()  # restores land in a reused host buffer, as in a serving engine's pool
        if cfg.mode in ("flatcake", "flatcake-native"):
            # FlatCake's engine: the whole store (native), or the L3 under SGLang's host tier (as it ships).
            if cfg.agent_socket:
                from flatcake.node_agent import connect

                self.engine = connect(cfg.agent_socket, layers=cfg.layers, page_bytes=cfg.page_bytes)
            else:
                self.engine = Engine(engine_config(cfg, root))
        if cfg.rules == "sglang" and cfg.mode != "none":
            bucket = max(cfg.page_span, (64 * MiB) // cfg.page_span * cfg.page_span)
            l3 = self._l3(root)
            log_buckets = -(-cfg.ssd_bytes // bucket) if cfg.storage == "log" else 0
            self.tiered = TieredStore(root, layers=cfg.layers, page_bytes=cfg.page_bytes,
                                      dram_pages=max(1, cfg.host_tier_bytes // cfg.page_span), bucket_bytes=bucket,
                                      buckets=log_buckets, workers=4, reader="whole_page", l3=l3)  # fmt: skip

    def _l3(self, root: Path) -> PageStore | ChainPageStore | None:
        """SGLang's storage backend below its host tier: FlatCake's (through its engine or agent), or a
        real baseline (``real_l3``); None for the idealized log or no L3."""
        if self.cfg.storage == "flatcake":
            assert self.engine is not None
            return FlatCakePages(self.engine, self.cfg.page_tokens)
        return real_l3(self.cfg, root) if self.cfg.mode == "tiered" else None

    def media(self, keys: list[str], prefix: list[str] | None = None) -> list[str]:
        """Medium of each page of the stored prefix of ``keys`` (``prefix``: the keys before them, which an
        L3 told the chain sees): under SGLang's rules "dram" is its host tier and "ssd" its L3."""
        if self.tiered is not None:
            return self.tiered.media(keys, prefix or [])
        if self.engine is not None:
            hit = self.engine.exists(keys)
            if not hit:
                return []
            lease = self.engine.catalog.acquire(keys[:hit])
            self.engine.catalog.release(lease.id)
            return ["ssd" if loc.gva >= SSD_THRESHOLD else "dram" for loc in lease.locations]
        return []

    def hold_host(self, keys: list[str], delta: int) -> None:
        """Lock (1) or unlock (-1) host-tier pages a waiting request matched (SGLang's lock on its node)."""
        if self.tiered is not None:
            self.tiered.hold(keys, delta)

    def host_media(self, keys: list[str]) -> list[str]:
        """SGLang's match at scheduling: the leading pages of ``keys`` in its host tier ("dram")."""
        return ["dram"] * self.tiered.host_prefix(keys) if self.tiered is not None else []

    def restore(
        self, keys: list[str], promote: bool = False, dest: npt.NDArray[np.uint8] | None = None
    ) -> tuple[int, list[float]]:
        """Bring pages to HBM (really read them); returns how many of the leading pages arrived and when
        each layer did (``time.monotonic``; empty when nothing was read): the prefill overlaps them
        (loadgen/overlap.py). FlatCake's restore yields its layers as they land; the tiered host tier's
        copy moves whole pages, and SGLang moves them to the device layer by layer
        (``LayerDoneCounter``), so its layers are charged as one copy at one rate.
        ``promote``: the tiered host tier keeps what was read from SSD (a finished SGLang prefetch).
        ``dest``: where the pages land (a prepared request's host staging); else a reused buffer."""
        if not keys:
            return 0, []
        if dest is None:
            dest = self._dests.get((self.cfg.layers, len(keys), self.cfg.page_bytes))
        if self.tiered is not None:
            started = time.monotonic()
            missing = self.tiered.restore_pages(keys, dest)
            got = min(missing) if missing else len(keys)
            if promote and got:
                self.tiered.promote(keys[:got], dest)
            return got, even_arrivals(started, time.monotonic(), self.cfg.layers) if got else []
        if self.engine is not None:
            times: list[float] = []
            try:
                with self.engine.get(keys, dest) as restore:
                    for _ in restore:
                        times.append(time.monotonic())
                    missing = restore.missing
            except KeyError:  # reclaimed between lookup and restore: recompute
                return 0, []
            return (min(missing) if missing else len(keys)), times
        return 0, []

    def load_held(self, held: list[tuple[npt.NDArray[np.uint8], list[int]]]) -> list[float]:
        """Copy a prepared request's pages from its host staging into HBM (``held``: staging buffers and
        the pages of each to take), layer by layer as SGLang's load-back moves them; returns when each
        layer was in (the prefill overlaps them)."""
        pages = sum(len(idx) for _, idx in held)
        if not pages:
            return []
        dest = self._dests.get((self.cfg.layers, pages, self.cfg.page_bytes))
        times = []
        for layer in range(self.cfg.layers):
            at = 0
            for buf, idx in held:
                dest[layer, at : at + len(idx)] = buf[layer, idx]
                at += len(idx)
            times.append(time.monotonic())
        return times

    def store(self, prefix: list[str], keys: list[str], signals: ChainSignals) -> list[str]:
        """Write-back of newly computed pages after ``prefix`` (in the background; not on the TTFT path),
        each run with the hints SGLang's backend derives for it (``signals``). Returns where each stored
        page was placed (FlatCake), for placement accuracy."""
        if self.tiered is not None:  # the host tier now; its backup thread writes the L3 through
            for lo, chunk, kv in self._chunks(keys):
                self.tiered.put(chunk, kv, prefix=[*prefix, *keys[:lo]])
            return []
        if self.engine is None:
            return []
        placed: list[str] = []
        runs = signals.write(prefix, keys, self.cfg.page_tokens)
        for run in runs:
            hints = run.hints()
            for lo, chunk, kv in self._chunks(keys[run.start : run.stop]):
                if lo:  # a later chunk of the run continues the one before it
                    hints = replace(hints, parent_key=keys[run.start + lo - 1])
                try:
                    self.engine.put(chunk, kv, hints)
                except (OSError, RuntimeError, ValueError) as exc:  # pool full: the pages stay uncached
                    log.warning("store failed: %s", exc)
                    return placed
                placed += self.media(chunk)
        signals.record(keys, runs)
        return placed

    def _chunks(self, keys: list[str]) -> Iterator[tuple[int, list[str], npt.NDArray[np.uint8]]]:
        """``keys`` in puts of at most the reused buffer's pages, each with contiguous bytes as put wants."""
        for lo in range(0, len(keys), self._kv.shape[1]):
            chunk = keys[lo : lo + self._kv.shape[1]]
            kv = aligned_empty((self.cfg.layers, len(chunk), self.cfg.page_bytes))
            kv[...] = self._kv[:, : len(chunk)]
            yield lo, chunk, kv

    def close(self) -> None:
        if self.tiered is not None:  # first: its backup thread may still be writing into the engine
            self.tiered.close()
        if self.engine is not None:
            self.engine.close()


def real_l3(cfg: EmulatorConfig, root: Path) -> PageStore | None:
    """The tiered mode's L3 when it is a real backend (``cfg.l3``), built through the registry and imported
    only then (SGLang, Mooncake)."""
    if cfg.l3 == "hicache-file":
        store: PageStore = names.implementation("l3", cfg.l3)(root / "hicache", cfg.layers, cfg.page_bytes,
                                                              drop_page_cache=cfg.drop_page_cache)  # fmt: skip
        return store
    if cfg.l3 == "hicache-mooncake":
        store = names.implementation("l3", cfg.l3)(root / "mooncake", cfg.layers, cfg.page_bytes,
                                                   segment_bytes=cfg.l3_dram_bytes)  # fmt: skip
        return store
    return None


def engine_config(cfg: EmulatorConfig, root: Path) -> EngineConfig:
    files = max(4, cfg.ssd_bytes // cfg.scope_file_bytes)
    return EngineConfig(
        layers=cfg.layers, page_bytes=cfg.page_bytes, page_tokens=cfg.page_tokens,
        dram=DramConfig(bytes=cfg.l3_dram_bytes, huge_pages=False, shm_dir=str(root), name="emulator-dram"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=cfg.scope_file_bytes, file_count=files),
        io=IOConfig(backend="posix", workers=2, staging_slot_bytes=max(cfg.page_bytes, 2 * MiB)),
        placement=PlacementConfig(mode=cfg.placement),
    )  # fmt: skip
