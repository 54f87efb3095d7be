"""The agent's HTTP endpoints: /metrics (Prometheus, read from the agent's state at scrape time),
/healthz (the process answers) and /readyz (recovery is done and the socket serves)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from flatcake import metrics as M

if TYPE_CHECKING:
    from flatcake.node_agent.service.server import Agent


class Server(ThreadingMixIn, WSGIServer):
    """One thread per connection, at most ``max_connections`` at once, each closed after ``timeout``
    seconds of silence: a stalled or idle client (a port scan, a half-open scrape) can never hold up
    ``/healthz`` and get the agent killed by its liveness probe, nor pile up threads."""

    daemon_threads = True
    block_on_close = False
    max_connections = 64
    refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()


class _IPv6Server(Server):
    address_family = socket.AF_INET6


def start(agent: Agent, host: str, port: int, timeout: float = 5.0, max_connections: int = 64) -> Server:
    """Serve the endpoints from daemon threads; ``port`` 0 picks a free one (``server_port``)."""

    class Handler(_QuietHandler):
        pass

    Handler.timeout = timeout  # StreamRequestHandler applies it to the connection's socket
    server_class = type(
        "AgentHTTPServer", (_IPv6Server if ":" in host else Server,), {"max_connections": max_connections}
    )
    server: Server = make_server(host, port, _wsgi_app(agent), server_class=server_class, handler_class=Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="flatcake-http").start()
    return server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


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
            status = "200 OK" if agent.ready and not agent.fenced() else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [_readiness(agent).encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"try /metrics, /healthz or /readyz\n"]

    return app


def _readiness(agent: Agent) -> str:
    r = agent.recovered
    now = agent.fenced()
    if now:
        return (f"fenced: the pool's epoch is {now}, this agent's {agent.epoch}: another agent has taken the pool, "
                "this one's leases and allocations are refused; stop it\n")  # fmt: skip
    if agent.ready:
        if r.scan_done:
            return "ready\n"
        return f"ready; checking recovered pages in the background: {r.verified_pages} of {r.scan_pages}\n"
    if r.done:
        return "recovered; starting the socket\n"
    if r.total_pages:
        return f"recovering: {r.verified_pages} of {r.total_pages} pages checked, {r.records} journal records read\n"
    return f"recovering: reading the journal, {r.records} records so far\n"


class AgentCollector(Collector):
    """Reads the agent's state at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        usage = a.catalog.table.usage()
        allocs, leases = a.catalog.handles()
        yield M.family("flatcake_agent_ready", [((), float(a.ready and not a.fenced()))])
        yield M.family("flatcake_agent_clients", [((), float(len(a.sessions)))])
        yield M.family("flatcake_agent_open_handles", [(("allocation",), allocs), (("lease",), leases)])
        yield M.family("flatcake_recovered_pages", [((), a.recovered.pages)])
        yield M.family("flatcake_recovery_dropped_pages", [((), a.recovered.dropped_pages)])
        yield M.family("flatcake_recovery_superseded_pages", [((), a.recovered.superseded_pages)])
        yield M.family("flatcake_recovery_skipped_records", [((), a.recovered.skipped_records)])
        yield M.family("flatcake_recovery_checked_pages", [((), a.recovered.verified_pages)])
        pending = 0 if a.recovered.scan_done else max(0, a.recovered.scan_pages - a.recovered.verified_pages)
        yield M.family("flatcake_recovery_unchecked_pages", [((), pending)])
        recheck = a.rechecker.stats()
        yield M.family("flatcake_recheck_pages", [(("dropped",), recheck["dropped_pages"]),
                                                  (("passed",), recheck["passed_pages"])])  # fmt: skip
        yield M.family("flatcake_agent_epoch", [((), a.epoch)])
        index = a.catalog.index.stats() if a.catalog.index is not None else None
        if index is not None:
            free = index["slots"] - index["entries"] - index["tombstones"]
            slots = [(("live",), index["entries"]), (("deleted",), index["tombstones"]), (("free",), free)]
            yield M.family("flatcake_shared_index_slots", slots)
            yield M.family("flatcake_shared_index_rebuilds", [((), index["rebuilds"])])
        yield M.family("flatcake_journal_errors", [((kind,), n) for kind, n in a.journal_errors().items()])
        yield M.family("flatcake_journal_bytes", [((), a.journal.size if a.journal else 0)])
        yield M.family("flatcake_journal_compactions", [((), a.journal.compactions if a.journal else 0)])
        dropped = {reason: 0 for reason in M.DROP_REASONS} | dict(a.dropped)
        dropped["http_busy"] = a.http_server.refused if a.http_server is not None else 0
        yield M.family("flatcake_agent_dropped_connections", [((k,), n) for k, n in dropped.items()])
        yield M.family("flatcake_agent_requests", [((op,), n) for op, n in a.requests.items()])
        yield M.family("flatcake_agent_request_errors", [((op, code), n) for (op, code), n in a.errors.items()])
        for name, key in (("flatcake_capacity_bytes", "capacity_bytes"), ("flatcake_used_bytes", "used_bytes"),
                          ("flatcake_scopes", "scopes"), ("flatcake_reclaimed_scopes", "reclaimed_scopes"),
                          ("flatcake_reclaimed_bytes", "reclaimed_bytes")):  # fmt: skip
            yield M.family(name, [((medium,), float(u[key])) for medium, u in usage.items()])
        placements = a.catalog.placements.snapshot()
        yield M.family("flatcake_placements", [(tuple(k.split("/")), v) for k, v in placements.items()])
        yield M.family("flatcake_copy_pages_held", [((), float(usage["dram"]["copy_pages"]))])
        copies = a.catalog.table.copy_stats.snapshot()
        yield M.family("flatcake_copy_pages", [((event,), float(n)) for event, n in copies.items()])
        yield from M.stats_families(dict(a.client_stats))
