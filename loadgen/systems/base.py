"""The interface every storage system of the benchmarks implements, FlatCake's adapter and the
baselines alike, so each benchmark drives all of them the same way.

A system stores whole pages (all layers) under page keys and restores a list of keys into a
``[layers][pages][page_bytes]`` destination. ``prepare`` makes the next restores cold (flushes what a
system caches) and resets the counters those restores are judged by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from flatcake.node_agent import Hints, Key

MiB = 1 << 20
Array = npt.NDArray[np.uint8]


@dataclass
class RestoreCounters:
    read_commands: int = 0
    bytes_read: int = 0
    bytes_requested: int = 0
    staging_peak_bytes: int = 0
    missing: int = 0


@dataclass(frozen=True)
class SystemSpec:
    """What a system is sized for: the model's page geometry and the data the benchmark will store."""

    layers: int
    page_bytes: int
    page_tokens: int
    sessions: int  # session histories that will be stored
    session_bytes: int  # the largest session history, all layers
    workers: int = 2
    gap_bytes: int = 64 * 1024
    staging_layers: int = 2
    staging_slot_bytes: int = 8 * MiB
    dram_fraction: float = 0.25  # the tiered cache's DRAM, as a share of all pages stored

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
