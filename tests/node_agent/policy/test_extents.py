"""The extent allocator and the scope table over it: property tests on random put/reclaim sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.errors import PoolFullError
from flatcake.node_agent.policy.extents import Extent, ExtentAllocator
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Decision, Reason
from flatcake.node_agent.policy.scope import Reservation
from flatcake.node_agent.policy.scopes import ScopeTable

pytestmark = pytest.mark.unit

A = 4096
SSD = Decision(Medium.SSD, Reason.ONE_SHOT)


def check_tiling(a: ExtentAllocator, used: list[Extent]) -> None:
    """Used extents and free runs tile every file exactly: no overlap, no leak, exact accounting, and
    no two free runs touch (coalescing)."""
    free = list(a.runs())
    assert a.free_bytes == sum(e.length for e in free)
    assert a.free_bytes + sum(e.length for e in used) == a.capacity
    assert a.used_bytes == sum(e.length for e in used)
    pieces = sorted([(e, True) for e in free] + [(e, False) for e in used])
    for f in range(a.files):
        mine = [(e, is_free) for e, is_free in pieces if e.file == f]
        at = 0
        for (e, is_free), nxt in zip(mine, [*mine[1:], None], strict=True):
            assert e.offset == at and e.length > 0 and e.offset % A == 0 and e.length % A == 0
            at = e.end
            if nxt is not None:
                assert not (is_free and nxt[1]), f"adjacent free runs {e} and {nxt[0]}"
        assert at == a.file_bytes
    assert [a._largest(f) for f in range(a.files)] == [
        max((e.length for e in free if e.file == f), default=0) for f in range(a.files)
    ]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 9 * A)),
        st.tuples(st.just("release"), st.integers(0, 1 << 30)),
        st.tuples(st.just("extend"), st.integers(0, 1 << 30), st.integers(1, 4 * A)),
        st.tuples(st.just("split"), st.integers(0, 1 << 30)),  # give back the tail half of an extent
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(1, 16), ops)
def test_random_alloc_release_sequences_keep_the_pool_exact(files: int, blocks: int, seq: list[tuple]) -> None:
    a = ExtentAllocator(files, blocks * A)
    used: list[Extent] = []
    check_tiling(a, used)
    for op in seq:
        if op[0] == "alloc":
            n = -(-op[1] // A) * A
            fits = [e for e in a.runs() if e.length >= n]
            got = a.alloc(op[1])
            if not fits:  # fails only when no free run is large enough, and then changes nothing
                assert got is None
            else:  # first fit: the lowest run that holds it, from its start
                assert got == Extent(fits[0].file, fits[0].offset, n)
                used.append(got)
        elif used and op[0] == "release":
            a.release(used.pop(op[1] % len(used)))
        elif used and op[0] == "extend":
            i = op[1] % len(used)
            room = a.room_after(used[i])
            grown = a.extend(used[i], op[2])
            assert (grown is not None) == (room >= -(-op[2] // A) * A)
            if grown is not None:
                used[i] = grown
        elif used and op[0] == "split":
            i = op[1] % len(used)
            e = used[i]
            if e.length >= 2 * A:
                keep = e.length // A // 2 * A
                a.release(Extent(e.file, e.offset + keep, e.length - keep))
                used[i] = e._replace(length=keep)
        check_tiling(a, used)
    for e in used:  # everything back: one free run per file again
        a.release(e)
    assert list(a.runs()) == [Extent(f, 0, a.file_bytes) for f in range(files)]


def test_double_free_take_of_used_space_and_bad_ranges_are_refused() -> None:
    a = ExtentAllocator(2, 8 * A)
    x = a.alloc(3 * A)
    assert x == Extent(0, 0, 3 * A)
    a.release(x)
    with pytest.raises(ValueError, match="double free"):
        a.release(x)
    a.take(Extent(1, 2 * A, 2 * A))
    with pytest.raises(ValueError, match="not free"):
        a.take(Extent(1, 3 * A, A))
    for bad in (Extent(2, 0, A), Extent(0, 1, A), Extent(0, 7 * A, 2 * A), Extent(0, 0, 0)):
        with pytest.raises(ValueError):
            a.release(bad)
    assert a.largest() == Extent(0, 0, 8 * A) and a.free_bytes == 14 * A


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15), st.integers(1, 4)), max_size=24))
def test_take_all_leaves_the_pool_as_taking_one_by_one_does(files: int, picks: list[tuple[int, int, int]]) -> None:
    """Recovery's bulk take against ``take`` per extent: the same free runs, largest runs and free bytes;
    an overlap (or a range outside the pool) refused by both, with nothing taken by ``take_all``."""
    extents = [Extent(f % files, o * A, n * A) for f, o, n in picks]
    one, bulk = ExtentAllocator(files, 16 * A), ExtentAllocator(files, 16 * A)
    try:
        for e in extents:
            one.take(e)
    except ValueError:
        with pytest.raises(ValueError):
            bulk.take_all(extents)
        assert bulk.free_bytes == bulk.capacity and list(bulk.runs()) == [Extent(f, 0, 16 * A) for f in range(files)]
        return
    bulk.take_all(extents)
    assert list(bulk.runs()) == list(one.runs()) and bulk.free_bytes == one.free_bytes
    check_tiling(bulk, extents)
    assert bulk.largest() == one.largest()
    if extents:  # it serves only a fresh allocator
        with pytest.raises(ValueError, match="not empty"):
            bulk.take_all(extents)


# ---- the scope table: puts, appends, aborts and reclaim in random order --------------------------
LAYERS, PAGE = 2, A
SPAN = LAYERS * PAGE


def scope_table(files: int, pages_per_file: int, high: float) -> ScopeTable:
    return ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=pages_per_file * SPAN + A, files=files,
                      dram_slots=1, high_watermark=high, low_watermark=high / 2)  # fmt: skip


def check_table(t: ScopeTable, pending: list[Reservation]) -> None:
    extents = [e for s in t.scopes.values() for e in s.extents]
    check_tiling(t.ssd, extents)  # scopes' extents and free runs tile the pool: no overlap, no leak
    for e in extents:
        assert e.offset % SPAN == 0 and e.length % SPAN == 0
    assert all(e.length % SPAN == 0 for e in t.ssd.runs())  # free runs are whole pages
    assert t.used(Medium.SSD) == sum(s.units() for s in t.scopes.values())
    for key, loc in t.items():  # every page lies inside its scope's extents (key: its digest)
        scope = t.scopes[loc.scope]
        assert key in scope.keys
        file, offset = divmod(loc.gva & ((1 << 48) - 1), t.file_bytes)
        for layer in range(LAYERS):
            at = offset + layer * loc.layer_stride
            assert any(e.file == file and e.offset <= at and at + PAGE <= e.end for e in scope.extents)
    for res in pending:
        for seg in res.segments:
            assert any(e.file == seg.file and e.offset <= seg.offset and seg.offset + seg.pages * SPAN <= e.end
                       for e in res.scope.extents)  # fmt: skip


table_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "publish", "abort", "free", "reclaim"]),
        st.integers(0, 1 << 20),
        st.integers(1, 6),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(2, 12), st.sampled_from([1.0, 0.75]), table_ops)
def test_random_put_and_reclaim_sequences_keep_space_exact(
    files: int, pages_per_file: int, high: float, seq: list[tuple[str, int, int]]
) -> None:
    t = scope_table(files, pages_per_file, high)
    assert t.ssd.capacity == files * pages_per_file * SPAN  # the sub-page tail of each file is never used
    pending: list[Reservation] = []
    names = iter(range(1 << 30))
    published: list[str] = []  # the table keeps key digests; the parent hint is a key
    for op, pick, n in seq:
        live = [k for k, loc in zip(published, t.lookup_many(published), strict=True) if loc is not None]
        try:
            if op == "new":
                pending.append(t.reserve([f"k{next(names)}" for _ in range(n)], None, SSD))
            elif op == "append" and live:
                parent = live[pick % len(live)]
                pending.append(t.reserve([f"k{next(names)}" for _ in range(n)], parent, SSD))
        except PoolFullError:
            pass  # refused: too little unpinned space (checked below to change nothing)
        if op in ("publish", "abort") and pending:
            res = pending.pop(pick % len(pending))
            (t.publish if op == "publish" else t.abort)(res)
            published += res.keys if op == "publish" else []
        elif op == "free":
            idle = [s for s in t.scopes.values() if s.pins == 0 and s.keys]
            if idle:
                t._free_scope(idle[pick % len(idle)], count=True)
        elif op == "reclaim":
            t.reclaim(Medium.SSD)
        check_table(t, pending)
    for res in pending:
        t.abort(res)
    for s in list(t.scopes.values()):
        t._free_scope(s, count=True)
    assert t.ssd.free_bytes == t.ssd.capacity and len(list(t.ssd.runs())) == files


def test_a_put_fits_whenever_enough_bytes_are_free_however_fragmented() -> None:
    t = scope_table(2, 8, 1.0)
    ones = [t.reserve([f"p{i}"], None, SSD) for i in range(16)]
    for r in ones:
        t.publish(r)
    for r in ones[1::2]:  # free every other page: 8 one-page runs, none adjacent
        t._free_scope(r.scope, count=True)
    assert max(e.length for e in t.ssd.runs()) == SPAN and t.ssd.free_bytes == 8 * SPAN
    big = t.reserve([f"b{i}" for i in range(8)], None, SSD)  # nothing contiguous, yet it fits
    assert len(big.segments) == 8 and t.ssd.free_bytes == 0
    more = t.reserve(["one-more"], None, SSD)  # the pool is full: the oldest session is reclaimed
    assert t.lookup("p0") is None and (more.segments[0].file, more.segments[0].offset) == (0, 0)
    t.publish(big)
    t.publish(more)
    check_table(t, [])
    with pytest.raises(PoolFullError, match="ssd.file_count"):
        t.reserve([f"x{i}" for i in range(17)], None, SSD)  # more than the whole pool


def test_one_page_scopes_use_the_whole_pool() -> None:
    t = scope_table(4, 10, 1.0)
    res = [t.reserve([f"s{i}"], None, SSD) for i in range(40)]
    for r in res:
        t.publish(r)
    assert len(t.scopes) == 40 and t.ssd.free_bytes == 0
    assert sorted({r.segments[0].file for r in res}) == [0, 1, 2, 3]  # 10 sessions per file
