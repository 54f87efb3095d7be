"""The key index (digests in numpy arrays) against a dict model, its memory per key, and page lists."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.node_agent.policy import keyindex as K

pytestmark = pytest.mark.unit

ops = st.lists(st.tuples(st.sampled_from(["put", "remove"]), st.lists(st.integers(0, 3000), max_size=300)),
               max_size=40)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(ops)
def test_put_and_remove_agree_with_a_dict_through_growth_and_tombstones(steps: list[tuple[str, list[int]]]) -> None:
    index = K.KeyIndex(K.MIN_SLOTS)  # small: many steps grow it or clear tombstones
    model: dict[int, tuple[int, int, int, int]] = {}
    for version, (op, keys) in enumerate(steps):
        keys = list(dict.fromkeys(keys))
        d = K.hash_keys(keys)
        assert d is not None
        if op == "put":
            cols = [(k % 7, (k << 20) | version, 4096 + k, k * 31 + version) for k in keys]
            a = np.array(cols, np.int64).reshape(-1, 4)
            index.put(d, a[:, 0], a[:, 1].astype(np.uint64), a[:, 2], a[:, 3])
            model.update(zip(keys, cols, strict=True))
        else:
            assert index.remove(d) == sum(k in model for k in keys)
            for k in keys:
                model.pop(k, None)
        assert len(index) == len(model)
    every = list(range(3001))
    d = K.hash_keys(every)
    assert d is not None
    found = index.find(d)
    assert found is not None
    for k, hit, sc, g, st_, crc in zip(every, found.hit.tolist(), found.scope.tolist(), found.gva.tolist(),
                                       found.stride.tolist(), found.crc.tolist(), strict=True):  # fmt: skip
        assert hit == (k in model)
        if hit:
            assert (sc, g, st_, crc) == model[k]


def test_a_table_at_one_million_keys_costs_under_128_bytes_a_key() -> None:
    """The issue's goal: the table (slots clients read plus the agent's columns) and the 16-byte digest
    each scope keeps per page, sized as the agent sizes it for a pool of 1M pages."""
    n = 1_000_000
    index = K.KeyIndex(K.slots_for(n))
    rng = np.random.default_rng(1)
    h1 = rng.integers(2, 1 << 63, n, dtype=np.uint64)
    h2 = rng.integers(0, 1 << 63, n, dtype=np.uint64)
    zeros = np.zeros(n, np.int64)
    for at in range(0, n, 1 << 16):
        cut = slice(at, at + (1 << 16))
        index.put((h1[cut], h2[cut]), zeros[cut], h1[cut], zeros[cut] + 4096, zeros[cut])
    assert len(index) == n and index.rebuilds == 0
    per_key = (index.nbytes() + 16 * n) / n
    assert per_key <= 128, per_key


def test_keys_of_every_type_get_distinct_128_bit_digests_and_pack_round_trips() -> None:
    keys: list[str | bytes | int] = ["a", b"a", 1, "1", f"{7:064x}", f"{7:064x}@tp0of8", -(1 << 70)]
    d = K.hash_keys(keys)
    assert d is not None and d[0].dtype == d[1].dtype == np.uint64
    assert len(set(zip(d[0].tolist(), d[1].tolist(), strict=True))) == len(keys)
    back = K.unpack(K.pack(d))
    assert np.array_equal(back[0], d[0]) and np.array_equal(back[1], d[1])
    with pytest.raises(ValueError, match="16-byte"):
        K.unpack(b"x" * 17)


def test_pages_grow_find_and_pop_in_publish_order() -> None:
    pages = K.Pages()
    d = K.hash_keys([f"k{i}" for i in range(10)])
    assert d is not None
    for i in range(10):  # one page a publish: grows by half, keeps the order
        pages.extend((d[0][i : i + 1], d[1][i : i + 1]))
    assert len(pages) == 10 and np.array_equal(pages.digests()[0], d[0])
    assert pages.index(int(d[0][4]), int(d[1][4])) == 4
    assert K.pack((d[0][3:4], d[1][3:4])) in pages
    pages.pop(4)
    assert len(pages) == 9 and pages.index(int(d[0][4]), int(d[1][4])) == -1
    assert pages.index(int(d[0][5]), int(d[1][5])) == 4
    pages.clear()
    assert not pages


@pytest.mark.parametrize("tail", [0, 1 << 20])  # every key through the batch passes, or each walked alone
def test_keys_displaced_too_far_grow_the_table_and_none_is_lost(monkeypatch: pytest.MonkeyPatch, tail: int) -> None:
    monkeypatch.setattr(K, "SCALAR_TAIL", tail)
    monkeypatch.setattr(K, "MAX_PROBE", 3)
    index = K.KeyIndex(K.MIN_SLOTS)
    # All in one home slot of the first table: most are displaced past MAX_PROBE, and the table grows
    # until their homes spread (at 16 times, 4 keys or fewer per home).
    n = 40
    h1 = np.arange(n, dtype=np.uint64) * np.uint64(K.MIN_SLOTS) + np.uint64(7)
    h2 = np.arange(n, dtype=np.uint64) + np.uint64(100)
    gva = np.arange(n, dtype=np.uint64) * np.uint64(4096)
    index.put((h1, h2), 5, gva, np.full(n, 4096), np.arange(n))
    found = index.find((h1, h2))
    assert found is not None and found.hit.all() and len(index) == n
    assert np.array_equal(found.gva, gva) and np.array_equal(found.crc, np.arange(n))
    assert index.rebuilds >= 1 and int(index.t.header[K._MAX_PROBE]) <= 3
    index.put((h1[:5], h2[:5]), 6, gva[:5] + np.uint64(1), np.full(5, 4096), np.zeros(5))  # replaced, not added
    again = index.find((h1, h2))
    assert again is not None and len(index) == n and again.gva[0] == 1 and again.scope[5] == 5


def _cols(h1: np.ndarray) -> tuple[np.ndarray, ...]:
    n = len(h1)
    h2 = np.arange(n, dtype=np.uint64) + np.uint64(1000)
    return (h1.astype(np.uint64), h2, np.full(n, 3, np.uint32), np.arange(n, dtype=np.uint64) * np.uint64(4096),
            np.full(n, 4096, np.uint32), np.arange(n, dtype=np.uint32))  # fmt: skip


def test_a_rebuild_fills_runs_that_wrap_past_the_end() -> None:
    t = K.Table.private(K.MIN_SLOTS)
    homes = np.repeat(np.arange(K.MIN_SLOTS - 5, K.MIN_SLOTS), 4)  # 20 keys for the last 5 slots
    h1 = homes.astype(np.uint64) + np.uint64(K.MIN_SLOTS) * np.arange(1, 21, dtype=np.uint64)
    cols = _cols(h1)
    assert K._fill(t, *cols).size == 0
    found = K.probe(t, cols[0], cols[1])
    assert found is not None and found.hit.all() and np.array_equal(found.gva, cols[3])
    assert int(t.header[K._LIVE]) == 20 and np.count_nonzero(t.h1[:15] > K.TOMB) == 15  # 15 wrapped


def test_a_rebuild_never_leaves_a_hole_in_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K, "MAX_PROBE", 3)
    t = K.Table.private(K.MIN_SLOTS)
    h1 = np.uint64(100) + np.uint64(K.MIN_SLOTS) * np.arange(1, 8, dtype=np.uint64)  # 7 keys, one home
    cols = _cols(h1)
    left = K._fill(t, *cols)
    assert sorted(left.tolist()) == [4, 5, 6]  # displaced past MAX_PROBE: not written (the caller grows)
    found = K.probe(t, cols[0][:4], cols[1][:4])
    assert found is not None and found.hit.all()  # the 4 placed are contiguous from their home
    assert np.count_nonzero(t.h1 > K.TOMB) == 4
