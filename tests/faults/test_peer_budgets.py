"""Other nodes' connections have budgets of their own (issue 44): a flood on the peer port never makes
this node's own inference processes get `busy` or wait for frame room. The agents here serve peers
without the cache's secret (cluster.insecure_peers), so that the flooding connections can register as
a compromised peer would: budgets hold against peers that passed the handshake too."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from flatcake.node_agent.config import ClusterConfig
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service.client import AgentConnection
from tests.support.agents import AgentThread
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

Start = Callable[..., AgentThread]


def peer_socket(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def call(sock: socket.socket, op: str, **args: Any) -> dict[str, Any]:
    body = msgpack.packb(P.request(1, op, args), use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "the agent closed the connection"
        head += chunk
    (n,) = struct.unpack(">I", head)
    reply = b""
    while len(reply) < n:
        reply += sock.recv(n - len(reply))
    out: dict[str, Any] = msgpack.unpackb(reply, raw=False, strict_map_key=False)
    return out


def test_idle_remote_sessions_leave_local_clients_served(agent_thread: Start) -> None:
    a = agent_thread(agent={"max_clients": 8},
                     cluster=ClusterConfig(listen="127.0.0.1:0", max_peer_clients=16, peer_idle_timeout_s=2.0,
                                           insecure_peers=True))  # fmt: skip
    wait_until(lambda: a.agent.peer_address, what="the peer port to be bound")
    remote: list[socket.socket] = []
    busy = 0
    for _ in range(1024):  # as many as agent.max_clients' default, all registered and then idle
        s = peer_socket(a.agent.peer_address)
        reply = call(s, "register")
        if reply["ok"]:
            remote.append(s)
        else:
            assert reply["error"]["code"] == P.BUSY and "cluster.max_peer_clients=16" in reply["error"]["message"]
            busy += 1
            s.close()
    assert len(remote) == 16 and busy == 1024 - 16
    # This node's own clients still get all of agent.max_clients.
    local = [AgentConnection(a.socket) for _ in range(8)]
    for conn in local:
        conn.call("register")
        assert conn.call("exists", keys=["x"]) == 0
    # Registered peers that stay silent are closed after cluster.peer_idle_timeout_s; local ones stay.
    wait_until(lambda: a.agent.dropped["idle_timeout"] >= 16, what="idle peers to be closed")
    assert all(s.recv(1) == b"" for s in remote)
    assert all(conn.call("exists", keys=["x"]) == 0 for conn in local)
    for conn in local:
        conn.close()


def test_remote_frame_floods_leave_a_local_large_frame_on_time(agent_thread: Start) -> None:
    a = agent_thread(agent={"frame_timeout_s": 3.0, "frame_budget_bytes": P.MAX_FRAME}, files=32, file_bytes=1 << 20,
                     cluster=ClusterConfig(listen="127.0.0.1:0", peer_frame_budget_bytes=P.MAX_FRAME,
                                           insecure_peers=True))  # fmt: skip
    wait_until(lambda: a.agent.peer_address, what="the peer port to be bound")
    # Peers start 16 MiB frames and stall in them: the peers' frame budget is taken.
    stalled = [peer_socket(a.agent.peer_address) for _ in range(4)]
    for s in stalled:
        s.sendall(struct.pack(">I", 16 << 20) + b"x" * 10)
    wait_until(lambda: a.agent._frame_bytes[True] > 0, what="a peer's stalled frame to hold budget")
    # A local put of 1,200 pages whose allocate frame is large (long keys: about 180 KiB).
    conn = AgentConnection(a.socket)
    conn.call("register")
    keys = [f"tenant-a/session-42/page-{i:06d}/" + "k" * 120 for i in range(1200)]
    started = time.perf_counter()
    alloc = conn.call("allocate", keys=keys, hints={"context_tokens": 100_000})
    took = time.perf_counter() - started
    assert alloc is not None and len(alloc["index"]) == 1200
    assert took < 1.0, f"a local frame waited {took:.2f} s behind peers' stalled frames"
    conn.call("abort", id=alloc["id"])
    conn.close()
    for s in stalled:
        s.close()
