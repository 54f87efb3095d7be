"""The node agent over its real socket: protocol errors, client round trips, leases, metrics."""

from __future__ import annotations

import socket
import struct
import urllib.request
from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from flatcake.errors import PoolFullError, ProtocolError, UnknownHandleError, UnknownKeyError
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service.client import AgentConnection, connect
from tests.support.agents import AgentThread
from tests.support.engines import pages
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

Start = Callable[..., AgentThread]


class Raw:
    """A client that can send anything."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def send_body(self, body: bytes) -> dict:
        self.sock.sendall(struct.pack(">I", len(body)) + body)
        return self.reply()

    def call(self, op: str, **args: object) -> dict:
        return self.send_body(msgpack.packb(P.request(7, op, args), use_bin_type=True))

    def reply(self) -> dict:
        def recv(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                chunk = self.sock.recv(n - len(buf))
                assert chunk, "agent closed the connection"
                buf += chunk
            return buf

        (length,) = struct.unpack(">I", recv(4))
        return msgpack.unpackb(recv(length), raw=False, strict_map_key=False)


def test_bad_frames_get_an_error_and_the_connection_stays_healthy(agent_thread: Start) -> None:
    a = agent_thread()
    raw = Raw(a.socket)
    assert raw.call("exists", keys=["a"])["error"]["code"] == P.NOT_REGISTERED
    assert raw.call("register")["ok"]
    bad = raw.send_body(b"\xc1\xc1 not msgpack")
    assert bad["error"]["code"] == P.MALFORMED and "msgpack" in bad["error"]["message"]
    assert raw.send_body(msgpack.packb([1, 2]))["error"]["code"] == P.MALFORMED
    assert raw.send_body(msgpack.packb({"v": 99, "op": "stats"}))["error"]["code"] == P.VERSION_MISMATCH
    assert raw.call("frobnicate")["error"]["code"] == P.UNKNOWN_OP
    r = raw.call("exists", keys=[1.5])
    assert r["error"]["code"] == P.BAD_ARGS and "keys[0]" in r["error"]["message"]
    r = raw.call("exists", keys=list(range(P.MAX_KEYS + 1)))
    assert r["error"]["code"] == P.BAD_ARGS and "split the batch" in r["error"]["message"]
    r = raw.call("allocate", keys=["a"], hints={"turnz": 1})
    assert r["error"]["code"] == P.BAD_ARGS and "turnz" in r["error"]["message"]
    r = raw.call("publish", id=12345, crc=[])
    assert r["error"]["code"] == P.UNKNOWN_HANDLE
    # An oversized frame is skipped whole, answered, and the stream stays in step.
    raw.sock.sendall(struct.pack(">I", P.MAX_FRAME + 1) + b"\0" * (P.MAX_FRAME + 1))
    assert raw.reply()["error"]["code"] == P.OVERSIZED
    assert raw.call("exists", keys=["a"]) == {"v": 1, "id": 7, "ok": True, "result": 0}
    errors = a.agent.snapshot()
    assert errors["clients"] == 1


def test_client_round_trip_through_the_agent(agent_thread: Start) -> None:
    a = agent_thread()
    kv, shared = pages(4, 6, 4096, 1), pages(4, 2, 4096, 2)
    with connect(a.socket, layers=4, page_bytes=4096) as e:
        keys = [f"s{i}" for i in range(6)]
        assert e.put(keys[:3], pages_slice(kv, 0, 3)).medium is Medium.SSD
        r = e.put(keys, kv, Hints(turn=2))
        assert (r.stored, r.skipped, r.reason) == (3, 3, "inherited")
        assert e.put(["sys0", "sys1"], shared, Hints(prefix_refcount=3)).medium is Medium.DRAM
        want = ["sys0", "sys1", *keys]
        assert e.exists(want) == 8 and e.exists(["zz", *want]) == 0
        dest = np.zeros((4, 8, 4096), np.uint8)
        with e.get(want, dest) as restore:
            assert list(restore) == [0, 1, 2, 3] and not restore.missing
        assert np.array_equal(dest, np.concatenate([shared, kv], axis=1))
        with pytest.raises(UnknownKeyError, match=r"keys\[1\]"):
            e.get(["s0", "nope"], dest)
    snap = a.agent.snapshot()
    assert snap["placements"] == {"dram/shared_prompt": 2, "ssd/inherited": 3, "ssd/one_shot": 3}
    assert snap["client_stats"]["read_commands"] >= 1 and snap["leases"] == 0
    # A second client sees the same catalog and the same bytes.
    with connect(a.socket) as other:
        dest2 = np.zeros((4, 8, 4096), np.uint8)
        other.get(want, dest2).run()
        assert np.array_equal(dest, dest2)


def pages_slice(kv: np.ndarray, lo: int, hi: int) -> np.ndarray:
    out = pages(kv.shape[0], hi - lo, kv.shape[2])
    out[...] = kv[:, lo:hi]
    return out


def test_geometry_mismatch_is_refused_at_register(agent_thread: Start) -> None:
    a = agent_thread()
    with pytest.raises(ValueError, match="page_bytes: the client's model has 8192"):
        connect(a.socket, page_bytes=8192)
    with pytest.raises(ConnectionError, match="cannot reach the flatcake agent"):
        connect(a.socket + ".missing")


def test_a_dead_client_leaves_no_allocation_or_pin_behind(agent_thread: Start) -> None:
    a = agent_thread()
    with connect(a.socket) as e:
        e.put(["a", "b"], pages(4, 2, 4096))
    conn = AgentConnection(a.socket)
    conn.call("register")
    alloc = conn.call("allocate", keys=["c", "d"], hints={})
    lease = conn.call("acquire", keys=["a"])
    assert alloc["id"] and lease["id"]
    snap = a.agent.snapshot()
    assert (snap["open_allocations"], snap["leases"]) == (1, 1)
    used = snap["usage"]["ssd"]["used_bytes"]
    # Another client cannot publish or release what it does not hold.
    with connect(a.socket) as e:
        with pytest.raises(UnknownHandleError):
            e.catalog.publish(alloc["id"], [0, 0])
        assert e.exists(["c"]) == 0
    conn.close()  # the process "dies": its connection drops
    dropped = lambda: (a.agent.snapshot()["open_allocations"], a.agent.snapshot()["leases"]) == (0, 0)  # noqa: E731
    wait_until(dropped, what="the dead client's allocation and lease to be dropped")
    snap = a.agent.snapshot()
    assert (snap["open_allocations"], snap["leases"]) == (0, 0)
    assert snap["usage"]["ssd"]["used_bytes"] <= used and all(
        s.pins == 0 for s in a.agent.catalog.table.scopes.values()
    )
    with connect(a.socket) as e:  # c, d were never published and can be written again
        assert e.put(["c", "d"], pages(4, 2, 4096)).stored == 2


def test_full_pool_is_an_error_that_names_the_fix(agent_thread: Start) -> None:
    a = agent_thread(files=1, file_bytes=4 * 4 * 4096, dram_bytes=0)
    with connect(a.socket) as e:
        full = [f"a{i}" for i in range(4)]  # the one file's 4 pages
        e.put(full, pages(4, 4, 4096))
        dest = np.zeros((4, 4, 4096), np.uint8)
        with e.get(full, dest):
            with pytest.raises(PoolFullError, match="file_count"):
                e.put(["b"], pages(4, 1, 4096))
            assert e.exists(["b"]) == 0
        assert e.put(["b"], pages(4, 1, 4096)).stored == 1


def test_metrics_health_and_readiness(agent_thread: Start) -> None:
    a = agent_thread()
    with connect(a.socket) as e:
        e.put(["a", "b"], pages(4, 2, 4096))
        e.get(["a", "b"], np.zeros((4, 2, 4096), np.uint8)).run()
    base = f"http://127.0.0.1:{a.port}"
    assert urllib.request.urlopen(base + "/healthz").read() == b"ok\n"
    assert urllib.request.urlopen(base + "/readyz").status == 200
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    for needle in (
        'flatcake_agent_requests_total{op="allocate"} 1.0',
        'flatcake_used_bytes{medium="ssd"}',
        'flatcake_placements_total{medium="ssd",reason="one_shot"} 2.0',
        "flatcake_ssd_read_commands_total",
        'flatcake_agent_request_seconds_bucket{le="0.005",op="acquire"}',
    ):
        assert needle in text, needle


def test_agent_error_type_for_unmapped_codes(agent_thread: Start) -> None:
    a = agent_thread()
    conn = AgentConnection(a.socket)
    with pytest.raises(ProtocolError, match="not_registered"):
        conn.call("stats")
    conn.close()


def test_an_unclosed_restore_is_released_without_deadlock(agent_thread: Start) -> None:
    """A Restore dropped unclosed while its thread holds the agent connection's lock (a finalizer can
    run anywhere) must not call the agent from the finalizer: it warns, and its pins are released once
    the lock is free."""
    import gc

    agent = agent_thread()
    with connect(agent.socket) as e:
        e.put(["a", "b"], pages(4, 2, 4096))
        restore = e.get(["a", "b"], np.zeros((4, 2, 4096), np.uint8))
        assert e.catalog.conn.call("stats")["leases"] == 1
        with e.catalog.conn._lock, pytest.warns(ResourceWarning, match="not closed"):
            del restore
            gc.collect()  # the finalizer runs here, in the thread holding the lock: it must not block
        wait_until(lambda: e.catalog.conn.call("stats")["leases"] == 0, what="the dropped restore's lease release")
        assert e.exists(["a", "b"]) == 2
