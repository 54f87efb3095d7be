"""The agent's HTTP endpoints: /metrics (Prometheus, read from the agent's state at scrape time),
/healthz (the process answers) and /readyz (recovery is done and the socket serves)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from flatcake import metrics as M

if TYPE_CHECKING:
    from flatcake.node_agent.service.server import Agent


def start(agent: Agent, host: str, port: int) -> WSGIServer:
    """Serve the endpoints from a daemon thread; ``port`` 0 picks a free one (``server_port``)."""
    server = make_server(host, port, _wsgi_app(agent), handler_class=_QuietHandler)
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
            status = "200 OK" if agent.ready else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ready\n" if agent.ready else b"recovering\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"try /metrics, /healthz or /readyz\n"]

    return app


class AgentCollector(Collector):
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
