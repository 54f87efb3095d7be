"""The simulated systems by name (``names.py``'s ``simulate`` systems): which class runs each."""

from __future__ import annotations

from flatcake.loadgen import names
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import Cluster, System
from flatcake.loadgen.simulate.native import FlatCake
from flatcake.loadgen.simulate.sglang_rules import ShippedFlatCake, Tiered

SYSTEMS = names.names("simulate")


def make(name: str, c: Cluster, loop: EventLoop) -> System:
    if name == "flatcake":
        return ShippedFlatCake(c, loop)
    if name == "flatcake-native":
        return FlatCake(c, loop)
    if name in ("dram", "tiered"):
        return Tiered(c, loop, l3=name == "tiered")
    raise ValueError(f"--systems: {name!r} is not a system; choose from {','.join(SYSTEMS)}")
