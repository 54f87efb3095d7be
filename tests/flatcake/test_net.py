from __future__ import annotations

import socket

import pytest

from flatcake.net import free_port

pytestmark = pytest.mark.unit


def test_free_port_can_be_bound_at_once() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if something holds it
