import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.gva import Medium

pytestmark = pytest.mark.unit


@given(st.sampled_from(list(Medium)), st.integers(0, G.MAX_NODE_ID), st.integers(0, G.MAX_OFFSET))
def test_encode_decode_round_trip(medium: Medium, node: int, offset: int) -> None:
    address = G.encode(medium, node, offset)
    assert 0 <= address < 1 << 64
    assert G.decode(address) == (medium, node, offset)
    assert G.needs_ssd([address]) == (medium is Medium.SSD)


def test_field_layout_matches_the_design() -> None:
    assert G.encode(Medium.SSD, 0, 0) == 1 << 60
    assert G.encode(Medium.DRAM, 1, 0) == 1 << 48
    assert G.encode(Medium.DRAM, 0, 5) == 5


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((Medium.DRAM, 4096, 0), "node_id"),
        ((Medium.DRAM, -1, 0), "node_id"),
        ((Medium.SSD, 0, 1 << 48), "offset"),
        ((Medium.SSD, 0, -1), "offset"),
        ((2, 0, 0), "medium"),
    ],
)
def test_encode_range_errors_name_the_field(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        G.encode(*args)


def test_decode_refuses_reserved_media() -> None:
    with pytest.raises(ValueError, match="reserved"):
        G.decode(2 << 60)
    with pytest.raises(ValueError, match="64-bit"):
        G.decode(1 << 64)


def test_needs_ssd_is_decided_by_the_largest_address() -> None:
    dram = [G.encode(Medium.DRAM, G.MAX_NODE_ID, G.MAX_OFFSET), G.encode(Medium.DRAM, 3, 7)]
    assert not G.needs_ssd(dram)
    assert G.needs_ssd([*dram, G.encode(Medium.SSD, 0, 0)])
    assert not G.needs_ssd([])
