"""The layer-overlap rule both sides of the main job are charged by (loadgen/overlap.py)."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake.loadgen.overlap import even_arrivals, latest, prefill_end

pytestmark = pytest.mark.unit


def test_a_hand_computed_prefill_waits_only_for_each_layer() -> None:
    # 4 layers of 1 s: layer l computes once it has arrived and layer l-1 is done.
    # Fast restore: e = 1.5, 2.5, 3.5, 4.5 (only layer 0's wait shows).
    assert prefill_end(0.0, [0.5, 1.0, 1.5, 2.0], 4, 4.0) == pytest.approx(4.5)
    # Slow restore: e = 3, 5, 7, 9: the last layer's arrival plus one layer of compute, where waiting for
    # the whole restore first (the rule before) charged 8 + 4 = 12.
    assert prefill_end(0.0, [2.0, 4.0, 6.0, 8.0], 4, 4.0) == pytest.approx(9.0)
    assert prefill_end(3.0, [], 4, 4.0) == 7.0  # nothing restored: compute alone
    assert prefill_end(0.0, [0.0] * 4, 4, 4.0) == 4.0  # everything already there


def test_the_closed_form_equals_the_layer_by_layer_recursion() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        layers = int(rng.integers(1, 64))
        start, compute = float(rng.uniform(0, 5)), float(rng.uniform(0, 3))
        arrivals = np.sort(start + rng.uniform(0, 4, layers)).tolist()
        end, c = start, compute / layers
        for a in arrivals:
            end = max(a, end) + c
        assert prefill_end(start, arrivals, layers, compute) == pytest.approx(end)


def test_even_arrivals_and_the_latest_of_several_restores() -> None:
    assert even_arrivals(1.0, 3.0, 4) == [1.5, 2.0, 2.5, 3.0]
    assert latest([1.0, 5.0], [2.0, 3.0], []) == [2.0, 5.0] and latest([], []) == []
    with pytest.raises(ValueError, match="arrivals"):
        prefill_end(0.0, [1.0], 2, 1.0)
