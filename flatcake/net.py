"""Network helpers shared by every component (stands below them, like flatcake.errors)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a child process to bind (the OS picks it; another
    process may take it before the child binds, which the caller's start-up check then reports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
