"""Restores into a ``PagedTarget`` (the caller's own layout, written in place): bit-exact from SSD and
DRAM, nothing written outside the named page-layers, checks run on the bytes as read (padding too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.restore import StagedVerifier
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.placement import Hints
from tests.support.engines import pages

pytestmark = pytest.mark.integration
Make = Callable[..., Engine]
LAYERS, PAGE_BYTES, PIECE, PIECES, SLOTS = 4, 8192, 2048, 3, 10  # raw 6144 B per page-layer, 2048 B padding


def page_first(memory: np.ndarray) -> PagedTarget:
    """SGLang's ``page_first`` shape: a page's pieces (tokens) each hold every layer back to back."""
    token = LAYERS * PIECE
    return PagedTarget(memory, LAYERS, [s * PIECES * token for s in range(SLOTS)], PIECE,
                       [k * token for k in range(PIECES)], PIECE)  # fmt: skip


def expected_in(target: PagedTarget, kv: np.ndarray, i: int, slot: int) -> None:
    for layer in range(LAYERS):
        assert np.array_equal(target.read(layer, slot), kv[layer, i, : PIECES * PIECE]), (i, slot, layer)


def test_ssd_and_dram_pages_land_in_place_and_nothing_else_is_written(make_engine: Make) -> None:
    e = make_engine(page_bytes=PAGE_BYTES, io={"verify_reads": "all"})
    kv = pages(LAYERS, 6, PAGE_BYTES, 7)
    ssd, dram = pages(LAYERS, 4, PAGE_BYTES), pages(LAYERS, 2, PAGE_BYTES)  # aligned copies (O_DIRECT)
    ssd[...], dram[...] = kv[:, :4], kv[:, 4:]
    e.put([f"s{i}" for i in range(4)], ssd)
    assert e.put(["d0", "d1"], dram, Hints(prefix_refcount=3)).medium is G.Medium.DRAM
    memory = np.full(SLOTS * PIECES * LAYERS * PIECE, 0xA5, np.uint8)
    target = page_first(memory)
    keys, slots = ["d1", "s0", "s1", "d0", "s2", "s3"], [9, 3, 2, 0, 5, 6]
    with e.get(keys, target, slots) as restore:
        assert restore.run() == set()
    for key, slot in zip(keys, slots, strict=True):
        expected_in(target, kv, int(key[1]) + (4 if key[0] == "d" else 0), slot)
    for slot in set(range(SLOTS)) - set(slots):
        assert all((target.read(layer, slot) == 0xA5).all() for layer in range(LAYERS)), slot
    assert e.stats.get("verify_failures") == 0


@pytest.mark.parametrize("where", ["payload", "padding"])
def test_a_corrupt_byte_read_from_ssd_is_a_miss_even_in_padding_never_landed(make_engine: Make, where: str) -> None:
    e = make_engine(page_bytes=PAGE_BYTES)
    kv = pages(LAYERS, 3, PAGE_BYTES, 8)
    keys = ["a", "b", "c"]
    e.put(keys, kv)
    loc = e.table.lookup("b")
    assert loc is not None
    at = G.decode(loc.gva).offset + 2 * loc.layer_stride + (100 if where == "payload" else PAGE_BYTES - 10)
    file, off = divmod(at, e.config.ssd.file_bytes)
    path = Path(e.config.ssd.dir) / e.pool.files[file]
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 1]))
    target = page_first(np.zeros(SLOTS * PIECES * LAYERS * PIECE, np.uint8))
    with e.get(keys, target, [4, 5, 6]) as restore:
        assert restore.run() == {1}
    assert e.stats.get("verify_failures") == 1
    expected_in(target, kv, 0, 4)
    expected_in(target, kv, 2, 6)


def test_a_target_is_checked_before_any_io(make_engine: Make) -> None:
    e = make_engine(page_bytes=PAGE_BYTES)
    e.put(["a", "b"], pages(LAYERS, 2, PAGE_BYTES))
    target = page_first(np.zeros(SLOTS * PIECES * LAYERS * PIECE, np.uint8))
    with pytest.raises(ValueError, match="appears twice"):
        e.get(["a", "b"], target, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        e.get(["a"], target, [SLOTS])
    with pytest.raises(ValueError, match="outside memory"):
        PagedTarget(np.zeros(100, np.uint8), LAYERS, [0], PIECE, [0], PIECE)


def test_layers_out_of_order_fail_the_page_instead_of_a_wrong_verdict() -> None:
    buf = np.zeros(2 * PAGE_BYTES, np.uint8)
    v = StagedVerifier(np.array([0]), np.array([0]), np.array([0]), PAGE_BYTES, 2, {}, lambda slot, layer: None)
    one = np.array([0])
    v.staged(1, buf, one * 0, one * 0, one)  # layer 1 before layer 0
    v.staged(0, buf, one * 0, one * 0, one)
    assert v.failed(set()) == {0}


def test_limits_keep_a_chunked_flat_page_inside_its_own_bytes(make_engine: Make) -> None:
    """A flat page of 2.5 chunks of ``LAYERS x PAGE_BYTES``: chunk c of page i lands at ``i * flat + c * span``,
    the third chunk only half; the bytes after each page (the next page's) are never written."""
    e = make_engine(page_bytes=PAGE_BYTES, io={"verify_reads": "all"})
    span = LAYERS * PAGE_BYTES
    flat, chunks, n = 2 * span + span // 2, 3, 2
    kv = pages(LAYERS, n * chunks, PAGE_BYTES, 11)
    ssd, dram = pages(LAYERS, chunks, PAGE_BYTES), pages(LAYERS, chunks, PAGE_BYTES)
    ssd[...], dram[...] = kv[:, :chunks], kv[:, chunks:]
    e.put([f"a/{c}" for c in range(chunks)], ssd)
    assert e.put([f"b/{c}" for c in range(chunks)], dram, Hints(prefix_refcount=2)).medium is G.Medium.DRAM
    memory = np.full(n * flat + 4096, 0xA5, np.uint8)  # pages back to back, then bytes nobody owns
    offsets = [i * flat + c * span for i in range(n) for c in range(chunks)]
    limits = [flat - c * span for _ in range(n) for c in range(chunks)]
    target = PagedTarget(memory, LAYERS, offsets, PAGE_BYTES, [0], PAGE_BYTES, limits)
    names = [f"{k}/{c}" for k in "ab" for c in range(chunks)]
    with e.get(names, target) as restore:
        assert restore.run() == set()
    for i in range(n):  # the flat page is its chunks' layers in order, cut at its end
        want = kv[:, i * chunks : (i + 1) * chunks].transpose(1, 0, 2).reshape(-1)[:flat]
        assert np.array_equal(memory[i * flat : (i + 1) * flat], want), i
    assert (memory[n * flat :] == 0xA5).all()
    assert len(target.read(LAYERS - 1, 2)) == 0 and len(target.read(1, 2)) == PAGE_BYTES  # what page 0 chunk 2 owns
    assert target.head(1).slots == 1
    with pytest.raises(ValueError, match="limits"):
        PagedTarget(memory, LAYERS, offsets, PAGE_BYTES, [0], PAGE_BYTES, limits[:-1])
