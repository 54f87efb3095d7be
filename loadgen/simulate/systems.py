"""The simulated systems by name (``names.py``'s ``simulate`` systems), built through the registry."""

from __future__ import annotations

from flatcake.loadgen import names
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import Cluster, System

SYSTEMS = names.names("simulate")


def make(name: str, c: Cluster, loop: EventLoop) -> System:
    """System ``name`` on cluster ``c`` (its class from ``names.IMPLEMENTATIONS["simulate"]``)."""
    if name not in SYSTEMS:
        raise ValueError(f"--systems: {name!r} is not a system; choose from {','.join(SYSTEMS)}")
    system: System = names.implementation("simulate", name)(c, loop)
    return system
