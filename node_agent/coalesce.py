"""FC-CIO read planning: sort-merge of page-layer descriptors into few large commands. Pure logic.

A restore asks for many ``(file, offset, length)`` ranges, one per page and layer. Sorted by
``(file, offset)``, adjacent ranges merge into one command and holes smaller than ``gap`` are bridged
(a little extra sequential read costs less than a second command). Commands are then packed into
staging slots so a bounded window can stream them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Extent:
    """A requested byte range; ``tag`` tells the caller where its bytes go."""

    file: int
    offset: int
    length: int
    tag: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Where a requested extent sits inside a command's bytes."""

    tag: int
    start: int  # byte offset inside the command
    length: int


@dataclass(frozen=True, slots=True)
class Command:
    """One read: a contiguous range of one file, covering one or more requested extents."""

    file: int
    offset: int
    length: int
    pieces: tuple[Piece, ...]

    @property
    def requested(self) -> int:
        return sum(p.length for p in self.pieces)


def coalesce(extents: Iterable[Extent], gap: int, max_bytes: int) -> list[Command]:
    """Merge extents into commands.

    Adjacent or overlapping extents always merge; a hole is bridged only when it is smaller than
    ``gap`` (so ``gap=0`` merges exact neighbours only). No command grows past ``max_bytes``; an
    extent longer than that is an error, since it could not be staged.
    """
    if gap < 0:
        raise ValueError(f"gap: {gap} must be >= 0")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: {max_bytes} must be > 0")
    ordered = sorted(extents, key=lambda e: (e.file, e.offset))
    commands: list[Command] = []
    if not ordered:
        return commands
    start_ext = ordered[0]
    _check(start_ext, max_bytes)
    file, start, end = start_ext.file, start_ext.offset, start_ext.offset + start_ext.length
    members: list[Extent] = [start_ext]
    for ext in ordered[1:]:
        _check(ext, max_bytes)
        hole = ext.offset - end
        new_end = max(end, ext.offset + ext.length)
        if ext.file == file and (hole <= 0 or hole < gap) and new_end - start <= max_bytes:
            end = new_end
            members.append(ext)
            continue
        commands.append(_command(file, start, end, members))
        file, start, end = ext.file, ext.offset, ext.offset + ext.length
        members = [ext]
    commands.append(_command(file, start, end, members))
    return commands


def _check(ext: Extent, max_bytes: int) -> None:
    if ext.length <= 0 or ext.offset < 0:
        raise ValueError(f"extent {ext}: offset must be >= 0 and length > 0")
    if ext.length > max_bytes:
        raise ValueError(f"extent {ext}: length {ext.length} exceeds the staging slot of {max_bytes} bytes")


def _command(file: int, start: int, end: int, members: list[Extent]) -> Command:
    return Command(file, start, end - start, tuple(Piece(e.tag, e.offset - start, e.length) for e in members))


def pack(commands: Sequence[Command], slot_bytes: int) -> list[list[Command]]:
    """Group commands, in order, into fills that each fit one staging slot."""
    fills: list[list[Command]] = []
    current: list[Command] = []
    used = 0
    for cmd in commands:
        if cmd.length > slot_bytes:
            raise ValueError(f"command of {cmd.length} bytes exceeds the staging slot of {slot_bytes} bytes")
        if current and used + cmd.length > slot_bytes:
            fills.append(current)
            current, used = [], 0
        current.append(cmd)
        used += cmd.length
    if current:
        fills.append(current)
    return fills


@dataclass(frozen=True, slots=True)
class Fill:
    """The commands that fill one staging slot, all for one layer."""

    layer: int
    commands: tuple[Command, ...]
    last_of_layer: bool

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.commands)


def plan_layers(per_layer_extents: Sequence[Sequence[Extent]], gap: int, slot_bytes: int) -> list[Fill]:
    """The whole restore in layer order: each layer's extents merged, then packed into slot fills."""
    fills: list[Fill] = []
    for layer, extents in enumerate(per_layer_extents):
        groups = pack(coalesce(extents, gap, slot_bytes), slot_bytes)
        for i, group in enumerate(groups):
            fills.append(Fill(layer, tuple(group), i == len(groups) - 1))
    return fills
