"""FC-CIO read planning: sort-merge of page-layer descriptors into few large commands. Pure logic.

A restore asks for many ``(file, offset, length)`` ranges, one per page and layer. Sorted by
``(file, offset)``, adjacent ranges merge into one command and holes smaller than ``gap`` are bridged
(a little extra sequential read costs less than a second command). Commands are then packed into
staging slots so a bounded window can stream them.

Descriptors are numpy arrays, not objects: a long-context restore has ``layers x pages`` of them
(43 x 3,400 in the paper's agentic trace) and per-object Python work would cost more than the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Commands:
    """Merged reads (struct of arrays). Command ``c`` covers pieces ``piece_ptr[c]:piece_ptr[c+1]``.

    ``piece_index`` is each piece's position in the request (its destination), ``piece_start`` its
    byte offset inside its command; pieces keep their request order's sort by ``(file, offset)``.
    """

    file: Ints
    offset: Ints
    length: Ints
    piece_ptr: Ints
    piece_index: Ints
    piece_start: Ints
    piece_length: Ints

    def __len__(self) -> int:
        return len(self.file)

    def requested(self, lo: int = 0, hi: int | None = None) -> int:
        hi = len(self) if hi is None else hi
        return int(self.piece_length[self.piece_ptr[lo] : self.piece_ptr[hi]].sum())

    def pieces(self, c: int) -> list[tuple[int, int, int]]:
        """``(index, start, length)`` of command ``c``'s pieces (for tests and debugging)."""
        sl = slice(self.piece_ptr[c], self.piece_ptr[c + 1])
        return list(
            zip(
                self.piece_index[sl].tolist(),
                self.piece_start[sl].tolist(),
                self.piece_length[sl].tolist(),
                strict=True,
            )
        )


def _ints(values: Sequence[int] | Ints) -> Ints:
    return np.asarray(values, dtype=np.int64)


def sort_order(file: Sequence[int] | Ints, offset: Sequence[int] | Ints) -> Ints:
    """The ``(file, offset)`` order of descriptors."""
    return np.lexsort((_ints(offset), _ints(file))).astype(np.int64)


def coalesce(
    file: Sequence[int] | Ints,
    offset: Sequence[int] | Ints,
    length: Sequence[int] | Ints,
    gap: int,
    max_bytes: int,
    order: Ints | None = None,
) -> Commands:
    """Merge descriptors into commands.

    Adjacent or overlapping ranges always merge; a hole is bridged only when it is smaller than ``gap``
    (so ``gap=0`` merges exact neighbours only). No command grows past ``max_bytes``; a descriptor
    longer than that is an error, since it could not be staged. ``order`` may pass a precomputed
    ``sort_order`` (a restore reuses one order for every layer: layers shift offsets within segments).
    """
    if gap < 0:
        raise ValueError(f"gap: {gap} must be >= 0")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: {max_bytes} must be > 0")
    f_in, o_in, n_in = _ints(file), _ints(offset), _ints(length)
    if not len(f_in) == len(o_in) == len(n_in):
        raise ValueError("file, offset and length must have the same number of descriptors")
    if len(n_in) and (n_in.min() <= 0 or o_in.min() < 0):
        raise ValueError("descriptors need offset >= 0 and length > 0")
    if len(n_in) and n_in.max() > max_bytes:
        raise ValueError(f"a descriptor of {n_in.max()} bytes exceeds the staging slot of {max_bytes} bytes")
    idx = sort_order(f_in, o_in) if order is None else order
    f, o, n = f_in[idx], o_in[idx], n_in[idx]
    end = o + n
    if len(idx) == 0:
        empty = np.zeros(0, np.int64)
        return Commands(empty, empty, empty, np.zeros(1, np.int64), empty, empty, empty)
    # Running end of what is merged so far, in one coordinate across files (offsets fit 48 bits, as in
    # a GVA), so the end of one file never reaches into the next.
    base = f << np.int64(48)
    run_end = np.maximum.accumulate(base + end)
    hole = (base + o)[1:] - run_end[:-1]
    split = (f[1:] != f[:-1]) | ((hole > 0) & (hole >= gap))
    starts = np.flatnonzero(np.concatenate(([True], split)))
    starts = _cap(starts, o, end, max_bytes)
    bounds = np.append(starts, len(idx))
    group_end = np.maximum.reduceat(end, starts)
    cmd_offset = o[starts]
    owner = np.repeat(np.arange(len(starts)), np.diff(bounds))
    return Commands(
        file=f[starts],
        offset=cmd_offset,
        length=group_end - cmd_offset,
        piece_ptr=bounds.astype(np.int64),
        piece_index=idx,
        piece_start=o - cmd_offset[owner],
        piece_length=n,
    )


def _cap(starts: Ints, o: Ints, end: Ints, max_bytes: int) -> Ints:
    """Split any group whose span exceeds ``max_bytes``, greedily in order: a command ends before the first
    piece that would take it past ``max_bytes``. One search per cut, not a step per piece (a restore of a
    long context has thousands of pieces per group)."""
    bounds = np.append(starts, len(o))
    spans = np.maximum.reduceat(end, starts) - o[starts]
    big = np.flatnonzero(spans > max_bytes)
    if not len(big):
        return starts
    cuts: list[int] = []
    for g in big.tolist():
        s, e = int(bounds[g]), int(bounds[g + 1])
        # The running end from the group's start bounds every command's span from above (pieces are sorted
        # by offset), so a command cut by it never exceeds max_bytes.
        run_end = np.maximum.accumulate(end[s:e])
        i = 0
        while True:
            j = max(int(np.searchsorted(run_end, o[s + i] + max_bytes, side="right")), i + 1)
            if j >= e - s:
                break
            cuts.append(s + j)
            i = j
    return np.sort(np.concatenate((starts, np.asarray(cuts, dtype=np.int64))))


def pack(lengths: Ints, slot_bytes: int) -> list[tuple[int, int]]:
    """Group commands, in order, into fills ``[lo, hi)`` that each fit one staging slot."""
    fills: list[tuple[int, int]] = []
    lo, used = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if n > slot_bytes:
            raise ValueError(f"command of {n} bytes exceeds the staging slot of {slot_bytes} bytes")
        if i > lo and used + n > slot_bytes:
            fills.append((lo, i))
            lo, used = i, 0
        used += n
    if lo < len(lengths):
        fills.append((lo, len(lengths)))
    return fills


@dataclass(frozen=True)
class Fill:
    """Commands ``lo:hi`` of one layer group's plan: what fills one staging slot.

    The group is layers ``layer .. last_layer`` of the request's ``pages`` SSD pages; piece index
    ``k * pages + i`` is page ``i`` of layer ``layer + k``."""

    layer: int
    commands: Commands
    lo: int
    hi: int
    last_layer: int
    pages: int

    @property
    def nbytes(self) -> int:
        return int(self.commands.length[self.lo : self.hi].sum())


def layer_groups(layers: int, layer_bytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """The layer ranges ``[first, end)`` planned together. Layer 0 alone, so the first layer lands as
    soon as it can; then as many layers as one staging slot holds. A segment's layers lie back to back
    on disk, so a small request (a few pages per segment) reads several layers of a segment in one
    command instead of one command per segment-layer; a large one (a slot's worth per layer) still
    goes one layer at a time."""
    per_group = max(1, slot_bytes // max(layer_bytes, 1))
    groups = [(0, 1)] if layers else []
    first = 1
    while first < layers:
        groups.append((first, min(layers, first + per_group)))
        first += per_group
    return groups


def plan_restore(
    file: Ints, base: Ints, stride: Ints, layers: int, page_bytes: int, gap: int, slot_bytes: int
) -> list[Fill]:
    """The whole restore in layer order. Page ``i`` of layer ``l`` is at ``base[i] + l * stride[i]`` of
    ``file[i]``; fills come in the order of their first layer, so a reader that waits for every fill
    starting at or before layer ``l`` has all of layer ``l``."""
    n = len(file)
    fills: list[Fill] = []
    for first, end in layer_groups(layers, n * page_bytes, slot_bytes):
        count = end - first
        group_file = np.tile(file, count)
        offset = np.concatenate([base + layer * stride for layer in range(first, end)]) if n else base
        length = np.full(n * count, page_bytes, dtype=np.int64)
        cmds = coalesce(group_file, offset, length, gap, slot_bytes)
        fills.extend(Fill(first, cmds, lo, hi, end - 1, n) for lo, hi in pack(cmds.length, slot_bytes))
    return fills


@dataclass(frozen=True)
class HostPlan:
    """A restore planned for reads straight into host memory: ``commands`` in issue order, and for each
    command the lowest layer it holds a piece of (``first_layer``, non-decreasing). Piece index
    ``k * pages + i`` is page ``i`` of layer ``k``. Layer ``l`` is whole once every command whose
    ``first_layer <= l`` has landed."""

    commands: Commands
    first_layer: Ints
    pages: int


def plan_host(file: Ints, base: Ints, stride: Ints, layers: int, page_bytes: int, gap: int, max_bytes: int) -> HostPlan:
    """The restore's page-layers merged as far as the layout allows. No staging slot bounds a command here
    (the bytes land in the destination), so a segment's layers, back to back on disk, are one command up
    to ``max_bytes``. Layer 0 is planned alone, so it lands after one command per segment instead of with
    the whole restore; commands are issued in order of their first layer."""
    n = len(file)
    f, b, s = _ints(file), _ints(base), _ints(stride)
    layer = np.repeat(np.arange(layers, dtype=np.int64), n)
    offset = np.tile(b, layers) + layer * np.tile(s, layers)
    # Layer 0 and the rest never share a command: a coalescing key of (file, layer > 0).
    key = np.tile(f, layers) * 2 + (layer > 0)
    cmds = coalesce(key, offset, np.full(n * layers, page_bytes, np.int64), gap, max_bytes)
    if not len(cmds):
        return HostPlan(cmds, np.zeros(0, np.int64), n)
    first = np.minimum.reduceat(cmds.piece_index // max(n, 1), cmds.piece_ptr[:-1])
    order = np.argsort(first, kind="stable")
    counts = np.diff(cmds.piece_ptr)[order]
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    # Piece positions of the reordered commands: each command's run of pieces, in the new order.
    take = np.repeat(cmds.piece_ptr[:-1][order] - ptr[:-1], counts) + np.arange(int(ptr[-1]), dtype=np.int64)
    reordered = Commands(
        file=cmds.file[order] // 2,
        offset=cmds.offset[order],
        length=cmds.length[order],
        piece_ptr=ptr,
        piece_index=cmds.piece_index[take],
        piece_start=cmds.piece_start[take],
        piece_length=cmds.piece_length[take],
    )
    return HostPlan(reordered, first[order], n)
