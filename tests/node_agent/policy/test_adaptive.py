"""Adaptive placement (``placement.mode: adaptive``) against Table 2 on a workload with known reuse
distances, through the agent's own catalog (no I/O): sessions that come back every round, and
sessions that come back only after DRAM has turned over."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from flatcake.errors import ConfigError
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy.adaptive import ReuseModel
from flatcake.node_agent.policy.gva import SSD_THRESHOLD, Medium
from flatcake.node_agent.policy.placement import Decision, Hints, Reason
from flatcake.node_agent.policy.scopes import ScopeTable

pytestmark = pytest.mark.unit

LAYERS, PAGE = 2, 4096


@dataclass
class Outcome:
    asked: int = 0
    hits: dict[tuple[str, str], int] = field(default_factory=dict)  # (fast|slow, dram|ssd) -> pages
    dram_placed: set[str] = field(default_factory=set)
    dram_read: set[str] = field(default_factory=set)
    reasons: dict[tuple[str, str], int] = field(default_factory=dict)  # (fast|slow, reason) -> pages
    model: ReuseModel | None = None

    def hit_rate(self) -> float:
        return sum(self.hits.values()) / self.asked

    def dram_accuracy(self) -> float:
        """Of the pages placed in DRAM, the share read back from DRAM (not reclaimed first)."""
        return len(self.dram_read & self.dram_placed) / len(self.dram_placed)


def replay(mode: str, *, fast: int = 3, slow: int = 6, every: int = 6, rounds: int = 48, dram: int = 24) -> Outcome:
    """Short-chat sessions (Table 2 sends their later turns to DRAM) of 4 turns of 2 pages each, then a
    new session in their place. ``fast`` ones come back every round (their contexts fill DRAM); ``slow``
    ones every ``every`` rounds, by then DRAM has reclaimed what they left there. Each turn looks its
    history up, leases what is stored (a restore), and writes what was missing plus its new pages."""
    table = ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=64 * LAYERS * PAGE, files=64,
                       dram_slots=dram, adaptive=mode == "adaptive", copies=mode == "copies")  # fmt: skip
    cat = LocalCatalog(table, PlacementConfig(mode=mode))
    out = Outcome()
    history: dict[int, list[str]] = {}
    generation: dict[int, int] = {}
    for r in range(rounds):
        for s in range(fast + slow):
            cls = "fast" if s < fast else "slow"
            if cls == "slow" and (r + s) % every:
                continue
            keys = history.setdefault(s, [])
            if len(keys) >= 8:
                generation[s] = generation.get(s, 0) + 1
                keys = history[s] = []
            n = cat.exists(keys) if keys else 0
            out.asked += len(keys)
            if n:
                lease = cat.acquire(keys[:n])
                for key, loc in zip(keys[:n], lease.locations, strict=True):
                    medium = "ssd" if loc.gva >= SSD_THRESHOLD else "dram"
                    out.hits[(cls, medium)] = out.hits.get((cls, medium), 0) + 1
                    if medium == "dram":
                        out.dram_read.add(key)
                cat.release(lease.id)
            turn = len(keys) // 2 + 1
            new = [f"s{s}-g{generation.get(s, 0)}-p{len(keys) + j}" for j in range(2)]
            put = keys[n:] + new  # what was lost is recomputed and written again
            hints = Hints(turn=turn, prev_reply_tokens=(100,) * (turn - 1), parent_key=keys[n - 1] if n else None)
            alloc = cat.allocate(put, hints)
            assert alloc is not None
            cat.publish(alloc.id, [0] * len(alloc.index))
            placed = [put[i] for i in alloc.index]
            if alloc.medium is Medium.DRAM:
                out.dram_placed.update(placed)
            out.reasons[(cls, alloc.reason)] = out.reasons.get((cls, alloc.reason), 0) + len(placed)
            history[s] = keys + new
    out.model = table.reuse
    return out


def test_adaptive_keeps_what_comes_back_late_and_dram_for_what_comes_back_soon() -> None:
    table2, adaptive = replay("table2"), replay("adaptive")
    # Table 2 sends the slow sessions' later turns to DRAM, which reclaims them (their only copy)
    # before they come back: they are recomputed. Adaptive learns that distance and puts them on SSD.
    assert table2.hits.get(("slow", "dram"), 0) == 0 and table2.hit_rate() < 0.9
    assert adaptive.hit_rate() == 1.0
    assert adaptive.model is not None and adaptive.model.to_ssd > 0  # then they join their SSD scopes
    assert not any(cls == "slow" and medium == "dram" for cls, medium in adaptive.hits)
    # The fast sessions keep DRAM (no fewer DRAM hits than under Table 2), and what DRAM holds is read.
    assert adaptive.hits[("fast", "dram")] >= table2.hits[("fast", "dram")]
    # A session's last turn is never read again: 2 of its 3 DRAM turns are, the most any rule can get.
    assert table2.dram_accuracy() < adaptive.dram_accuracy() == pytest.approx(2 / 3)


def test_copies_mode_keeps_table2s_homes_where_adaptive_moves_them() -> None:
    """Copies mode learns the same distances but places every home as Table 2 does: the slow sessions'
    short-chat turns stay DRAM-only (never written to SSD), and DRAM serves the rest as copies."""
    table2, adaptive, copies = replay("table2"), replay("adaptive"), replay("copies")
    assert adaptive.model is not None and adaptive.model.to_ssd > 0
    assert copies.model is not None and copies.model.samples > 0 and copies.model.to_ssd == copies.model.to_dram == 0
    assert {reason for _, reason in copies.reasons} == {reason for _, reason in table2.reasons}
    assert not {Reason.REUSE_BEYOND_DRAM, Reason.REUSE_WITHIN_DRAM} & {reason for _, reason in copies.reasons}


def test_the_rule_against_the_measured_residence() -> None:
    model = ReuseModel()
    dram = Decision(Medium.DRAM, Reason.SHORT_CHAT)
    ssd = Decision(Medium.SSD, Reason.ONE_SHOT)
    # DRAM has never reclaimed: it keeps whatever it takes, so DRAM choices stand and every session
    # that has come back goes there; one with no history of its own stays where Table 2 put it.
    assert model.adjust(dram, session_reuse=10_000) == dram
    assert model.adjust(ssd, session_reuse=10_000) == Decision(Medium.DRAM, Reason.REUSE_WITHIN_DRAM)
    assert model.adjust(ssd, session_reuse=None) == ssd
    model.reclaimed(100)
    assert model.adjust(dram, session_reuse=50) == dram
    assert model.adjust(dram, session_reuse=150) == Decision(Medium.SSD, Reason.REUSE_BEYOND_DRAM)
    # A pool that still holds a scope idle for 400 ticks keeps scopes at least that long.
    assert model.adjust(dram, session_reuse=150, oldest_idle=400) == dram
    ssd = Decision(Medium.SSD, Reason.AGENT_SESSION)
    assert model.adjust(ssd, session_reuse=40) == Decision(Medium.DRAM, Reason.REUSE_WITHIN_DRAM)
    assert model.adjust(ssd, session_reuse=80) == ssd  # promotion needs reuse well within the residence
    assert model.adjust(ssd, session_reuse=None) == ssd  # no evidence of its own: the mean never promotes


def test_the_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match="placement.mode: 'lru' must be one of table2, adaptive"):
        PlacementConfig(mode="lru")


def test_a_promotion_takes_free_dram_only_and_never_reclaims_for_itself() -> None:
    table = ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=64 * LAYERS * PAGE, files=8,
                       dram_slots=4, adaptive=True)  # fmt: skip
    ssd = Decision(Medium.SSD, Reason.ONE_SHOT)
    first = table.reserve(["a0", "a1"], None, ssd)
    table.publish(first)
    found = table.pin(["a0", "a1"])  # the session comes back: its reuse distance is measured
    table.unpin(set(found.scope.tolist()))
    full = table.reserve(["d0", "d1", "d2", "d3"], None, Decision(Medium.DRAM, Reason.SHARED_PROMPT))
    table.publish(full)
    # DRAM has never reclaimed: the session's next turn is promoted, but DRAM is full and a promotion
    # does not evict the shared prompt: the turn stays on SSD.
    turn = table.reserve(["a2"], "a1", ssd)
    assert turn.scope.medium is Medium.SSD and full.scope.id in table.scopes
    assert table.reuse is not None and table.reuse.to_dram == 1 and table.reclaimed[Medium.DRAM].scopes == 0
    table.publish(turn)
    # With room, the same promotion lands in DRAM.
    roomy = ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=64 * LAYERS * PAGE, files=8,
                       dram_slots=8, adaptive=True)  # fmt: skip
    roomy.publish(roomy.reserve(["a0", "a1"], None, ssd))
    roomy.unpin(set(roomy.pin(["a0", "a1"]).scope.tolist()))
    assert roomy.reserve(["a2"], "a1", ssd).scope.medium is Medium.DRAM
