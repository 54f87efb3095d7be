"""The client library: an ``Engine`` whose catalog is the node agent.

``connect(socket)`` registers with the agent, maps its DRAM pool, opens the pool files itself and
returns an ``Engine``: ``put`` / ``exists`` / ``get`` work as in-process, with FC-CIO restores run
locally. One client per process; it is thread-safe (calls on the socket are serialised).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from flatcake.errors import by_code
from flatcake.node_agent.catalog.interface import Allocation, Lease
from flatcake.node_agent.catalog.shared_index import SharedIndexReader
from flatcake.node_agent.config import EngineConfig, host_port
from flatcake.node_agent.constants import CLIENT_ID_ENV
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.io_backends import IOBackend
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints, Key
from flatcake.node_agent.policy.scope import Location, Segment
from flatcake.node_agent.service import protocol as P

log = logging.getLogger(__name__)


class AgentConnection:
    """One control connection, thread-safe (calls are serialised). A connection the agent dropped (it
    restarted, or was killed) is made again on the next call, registering as before, so a long-lived
    client (an inference server) serves hits again once the agent is back: the call that met the break
    fails with ConnectionError (its caller's miss), later ones go to the new agent. A new agent whose
    configuration differs from the one first registered with is refused (the pools this client mapped
    would not be its)."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = self._open()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._register: dict[str, Any] | None = None  # the first register's arguments and configuration
        self.client_id = os.environ.get(CLIENT_ID_ENV, "")  # who this pod says it is (register's ``client``)
        self._config: dict[str, Any] | None = None
        self.reconnects = 0

    def _open(self) -> socket.socket:
        """A Unix socket (this node's agent), or TCP for ``host:port`` (another node's, cluster.listen)."""
        tcp = host_port(self.path) if not self.path.startswith("/") else None
        sock = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(tcp or self.path)
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"cannot reach the flatcake agent at {self.path}: {exc.strerror or exc}") from None
        if tcp:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/reply frames
        return sock

    def call(self, op: str, **args: Any) -> Any:
        """One request and its reply's result; a ``FlatCakeError`` of the reply's kind when the agent refused it."""
        with self._lock:
            sock = self._sock if self._sock is not None else self._reopen()
            try:
                reply = self._exchange(sock, op, args)
            except OSError as exc:  # reset, broken pipe, closed, timed out: the stream is lost either way
                self._drop()
                raise ConnectionError(f"the flatcake agent at {self.path} went away during {op!r}: {exc}") from None
        if reply.get("ok"):
            result = reply.get("result")
            if op == "register" and self._register is None:
                self._register, self._config = dict(args), (result or {}).get("config")
            return result
        err = reply.get("error", {})
        code, message = err.get("code", P.INTERNAL), err.get("message", "")
        raise _error(code, message)

    def _exchange(self, sock: socket.socket, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "register" and self.client_id and "client" not in args:
            args = {**args, "client": self.client_id}
        try:
            sock.sendall(P.pack(P.request(next(self._ids), op, args)))
        except (BrokenPipeError, ConnectionResetError):
            # The agent may have refused the connection (busy) and closed it before this request came: its
            # reason is waiting to be read, and says more than a broken pipe.
            try:
                return P.unpack(self._recv_frame(sock))
            except (OSError, ValueError):
                pass
            raise
        return P.unpack(self._recv_frame(sock))

    def _reopen(self) -> socket.socket:
        """A new connection, registered as the first one was (under the lock)."""
        sock = self._open()
        if self._register is not None:
            try:
                reply = self._exchange(sock, "register", self._register)
            except OSError as exc:
                sock.close()
                raise ConnectionError(f"the flatcake agent at {self.path} went away while registering: {exc}") from None
            config = (reply.get("result") or {}).get("config") if reply.get("ok") else None
            if config != self._config:
                sock.close()
                why = reply.get("error", {}).get("message") or "its configuration differs from the one registered with"
                raise ConnectionError(f"the flatcake agent at {self.path} restarted and cannot be used: {why}")
        self._sock = sock
        self.reconnects += 1
        log.info("reconnected to the flatcake agent at %s (%d reconnects)", self.path, self.reconnects)
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _recv_frame(self, sock: socket.socket) -> bytes:
        (length,) = P.HEADER.unpack(self._recv(sock, P.HEADER.size))
        return self._recv(sock, length)

    def _recv(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError(f"the flatcake agent at {self.path} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        """Close the connection: the agent aborts its unpublished allocations and releases its leases."""
        with self._lock:
            self._drop()


def _error(code: str, message: str) -> Exception:
    """The exception an error reply stands for: its FlatCakeError class by wire code; ``bad_args`` as
    the ``ValueError`` the agent's argument check raised; other protocol codes as a ``ProtocolError``."""
    if code == P.BAD_ARGS:
        return ValueError(message)
    cls = by_code(code)
    return cls(message) if cls is not None else P.ProtocolError(code, f"agent: {code}: {message}")


class RemoteCatalog:
    """The ``Catalog`` calls, answered by the agent. Data-path counters ride along with ``release``.

    ``exists`` and ``lookup`` read the agent's shared index when it offers one (no round trip, no
    queueing behind other clients on the agent's one thread) and ask the agent when the index cannot
    answer. Reading bytes still takes a lease from the agent (``acquire``), which re-checks every key
    under the catalog's lock, so a reclaim racing a lookup can never hand out freed space."""

    def __init__(
        self, conn: AgentConnection, stats: Stats | None = None, index: SharedIndexReader | None = None
    ) -> None:
        self.conn = conn
        self.stats = stats
        self.index = index
        self._reported: dict[str, int] = {}
        self._epochs: dict[int, int] = {}  # open allocation -> the agent epoch it was made in

    def allocate(self, keys: Sequence[Key], hints: Hints) -> Allocation | None:
        r = self.conn.call("allocate", keys=list(keys), hints=asdict(hints))
        if r is None:
            return None
        epoch = int(r.get("epoch", 0))
        self._epochs[r["id"]] = epoch
        segments = [Segment(*s) for s in r["segments"]]
        return Allocation(r["id"], r["index"], Medium(r["medium"]), r["reason"], segments, r["slots"], epoch,
                          list(r.get("copies", [])))  # fmt: skip

    def publish(self, alloc_id: int, checksums: Sequence[int]) -> None:
        epoch = self._epochs.pop(alloc_id, 0)
        self.conn.call("publish", id=alloc_id, crc=list(checksums), **({"epoch": epoch} if epoch else {}))

    def abort(self, alloc_id: int) -> None:
        self._epochs.pop(alloc_id, None)
        self.conn.call("abort", id=alloc_id)

    def exists(self, keys: Sequence[Key]) -> int:
        hit = self.index.hit_prefix(keys) if self.index is not None else None
        self._count(hit is not None)
        return hit if hit is not None else int(self.conn.call("exists", keys=list(keys)))

    def lookup(self, keys: Sequence[Key]) -> tuple[int, list[int], list[int]]:
        """The stored prefix of ``keys``: its length, and each page's GVA and layer stride (as the
        agent's ``lookup`` op answers). Locations are for planning; ``acquire`` before reading."""
        found = self.index.find(keys) if self.index is not None else None
        self._count(found is not None)
        if found is None:
            r = self.conn.call("lookup", keys=list(keys))
            return int(r["hit"]), list(r["gva"]), list(r["stride"])
        hit, gva, stride = found
        miss = np.flatnonzero(~hit)
        n = int(miss[0]) if miss.size else len(keys)
        return n, gva[:n].tolist(), stride[:n].tolist()

    def _count(self, shared: bool) -> None:
        if self.stats is not None:
            self.stats.add("index_lookups_shared" if shared else "index_lookups_agent")

    def acquire(self, keys: Sequence[Key], copy: bool = False) -> Lease:
        r = self.conn.call("acquire", keys=list(keys), **({"copy": True} if copy else {}))
        locs = [Location(*x) for x in zip(r["scope"], r["gva"], r["stride"], strict=True)]
        return Lease(r["id"], locs, list(r.get("crc", [])), bool(r.get("verify", False)), int(r.get("epoch", 0)),
                     list(r.get("copies", [])))  # fmt: skip

    def release(self, lease_id: int, copied: Sequence[int] | None = None, damaged: Sequence[int] | None = None) -> None:
        extra: dict[str, list[int]] = {"copied": list(copied)} if copied is not None else {}
        if damaged:
            extra["damaged"] = [int(i) for i in damaged]
        self.conn.call("release", id=lease_id, stats=self._delta(), **extra)

    def _delta(self) -> dict[str, int]:
        if self.stats is None:
            return {}
        now = self.stats.snapshot()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if k != "staging_peak_bytes"}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    def close(self) -> None:
        self.conn.close()


def open_index(path: str) -> SharedIndexReader | None:
    """The agent's shared index, or None (then every lookup asks the agent): an agent without one,
    or a file this process cannot map (another mount namespace, no permission) is not an error."""
    if not path:
        return None
    try:
        return SharedIndexReader(path)
    except (OSError, ValueError) as exc:
        log.warning("shared index %s: not usable here (%s); lookups go to the agent", path, exc)
        return None


def connect(
    socket_path: str, *, io: IOBackend | None = None, layers: int | None = None, page_bytes: int | None = None
) -> Engine:
    """An engine on this node's agent. ``layers``/``page_bytes`` are checked against the agent's pool."""
    conn = AgentConnection(socket_path)
    try:
        expect = {k: v for k, v in (("layers", layers), ("page_bytes", page_bytes)) if v is not None}
        info = conn.call("register", **expect)
        config = EngineConfig.from_dict(info["config"])
        catalog = RemoteCatalog(conn, index=open_index(info.get("index_path") or ""))
        engine = Engine(config, io=io, catalog=catalog, dram_path=info["dram_path"])
    except BaseException:
        conn.close()
        raise
    catalog.stats = engine.stats
    return engine
