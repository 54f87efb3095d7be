from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake.errors import PoolFullError, StorageWriteError, UnknownKeyError
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import Hints
from tests.support.engines import FaultyIO, FaultyReads, pages, small_config

pytestmark = pytest.mark.integration

Make = Callable[..., Engine]


def restore(engine: Engine, keys: list, n_slots: int | None = None, dest_pages: list[int] | None = None):
    c = engine.config
    dest = np.zeros((c.layers, n_slots or len(keys), c.page_bytes), np.uint8)
    r = engine.get(keys, dest, dest_pages)
    layers = list(r)
    assert layers == list(range(c.layers))
    return dest, r.missing


def test_round_trip_across_turns_and_media(make_engine: Make) -> None:
    e = make_engine()
    kv1, kv2, shared = pages(4, 5, 4096, 1), pages(4, 3, 4096, 2), pages(4, 2, 4096, 3)
    t1 = [f"s-{i}" for i in range(5)]
    t2 = [f"s-{i}" for i in range(5, 8)]
    assert e.put(t1, kv1).medium is Medium.SSD
    r = e.put(t2, kv2, Hints(turn=2, prev_reply_tokens=(4096,), parent_key=t1[-1]))
    assert (r.medium, r.reason) == (Medium.SSD, "inherited")  # agent work continues its session's scope
    assert e.put(["sys-0", "sys-1"], shared, Hints(prefix_refcount=4)).medium is Medium.DRAM
    keys = ["sys-0", "sys-1", *t1, *t2]
    assert e.exists(keys) == len(keys) and e.exists(["nope", *keys]) == 0
    dest, missing = restore(e, keys, 12, list(range(12))[::-1][: len(keys)])
    assert missing == set()
    expected = np.concatenate([shared, kv1, kv2], axis=1)
    for i in range(len(keys)):
        assert np.array_equal(dest[:, 11 - i], expected[:, i])
    # SSD restore of 8 pages in 2 segments: one read per segment-layer, nothing read twice.
    s = e.stats.snapshot()
    assert s["read_commands"] <= 2 * 4 and s["read_bytes"] >= s["requested_bytes"] == 8 * 4 * 4096


def test_put_skips_stored_pages_and_writes_only_new_ones(make_engine: Make) -> None:
    e = make_engine()
    kv = pages(4, 6, 4096)
    e.put(["a", "c", "e"], _aligned(kv[:, [0, 2, 4]]))
    res = e.put(list("abcdef"), kv)
    assert (res.stored, res.skipped) == (3, 3)
    dest, missing = restore(e, list("abcdef"))
    assert not missing and np.array_equal(dest, kv)
    assert e.put(list("abc"), _aligned(kv[:, :3])).stored == 0


def _aligned(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape)
    out[...] = a
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.integers(1, 5),
    page_kib=st.sampled_from([4, 8, 12]),
    turns=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    data=st.data(),
)
def test_restored_bytes_equal_written_bytes(
    tmp_path: Path, layers: int, page_kib: int, turns: list[int], data: st.DataObject
) -> None:
    """Random geometry, several appends per session, partial hits and holes in the requested pages."""
    sub = Path(tempfile.mkdtemp(dir=tmp_path))
    cfg = small_config(
        sub,
        layers=layers,
        page_bytes=page_kib * 1024,
        file_bytes=layers * page_kib * 1024 * 8,
        files=8,
        dram_bytes=40 * layers * page_kib * 1024,  # room for every page: this checks bytes, not reclaim
        io={"gap_bytes": data.draw(st.sampled_from([0, 4096, 65536]))},
    )
    with Engine(cfg) as e:
        written: dict[str, np.ndarray] = {}
        parent = None
        for t, n in enumerate(turns):
            keys = [f"t{t}p{j}" for j in range(n)]
            kv = pages(layers, n, page_kib * 1024, seed=t)
            e.put(keys, kv, Hints(turn=t + 1, parent_key=parent, prefix_refcount=data.draw(st.sampled_from([1, 1, 2]))))
            written.update({k: kv[:, j].copy() for j, k in enumerate(keys)})
            parent = keys[-1]
        everything = list(written)
        wanted = data.draw(st.lists(st.sampled_from(everything), unique=True, min_size=1))
        assert e.exists(everything) == len(everything)
        dest, missing = restore(e, wanted)
        assert missing == set()
        for i, k in enumerate(wanted):
            assert np.array_equal(dest[:, i], written[k]), k
        stats = e.stats.snapshot()
        assert stats.get("read_bytes", 0) >= stats.get("requested_bytes", 0)


def test_eio_and_short_reads_mark_pages_missing_and_are_counted(make_engine: Make) -> None:
    e = make_engine(slot_bytes=4096 * 2)
    kv = pages(4, 6, 4096)
    keys = [f"k{i}" for i in range(6)]
    e.put(keys, kv)
    good = restore(e, keys)[0]
    locs = [e.table.lookup(k) for k in keys]
    bad_file = int(locs[0].gva & ((1 << 48) - 1)) // e.config.ssd.file_bytes  # type: ignore[union-attr]
    calls = {"n": 0}

    def rule(kind: str, file: int, offset: int, length: int) -> str | None:
        if kind != "read" or file != bad_file:
            return None
        calls["n"] += 1
        return "eio" if calls["n"] == 1 else ("short" if calls["n"] == 2 else None)

    with FaultyReads(e, rule):
        dest, missing = restore(e, keys)
    assert calls["n"] >= 2
    assert missing and len(missing) < len(keys)
    for i in set(range(6)) - missing:
        assert np.array_equal(dest[:, i], good[:, i])
    s = e.stats.snapshot()
    assert s["io_errors_eio"] == 1 and s["io_errors_short_read"] == 1 and s["pages_missing"] == len(missing)
    assert restore(e, keys)[1] == set()  # the engine still works afterwards


def test_write_error_publishes_nothing_and_frees_space(make_engine: Make) -> None:
    e = make_engine()
    e.put(["old"], pages(4, 1, 4096))
    used = e.usage()["ssd"]["used_bytes"]
    e.io = FaultyIO(e.io, lambda kind, *a: "enospc" if kind == "write" else None)
    with pytest.raises(StorageWriteError, match="nothing published"):
        e.put(["n1", "n2"], pages(4, 2, 4096))
    assert e.exists(["n1"]) == 0 and e.usage()["ssd"]["used_bytes"] == used
    assert e.stats.get("write_errors") == 1
    e.io = e.io.inner  # type: ignore[attr-defined]
    assert e.put(["n1", "n2"], pages(4, 2, 4096)).stored == 2  # keys are free to be written again
    assert restore(e, ["old", "n1"])[1] == set()


def test_ten_one_page_sessions_use_one_file_and_read_back_bit_exact(make_engine: Make) -> None:
    e = make_engine(files=10, file_bytes=16 * 4 * 4096, dram_bytes=0)
    kv = [pages(4, 1, 4096, seed=i) for i in range(10)]
    for i in range(10):  # ten sessions, one page each, each its own scope
        assert e.put([f"s{i}"], kv[i], Hints(turn=1)).medium is Medium.SSD
    assert len(e.table.scopes) == 10
    files = {G.decode(loc.gva).offset // e.config.ssd.file_bytes for _, loc in e.table.items()}
    assert files == {0}  # they share the first file, back to back (whole files took all ten before)
    assert e.usage()["ssd"]["used_bytes"] == 10 * 4 * 4096
    dest, missing = restore(e, [f"s{i}" for i in range(10)])
    assert missing == set() and all(np.array_equal(dest[:, i], kv[i][:, 0]) for i in range(10))
    # A session that grows keeps one read per layer run: its next turn extends its extent in place
    # when the space after it is free (s9's is), else takes one new extent for the whole turn (s0's).
    more = pages(4, 3, 4096, seed=99)
    for parent in ("s9", "s0"):
        e.put([f"{parent}-t2-{j}" for j in range(3)], more, Hints(turn=2, parent_key=parent))
    assert [len(s.extents) for s in (e.table.scopes[e.table.lookup(k).scope] for k in ("s9", "s0"))] == [1, 2]
    for parent in ("s9", "s0"):
        keys = [parent] + [f"{parent}-t2-{j}" for j in range(3)]
        before = e.stats.get("read_commands")
        dest, missing = restore(e, keys)
        assert missing == set() and np.array_equal(dest[:, 1:], more)
        assert e.stats.get("read_commands") - before <= 2 * 4  # at most one per segment-layer


def test_full_pool_refuses_cleanly(make_engine: Make) -> None:
    e = make_engine(files=2, file_bytes=4 * 4 * 4096, dram_bytes=0)
    keys = [f"k{i}" for i in range(8)]
    e.put(keys[:4], pages(4, 4, 4096))
    e.put(keys[4:], pages(4, 4, 4096), Hints(parent_key="k3"))
    dest = np.zeros((4, 8, 4096), np.uint8)
    with e.get(keys, dest):  # a reader pins the only scope
        before = e.usage()
        with pytest.raises(PoolFullError, match="SSD file pool full"):
            e.put(["x"], pages(4, 1, 4096))
        assert e.usage() == before and e.exists(["x"]) == 0
    assert e.put(["x"], pages(4, 1, 4096)).stored == 1  # unpinned now: reclaimed whole, then placed
    assert e.exists(keys) == 0 and e.usage()["ssd"]["reclaimed_scopes"] == 1


@pytest.mark.parametrize(
    ("make_kv", "match"),
    [
        (lambda: pages(4, 2, 4096).view(np.uint16), "kv.dtype"),
        (lambda: pages(3, 2, 4096), r"kv.shape"),
        (lambda: pages(4, 3, 4096), r"kv.shape"),
        (lambda: pages(4, 2, 8192)[:, :, :4096], "C-contiguous"),
        (lambda: aligned_empty(4 * 2 * 4096 + 1)[1:].reshape(4, 2, 4096), "aligned"),
        (lambda: [[0]], "numpy array"),
    ],
)
def test_invalid_put_is_refused_naming_the_field(make_engine: Make, make_kv, match: str) -> None:
    e = make_engine()
    with pytest.raises((TypeError, ValueError), match=match):
        e.put(["a", "b"], make_kv())
    assert e.exists(["a"]) == 0 and e.usage()["ssd"]["used_bytes"] == 0


def test_invalid_get_and_keys_are_refused(make_engine: Make) -> None:
    e = make_engine()
    e.put(["a", "b"], pages(4, 2, 4096))
    with pytest.raises(UnknownKeyError, match=r"keys\[1\]: 'zz' is not stored"):
        e.get(["a", "zz"], np.zeros((4, 2, 4096), np.uint8))
    with pytest.raises(ValueError, match="dest.shape"):
        e.get(["a"], np.zeros((3, 2, 4096), np.uint8))
    with pytest.raises(TypeError, match="dest.dtype"):
        e.get(["a"], np.zeros((4, 2, 2048), np.uint16))
    with pytest.raises(ValueError, match="dest_pages"):
        e.get(["a"], np.zeros((4, 2, 4096), np.uint8), [5])
    with pytest.raises(ValueError, match="duplicate"):
        e.put(["a", "a"], pages(4, 2, 4096))
    with pytest.raises(TypeError, match=r"keys\[0\]"):
        e.put([1.5, "x"], pages(4, 2, 4096))  # type: ignore[list-item]
    # Nothing leaked: pins released after refused gets, the pages still restore.
    assert all(s.pins == 0 for s in e.table.scopes.values())
    assert restore(e, ["a", "b"])[1] == set()


def test_window_bounds_staging_and_early_close_releases_pins(make_engine: Make) -> None:
    e = make_engine(slot_bytes=2 * 4096, files=4, file_bytes=64 * 4 * 4096)
    keys = [f"k{i}" for i in range(40)]
    e.put(keys, pages(4, 40, 4096))
    dest = aligned_empty(4 * 40 * 4096 + 512)[512:].reshape(4, 40, 4096)  # rows off 4 KiB: staged reads
    r = e.get(keys, dest)
    assert next(r) == 0
    r.close()  # stop after one layer: in-flight reads drain, the window and pins are released
    assert all(s.pins == 0 for s in e.table.scopes.values())
    _, missing = restore(e, keys)
    assert not missing
    # Staged reads hold a slot per read thread at most, whatever the context.
    assert 0 < e.stats.get("staging_peak_bytes") <= e.config.io.read_threads * 2 * 4096


def test_concurrent_writers_and_readers(make_engine: Make) -> None:
    e = make_engine(files=16, file_bytes=16 * 4 * 4096, dram_bytes=64 * 4 * 4096)  # room for all: no reclaim
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            parent = None
            for t in range(4):
                keys = [f"w{w}t{t}p{j}" for j in range(4)]
                kv = pages(4, 4, 4096, seed=w * 10 + t)
                e.put(keys, kv, Hints(turn=t + 1, parent_key=parent, prefix_refcount=1 + (w % 2)))
                parent = keys[-1]
                dest, missing = restore(e, keys)
                assert not missing and np.array_equal(dest, kv)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert e.stats.get("put_pages") == 6 * 16
