from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.node_agent.coalesce import Extent, coalesce, pack, plan_layers

PAGE = 4096


@st.composite
def extent_sets(draw: st.DrawFn) -> list[Extent]:
    """Page-aligned, non-overlapping extents spread over a few files, in random order."""
    files = draw(st.integers(1, 3))
    out: list[Extent] = []
    for f in range(files):
        slots = draw(st.sets(st.integers(0, 200), max_size=40))
        for s in slots:
            pages = draw(st.integers(1, 3))
            if any(e.file == f and e.offset < (s + pages) * PAGE and s * PAGE < e.offset + e.length for e in out):
                continue
            out.append(Extent(f, s * PAGE, pages * PAGE, len(out)))
    return draw(st.permutations(out))


@settings(max_examples=200, deadline=None)
@given(extent_sets(), st.sampled_from([0, PAGE, 4 * PAGE, 16 * PAGE]), st.sampled_from([3 * PAGE, 8 * PAGE, 1 << 20]))
def test_merged_ranges_cover_every_request_and_only_bridge_small_holes(
    extents: list[Extent], gap: int, max_bytes: int
) -> None:
    commands = coalesce(extents, gap, max_bytes)
    seen = sorted(p.tag for c in commands for p in c.pieces)
    assert seen == sorted(e.tag for e in extents)  # every request, exactly once
    by_tag = {e.tag: e for e in extents}
    for c in commands:
        assert c.length <= max_bytes
        covered = []
        for p in c.pieces:
            e = by_tag[p.tag]
            assert e.file == c.file and c.offset + p.start == e.offset and p.length == e.length
            assert p.start >= 0 and p.start + p.length <= c.length
            covered.append((p.start, p.start + p.length))
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == c.length  # no bytes read outside the pieces' span
        for (_, end), (start, _) in itertools.pairwise(covered):
            hole = start - end
            assert hole < max(gap, 1)  # extra bytes come only from holes smaller than Δgap
    # Commands of one file never overlap, and consecutive ones are split only by a big hole or the cap.
    ordered = sorted(commands, key=lambda c: (c.file, c.offset))
    for a, b in itertools.pairwise(ordered):
        if a.file == b.file:
            assert b.offset >= a.offset + a.length
            assert (
                b.offset - (a.offset + a.length) >= gap
                or a.length + (b.offset - a.offset - a.length) + b.length > max_bytes
            )


def test_gap_zero_merges_exact_neighbours_only() -> None:
    ext = [Extent(0, 0, PAGE, 0), Extent(0, PAGE, PAGE, 1), Extent(0, 3 * PAGE, PAGE, 2)]
    assert [(c.offset, c.length) for c in coalesce(ext, 0, 1 << 20)] == [(0, 2 * PAGE), (3 * PAGE, PAGE)]
    assert [(c.offset, c.length) for c in coalesce(ext, 2 * PAGE, 1 << 20)] == [(0, 4 * PAGE)]
    # A hole of exactly Δgap is not bridged: only holes smaller than it are.
    assert len(coalesce(ext, PAGE, 1 << 20)) == 2


def test_different_files_never_merge() -> None:
    ext = [Extent(0, 0, PAGE, 0), Extent(1, PAGE, PAGE, 1)]
    assert len(coalesce(ext, 1 << 20, 1 << 20)) == 2


def test_errors() -> None:
    with pytest.raises(ValueError, match="gap"):
        coalesce([], -1, PAGE)
    with pytest.raises(ValueError, match="exceeds the staging slot"):
        coalesce([Extent(0, 0, 2 * PAGE, 0)], 0, PAGE)


def test_pack_fills_slots_in_order() -> None:
    cmds = coalesce([Extent(0, i * 10 * PAGE, 2 * PAGE, i) for i in range(5)], 0, 1 << 20)
    fills = pack(cmds, 5 * PAGE)
    assert [len(f) for f in fills] == [2, 2, 1]
    assert [c for f in fills for c in f] == cmds


def test_plan_layers_is_in_layer_order() -> None:
    per_layer = [[Extent(0, (layer * 8 + i) * PAGE, PAGE, i) for i in range(4)] for layer in range(3)]
    fills = plan_layers(per_layer, 0, 2 * PAGE)
    assert [f.layer for f in fills] == [0, 0, 1, 1, 2, 2]
    assert [f.last_of_layer for f in fills] == [False, True] * 3
    assert all(f.nbytes <= 2 * PAGE for f in fills)
