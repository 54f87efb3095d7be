"""Who a local client is, for ``agent.max_clients_per_process``: the kernel's pid where the agent sees it
(SO_PEERCRED); a process of another PID namespace (every pod, under the operator) reads as pid 0 and is
counted by the pod it names at ``register`` (``FLATCAKE_CLIENT_ID``, set by the webhook to namespace/name),
else by its uid. Fairness, not authentication: a pod could name itself otherwise."""

from __future__ import annotations

import asyncio
import socket
import struct

from flatcake.node_agent.constants import CLIENT_ID_ENV
from flatcake.node_agent.service import protocol as P


def connected(writer: asyncio.StreamWriter, remote: bool) -> tuple[int, str]:
    """The peer's pid (0 where not seen) and the key its connections are counted under ("" for none)."""
    if remote:
        return 0, ""
    sock = writer.get_extra_info("socket")
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):
        return 0, ""
    return int(pid), f"pid {pid}" if pid else f"uid {uid}"


def claimed(name: object) -> str:
    """The key of a pod a client names at ``register``; a ProtocolError naming the field and the fix."""
    if not isinstance(name, str) or not 0 < len(name) <= 253:
        raise P.ProtocolError(P.BAD_ARGS, f"client: {name!r} is not a name of 1 to 253 characters; set "
                              f"{CLIENT_ID_ENV} to the pod's namespace/name (the webhook does)")  # fmt: skip
    return f"pod {name}"


def too_many(client: str, limit: int) -> str:
    return f"{client} holds agent.max_clients_per_process={limit} connections already; reuse one or close some"
