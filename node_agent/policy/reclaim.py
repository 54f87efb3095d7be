"""Which scopes reclaim frees, as a pure plan over their sizes and ages (``plan_reclaim``), and the
counts it keeps: the scope table (``scopes.ScopeTable``) calls it under its lock and frees what it
names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Victim(NamedTuple):
    scope: int
    last_used: int
    units: int
    pinned: bool


def plan_reclaim(victims: Sequence[Victim], used: int, capacity: int, need: int, high: float, low: float) -> list[int]:
    """Scopes to free, oldest first, so that ``need`` more units fit and usage ends at or below the
    low watermark when it would pass the high one. Pinned scopes are never chosen; the plan may fall
    short when too much is pinned (the caller then reports the pool full)."""
    after = used + need
    if after <= high * capacity and after <= capacity:
        return []
    if after - sum(v.units for v in victims if not v.pinned) > capacity:
        return []  # even freeing every unpinned scope would not make room: free nothing
    target = min(low * capacity, capacity) if after > high * capacity else capacity
    chosen: list[int] = []
    for v in sorted(victims, key=lambda v: v.last_used):
        if after <= target:
            break
        if v.pinned or v.units == 0:
            continue
        chosen.append(v.scope)
        after -= v.units
    return chosen


@dataclass
class ReclaimStats:
    scopes: int = 0
    bytes: int = 0
