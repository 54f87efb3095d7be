import pytest

from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import (
    Decision,
    Hints,
    PlacementConfig,
    PlacementCounts,
    Reason,
    decide,
    overflow,
)

pytestmark = pytest.mark.unit

CFG = PlacementConfig(agent_context_tokens=1000, agent_reply_tokens=100, short_reply_tokens=50)


@pytest.mark.parametrize(
    ("hints", "medium", "reason"),
    [
        (Hints(prefix_refcount=3), Medium.DRAM, Reason.SHARED_PROMPT),
        (Hints(prefix_refcount=2, context_tokens=5000), Medium.DRAM, Reason.SHARED_PROMPT),
        (Hints(turn=3, prev_reply_tokens=(10, 50)), Medium.DRAM, Reason.SHORT_CHAT),
        (Hints(turn=3, prev_reply_tokens=(10, 51)), Medium.SSD, Reason.AGENT_SESSION),
        (Hints(turn=2, context_tokens=1000), Medium.SSD, Reason.AGENT_SESSION),
        (Hints(turn=2, reply_tokens=100), Medium.SSD, Reason.AGENT_SESSION),
        (Hints(turn=1), Medium.SSD, Reason.ONE_SHOT),
        (Hints(turn=2), Medium.SSD, Reason.ONE_SHOT),  # earlier replies unknown: no evidence of a short chat
        (Hints(), Medium.SSD, Reason.ONE_SHOT),
    ],
)
def test_table_2(hints: Hints, medium: Medium, reason: Reason) -> None:
    assert decide(hints, CFG) == Decision(medium, reason)


def test_overflow_sends_dram_decisions_to_ssd() -> None:
    assert overflow(Decision(Medium.DRAM, Reason.SHORT_CHAT)) == Decision(Medium.SSD, Reason.DRAM_FULL)
    ssd = Decision(Medium.SSD, Reason.ONE_SHOT)
    assert overflow(ssd) is ssd


def test_hints_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="hints.turn"):
        Hints(turn=0)
    with pytest.raises(ValueError, match="hints.context_tokens"):
        Hints(context_tokens=-1)
    with pytest.raises(ValueError, match="prev_reply_tokens"):
        Hints(prev_reply_tokens=(1, -2))
    with pytest.raises(ValueError, match="unknown field.*turns"):
        Hints.from_dict({"turns": 2})
    assert Hints.from_dict({"turn": 2, "prev_reply_tokens": [1, 2]}).prev_reply_tokens == (1, 2)


def test_config_validation_and_counts() -> None:
    with pytest.raises(ValueError, match="agent_context_tokens"):
        PlacementConfig(agent_context_tokens=0)
    counts = PlacementCounts()
    counts.add(Decision(Medium.SSD, Reason.ONE_SHOT), 3)
    counts.add(Decision(Medium.DRAM, Reason.SHARED_PROMPT), 2)
    counts.add(Decision(Medium.SSD, Reason.ONE_SHOT), 1)
    assert counts.snapshot() == {"dram/shared_prompt": 2, "ssd/one_shot": 4}
