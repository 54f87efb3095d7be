"""A peer that answers garbage: every malformed reply is a miss for the reader (never an exception into
SGLang's or vLLM's thread, never a wrong byte), and the peer is left out for a while. The peer here is
a fake that speaks FlatCake's framing and answers what each case scripts."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from flatcake.node_agent.service.cluster import Cluster

pytestmark = pytest.mark.integration

LAYERS, PAGE = 4, 4096
KEYS = [f"k{i}" for i in range(4)]
GOOD_PEER = {"node_id": 7, "transfer": "127.0.0.1:1", "dram_base": 1 << 20, "stage_pages": 8}
SSD_GVA = (1 << 60) + 4096


class FakePeer:
    """A TCP server answering each op with ``script[op](args)`` (a result, or ``RAW`` bytes sent as the
    frame's body)."""

    def __init__(self, script: dict[str, Callable[[dict[str, Any]], Any]]) -> None:
        self.script = script
        self.asked: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        with conn:
            while True:
                head = _recv(conn, 4)
                if head is None:
                    return
                body = _recv(conn, struct.unpack(">I", head)[0])
                if body is None:
                    return
                req = msgpack.unpackb(body, raw=False)
                op = req["op"]
                self.asked.append(op)
                answer = self.script.get(op, lambda a: None)(req.get("args", {}))
                if isinstance(answer, Raw):
                    out = answer.body
                else:
                    out = msgpack.packb({"v": 1, "id": req["id"], "ok": True, "result": answer}, use_bin_type=True)
                conn.sendall(struct.pack(">I", len(out)) + out)

    def close(self) -> None:
        self.sock.close()


class Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body


def _recv(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def lease(n: int, **over: Any) -> dict[str, Any]:
    return {"id": 1, "scope": [1] * n, "gva": [SSD_GVA + i * PAGE for i in range(n)], "stride": [n * PAGE] * n,
            "crc": [0] * n, "verify": False, "epoch": 0} | over  # fmt: skip


@pytest.fixture
def reader(make_engine: Any) -> Iterator[Callable[[dict[str, Any]], tuple[Cluster, FakePeer]]]:
    made: list[tuple[Cluster, FakePeer]] = []

    def make(script: dict[str, Any]) -> tuple[Cluster, FakePeer]:
        full = {"hello": lambda a: {"nonce": b"n" * 16}, "register": lambda a: {"peer": GOOD_PEER},
                "release": lambda a: None, "unstage": lambda a: None}  # fmt: skip
        full.update(script)
        peer = FakePeer(full)
        engine = make_engine(layers=LAYERS, page_bytes=PAGE)
        cluster = Cluster(engine, peers=[peer.address], timeout_s=2)
        made.append((cluster, peer))
        return cluster, peer

    yield make
    for cluster, peer in made:
        cluster.close()
        peer.close()


EXISTS_CASES = {
    "not a number": lambda a: "many",
    "a boolean": lambda a: True,
    "more than asked": lambda a: len(a["keys"]) + 5,
    "negative": lambda a: -1,
    "not a frame": lambda a: Raw(b"\xc1garbage"),
}


@pytest.mark.parametrize("answer", list(EXISTS_CASES.values()), ids=list(EXISTS_CASES))
def test_a_malformed_lookup_answer_is_a_miss(reader: Any, answer: Callable[[dict[str, Any]], Any]) -> None:
    cluster, peer = reader({"exists": answer})
    assert cluster.exists(KEYS) == 0
    assert cluster.peers[0].down_until > time.monotonic() and cluster.peers[0].failures == 1
    assert "exists" in peer.asked


def test_a_challenge_without_a_nonce_is_a_miss(reader: Any) -> None:
    cluster, peer = reader({"hello": lambda a: {"nonce": "not bytes"}, "exists": lambda a: len(a["keys"])})
    assert cluster.exists(KEYS) == 0
    assert cluster.peers[0].failures == 1 and "register" not in peer.asked


REGISTER_CASES = {
    "no peer info": {},
    "peer info not a map": {"peer": "yes"},
    "no transfer endpoint": {"peer": {k: v for k, v in GOOD_PEER.items() if k != "transfer"}},
    "dram_base not a number": {"peer": GOOD_PEER | {"dram_base": "0x10"}},
    "stage_pages negative": {"peer": GOOD_PEER | {"stage_pages": -1}},
}


@pytest.mark.parametrize("reply", list(REGISTER_CASES.values()), ids=list(REGISTER_CASES))
def test_a_malformed_register_answer_is_a_miss(reader: Any, reply: dict[str, Any]) -> None:
    cluster, peer = reader({"register": lambda a: reply, "exists": lambda a: len(a["keys"])})
    assert cluster.exists(KEYS) == 0
    assert cluster.peers[0].failures == 1 and "exists" not in peer.asked


LEASE_CASES = {
    "no crc list": lambda a: lease(len(a["keys"]), crc=[]),
    "short crc list": lambda a: lease(len(a["keys"]), crc=[0]),
    "crc not numbers": lambda a: lease(len(a["keys"]), crc=["x"] * len(a["keys"])),
    "short gva list": lambda a: lease(len(a["keys"]), gva=[SSD_GVA]),
    "gva not numbers": lambda a: lease(len(a["keys"]), gva=[None] * len(a["keys"])),
    "no id": lambda a: {k: v for k, v in lease(len(a["keys"])).items() if k != "id"},
    "not a map": lambda a: [1, 2, 3],
}


@pytest.mark.parametrize("answer", list(LEASE_CASES.values()), ids=list(LEASE_CASES))
def test_a_malformed_lease_is_a_miss_and_nothing_reaches_the_destination(reader: Any, answer: Any) -> None:
    cluster, peer = reader({"exists": lambda a: len(a["keys"]), "acquire": answer})
    dest = np.full((LAYERS, len(KEYS), PAGE), 0x5A, np.uint8)
    assert cluster.restore(KEYS, dest) == set(range(len(KEYS)))
    assert (dest == 0x5A).all() and cluster.last.pages == 0
    assert cluster.peers[0].failures == 1
    assert "stage" not in peer.asked  # refused before anything was read


STAGE_CASES = {
    "missing indexes out of range": lambda a: {"handle": 1, "address": 4096, "missing": [99]},
    "no address": lambda a: {"handle": 1, "missing": []},
    "not a map": lambda a: "staged",
}


@pytest.mark.parametrize("answer", list(STAGE_CASES.values()), ids=list(STAGE_CASES))
def test_a_malformed_staging_answer_is_a_miss(reader: Any, answer: Any) -> None:
    cluster, _ = reader({"exists": lambda a: len(a["keys"]), "acquire": lambda a: lease(len(a["keys"])),
                         "stage": answer})  # fmt: skip
    dest = np.full((LAYERS, len(KEYS), PAGE), 0x5A, np.uint8)
    assert cluster.restore(KEYS, dest) == set(range(len(KEYS)))
    assert (dest == 0x5A).all() and cluster.peers[0].failures == 1
