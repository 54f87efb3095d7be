"""The agent process: ``flatcake agent serve`` (``run``) and a helper that starts it as a child
process and waits until its socket answers (``spawn``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.service.client import AgentConnection
from flatcake.node_agent.service.server import Agent

log = logging.getLogger(__name__)


def spawn(config: EngineConfig, workdir: Path, output: Any = None, timeout: float = 60,
          prefix: Sequence[str] = ()) -> Any:  # fmt: skip
    """Start ``flatcake agent serve`` as its own process (config written to ``workdir/engine.json``)
    and return it once its socket answers. ``prefix`` runs it under another command (``ip netns exec NS``).
    Its output goes to ``output`` (an open file), by default appended to ``workdir/agent.log``; an agent that
    exits or stays silent past ``timeout`` raises a RuntimeError that says which, with the log's tail."""
    path = workdir / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    exe = Path(sys.executable).parent / "flatcake"
    own = output is None
    if own:
        output = (workdir / "agent.log").open("ab")
    try:
        proc = subprocess.Popen([*prefix, str(exe), "agent", "serve", "--config", str(path)], cwd=workdir,
                                stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        if own:
            output.close()  # the agent holds its own descriptor
    deadline = time.monotonic() + timeout
    while True:
        try:
            AgentConnection(config.agent.socket, timeout=5).close()
            return proc
        except ConnectionError:
            exited = proc.poll()
            if exited is None and time.monotonic() <= deadline:
                time.sleep(0.05)
                continue
            why = (f"exited with code {exited}" if exited is not None else
                   f"did not answer on {config.agent.socket} within {timeout:.0f} s")  # fmt: skip
            proc.kill()
            proc.wait(30)
            raise RuntimeError(f"the node agent {why}{_log_tail(getattr(output, 'name', None))}") from None


def _log_tail(name: Any, lines: int = 20) -> str:
    """The last lines of the agent's log file for an error message, or where to look when there is no file."""
    if not isinstance(name, str) or not Path(name).is_file():
        return "; run `flatcake agent serve` to see why"
    tail = Path(name).read_text(errors="replace").splitlines()[-lines:]
    return f"; the end of its log ({name}):\n" + "\n".join(tail)


def run(config: EngineConfig) -> None:
    """``flatcake agent serve``: (in a cluster: wait for this node's NodeID), recover, then serve until
    SIGTERM, reporting a FlatCakeNode when the configuration names a cache."""
    from flatcake.node_agent.node import identity as R  # the kube client only where a cluster is configured

    node = R.node_name() if config.cluster.node_ids_dir or config.cluster.cache else ""
    if config.cluster.node_ids_dir:
        config = dataclasses.replace(config, node_id=R.resolve_node_id(config, node))
        log.info("flatcake agent: node %s has NodeID %d", node, config.node_id)
    agent = Agent(config)
    reporter = None
    try:
        port = agent.start_http()
        log.info("flatcake agent: socket %s, metrics http://%s:%d/metrics", config.agent.socket,
                    config.agent.metrics_host, port)  # fmt: skip
        if config.cluster.cache:
            from flatcake.kube import Kube

            cross_node = bool(config.cluster.listen)
            reporter = R.NodeReporter(config, node, config.node_id, agent.catalog.table.usage,
                                      lambda: agent.ready, Kube.from_environment(R.USER_AGENT),
                                      peer=lambda: agent.peer_address,
                                      on_peers=agent.set_discovered_peers if cross_node else None)  # fmt: skip
            reporter.start()
        asyncio.run(agent.serve())
    finally:
        if reporter is not None:
            reporter.stop()
            with contextlib.suppress(Exception):
                reporter.report_once(ready=False, force=True)  # the operator sees the node go down at once
        agent.close()
