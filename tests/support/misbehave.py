"""Clients that misbehave on the agent's control socket, run as a script in a process of their own
(so that the well-behaved client measured beside them shares neither its pid nor its GIL):

    python misbehave.py SOCKET PROGRESS_FILE stall,slow,flood,oversized,malformed,many

Each mode runs in a thread until the process is killed; PROGRESS_FILE gets one line per mode once that
mode is under way (the test waits for them, not for a fixed time).
- ``stall``: four frames that declare 16 MiB (together the whole default frame budget) and send 10 bytes;
  reconnects and stalls again whenever the agent cuts one off.
- ``slow``: registers, then pipelines lookups of 256 keys and never reads a reply.
- ``flood``: pipelines lookups as fast as the socket takes them, reading replies in another thread.
- ``oversized``: declares 32 MiB frames (over MAX_FRAME) and trickles junk.
- ``malformed``: frames that are not msgpack, maps without an op, unknown ops, wrong versions.
- ``many``: opens registered connections until the agent refuses them, and keeps them.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from pathlib import Path

import msgpack

from flatcake.node_agent.service import protocol as P

SOCKET, PROGRESS = sys.argv[1], Path(sys.argv[2])
_lock = threading.Lock()


def progress(line: str) -> None:
    with _lock, PROGRESS.open("a") as f:
        f.write(line + "\n")


def connect() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCKET)
    return s


def frame(op: str, **args: object) -> bytes:
    body = msgpack.packb(P.request(1, op, args), use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def read_reply(s: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return body


def registered() -> socket.socket:
    s = connect()
    s.sendall(frame("register"))
    read_reply(s)
    return s


KEYS = [f"misbehave-{i:04d}" for i in range(256)]


def stall() -> None:
    said = False
    while True:
        held = []
        for _ in range(4):
            s = connect()
            s.sendall(struct.pack(">I", 16 << 20) + b"x" * 10)
            held.append(s)
        if not said:
            progress("stall")
            said = True
        for s in held:  # the agent cuts each off after frame_timeout_s; then stall again
            s.settimeout(None)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
            s.close()


def slow() -> None:
    s = registered()
    s.setblocking(False)
    lookup, sent = frame("exists", keys=KEYS), 0
    while True:
        try:
            s.send(lookup)
            sent += 1
            if sent == 200:
                progress("slow")
        except BlockingIOError:
            time.sleep(0.01)  # its buffers are full: the agent stops answering it, then cuts it off
        except OSError:
            s = registered()
            s.setblocking(False)


def flood() -> None:
    s = registered()
    lookup = frame("exists", keys=KEYS[:16])

    def drain() -> None:
        try:
            while True:
                read_reply(s)
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    s.sendall(lookup * 100)
    progress("flood")
    while True:
        s.sendall(lookup * 100)


def oversized() -> None:
    said = False
    while True:
        s = connect()
        try:
            s.sendall(struct.pack(">I", 32 << 20))
            if not said:
                progress("oversized")
                said = True
            while True:
                s.sendall(b"j" * 4096)
                time.sleep(0.001)
        except OSError:
            s.close()


def malformed() -> None:
    bad = [b"\xc1garbage", msgpack.packb({"v": P.VERSION, "id": 1}), msgpack.packb([1, 2, 3]),
           msgpack.packb({"v": P.VERSION, "id": 1, "op": "no-such-op", "args": {}}),
           msgpack.packb({"v": 999, "id": 1, "op": "exists", "args": {}})]  # fmt: skip
    s, n = connect(), 0
    while True:
        try:
            for body in bad:
                s.sendall(struct.pack(">I", len(body)) + body)
                read_reply(s)
            n += 1
            if n == 50:
                progress("malformed")
        except OSError:
            s = connect()


def many() -> None:
    held = []
    while True:
        s = connect()
        s.sendall(frame("register"))
        reply = msgpack.unpackb(read_reply(s), raw=False, strict_map_key=False)
        if not reply.get("ok"):
            break
        held.append(s)
    progress(f"many {len(held)}")
    while True:
        time.sleep(1)


MODES = {"stall": stall, "slow": slow, "flood": flood, "oversized": oversized, "malformed": malformed, "many": many}

if __name__ == "__main__":
    for mode in sys.argv[3].split(","):
        threading.Thread(target=MODES[mode], daemon=True, name=mode).start()
    while True:
        time.sleep(1)
