"""The FlatCake node agent and its client library: what a user programs against.

A tour in twenty lines:

- ``EngineConfig`` (with ``DramConfig``, ``SsdConfig``, ``IOConfig``, ...) is the one configuration;
  ``EngineConfig.load(path)`` reads the JSON the operator renders, and every field error is a
  ``ConfigError`` naming the field and the fix.
- ``Engine(config)`` stores and restores KV pages in one process: ``put(keys, kv, Hints(...))`` writes
  ``[layers][pages][page_bytes]`` uint8 pages, each placed once on DRAM or SSD by its reuse scope
  (``Hints``: turn, context, reply lengths, prefix refcount, parent key); ``exists(keys)`` gives the
  stored prefix length; ``get(keys, dest)`` returns a restore that yields layers as they land (use it
  as a context manager, or call ``run()``): SSD pages read as sorted, merged ranges straight into host
  memory (``HostRestore``), or streamed through a bounded staging window into GPU memory (``Restore``).
- ``connect(socket)`` is the same ``Engine`` whose catalog is the node agent: many processes on a node
  share one index and one allocator, and move the bytes themselves. ``spawn`` starts an agent process.
- ``Scheduler`` orders requests by the slowest medium they need (FC-MAS); ``needs_ssd`` is its test.
- ``ChainSignals`` derives a put's ``Hints`` from the key chains a serving engine names (continuations
  make a prefix shared; a write continuing a session's last page is its next turn): the SGLang
  backend's derivation, shared by every benchmark.
- The pure policy behind them, for what-if tools that must run the agent's own decisions
  (``flatcake simulate``): ``decide`` (Table 2 placement, a ``Decision`` with its ``Reason``),
  ``ScopeTable`` (scopes, index, reclaim; ``Location``), ``plan_restore`` (FC-CIO read plans), ``hrrn``;
  ``SharedIndexWriter`` and ``slots_for`` build the agent's shared key index (``bench agent`` sizes it).
- Errors: every failure is a ``FlatCakeError``: ``ConfigError``, ``ProtocolError``, ``CapacityError``
  (``PoolFullError``), ``NotFoundError`` (``UnknownKeyError``), ``StorageIOError``
  (``StorageWriteError``), ``FencedError``, ``PrepareError``.
- ``aligned_empty`` makes 4 KiB-aligned host buffers (O_DIRECT and GDS need them); ``ThreadBuffers`` reuses
  one pre-faulted buffer per thread (restore destinations).

Inside, the folders are the layers (imports point downward only; import-linter checks it):
``policy`` (pure decisions) < ``catalog`` (index, journal, recovery) < ``datapath`` (pools, I/O,
restores, the engine) < ``node`` (node preparation, reports) < ``service`` (the agent, its protocol
and client) < ``sglang`` (the HiCache backend). ``config`` and ``constants`` are the contract the
operator shares.
"""

# The face is lazy: importing the package (the operator does, for ``config`` and ``constants``) loads
# none of the engine, numpy or msgpack; a name is imported from its module on first use (PEP 562).
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flatcake.errors import (
        CapacityError,
        ConfigError,
        FencedError,
        FlatCakeError,
        NotFoundError,
        PoolFullError,
        PrepareError,
        ProtocolError,
        StorageIOError,
        StorageWriteError,
        UnknownHandleError,
        UnknownKeyError,
    )
    from flatcake.node_agent.catalog.local import LocalCatalog
    from flatcake.node_agent.catalog.shared_index import SharedIndexWriter
    from flatcake.node_agent.config import (
        AgentConfig,
        DramConfig,
        EngineConfig,
        IOConfig,
        PlacementConfig,
        SsdConfig,
    )
    from flatcake.node_agent.datapath.buffers import ThreadBuffers, aligned_empty, round_up
    from flatcake.node_agent.datapath.engine import Engine, PutResult, local_table
    from flatcake.node_agent.datapath.file_pool import create_pool, open_direct
    from flatcake.node_agent.datapath.host_restore import HostRestore
    from flatcake.node_agent.datapath.io_backends import IOBackend, PosixDirectIO
    from flatcake.node_agent.datapath.restore import Restore
    from flatcake.node_agent.policy.coalesce import plan_restore
    from flatcake.node_agent.policy.gva import SSD_THRESHOLD, Medium, needs_ssd
    from flatcake.node_agent.policy.keyindex import slots_for
    from flatcake.node_agent.policy.placement import Decision, Hints, Key, Reason, decide
    from flatcake.node_agent.policy.scheduler import Request, Scheduler, hrrn
    from flatcake.node_agent.policy.scopes import Location, ScopeTable
    from flatcake.node_agent.policy.signals import ChainSignals
    from flatcake.node_agent.service import protocol
    from flatcake.node_agent.service.client import AgentConnection, RemoteCatalog, connect, open_index
    from flatcake.node_agent.service.main import spawn

_EXPORTS = {
    "AgentConfig": "flatcake.node_agent.config",
    "AgentConnection": "flatcake.node_agent.service.client",
    "aligned_empty": "flatcake.node_agent.datapath.buffers",
    "CapacityError": "flatcake.errors",
    "ChainSignals": "flatcake.node_agent.policy.signals",
    "ConfigError": "flatcake.errors",
    "connect": "flatcake.node_agent.service.client",
    "create_pool": "flatcake.node_agent.datapath.file_pool",
    "decide": "flatcake.node_agent.policy.placement",
    "Decision": "flatcake.node_agent.policy.placement",
    "DramConfig": "flatcake.node_agent.config",
    "Engine": "flatcake.node_agent.datapath.engine",
    "EngineConfig": "flatcake.node_agent.config",
    "FencedError": "flatcake.errors",
    "FlatCakeError": "flatcake.errors",
    "Hints": "flatcake.node_agent.policy.placement",
    "HostRestore": "flatcake.node_agent.datapath.host_restore",
    "hrrn": "flatcake.node_agent.policy.scheduler",
    "IOBackend": "flatcake.node_agent.datapath.io_backends",
    "IOConfig": "flatcake.node_agent.config",
    "Key": "flatcake.node_agent.policy.placement",
    "local_table": "flatcake.node_agent.datapath.engine",
    "LocalCatalog": "flatcake.node_agent.catalog.local",
    "Location": "flatcake.node_agent.policy.scopes",
    "Medium": "flatcake.node_agent.policy.gva",
    "needs_ssd": "flatcake.node_agent.policy.gva",
    "NotFoundError": "flatcake.errors",
    "open_direct": "flatcake.node_agent.datapath.file_pool",
    "open_index": "flatcake.node_agent.service.client",
    "PlacementConfig": "flatcake.node_agent.config",
    "plan_restore": "flatcake.node_agent.policy.coalesce",
    "PoolFullError": "flatcake.errors",
    "PosixDirectIO": "flatcake.node_agent.datapath.io_backends",
    "PrepareError": "flatcake.errors",
    "protocol": "flatcake.node_agent.service",
    "ProtocolError": "flatcake.errors",
    "PutResult": "flatcake.node_agent.datapath.engine",
    "Reason": "flatcake.node_agent.policy.placement",
    "RemoteCatalog": "flatcake.node_agent.service.client",
    "Request": "flatcake.node_agent.policy.scheduler",
    "Restore": "flatcake.node_agent.datapath.restore",
    "round_up": "flatcake.node_agent.datapath.buffers",
    "Scheduler": "flatcake.node_agent.policy.scheduler",
    "ScopeTable": "flatcake.node_agent.policy.scopes",
    "SharedIndexWriter": "flatcake.node_agent.catalog.shared_index",
    "slots_for": "flatcake.node_agent.policy.keyindex",
    "spawn": "flatcake.node_agent.service.main",
    "SSD_THRESHOLD": "flatcake.node_agent.policy.gva",
    "SsdConfig": "flatcake.node_agent.config",
    "StorageIOError": "flatcake.errors",
    "StorageWriteError": "flatcake.errors",
    "ThreadBuffers": "flatcake.node_agent.datapath.buffers",
    "UnknownHandleError": "flatcake.errors",
    "UnknownKeyError": "flatcake.errors",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    owner = importlib.import_module(module)
    # A submodule (``protocol``) is an attribute of its package only once imported.
    value = getattr(owner, name) if hasattr(owner, name) else importlib.import_module(f"{module}.{name}")
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "SSD_THRESHOLD",
    "AgentConfig",
    "AgentConnection",
    "CapacityError",
    "ChainSignals",
    "ConfigError",
    "Decision",
    "DramConfig",
    "Engine",
    "EngineConfig",
    "FencedError",
    "FlatCakeError",
    "Hints",
    "HostRestore",
    "IOBackend",
    "IOConfig",
    "Key",
    "LocalCatalog",
    "Location",
    "Medium",
    "NotFoundError",
    "PlacementConfig",
    "PoolFullError",
    "PosixDirectIO",
    "PrepareError",
    "ProtocolError",
    "PutResult",
    "Reason",
    "RemoteCatalog",
    "Request",
    "Restore",
    "Scheduler",
    "ScopeTable",
    "SharedIndexWriter",
    "SsdConfig",
    "StorageIOError",
    "StorageWriteError",
    "ThreadBuffers",
    "UnknownHandleError",
    "UnknownKeyError",
    "aligned_empty",
    "connect",
    "create_pool",
    "decide",
    "hrrn",
    "local_table",
    "needs_ssd",
    "open_direct",
    "open_index",
    "plan_restore",
    "protocol",
    "round_up",
    "slots_for",
    "spawn",
]
