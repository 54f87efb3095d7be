"""The node agent: one catalog per node, shared by every inference process on it.

The agent owns the metadata (index, allocation, scopes, reclaim, journal) and serves it on a Unix
socket; clients map the DRAM pool and open the pool files themselves, so KV bytes never pass through
the agent. A client's unpublished allocations and pins belong to its connection: when the connection
drops (the process exited or was killed) they are aborted and released.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from flatcake import metrics as M
from flatcake.node_agent import gva as G
from flatcake.node_agent import protocol as P
from flatcake.node_agent.catalog import (
    LocalCatalog,
    Recovered,
    UnknownHandleError,
    UnknownKeyError,
    recover,
)
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.dram_pool import DramPool, PoolFullError
from flatcake.node_agent.engine import local_table
from flatcake.node_agent.file_pool import create_pool
from flatcake.node_agent.gva import Medium
from flatcake.node_agent.journal import Journal
from flatcake.node_agent.placement import Hints
from flatcake.node_agent.scopes import Location

log = logging.getLogger(__name__)

JOURNAL = "journal.log"


@dataclass(eq=False)
class Session:
    id: int
    registered: bool = False
    allocs: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)


class Agent:
    def __init__(self, config: EngineConfig) -> None:
        c = self.config = config
        self.ready = False
        self.pool = create_pool(c.ssd.dir, c.ssd.file_count, c.ssd.file_bytes, extent_policy=c.ssd.extent_policy)
        self._paths = [Path(c.ssd.dir) / name for name in self.pool.files]
        # The pool file is reused when it exists: DRAM pages survive an agent restart (not a reboot).
        self.dram = DramPool(
            c.layers * c.page_bytes, c.dram_slots, name=c.dram.name, want_huge_pages=c.dram.huge_pages,
            shm_dir=c.dram.shm_dir, hugetlbfs_dir=c.dram.hugetlbfs_dir,
        )  # fmt: skip
        self.catalog = LocalCatalog(local_table(c), c.placement)
        journal_path = Path(c.ssd.dir) / JOURNAL
        started = time.monotonic()
        self.recovered: Recovered = recover(
            self.catalog, journal_path, self._page_crc if c.agent.verify_on_recovery else None
        )
        self.journal = Journal(journal_path, c.agent.journal_fsync, c.agent.journal_fsync_ms)
        self.journal.rewrite(self.catalog.snapshot_records())  # compact: live state only
        self.catalog.journal = self.journal
        log.info(
            "recovered %d pages in %d scopes from %d journal records (%d dropped) in %.2fs",
            self.recovered.pages, self.recovered.scopes, self.recovered.records, self.recovered.dropped_pages,
            time.monotonic() - started,
        )  # fmt: skip
        self.client_stats: Counter[str] = Counter()  # data-path counters reported by clients
        self.sessions: dict[int, Session] = {}
        self._next_session = 0
        self.registry = CollectorRegistry()
        self.registry.register(_AgentCollector(self))
        self.latency = M.histogram("flatcake_agent_request_seconds", self.registry)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()
        self._http: WSGIServer | None = None
        self.metrics_port = c.agent.metrics_port

    # ---- recovery --------------------------------------------------------------------------------
    def _page_crc(self, loc: Location) -> int:
        c = self.config
        medium, _, offset = G.decode(loc.gva)
        crc = 0
        if medium is Medium.DRAM:
            for layer in range(c.layers):
                at = offset + layer * loc.layer_stride
                crc = zlib.crc32(self.dram.view[at : at + c.page_bytes].data, crc)
            return crc
        file, at = divmod(offset, c.ssd.file_bytes)
        with open(self._paths[file], "rb", buffering=0) as f:
            for layer in range(c.layers):
                crc = zlib.crc32(os.pread(f.fileno(), c.page_bytes, at + layer * loc.layer_stride), crc)
        return crc

    # ---- control protocol ------------------------------------------------------------------------
    def dispatch(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        if op == "register":
            return self._register(session, args)
        if not session.registered:
            raise P.ProtocolError(P.NOT_REGISTERED, f"{op}: register first (send op 'register')")
        cat = self.catalog
        if op == "exists":
            return cat.exists(P.keys_arg(args))
        if op == "lookup":
            found = cat.table.lookup_many(P.keys_arg(args))
            hit = found.index(None) if None in found else len(found)
            return {"hit": hit, **_columns(cast(list[Location], found[:hit]), gva=1, stride=2)}
        if op == "allocate":
            hints = args.get("hints", {})
            if not isinstance(hints, dict):
                raise P.ProtocolError(P.BAD_ARGS, "hints: must be a map")
            alloc = cat.allocate(P.keys_arg(args), Hints.from_dict(hints))
            if alloc is None:
                return None
            session.allocs.add(alloc.id)
            return {
                "id": alloc.id, "index": alloc.index, "medium": int(alloc.medium), "reason": alloc.reason,
                "segments": [[s.file, s.offset, s.first_page, s.pages] for s in alloc.segments], "slots": alloc.slots,
            }  # fmt: skip
        if op == "publish":
            alloc_id = self._owned(session.allocs, P.int_arg(args, "id"), "allocation")
            crc = args.get("crc")
            if not isinstance(crc, list) or not all(isinstance(x, int) for x in crc):
                raise P.ProtocolError(P.BAD_ARGS, "crc: must be a list of integers, one per page")
            session.allocs.discard(alloc_id)
            cat.publish(alloc_id, crc)
            return None
        if op == "abort":
            alloc_id = self._owned(session.allocs, P.int_arg(args, "id"), "allocation")
            session.allocs.discard(alloc_id)
            cat.abort(alloc_id)
            return None
        if op == "acquire":
            lease = cat.acquire(P.keys_arg(args))
            session.leases.add(lease.id)
            return {"id": lease.id, **_columns(lease.locations, scope=0, gva=1, stride=2)}
        if op == "release":
            lease_id = self._owned(session.leases, P.int_arg(args, "id"), "lease")
            self._merge_stats(args.get("stats", {}))
            session.leases.discard(lease_id)
            cat.release(lease_id)
            return None
        if op == "report":
            self._merge_stats(args.get("stats", {}))
            return None
        if op == "stats":
            return self.snapshot()
        raise P.ProtocolError(P.UNKNOWN_OP, f"op: {op!r} is not one of {', '.join(sorted(_OPS))}")

    def _register(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        for name in ("layers", "page_bytes"):
            if name in args and args[name] != getattr(c, name):
                raise P.ProtocolError(
                    P.BAD_ARGS, f"{name}: the client's model has {args[name]}, this agent's pool {getattr(c, name)}; "
                    "run one agent (cache) per model geometry",
                )  # fmt: skip
        session.registered = True
        return {"config": c.to_dict(), "dram_path": self.dram.info.path, "session": session.id}

    @staticmethod
    def _owned(held: set[int], handle: int, what: str) -> int:
        if handle not in held:
            raise UnknownHandleError(f"id: {what} {handle} is not held by this connection")
        return handle

    def _merge_stats(self, stats: Any) -> None:
        if not isinstance(stats, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in stats.items()):
            raise P.ProtocolError(P.BAD_ARGS, "stats: must be a map of counter name to integer")
        self.client_stats.update(stats)

    def service_seconds(self) -> dict[str, tuple[float, float]]:
        """Per op: (count, total seconds) of service time, from the request histogram."""
        out: dict[str, tuple[float, float]] = {}
        for metric in self.registry.collect():
            if metric.name != "flatcake_agent_request_seconds":
                continue
            for sample in metric.samples:
                op = sample.labels.get("op", "")
                count, total = out.get(op, (0.0, 0.0))
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
                out[op] = (count, total)
        return out

    def snapshot(self) -> dict[str, Any]:
        allocs, leases = self.catalog.handles()
        return {
            "usage": self.catalog.table.usage(), "placements": self.catalog.placements.snapshot(),
            "clients": len(self.sessions), "open_allocations": allocs, "leases": leases,
            "recovered": asdict(self.recovered), "client_stats": dict(self.client_stats),
            "journal_records": self.journal.records, "service_seconds": self.service_seconds(),
        }  # fmt: skip

    def handle_frame(self, session: Session, body: bytes) -> tuple[str, dict[str, Any]]:
        """The reply to one request frame, and the op it was (for metrics); never raises."""
        req_id, op = 0, "?"
        try:
            req_id, op, args = P.check_request(P.unpack(body))
            result = self.dispatch(session, op, args)
            reply = P.ok(req_id, result)
        except P.ProtocolError as exc:
            reply = P.error(req_id, exc.code, str(exc))
        except UnknownKeyError as exc:
            reply = P.error(req_id, P.UNKNOWN_KEY, str(exc))
        except UnknownHandleError as exc:
            reply = P.error(req_id, P.UNKNOWN_HANDLE, str(exc))
        except PoolFullError as exc:
            reply = P.error(req_id, P.POOL_FULL, str(exc))
        except (ValueError, TypeError) as exc:
            reply = P.error(req_id, P.BAD_ARGS, str(exc))
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("op %s failed", op)
            reply = P.error(req_id, P.INTERNAL, f"{exc.__class__.__name__}: {exc}")
        op = op if op in _OPS else "other"
        self.requests[op] += 1
        if not reply["ok"]:
            self.errors[(op, reply["error"]["code"])] += 1
        return op, reply

    def drop(self, session: Session) -> None:
        """The client is gone: abort what it never published, release what it pinned."""
        for alloc_id in list(session.allocs):
            with contextlib.suppress(UnknownHandleError):
                self.catalog.abort(alloc_id)
        for lease_id in list(session.leases):
            with contextlib.suppress(UnknownHandleError):
                self.catalog.release(lease_id)
        if session.allocs or session.leases:
            log.info("client %d left: aborted %d allocations, released %d leases",
                     session.id, len(session.allocs), len(session.leases))  # fmt: skip
        session.allocs.clear()
        session.leases.clear()
        self.sessions.pop(session.id, None)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._next_session += 1
        session = self.sessions[self._next_session] = Session(self._next_session)
        try:
            while True:
                try:
                    header = await reader.readexactly(P.HEADER.size)
                except asyncio.IncompleteReadError:
                    break
                (length,) = P.HEADER.unpack(header)
                if length > P.MAX_FRAME:
                    # Skip the body to stay in step with the stream, then say why it was refused.
                    remaining = length
                    while remaining:
                        chunk = await reader.read(min(remaining, 1 << 20))
                        if not chunk:
                            break
                        remaining -= len(chunk)
                    self.errors[("other", P.OVERSIZED)] += 1
                    reply = P.error(0, P.OVERSIZED, f"frame of {length} bytes exceeds {P.MAX_FRAME}; send fewer keys")
                    writer.write(P.pack(reply))
                else:
                    body = await reader.readexactly(length)
                    started = time.perf_counter()
                    op, reply = self.handle_frame(session, body)
                    writer.write(P.pack(reply))
                    # Service time: decode, work, encode (the socket and queueing are the client's view).
                    self.latency.labels(op).observe(time.perf_counter() - started)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.drop(session)
            writer.close()

    # ---- process lifecycle -----------------------------------------------------------------------
    def start_http(self) -> int:
        app = _wsgi_app(self)
        self._http = make_server(self.config.agent.metrics_host, self.metrics_port, app, handler_class=_QuietHandler)
        self.metrics_port = self._http.server_port
        threading.Thread(target=self._http.serve_forever, daemon=True, name="flatcake-http").start()
        return self.metrics_port

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        path = Path(self.config.agent.socket)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a stale socket of a previous (killed) agent
        server = await asyncio.start_unix_server(self._serve_connection, path=str(path))
        os.chmod(path, 0o660)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError, ValueError):  # not the main thread (tests)
                loop.add_signal_handler(sig, stop.set)
        self.ready = True
        log.info("serving %s; metrics on port %d", path, self.metrics_port)
        async with server:
            await stop.wait()
        self.ready = False

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.journal.close()
        self.dram.close(unlink=False)  # the pool outlives the agent process


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _columns(rows: Sequence[Location], **fields: int) -> dict[str, list[int]]:
    """Columns of Location tuples (``itemgetter`` keeps the per-row cost in C; ``zip(*rows)`` does not)."""
    return {name: list(map(operator.itemgetter(i), rows)) for name, i in fields.items()}


_OPS = {"register", "exists", "lookup", "allocate", "publish", "abort", "acquire", "release", "report", "stats"}


def _wsgi_app(agent: Agent) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            body = generate_latest(agent.registry)
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
            return [body]
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            status = "200 OK" if agent.ready else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ready\n" if agent.ready else b"recovering\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"try /metrics, /healthz or /readyz\n"]

    return app


class _AgentCollector(Collector):
    """Reads the agent's state at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        usage = a.catalog.table.usage()
        allocs, leases = a.catalog.handles()
        yield M.family("flatcake_agent_ready", [((), float(a.ready))])
        yield M.family("flatcake_agent_clients", [((), float(len(a.sessions)))])
        yield M.family("flatcake_agent_open_handles", [(("allocation",), allocs), (("lease",), leases)])
        yield M.family("flatcake_recovered_pages", [((), a.recovered.pages)])
        yield M.family("flatcake_recovery_dropped_pages", [((), a.recovered.dropped_pages)])
        yield M.family("flatcake_agent_requests", [((op,), n) for op, n in a.requests.items()])
        yield M.family("flatcake_agent_request_errors", [((op, code), n) for (op, code), n in a.errors.items()])
        for name, key in (("flatcake_capacity_bytes", "capacity_bytes"), ("flatcake_used_bytes", "used_bytes"),
                          ("flatcake_scopes", "scopes"), ("flatcake_reclaimed_scopes", "reclaimed_scopes"),
                          ("flatcake_reclaimed_bytes", "reclaimed_bytes")):  # fmt: skip
            yield M.family(name, [((medium,), float(u[key])) for medium, u in usage.items()])
        placements = a.catalog.placements.snapshot()
        yield M.family("flatcake_placements", [(tuple(k.split("/")), v) for k, v in placements.items()])
        yield from M.stats_families(dict(a.client_stats))


def spawn(config: EngineConfig, workdir: Path, output: Any = subprocess.DEVNULL, timeout: float = 60) -> Any:
    """Start ``flatcake agent serve`` as its own process (config written to ``workdir/engine.json``)
    and return it once its socket answers."""
    from flatcake.node_agent.client import AgentConnection

    path = workdir / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    exe = Path(sys.executable).parent / "flatcake"
    proc = subprocess.Popen([str(exe), "agent", "serve", "--config", str(path)], cwd=workdir, stdout=output,
                            stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        try:
            AgentConnection(config.agent.socket, timeout=5).close()
            return proc
        except ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the node agent did not start; run `flatcake agent serve` to see why") from None
            time.sleep(0.05)


def run(config: EngineConfig) -> None:
    """``flatcake agent serve``: (in a cluster: wait for this node's NodeID), recover, then serve until
    SIGTERM, reporting a FlatCakeNode when the configuration names a cache."""
    from flatcake.node_agent import node_report as R

    node = R.node_name() if config.cluster.node_ids_dir or config.cluster.cache else ""
    if config.cluster.node_ids_dir:
        config = dataclasses.replace(config, node_id=R.resolve_node_id(config, node))
        log.warning("flatcake agent: node %s has NodeID %d", node, config.node_id)
    agent = Agent(config)
    reporter = None
    try:
        port = agent.start_http()
        log.warning("flatcake agent: socket %s, metrics http://%s:%d/metrics", config.agent.socket,
                    config.agent.metrics_host, port)  # fmt: skip
        if config.cluster.cache:
            from flatcake.kube import Kube

            reporter = R.NodeReporter(config, node, config.node_id, agent.catalog.table.usage,
                                      lambda: agent.ready, Kube.from_environment(R.USER_AGENT))  # fmt: skip
            reporter.start()
        asyncio.run(agent.serve())
    finally:
        if reporter is not None:
            reporter.stop()
            with contextlib.suppress(Exception):
                reporter.report_once(ready=False, force=True)  # the operator sees the node go down at once
        agent.close()
