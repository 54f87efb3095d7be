from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.node_agent.policy.coalesce import coalesce, layer_groups, pack, plan_host, plan_restore

pytestmark = pytest.mark.unit

PAGE = 4096
Desc = tuple[int, int, int]  # file, offset, length


@st.composite
def descriptor_sets(draw: st.DrawFn) -> list[Desc]:
    """Page-aligned, non-overlapping ranges spread over a few files, in random order."""
    out: list[Desc] = []
    for f in range(draw(st.integers(1, 3))):
        for s in draw(st.sets(st.integers(0, 200), max_size=40)):
            pages = draw(st.integers(1, 3))
            if any(g == f and o < (s + pages) * PAGE and s * PAGE < o + n for g, o, n in out):
                continue
            out.append((f, s * PAGE, pages * PAGE))
    return draw(st.permutations(out))


def merge(desc: list[Desc], gap: int, max_bytes: int):  # type: ignore[no-untyped-def]
    f, o, n = zip(*desc, strict=True) if desc else ((), (), ())
    return coalesce(list(f), list(o), list(n), gap, max_bytes)


@settings(max_examples=200, deadline=None)
@given(
    descriptor_sets(),
    st.sampled_from([0, PAGE, 4 * PAGE, 16 * PAGE]),
    st.sampled_from([3 * PAGE, 8 * PAGE, 1 << 20]),
)
def test_merged_ranges_cover_every_request_and_only_bridge_small_holes(
    desc: list[Desc], gap: int, max_bytes: int
) -> None:
    cmds = merge(desc, gap, max_bytes)
    seen = sorted(i for c in range(len(cmds)) for i, _, _ in cmds.pieces(c))
    assert seen == list(range(len(desc)))  # every request, exactly once
    for c in range(len(cmds)):
        file, offset, length = int(cmds.file[c]), int(cmds.offset[c]), int(cmds.length[c])
        assert length <= max_bytes
        covered = []
        for i, start, n in cmds.pieces(c):
            f, o, ln = desc[i]
            assert (f, offset + start, n) == (file, o, ln)
            assert start >= 0 and start + n <= length
            covered.append((start, start + n))
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == length  # nothing read outside the pieces' span
        for (_, end), (start, _) in itertools.pairwise(covered):
            assert start - end < max(gap, 1)  # extra bytes come only from holes smaller than Δgap
    assert cmds.requested() == sum(n for _, _, n in desc)
    # Commands of one file never overlap, and consecutive ones split only at a big hole or the cap.
    ordered = sorted(range(len(cmds)), key=lambda c: (cmds.file[c], cmds.offset[c]))
    for a, b in itertools.pairwise(ordered):
        if cmds.file[a] == cmds.file[b]:
            hole = int(cmds.offset[b] - (cmds.offset[a] + cmds.length[a]))
            assert hole >= 0
            assert hole >= gap or int(cmds.length[a]) + hole + int(cmds.length[b]) > max_bytes


def test_gap_zero_merges_exact_neighbours_only() -> None:
    desc = [(0, 0, PAGE), (0, PAGE, PAGE), (0, 3 * PAGE, PAGE)]
    spans = lambda c: list(zip(c.offset.tolist(), c.length.tolist(), strict=True))  # noqa: E731
    assert spans(merge(desc, 0, 1 << 20)) == [(0, 2 * PAGE), (3 * PAGE, PAGE)]
    assert spans(merge(desc, 2 * PAGE, 1 << 20)) == [(0, 4 * PAGE)]
    assert len(merge(desc, PAGE, 1 << 20)) == 2  # a hole of exactly Δgap is not bridged


def test_different_files_never_merge() -> None:
    assert len(merge([(0, 0, PAGE), (1, PAGE, PAGE)], 1 << 20, 1 << 20)) == 2


def test_errors() -> None:
    with pytest.raises(ValueError, match="gap"):
        merge([], -1, PAGE)
    with pytest.raises(ValueError, match="exceeds the staging slot"):
        merge([(0, 0, 2 * PAGE)], 0, PAGE)
    with pytest.raises(ValueError, match="length > 0"):
        merge([(0, 0, 0)], 0, PAGE)
    assert len(merge([], 0, PAGE)) == 0


def test_pack_fills_slots_in_order() -> None:
    assert pack(np.array([2, 2, 2, 2, 2]) * PAGE, 5 * PAGE) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="exceeds the staging slot"):
        pack(np.array([6 * PAGE]), 5 * PAGE)


def test_plan_restore_is_in_layer_order_and_one_read_per_segment_layer() -> None:
    # Two segments in one file (4 pages, then 2 pages) and one in another; 3 layers.
    file = np.array([0, 0, 0, 0, 0, 0, 1])
    seg1 = [j * PAGE for j in range(4)]
    seg2 = [3 * 4 * PAGE + j * PAGE for j in range(2)]
    base = np.array([*seg1, *seg2, 0])
    stride = np.array([4 * PAGE] * 4 + [2 * PAGE] * 2 + [PAGE])
    fills = plan_restore(file, base, stride, 3, PAGE, 0, 7 * PAGE)  # a slot holds one layer: one at a time
    assert [f.layer for f in fills] == [0, 1, 2]
    for f in fills:
        assert len(f.commands) == 3  # one command per segment-layer
        assert f.commands.requested() == 7 * PAGE
    fills = plan_restore(file, base, stride, 3, PAGE, 0, 4 * PAGE)
    assert [f.layer for f in fills] == [0, 0, 1, 1, 2, 2] and all(f.nbytes <= 4 * PAGE for f in fills)
    # A slot of many layers: layer 0 alone, then layers 1 and 2 of each segment in one command each
    # (a segment's layers are back to back), pieces numbered layer-major within the group.
    fills = plan_restore(file, base, stride, 3, PAGE, 0, 1 << 20)
    assert [(f.layer, f.last_layer) for f in fills] == [(0, 0), (1, 2)]
    assert len(fills[0].commands) == 3 and len(fills[1].commands) == 3
    assert fills[1].commands.requested() == 2 * 7 * PAGE
    pieces = fills[1].commands.pieces(0)  # segment 1, layers 1 and 2: pages 0-3, then 0-3 again
    assert [i for i, _, _ in pieces] == [0, 1, 2, 3, 7, 8, 9, 10]
    assert [start for _, start, _ in pieces] == [j * PAGE for j in range(8)]


def test_layer_groups_keep_the_first_layer_alone_and_fill_a_slot_after() -> None:
    assert layer_groups(43, 100, 1000) == [(0, 1), *[(f, min(43, f + 10)) for f in range(1, 43, 10)]]
    assert layer_groups(3, 1000, 1000) == [(0, 1), (1, 2), (2, 3)]  # a layer fills the slot: one at a time
    assert layer_groups(1, 1, 1 << 20) == [(0, 1)] and layer_groups(0, 1, 1) == []
    groups = layer_groups(80, 3 * 4096, 8 << 20)
    assert [g for g in groups for _ in range(g[1] - g[0])] and sum(e - f for f, e in groups) == 80


@settings(max_examples=200, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 200), st.integers(1, 8)), min_size=1, max_size=60),
    gap=st.sampled_from([0, 512, 4096]),
    cap=st.integers(8, 40),
)
def test_capped_commands_never_exceed_max_bytes_even_with_overlaps(ranges: list[Desc], gap: int, cap: int) -> None:
    f, o, n = (np.array(x, np.int64) for x in zip(*ranges, strict=True))
    o, n = o * 512, n * 512
    c = coalesce(f, o, n, gap, cap * 512)
    assert (c.length <= cap * 512).all()
    assert sorted(c.piece_index.tolist()) == list(range(len(f)))  # each piece in exactly one command
    owner = np.repeat(np.arange(len(c)), np.diff(c.piece_ptr))
    assert (c.piece_start >= 0).all() and (c.piece_start + c.piece_length <= c.length[owner]).all()


def test_plan_host_merges_a_segments_layers_and_keeps_layer_0_alone() -> None:
    # Two segments of 3 pages (stride 3 pages), 5 layers; 1 page of a third segment.
    file = np.array([0, 0, 0, 1, 1, 1, 0], np.int64)
    base = np.array([0, 1, 2, 0, 1, 2, 100], np.int64) * PAGE
    stride = np.array([3, 3, 3, 3, 3, 3, 1], np.int64) * PAGE
    plan = plan_host(file, base, stride, 5, PAGE, 0, 1 << 20)
    assert plan.first_layer.tolist() == [0, 0, 0, 1, 1, 1]  # layer 0 of each segment, then the rest
    assert sorted(plan.commands.length.tolist()[3:]) == [4 * PAGE, 12 * PAGE, 12 * PAGE]  # layers 1-4 back to back
    pieces = sorted(plan.commands.piece_index.tolist())
    assert pieces == list(range(5 * 7))
    small = plan_host(file, base, stride, 5, PAGE, 0, 6 * PAGE)  # capped: layers 1-4 of a segment in two
    assert (small.commands.length <= 6 * PAGE).all() and small.first_layer.tolist() == sorted(small.first_layer)
    assert len(small.commands) == 3 + 2 + 2 + 1
