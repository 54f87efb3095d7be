import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake.errors import PoolFullError
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Decision, Reason
from flatcake.node_agent.policy.reclaim import Victim, plan_reclaim
from flatcake.node_agent.policy.scopes import ScopeTable

pytestmark = pytest.mark.unit

SSD = Decision(Medium.SSD, Reason.ONE_SHOT)
DRAM = Decision(Medium.DRAM, Reason.SHARED_PROMPT)


def table(**kw: float) -> ScopeTable:
    args = dict(
        node_id=3,
        layers=2,
        page_bytes=4096,
        file_bytes=4 * 2 * 4096,
        files=4,
        dram_slots=4,
        high_watermark=1.0,
        low_watermark=1.0,
    )
    args.update(kw)
    return ScopeTable(**args)  # type: ignore[arg-type]


def test_publish_after_reserve_and_abort_frees_space() -> None:
    t = table()
    res = t.reserve(["a", "b"], None, SSD)
    assert t.lookup("a") is None  # reserved, not yet visible
    assert t.new_keys(["a", "c"]) == [1]  # a write in flight is not written twice
    t.publish(res)
    assert t.hit_prefix(["a", "b", "c"]) == 2
    res2 = t.reserve(["x"], None, SSD)
    used = t.used(Medium.SSD)
    t.abort(res2)
    assert t.used(Medium.SSD) == used - 2 * 4096 and t.lookup("x") is None and t.new_keys(["x"]) == [0]


def test_later_turns_append_to_the_parent_scope_layer_major() -> None:
    t = table()
    first = t.reserve(["a", "b"], None, SSD)
    t.publish(first)
    second = t.reserve(["c", "d"], "b", SSD)  # no evidence for the other medium: it joins, inherited
    t.publish(second)
    assert second.scope is first.scope and second.decision.reason is Reason.INHERITED
    # A file holds 4 pages of 2 layers: turn 2 extends the scope's extent in place, right after turn 1.
    f = first.segments[0].file
    assert [(s.file, s.offset, s.first_page, s.pages) for s in second.segments] == [(f, 2 * 2 * 4096, 0, 2)]
    assert first.scope.extents == [(f, 0, 4 * 2 * 4096)]
    loc_c, loc_d = t.lookup("c"), t.lookup("d")
    assert loc_c is not None and loc_d is not None
    assert loc_c.layer_stride == 2 * 4096 and loc_d.gva - loc_c.gva == 4096
    # Turn 3 does not fit after it: it takes one new extent holding the whole turn (one segment).
    third = t.reserve(["e", "f", "g"], "d", SSD)
    t.publish(third)
    assert [(s.file, s.offset, s.first_page, s.pages) for s in third.segments] == [(f + 1, 0, 0, 3)]
    assert first.scope.extents == [(f, 0, 4 * 2 * 4096), (f + 1, 0, 3 * 2 * 4096)]


def test_many_scopes_share_a_file_and_a_freed_extent_is_reused() -> None:
    t = table()
    scopes = [t.reserve([f"s{i}"], None, SSD) for i in range(4)]
    for r in scopes:
        t.publish(r)
    assert {r.segments[0].file for r in scopes} == {0}  # four one-page sessions, one file
    assert [r.segments[0].offset for r in scopes] == [i * 2 * 4096 for i in range(4)]
    t._free_scope(scopes[1].scope, count=True)
    again = t.reserve(["n"], None, SSD)
    assert (again.segments[0].file, again.segments[0].offset) == (0, 2 * 4096)  # first fit: the hole


def test_a_put_larger_than_any_free_run_is_split_across_runs() -> None:
    t = table()
    held = [t.reserve([f"k{i}"], None, SSD) for i in range(16)]
    for r in held:
        t.publish(r)
    for r in held[::2]:  # every other page free: 8 pages free, no two adjacent
        t._free_scope(r.scope, count=True)
    res = t.reserve([f"big{i}" for i in range(3)], None, SSD)
    assert [s.pages for s in res.segments] == [1, 1, 1] and t.ssd.free_bytes == 5 * 2 * 4096
    t.abort(res)
    assert t.ssd.free_bytes == 8 * 2 * 4096 and not res.scope.extents


def test_full_pool_raises_and_changes_nothing() -> None:
    t = table()
    held = t.reserve([f"k{i}" for i in range(16)], None, SSD)  # all 4 files, pinned (in flight)
    before = (t.used(Medium.SSD), dict(t.items()))
    with pytest.raises(PoolFullError, match="file_count"):
        t.reserve(["z"], None, SSD)
    assert (t.used(Medium.SSD), dict(t.items())) == before and t.new_keys(["z"]) == [0]
    t.publish(held)


def test_reclaim_frees_whole_unpinned_scopes_oldest_first() -> None:
    t = table(high_watermark=0.75, low_watermark=0.5)
    scopes = []
    for name in "abc":
        res = t.reserve([name + "1", name + "2", name + "3", name + "4"], None, SSD)
        t.publish(res)
        scopes.append(res.scope)
    loc = t.lookup("a1")
    assert loc is not None
    assert t.pin(["a1"]).hit.all()  # 'a' is oldest but pinned by a reader
    res = t.reserve(["d1"], None, SSD)  # 4th file crosses the high watermark: reclaim to the low one
    t.publish(res)
    assert t.lookup("a1") is not None  # pinned: never reclaimed
    assert t.lookup("b1") is None and t.lookup("b4") is None  # whole scope gone
    assert t.reclaimed[Medium.SSD].scopes >= 1
    t.unpin({loc.scope})


def test_pin_detects_a_reclaimed_entry_and_pins_nothing() -> None:
    t = table()
    res = t.reserve(["a"], None, SSD)
    t.publish(res)
    other = t.reserve(["b"], None, SSD)
    t.publish(other)
    t._free_scope(res.scope, count=True)
    assert t.pin(["b", "a"]).hit.tolist() == [True, False]  # looked up and pinned in one step, under the lock
    assert other.scope.pins == 0  # not every key was there: nothing pinned


def test_dram_full_overflows_to_ssd() -> None:
    t = table()
    t.publish(t.reserve(["a", "b", "c", "d"], None, DRAM))
    r = t.reserve(["e"], None, DRAM)  # DRAM has 4 slots; reclaim needs an unpinned scope
    assert r.scope.medium is Medium.DRAM or r.decision.reason is Reason.DRAM_FULL


@given(st.lists(st.tuples(st.integers(1, 5), st.booleans()), max_size=12), st.integers(0, 20), st.integers(0, 5))
def test_plan_reclaim_never_picks_pinned_and_goes_oldest_first(
    scopes: list[tuple[int, bool]], used: int, need: int
) -> None:
    victims = [Victim(i, i, units, pinned) for i, (units, pinned) in enumerate(scopes)]
    chosen = plan_reclaim(victims, used, 20, need, 0.8, 0.5)
    assert all(not victims[i].pinned for i in chosen)
    assert chosen == sorted(chosen)  # oldest (smallest last_used) first
    if used + need <= 16:
        assert chosen == []


def test_only_a_continuation_of_a_scopes_last_page_joins_it() -> None:
    """Session A stores a shared prompt and its own turn; session B's put starts after the prompt's last
    page, inside A's run: B gets a scope of its own (placed by its own decision), not A's."""
    t = table()
    a = t.reserve(["sys0", "sys1", "a0", "a1"], None, SSD)
    t.publish(a)
    b = t.reserve(["b0", "b1"], "sys1", DRAM)  # "sys1" is stored, but A's run goes on after it
    t.publish(b)
    assert b.scope is not a.scope and b.decision == DRAM
    a2 = t.reserve(["a2"], "a1", SSD)  # A's next turn continues its last page: joins, SSD inherited
    t.publish(a2)
    assert a2.scope is a.scope and a2.decision.reason is Reason.INHERITED
    b2 = t.reserve(["b2"], "b1", SSD)
    t.publish(b2)
    assert b2.scope is b.scope and b2.scope.medium is Medium.DRAM


def test_a_continuation_whose_signals_name_the_other_medium_starts_a_scope_there() -> None:
    """Peers, not tiers: a one-shot first turn on SSD, then short chat turns, go to DRAM in a scope of
    their own, which later short turns join; a turn grown into an agent session goes back to SSD. Nothing
    already written moves. Without the rule every later turn inherited SSD and DRAM held no session."""
    short, agent = Decision(Medium.DRAM, Reason.SHORT_CHAT), Decision(Medium.SSD, Reason.AGENT_SESSION)
    t = table()
    first = t.reserve(["t1"], None, SSD)
    t.publish(first)
    second = t.reserve(["t2"], "t1", short)
    t.publish(second)
    assert second.scope is not first.scope and second.scope.medium is Medium.DRAM
    assert second.decision == short and first.scope.medium is Medium.SSD
    third = t.reserve(["t3"], "t2", short)
    t.publish(third)
    assert third.scope is second.scope and third.decision.reason is Reason.INHERITED
    fourth = t.reserve(["t4"], "t3", agent)
    t.publish(fourth)
    assert fourth.scope.medium is Medium.SSD and fourth.scope is not first.scope
    assert [t.lookup(k) is not None for k in ("t1", "t2", "t3", "t4")] == [True] * 4
    fifth = t.reserve(["t5"], "t4", SSD)  # one-shot is no evidence: it joins
    t.publish(fifth)
    assert fifth.scope is fourth.scope and fifth.decision.reason is Reason.INHERITED
