"""The agent's side of cross-node reads: its pages, served to clients on other nodes.

With ``cluster.listen`` set, the agent serves its control protocol on TCP as well, limited to the read
ops (``PEER_OPS``): peers look keys up and lease pages as local clients do, and never allocate or
publish here. The bytes move over Mooncake's transfer engine (``datapath/transfer.py``), never through
the agent's protocol:

- **DRAM pages** are read one-sided from the agent's pool, which is registered with the engine whole:
  the peer holds a lease (the pages cannot be reclaimed under it) and reads ``dram_base + slot x
  page span + layer x page_bytes``; the agent's CPU does nothing per read.
- **SSD pages** cannot be read by a peer (that would be NVMe-oF): ``stage`` has the agent restore them,
  sorted and merged as every local restore (FC-CIO), into a region of a registered staging buffer,
  layer-major, from which the peer reads one range per layer; ``unstage`` frees the region (so does
  the peer's connection closing).

Every page a peer reads is checked against its published crc32 on arrival (``service/cluster.py``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.errors import CapacityError, ConfigError
from flatcake.node_agent.config import EngineConfig, host_port
from flatcake.node_agent.constants import ALIGN
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.dram_pool import DramPool
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.transfer import Transfer
from flatcake.node_agent.policy.placement import Key

log = logging.getLogger(__name__)

# What a connection from another node may ask: look up, lease, stage, and the handshake (peer_auth.py).
PEER_OPS = frozenset({"hello", "register", "exists", "lookup", "acquire", "release", "stage", "unstage"})


@dataclass
class Staging:
    """First-fit regions of one registered buffer; a region is ``[layers][pages][page_bytes]``."""

    buffer: npt.NDArray[np.uint8]
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)  # handle -> (offset, bytes)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, nbytes: int) -> tuple[int, int]:
        """A free region's handle and offset; ``CapacityError`` when none is free now."""
        with self._lock:
            offset = 0
            for start, size in sorted(self.regions.values()):
                if start - offset >= nbytes:
                    break
                offset = max(offset, start + size)
            if offset + nbytes > self.buffer.nbytes:
                raise CapacityError(f"stage: {nbytes} bytes do not fit the free part of cluster.staging_bytes "
                                    f"({self.buffer.nbytes}) now; retry, or stage fewer pages")  # fmt: skip
            self._next += 1
            self.regions[self._next] = (offset, nbytes)
            return self._next, offset

    def give(self, handle: int) -> None:
        """Free a region, zeroed first: the buffer is registered with the transfer engine, which does not
        check who reads it, so a page stays readable there only while its peer reads it."""
        with self._lock:
            offset, nbytes = self.regions.pop(handle, (0, 0))
            self.buffer[offset : offset + nbytes] = 0


class PeerService:
    """What the agent needs to serve peers: its transfer engine, the registered DRAM pool and staging
    buffer, and an engine over the agent's own catalog that restores SSD pages into staging."""

    def __init__(self, config: EngineConfig, catalog: Any, dram: DramPool) -> None:
        c = config.cluster
        where = host_port(c.listen)
        assert where is not None  # EngineConfig checked it
        if where[0] in ("0.0.0.0", "::", ""):
            raise ConfigError(f"cluster.listen: {c.listen!r}: peers need an address to reach this agent at; give "
                              "the node's or pod's IP (agent serve --listen-host $(POD_IP))")  # fmt: skip
        self.config = config
        self.transfer = Transfer(where[0], c.transfer_protocol, c.transfer_device)
        self.dram = dram
        # The transfer engine's port authenticates nobody: whatever is registered with it, anyone who
        # reaches it can read and write. Over TCP peers stage DRAM pages as they stage SSD pages, so only
        # the staging buffer is registered; over RDMA the pool too, for one-sided reads (operations.md).
        one_sided = c.one_sided_dram == "on" or (c.one_sided_dram == "auto" and c.transfer_protocol == "rdma")
        self.dram_registered = bool(dram.view.nbytes) and one_sided
        if self.dram_registered:
            self.transfer.register(int(dram.view.ctypes.data), dram.view.nbytes)
        self.staging = Staging(aligned_empty(c.staging_bytes))
        self.staging.buffer[::ALIGN] = 0  # fault the buffer in now, not during a peer's first read
        self.transfer.register(int(self.staging.buffer.ctypes.data), self.staging.buffer.nbytes)
        self.engine = Engine(config, catalog=catalog, dram_path=dram.info.path)
        self.span = config.layers * config.page_bytes

    def info(self) -> dict[str, Any]:
        """What a peer's ``register`` learns: where to read, and how much one ``stage`` may ask."""
        return {
            "node_id": self.config.node_id, "transfer": self.transfer.endpoint,
            "dram_base": int(self.dram.view.ctypes.data) if self.dram_registered else 0,  # 0: stage them
            "stage_pages": self.staging.buffer.nbytes // self.span // 2,
        }  # fmt: skip

    def stage(self, keys: list[Key]) -> dict[str, Any]:
        """Restore ``keys`` (SSD pages the caller leased) into a staging region. Blocking: run off the loop."""
        handle, offset = self.staging.take(len(keys) * self.span)
        try:
            c = self.config
            region = self.staging.buffer[offset : offset + len(keys) * self.span].reshape(
                c.layers, len(keys), c.page_bytes
            )
            with self.engine.get(keys, region) as restore:
                missing = sorted(restore.run())
        except BaseException:
            self.staging.give(handle)
            raise
        return {"handle": handle, "address": int(self.staging.buffer.ctypes.data) + offset, "missing": missing}

    def close(self) -> None:
        self.engine.close()
        self.transfer.close()
