"""``flatcake agent``: the node agent (prepare, serve, reclaim)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from flatcake.cli.common import _address
from flatcake.errors import ConfigError

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _agent_prepare(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.node import prepare as P

    config = EngineConfig.load(args.config)
    steps = P.plan(config, P.probe(config))
    if args.dry_run:
        for step in steps:
            print(step.describe())
        return 0
    P.apply(config, steps, log=lambda m: print(m, file=sys.stderr))
    return 0


def _agent_reclaim(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.node import prepare as P

    P.reclaim(EngineConfig.load(args.config), log=lambda m: print(m, file=sys.stderr))
    return 0


def _agent_serve(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.service import main as agent

    config = EngineConfig.load(args.config)
    if args.metrics_host is not None:
        host = _address("--metrics-host", args.metrics_host)
        config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, metrics_host=host))
    if args.listen_host is not None:
        if not config.cluster.listen:
            raise ConfigError("--listen-host: the configuration has no cluster.listen (cross-node reads are off)")
        port = config.cluster.listen.rpartition(":")[2]
        listen = f"{_address('--listen-host', args.listen_host)}:{port}"
        config = dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, listen=listen))
    agent.run(config)
    return 0


def add(sub: Subparsers) -> None:
    """``flatcake agent``: the node agent's commands."""
    agent = sub.add_parser("agent", help="the node agent").add_subparsers(dest="agent", required=True)
    serve = agent.add_parser("serve", help="serve the storage engine's catalog to this node's clients")
    serve.add_argument("--config", required=True, help="engine configuration (JSON), as rendered by the operator")
    serve.add_argument("--metrics-host", dest="metrics_host",
                       help="IP for /metrics, /healthz, /readyz (default: agent.metrics_host, 127.0.0.1)")  # fmt: skip
    serve.add_argument("--listen-host", dest="listen_host",
                       help="IP other nodes reach this agent at: cluster.listen's host (in a pod, its IP)")  # fmt: skip
    serve.set_defaults(func=_agent_serve, service=True)
    prep = agent.add_parser("prepare", help="hugepages, RAID-0, XFS, mount and the file pool (plan, then apply)")
    prep.add_argument("--config", required=True, help="engine configuration (JSON), as rendered by the operator")
    prep.add_argument("--dry-run", action="store_true", dest="dry_run", help="print the plan, change nothing")
    prep.set_defaults(func=_agent_prepare)
    reclaim = agent.add_parser("reclaim", help="erase this node's pool and DRAM pool file (reclaimPolicy Delete)")
    reclaim.add_argument("--config", required=True, help="engine configuration (JSON)")
    reclaim.set_defaults(func=_agent_reclaim)
