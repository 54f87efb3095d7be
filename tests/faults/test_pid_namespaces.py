"""Fairness between inference pods (issue 44 item 2): under the operator every pod is in a PID namespace
the agent cannot see, so the socket's peer pid reads 0 and a per-process connection cap counted
nothing. Here the agent and each client run in PID namespaces of their own (``unshare``, as root, the
way pods and the agent's pod are apart): each client is counted by the pod identity the webhook gives
it (``FLATCAKE_CLIENT_ID``), so one pod past its cap leaves another pod served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.node_agent.service.client import AgentConnection
from tests.node_agent.service.test_agent_processes import FLATCAKE
from tests.support.engines import small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

CAP = 4
HOLD = """
import sys
from flatcake.node_agent.service.client import AgentConnection
held, out = [], []
for _ in range(int(sys.argv[2])):
    try:
        conn = AgentConnection(sys.argv[1], timeout=10)
        conn.call("register")
        held.append(conn)
        out.append("ok")
    except Exception as exc:
        out.append("busy" if "max_clients_per_process" in str(exc) else f"error:{exc}")
print(" ".join(out), flush=True)
sys.stdin.read()  # hold the connections until the test closes stdin
"""


def in_own_pid_namespace(argv: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child=SIGTERM", *argv], text=True, **kw)  # type: ignore[call-overload]


def pod(socket: str, connections: int, client_id: str | None) -> tuple[subprocess.Popen[str], list[str]]:
    """A client process in a PID namespace of its own, holding ``connections``: its process and what each
    connection got ("ok" or "busy")."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1", **({"FLATCAKE_CLIENT_ID": client_id} if client_id else {})}
    proc = in_own_pid_namespace([sys.executable, "-c", HOLD, socket, str(connections)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the client exited: {proc.stderr.read() if proc.stderr else ''}"
    return proc, line.split()


def test_pods_in_other_pid_namespaces_are_capped_one_by_one(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node", agent={"max_clients": 64, "max_clients_per_process": CAP})
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    agent = in_own_pid_namespace([str(FLATCAKE), "agent", "serve", "--config", str(path)], stderr=subprocess.PIPE)

    def answers() -> bool:
        assert agent.poll() is None, f"agent exited: {agent.stderr.read() if agent.stderr else ''}"
        try:
            AgentConnection(config.agent.socket, timeout=5).close()
            return True
        except (ConnectionError, OSError):
            return False

    pods: list[subprocess.Popen[str]] = []
    try:
        wait_until(answers, what="the agent (in its own PID namespace) to answer")
        greedy, got = pod(config.agent.socket, CAP + 2, "team-a/sglang-0")
        pods.append(greedy)
        assert got == ["ok"] * CAP + ["busy"] * 2  # counted as one pod although the agent sees pid 0
        other, got = pod(config.agent.socket, CAP, "team-b/vllm-0")
        pods.append(other)
        assert got == ["ok"] * CAP  # the greedy pod's connections do not count against another pod
        conn = AgentConnection(config.agent.socket)
        try:
            conn.call("register")
            stats = conn.call("stats")
        finally:
            conn.close()
        held = stats["connections_by_client"]
        assert held["pod team-a/sglang-0"] == CAP and held["pod team-b/vllm-0"] == CAP, held
        assert not [k for k in held if k.startswith("pid ")], held  # the agent saw no client's pid: the case tested
        # No identity: counted by its uid (this test process's uid too, whose last connection the agent may
        # not have seen close yet), still capped: refused with the reason, never more than CAP served.
        anonymous, got = pod(config.agent.socket, CAP + 1, None)
        pods.append(anonymous)
        assert got.count("busy") >= 1 and got.count("ok") <= CAP and got.count("ok") + got.count("busy") == CAP + 1, got
    finally:
        for proc in pods:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(30)
        agent.kill()  # unshare blocks SIGTERM while it waits; killed, it sends the agent SIGTERM (--kill-child)
        agent.wait(30)
