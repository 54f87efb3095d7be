"""The interface every storage system of the benchmarks implements, FlatCake's adapter and the
baselines alike, so each benchmark drives all of them the same way.

A system stores whole pages (all layers) under page keys and restores a list of keys into a
``[layers][pages][page_bytes]`` destination. ``prepare`` makes the next restores cold (flushes what a
system caches) and resets the counters those restores are judged by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from flatcake.node_agent import Hints, Key

MiB = 1 << 20
Array = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class RequestTiming:
    """One restore as its caller sees it: when the whole request was in place, and when its first
    layer was (usable for compute to start); equal for systems that return whole requests."""

    seconds: float
    first_layer_seconds: float
    # When each layer was in place, in order (systems that stream layers; empty for whole requests)
    layer_seconds: tuple[float, ...] = ()


@dataclass
class RestoreCounters:
    read_commands: int = 0
    bytes_read: int = 0
    bytes_requested: int = 0
    staging_peak_bytes: int = 0
    missing: int = 0
    dram_pages: int = 0  # pages restored from the system's DRAM tier
    # Systems whose restore() does more than the storage work (a conversion the benchmark needs for
    # checking) record the storage part here; the benchmark times the whole call otherwise.
    requests: list[RequestTiming] = field(default_factory=list)


@dataclass(frozen=True)
class SystemSpec:
    """What a system is sized for: the model's page geometry and the data the benchmark will store."""

    layers: int
    page_bytes: int
    page_tokens: int
    sessions: int  # session histories that will be stored
    session_bytes: int  # the largest session history, all layers
    # Reads in flight: every system's own reader gets the same depth (FlatCake: io.read_threads). 4 fills
    # this box's disk (2 / 4 / 8 threads measured 1.77 / 1.79 / 1.65 GB/s, issue 26).
    workers: int = 4
    gap_bytes: int = 64 * 1024
    staging_layers: int = 2
    staging_slot_bytes: int = 8 * MiB
    dram_fraction: float = 0.25  # a DRAM tier's size, as a share of all pages stored
    # prepare() empties DRAM tiers too (every restore from SSD), or keeps them (the DRAM budget at work)
    flush_dram: bool = True
    mla: bool = True  # one latent per token (a flat byte page per layer), or MHA K/V heads (SGLang's layouts)
    # tiered: read into a host pool allocated once for the largest session (SGLang's), not a buffer per restore
    host_pool: bool = False
    placement: str = "table2"  # FlatCake's placement.mode

    @property
    def session_pages(self) -> int:
        """Pages of the largest session."""
        return -(-self.session_bytes // (self.layers * self.page_bytes))

    @property
    def page_span(self) -> int:
        return self.layers * self.page_bytes

    @property
    def total_pages(self) -> int:
        return self.sessions * -(-self.session_bytes // self.page_span)


class System(Protocol):
    name: str

    def put(self, keys: Sequence[Key], kv: Array, hints: Hints) -> None: ...
    def prepare(self) -> None: ...
    def restore(self, keys: Sequence[Key], dest: Array, dest_pages: Sequence[int] | None = None) -> int: ...
    def counters(self) -> RestoreCounters: ...
    def close(self) -> None: ...


def pids(system: object) -> list[int]:
    """Processes besides this one that do a system's work (a server, a master), if it has any."""
    method = getattr(system, "pids", None)
    return list(method()) if callable(method) else []


class Store(Protocol):
    """A baseline's own store: pages in, pages out, its counters."""

    counters: RestoreCounters

    def put(self, keys: Sequence[Key], kv: Array) -> None: ...
    def restore(self, keys: Sequence[Key], dest: Array) -> int: ...
    def close(self) -> None: ...


class StoreSystem:
    """A ``System`` over a ``Store`` that takes no hints (the baselines place by their own policy)."""

    name = ""
    store: Store

    def put(self, keys: Sequence[Key], kv: Array, hints: Hints) -> None:
        self.store.put(keys, kv)

    def prepare(self) -> None:
        self.store.counters = RestoreCounters()

    def restore(self, keys: Sequence[Key], dest: Array, dest_pages: Sequence[int] | None = None) -> int:
        return self.store.restore(keys, dest)

    def counters(self) -> RestoreCounters:
        return self.store.counters

    def close(self) -> None:
        self.store.close()
