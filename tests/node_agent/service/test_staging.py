"""The staging buffer an agent restores SSD pages into for other nodes (service/peer_service.py): first fit."""

from __future__ import annotations

import pytest

from flatcake.errors import CapacityError
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.service.peer_service import Staging

pytestmark = pytest.mark.unit


def test_regions_are_first_fit_and_given_back() -> None:
    s = Staging(aligned_empty(100))
    a, at_a = s.take(40)
    b, at_b = s.take(40)
    assert (at_a, at_b) == (0, 40)
    with pytest.raises(CapacityError, match="do not fit the free part of cluster.staging_bytes"):
        s.take(30)  # 20 bytes left: the peer retries or stages fewer pages
    s.give(a)
    c, at_c = s.take(30)  # the hole the first region left
    assert at_c == 0 and len({a, b, c}) == 3
    d, at_d = s.take(20)
    assert at_d == 80
    s.give(b)
    s.give(b)  # giving twice is harmless (a connection drop after an unstage)
    e, at_e = s.take(50)
    assert at_e == 30 and set(s.regions) == {c, d, e}


def test_a_region_given_back_holds_no_page() -> None:
    """The buffer is registered with the transfer engine, which serves whoever reaches its port: a page
    staged for a peer is zeroed when the peer is done, not left there until the region is reused."""
    s = Staging(aligned_empty(100))
    a, at_a = s.take(40)
    _, at_b = s.take(40)
    s.buffer[:] = 7  # staged pages
    s.give(a)
    assert not s.buffer[at_a : at_a + 40].any() and (s.buffer[at_b : at_b + 40] == 7).all()  # b is still being read
