"""Which spec changes destroy stored KV (pure): compared against the configuration that is deployed,
not against the last spec seen, so a refused change stays refused until it is undone or allowed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Change:
    """A destructive change: the spec field that makes it, and why it loses the stored KV."""

    field: str
    why: str


def destructive_changes(deployed: dict[str, Any], wanted: dict[str, Any]) -> list[Change]:
    """Why going from ``deployed`` to ``wanted`` loses data, one Change per spec field at fault."""
    found = []
    old_prep, new_prep = deployed.get("prepare", {}), wanted.get("prepare", {})
    old_ssd, new_ssd = deployed.get("ssd", {}), wanted.get("ssd", {})
    if sorted(old_prep.get("devices", [])) != sorted(new_prep.get("devices", [])):
        if old_prep.get("devices") and new_prep.get("devices"):
            found.append(Change("spec.ssd.devices", "other devices mean a new array and filesystem"))
        else:
            found.append(Change("spec.ssd", "switching between devices and a directory means another filesystem"))
    elif old_ssd.get("dir") != new_ssd.get("dir"):
        found.append(Change("spec.ssd.directory", "the pool would move and start empty"))
    old_pool = old_ssd.get("file_bytes", 0) * old_ssd.get("file_count", 0)
    new_pool = new_ssd.get("file_bytes", 0) * new_ssd.get("file_count", 0)
    if old_ssd.get("file_bytes") != new_ssd.get("file_bytes"):
        found.append(
            Change("spec.ssd.fileSize", "pool files are preallocated at one size; changing it rebuilds the pool")
        )
    elif new_pool < old_pool:
        found.append(Change("spec.ssd.fileCount", "a smaller pool drops the files beyond the new count"))
    geometry = ("layers", "page_bytes")
    if any(deployed.get(k) != wanted.get(k) for k in geometry):
        found.append(Change("spec.kv", "another KV geometry cannot read the stored pages"))
    return found
