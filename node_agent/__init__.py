"""The FlatCake node agent and its client library: what a user programs against.

A tour:

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
- ``Cluster(engine)`` adds the other nodes' agents (``cluster.peers``): ``exists`` and ``restore`` go on
  where the local prefix ends, reading a peer's DRAM and staged SSD pages over Mooncake's transfer engine.
- ``ChainSignals`` derives a put's ``Hints`` from the key chains a serving engine names (continuations
  make a prefix shared; a write continuing a session's last page is its next turn): the SGLang
  backend's derivation, shared by every benchmark.
- ``geometry`` (a module) works out a model's ``layers`` and ``page_bytes`` from its ``config.json``.
- Errors: every failure is a ``FlatCakeError``: ``ConfigError``, ``ProtocolError``, ``CapacityError``
  (``PoolFullError``), ``NotFoundError`` (``UnknownKeyError``), ``StorageIOError``
  (``StorageWriteError``), ``FencedError``, ``PrepareError``.
- ``aligned_empty`` makes 4 KiB-aligned host buffers (O_DIRECT and GDS need them); ``ThreadBuffers`` reuses
  one pre-faulted buffer per thread (restore destinations).

Nothing else is on the face. Benchmarks and the simulator, which run the agent's own decisions
(placement, FC-MAS, read plans, the scope table), import those by module path, each allowed by name
in the load generator's import contract (pyproject.toml).

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

if TYPE_CHECKING:  # the same names from the same modules as _EXPORTS (tests/operator/test_import_weight.py)
    from flatcake.errors import CapacityError as CapacityError
    from flatcake.errors import ConfigError as ConfigError
    from flatcake.errors import FencedError as FencedError
    from flatcake.errors import FlatCakeError as FlatCakeError
    from flatcake.errors import NotFoundError as NotFoundError
    from flatcake.errors import PoolFullError as PoolFullError
    from flatcake.errors import PrepareError as PrepareError
    from flatcake.errors import ProtocolError as ProtocolError
    from flatcake.errors import StorageIOError as StorageIOError
    from flatcake.errors import StorageWriteError as StorageWriteError
    from flatcake.errors import UnknownHandleError as UnknownHandleError
    from flatcake.errors import UnknownKeyError as UnknownKeyError
    from flatcake.node_agent.config import AgentConfig as AgentConfig
    from flatcake.node_agent.config import DramConfig as DramConfig
    from flatcake.node_agent.config import EngineConfig as EngineConfig
    from flatcake.node_agent.config import IOConfig as IOConfig
    from flatcake.node_agent.config import PlacementConfig as PlacementConfig
    from flatcake.node_agent.config import SsdConfig as SsdConfig
    from flatcake.node_agent.datapath.buffers import ThreadBuffers as ThreadBuffers
    from flatcake.node_agent.datapath.buffers import aligned_empty as aligned_empty
    from flatcake.node_agent.datapath.engine import Engine as Engine
    from flatcake.node_agent.datapath.engine import PutResult as PutResult
    from flatcake.node_agent.datapath.host_restore import HostRestore as HostRestore
    from flatcake.node_agent.datapath.restore import Restore as Restore
    from flatcake.node_agent.policy.placement import Hints as Hints
    from flatcake.node_agent.policy.placement import Key as Key
    from flatcake.node_agent.policy.signals import ChainSignals as ChainSignals
    from flatcake.node_agent.service.client import AgentConnection as AgentConnection
    from flatcake.node_agent.service.client import connect as connect
    from flatcake.node_agent.service.cluster import Cluster as Cluster
    from flatcake.node_agent.service.main import spawn as spawn

_EXPORTS = {
    "AgentConfig": "flatcake.node_agent.config",
    "AgentConnection": "flatcake.node_agent.service.client",
    "aligned_empty": "flatcake.node_agent.datapath.buffers",
    "CapacityError": "flatcake.errors",
    "ChainSignals": "flatcake.node_agent.policy.signals",
    "Cluster": "flatcake.node_agent.service.cluster",
    "ConfigError": "flatcake.errors",
    "connect": "flatcake.node_agent.service.client",
    "DramConfig": "flatcake.node_agent.config",
    "Engine": "flatcake.node_agent.datapath.engine",
    "EngineConfig": "flatcake.node_agent.config",
    "FencedError": "flatcake.errors",
    "FlatCakeError": "flatcake.errors",
    "Hints": "flatcake.node_agent.policy.placement",
    "HostRestore": "flatcake.node_agent.datapath.host_restore",
    "IOConfig": "flatcake.node_agent.config",
    "Key": "flatcake.node_agent.policy.placement",
    "NotFoundError": "flatcake.errors",
    "PlacementConfig": "flatcake.node_agent.config",
    "PoolFullError": "flatcake.errors",
    "PrepareError": "flatcake.errors",
    "ProtocolError": "flatcake.errors",
    "PutResult": "flatcake.node_agent.datapath.engine",
    "Restore": "flatcake.node_agent.datapath.restore",
    "spawn": "flatcake.node_agent.service.main",
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


__all__ = sorted(_EXPORTS)  # the face: _EXPORTS is its one list
