"""Bytes between nodes: Mooncake's Transfer Engine, one per process.

FlatCake does not move bytes across nodes itself. Mooncake's Transfer Engine (``mooncake-transfer-engine``)
reads a peer's registered memory over RDMA where the node has it and over TCP elsewhere; this module is
the narrow face the agent and its clients use: ``register`` memory a peer may read, ``read`` ranges of a
peer's registered memory into this process's registered memory.

Endpoints are exchanged peer to peer (the engine's ``P2PHANDSHAKE`` mode): a peer is named by
``host:port`` of its engine's RPC port, learned from the peer agent's ``register`` reply, so no
metadata server sits in front of a read. A read that fails (the peer died, its memory is no longer
registered) or does not finish within the timeout returns False: the caller turns it into misses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from flatcake.errors import ConfigError
from flatcake.node_agent.constants import TRANSFER_PROTOCOLS

log = logging.getLogger(__name__)

INSTALL = "pip install 'flatcake[cluster]' (mooncake-transfer-engine-non-cuda; on GPU nodes mooncake-transfer-engine)"


class Transfer:
    """This process's transfer engine, bound to ``host`` (an address peers reach it at)."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in TRANSFER_PROTOCOLS:
            raise ConfigError(f"cluster.transfer_protocol: {protocol!r} must be one of {', '.join(TRANSFER_PROTOCOLS)}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(f"cross-node reads need Mooncake's transfer engine ({exc}); {INSTALL}") from None
        self._engine: Any = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            on = f"{host} over {protocol}" + (f" (device {device})" if device else "")
            raise ConfigError(f"cluster: the transfer engine could not start on {on}; check the address and devices")
        self.host = host
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()
        # Reads run on their own threads so that a caller can stop waiting (the engine's call cannot be
        # interrupted); a read abandoned at its timeout keeps its thread until the engine gives up.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="flatcake-transfer")

    def register(self, address: int, size: int) -> None:
        """Let peers read (and this process land reads in) ``[address, address + size)``."""
        with self._lock:
            if self._registered.get(address) == size:
                return
            if self._engine.register_memory(address, size) != 0:
                raise OSError(f"transfer engine: cannot register {size} bytes at {address:#x}")
            self._registered[address] = size

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is not None:
                self._engine.unregister_memory(address)

    def registered(self, address: int, size: int) -> bool:
        """Whether ``[address, address + size)`` lies inside one registered range."""
        with self._lock:
            return any(a <= address and address + size <= a + n for a, n in self._registered.items())

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int],
             timeout_s: float) -> bool:  # fmt: skip
        """Read ``lengths[i]`` bytes at the peer's ``remote[i]`` into this process's ``local[i]``, all or
        nothing: True when every range arrived, False when the engine reported a failure. ``TimeoutError``
        when it did not finish within ``timeout_s``: the read may still land later, so the caller must not
        hand the local memory to anyone else."""
        if not lengths:
            return True
        job: Future[int] = self._pool.submit(
            self._engine.batch_transfer_sync_read, peer, list(local), list(remote), list(lengths)
        )
        try:
            return job.result(timeout=timeout_s) == 0
        except FutureTimeout:
            raise TimeoutError(f"transfer from {peer}: {len(lengths)} ranges not done in {timeout_s:.1f} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for address in list(self._registered):
            self.unregister(address)
