"""Recovery: rebuild a catalog from its journal at start-up, checking stored bytes against the
per-page checksums so that a page overwritten or torn on disk is dropped, never served."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake.node_agent.catalog.journal import replay
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.policy.scopes import Location, Scope

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    scopes: int = 0
    pages: int = 0
    dropped_pages: int = 0
    records: int = 0


def recover(
    catalog: LocalCatalog, journal_path: str | os.PathLike[str], read_page: Callable[[Location], int] | None
) -> Recovered:
    """Rebuild the catalog from the journal. With ``read_page`` (returns a stored page's crc32), pages
    whose bytes no longer match are dropped instead of served."""
    scopes: dict[int, dict[str, Any]] = {}
    out = Recovered()
    for rec in replay(journal_path):
        out.records += 1
        if rec["t"] == "free":
            scopes.pop(rec["scope"], None)
            continue
        s = scopes.setdefault(rec["scope"], {"medium": rec["medium"], "keys": [], "locs": [], "crc": [], "slots": []})
        s["files"], s["cursor"] = rec["files"], rec["cursor"]
        s["slots"].extend(rec["slots"])
        s["keys"].extend(rec["keys"])
        s["locs"].extend(Location(rec["scope"], g, st) for g, st in zip(rec["gva"], rec["stride"], strict=True))
        s["crc"].extend(rec["crc"])
    for sid, s in sorted(scopes.items()):
        keep_keys: list[Key] = []
        entries: dict[Key, Location] = {}
        checksums: dict[Key, int] = {}
        for key, loc, crc in zip(s["keys"], s["locs"], s["crc"], strict=True):
            if read_page is not None and read_page(loc) != crc:
                out.dropped_pages += 1
                continue
            keep_keys.append(key)
            entries[key] = loc
            checksums[key] = crc
        if not keep_keys:
            continue  # nothing left to serve: its space stays free
        scope = Scope(sid, Medium(s["medium"]), 0, files=list(s["files"]), cursor=s["cursor"],
                      slots=list(s["slots"]), keys=keep_keys)  # fmt: skip
        catalog.adopt(scope, entries, checksums)
        out.scopes += 1
        out.pages += len(keep_keys)
    if out.dropped_pages:
        log.warning("recovery dropped %d pages whose bytes no longer match their checksum", out.dropped_pages)
    return out


def page_crc_reader(c: EngineConfig, dram: Any, pool_files: Sequence[Path]) -> Callable[[Location], int]:
    """A function giving the crc32 of a stored page (all layers, layer 0 first) as it is now on its
    medium: ``dram`` is the DRAM pool's byte view, ``pool_files`` the SSD pool's files by index."""

    def crc_of(loc: Location) -> int:
        medium, _, offset = G.decode(loc.gva)
        crc = 0
        if medium is Medium.DRAM:
            for layer in range(c.layers):
                at = offset + layer * loc.layer_stride
                crc = zlib.crc32(dram[at : at + c.page_bytes].data, crc)
            return crc
        file, at = divmod(offset, c.ssd.file_bytes)
        with open(pool_files[file], "rb", buffering=0) as f:
            for layer in range(c.layers):
                crc = zlib.crc32(os.pread(f.fileno(), c.page_bytes, at + layer * loc.layer_stride), crc)
        return crc

    return crc_of
