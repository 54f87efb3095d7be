"""Load or decline (node_agent/policy/offer.py): a load is waited for only where computing costs more."""

from __future__ import annotations

import pytest

from flatcake.node_agent.policy import offer

pytestmark = pytest.mark.unit


def test_a_load_that_lands_before_the_gpus_turn_is_always_taken() -> None:
    o = offer.decide(ready_s=2.0, gpu_s=3.0, recompute_s=0.01)
    assert o.load and o.reason == "lands before the GPU's turn"


def test_a_load_past_the_gpus_turn_is_taken_while_the_delay_is_shorter_than_computing() -> None:
    assert offer.decide(ready_s=1.4, gpu_s=1.0, recompute_s=0.5).load  # 0.4 s late against 0.5 s of prefill
    o = offer.decide(ready_s=1.6, gpu_s=1.0, recompute_s=0.5)
    assert not o.load and o.reason == "computing beats waiting"


def test_always_waits_as_the_papers_fc_mas() -> None:
    assert offer.decide(ready_s=100.0, gpu_s=0.0, recompute_s=0.1, rule="always").load
    with pytest.raises(ValueError, match="wait rule"):
        offer.decide(1.0, 0.0, 1.0, rule="sometimes")


def test_read_time_counts_the_backlog_the_queue_ahead_and_its_own_bytes() -> None:
    assert offer.read_s(backlog_s=0.5, queued_bytes=1000, own_bytes=1000, bytes_per_s=1000.0) == pytest.approx(2.5)
    assert offer.read_s(
        backlog_s=-3.0, queued_bytes=0, own_bytes=500, bytes_per_s=1000.0, command_s=0.1
    ) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="read rate"):
        offer.read_s(0.0, 0, 1, 0.0)
