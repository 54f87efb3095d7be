import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake.errors import PoolFullError
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Decision, Reason
from flatcake.node_agent.policy.scopes import ScopeTable, Victim, plan_reclaim

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
    assert t.used(Medium.SSD) == used - 1 and t.lookup("x") is None and t.new_keys(["x"]) == [0]


def test_later_turns_append_to_the_parent_scope_layer_major() -> None:
    t = table()
    first = t.reserve(["a", "b"], None, SSD)
    t.publish(first)
    second = t.reserve(["c", "d", "e"], "b", DRAM)  # the decision is overridden by inheritance
    t.publish(second)
    assert second.scope is first.scope and second.decision.reason is Reason.INHERITED
    # File holds 4 pages of 2 layers: 2 pages fit after turn 1, the third continues in a new file.
    assert [(s.file, s.offset, s.first_page, s.pages) for s in second.segments] == [
        (first.segments[0].file, 2 * 2 * 4096, 0, 2),
        (second.segments[1].file, 0, 2, 1),
    ]
    loc_c, loc_d = t.lookup("c"), t.lookup("d")
    assert loc_c is not None and loc_d is not None
    assert loc_c.layer_stride == 2 * 4096 and loc_d.gva - loc_c.gva == 4096


def test_full_pool_raises_and_changes_nothing() -> None:
    t = table()
    held = t.reserve([f"k{i}" for i in range(16)], None, SSD)  # all 4 files, pinned (in flight)
    before = (t.used(Medium.SSD), dict(t.entries))
    with pytest.raises(PoolFullError, match="file_count"):
        t.reserve(["z"], None, SSD)
    assert (t.used(Medium.SSD), dict(t.entries)) == before and t.new_keys(["z"]) == [0]
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
    assert t.pin(["a1"], [loc]) == []  # 'a' is oldest but pinned by a reader
    res = t.reserve(["d1"], None, SSD)  # 4th file crosses the high watermark: reclaim to the low one
    t.publish(res)
    assert t.lookup("a1") is not None  # pinned: never reclaimed
    assert t.lookup("b1") is None and t.lookup("b4") is None  # whole scope gone
    assert t.reclaimed[Medium.SSD].scopes >= 1
    t.unpin({loc.scope})


def test_pin_detects_a_reclaimed_entry() -> None:
    t = table()
    res = t.reserve(["a"], None, SSD)
    t.publish(res)
    stale = t.lookup("a")
    assert stale is not None
    t._free_scope(res.scope, count=True)
    assert t.pin(["a"], [stale]) == [0]


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
