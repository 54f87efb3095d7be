"""The storage systems the benchmarks compare, behind one interface (``base.System``): FlatCake's
adapter and the baselines a user would otherwise pick."""

from collections.abc import Callable
from pathlib import Path

from flatcake.loadgen.systems.base import RestoreCounters, System, SystemSpec
from flatcake.loadgen.systems.flatcake import FlatCakeSystem
from flatcake.loadgen.systems.per_block import PerBlockSystem
from flatcake.loadgen.systems.tiered import TieredNaiveSystem, TieredSystem

# The in-process systems of bench restore (and of peers, context), by their registry names (names.py).
SYSTEMS: dict[str, Callable[[Path, SystemSpec], System]] = {
    "flatcake-engine": FlatCakeSystem,
    "tiered": TieredSystem,
    "tiered-naive": TieredNaiveSystem,
    "per-block": PerBlockSystem,
}

__all__ = [
    "SYSTEMS",
    "FlatCakeSystem",
    "PerBlockSystem",
    "RestoreCounters",
    "System",
    "SystemSpec",
    "TieredNaiveSystem",
    "TieredSystem",
]
