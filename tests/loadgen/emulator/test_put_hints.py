"""The emulator tells FlatCake what SGLang's backend would about each put (node_agent/sglang/signals.py)."""

from __future__ import annotations

import pytest

from flatcake.loadgen.emulator.storage import put_hints
from flatcake.node_agent import Medium, PlacementConfig, decide

pytestmark = pytest.mark.unit


def test_a_branch_after_a_shared_prefix_begins_a_session_of_its_own() -> None:
    h = put_hints("prompt-end", siblings=3, appended_tokens=512, context_tokens=4096)
    assert (h.turn, h.prefix_refcount, h.prev_reply_tokens, h.parent_key) == (1, 1, (), "prompt-end")
    assert decide(h, PlacementConfig()).medium is Medium.SSD  # one-shot, not a 'shared prompt' in DRAM


def test_a_continuation_is_a_next_turn_reporting_what_it_appended() -> None:
    h = put_hints("turn-1-end", siblings=1, appended_tokens=256, context_tokens=2048)
    assert (h.turn, h.prefix_refcount, h.prev_reply_tokens) == (2, 1, (256,))
    long = put_hints("turn-1-end", siblings=1, appended_tokens=4096, context_tokens=8192)
    assert decide(long, PlacementConfig()).medium is Medium.SSD  # a long appended turn is agent work
    first = put_hints(None, siblings=1, appended_tokens=256, context_tokens=256)
    assert first.turn == 1 and first.parent_key is None
