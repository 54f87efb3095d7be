"""The shared index: what clients read without the agent is exactly what the agent published."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake.node_agent.catalog import shared_index as S
from flatcake.node_agent.catalog.journal import Journal
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.recovery import recover
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy import keyindex
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.policy.scope import Location
from flatcake.node_agent.policy.scopes import ScopeTable

pytestmark = pytest.mark.unit

keys_st = st.lists(
    st.one_of(st.text(max_size=40), st.binary(max_size=40), st.integers(-(1 << 80), 1 << 80)), max_size=30
)


@given(keys_st)
@settings(max_examples=200, deadline=None)
def test_a_key_hashes_alike_in_every_batch(keys: list) -> None:
    """Writer and readers hash different batches; a key's hash must not depend on its company (the
    vectorised fast paths for equal-length str and for int agree with the general one)."""
    alone = [keyindex.hash_keys([k]) for k in keys]
    together = keyindex.hash_keys(keys)
    assert together is not None
    for i, one in enumerate(alone):
        assert one is not None
        assert (one[0][0], one[1][0]) == (together[0][i], together[1][i])
    same_length = [f"{i:040x}" for i in range(50)]
    fast, general = keyindex.hash_keys(same_length), keyindex.hash_keys([*same_length, b"odd one"])
    assert fast is not None and general is not None
    assert np.array_equal(fast[0], general[0][:50]) and np.array_equal(fast[1], general[1][:50])


def test_str_bytes_and_int_keys_do_not_collide() -> None:
    h = keyindex.hash_keys(["1", b"1", 1, "", b"", 0])
    assert h is not None and len(set(zip(h[0].tolist(), h[1].tolist(), strict=True))) == 6
    assert keyindex.hash_keys([1.5]) is None  # not a key type: the caller asks the agent


def loc(i: int, version: int = 0) -> Location:
    return Location(1, (i << 20) | version, 4096 * (version % 7 + 1))


def test_insert_find_delete_and_rebuild(tmp_path: Path) -> None:
    w = S.SharedIndexWriter(tmp_path / "idx", 1024)
    r = S.SharedIndexReader(tmp_path / "idx")
    keys = [f"k{i}" for i in range(600)]
    w.insert(keys, [loc(i) for i in range(600)])
    assert r.hit_prefix(keys) == 600 and r.hit_prefix(["nope", *keys]) == 0
    found = r.find(keys)
    assert found is not None
    assert found[1].tolist() == [loc(i).gva for i in range(600)]
    assert found[2].tolist() == [loc(i).layer_stride for i in range(600)]
    w.delete(keys[:100])
    assert r.hit_prefix(keys) == 0 and r.hit_prefix(keys[100:]) == 500
    assert w.stats()["tombstones"] == 100 and w.stats()["entries"] == 500
    # A rebuild replaces the file; the reader sees the old one retired and reopens the new one.
    w.rebuild({k: loc(i) for i, k in enumerate(keys) if i >= 100})
    assert w.stats()["tombstones"] == 0 and r.hit_prefix(keys[100:]) == 500
    w.close()
    assert r.find(keys) is None  # the agent stopped: ask it (and fail), never trust the table


def test_a_table_that_fills_grows_and_readers_follow(tmp_path: Path) -> None:
    """The agent's only index never leaves an entry out: more keys than fit make a larger table,
    which readers reopen."""
    w = S.SharedIndexWriter(tmp_path / "idx", 1024)
    r = S.SharedIndexReader(tmp_path / "idx")
    keys = list(range(1100))  # more than the table holds
    w.insert(keys, [loc(k) for k in keys])
    assert w.stats()["slots"] >= 2048 and w.stats()["entries"] == 1100 and w.rebuilds >= 1
    assert r.hit_prefix(keys) == 1100
    found = r.find(keys)
    assert found is not None and found[1].tolist() == [loc(k).gva for k in keys]


def mapped_kib(path: Path) -> int:
    """This process's resident KiB of the mapping of ``path`` (from /proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


@pytest.mark.parametrize("madvise", [True, False])
def test_warm_faults_the_table_in_and_changes_no_entry(tmp_path: Path, madvise: bool, monkeypatch) -> None:
    """Recovery faults the first table in beside reading the journal (``warm``: one madvise, or a
    same-byte store per page on kernels without MADV_POPULATE_WRITE), instead of page by page as the
    bulk load writes; its entries and header are what they were."""
    if not madvise:
        monkeypatch.setattr(S, "_libc", lambda: None)
    w = S.SharedIndexWriter(tmp_path / "idx", 1 << 16)  # 2 MiB of slots
    w.insert(["a", "b"], [loc(1), loc(2)])
    path = Path(w.t.path)
    before = mapped_kib(path)
    w.warm()
    after = mapped_kib(path)
    assert before < 1024 and after >= (1 << 16) * keyindex.SLOT.itemsize // 1024, (before, after)
    r = S.SharedIndexReader(tmp_path / "idx")
    found = r.find(["a", "b", "c"])
    assert found is not None and found[0].tolist() == [True, True, False]
    assert found[1][:2].tolist() == [loc(1).gva, loc(2).gva]


def test_a_new_writer_retires_the_previous_agents_table(tmp_path: Path) -> None:
    old = S.SharedIndexWriter(tmp_path / "idx", 1024)
    old.insert(["a"], [loc(1)])
    r = S.SharedIndexReader(tmp_path / "idx")
    assert r.hit_prefix(["a"]) == 1
    new = S.SharedIndexWriter(tmp_path / "idx", 1024)  # a restarted agent, before recovery
    assert r.hit_prefix(["a"]) == 0  # the reader moved to the new (empty) table
    new.insert(["a"], [loc(2)])
    found = r.find(["a"])
    assert found is not None and found[1].tolist() == [loc(2).gva]


def test_a_slot_left_mid_write_makes_the_reader_ask_the_agent(tmp_path: Path) -> None:
    w = S.SharedIndexWriter(tmp_path / "idx", 1024)
    w.insert(["a"], [loc(1)])
    r = S.SharedIndexReader(tmp_path / "idx")
    h = keyindex.hash_keys(["a"])
    assert h is not None
    w.t.seq[int(h[0][0] & w.t.mask)] += np.uint64(1)  # a writer killed between its two increments
    assert r.find(["a"]) is None


# ---- torn reads under a concurrent writer ---------------------------------------------------------
N_KEYS = 3000


def _churn(path: str, seconds: float, seed: int, ready: object) -> None:
    """Publish and delete keys at random for ``seconds``; each publication of key i has a new version
    v, published as ``loc(i, v)``. Rebuilds included, as the agent does them."""
    rng = random.Random(seed)
    w = S.SharedIndexWriter(path, 2048)
    live: dict[int, Location] = {}
    version = 0
    ready.set()  # type: ignore[attr-defined]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        version += 1
        batch = rng.sample(range(N_KEYS), rng.randint(1, 200))
        gone = [k for k in batch if k in live]
        w.delete(gone)
        for k in gone:
            del live[k]
        new = [k for k in batch if k not in gone]
        for k in new:
            live[k] = loc(k, version % (1 << 20))
        if w.wants_rebuild():
            w.rebuild(live)
        else:
            w.insert(new, [live[k] for k in new])
    w.close()


def test_readers_never_see_a_torn_or_foreign_entry(tmp_path: Path) -> None:
    """A writer process churns a small table (slots reused by other keys all the time, tombstones,
    rebuilds) while this process reads: every location found must be one published for that key,
    whole: key id in the GVA's high bits, the version's stride with the version in its low bits."""
    ctx = mp.get_context("fork")
    path = str(tmp_path / "idx")
    ready = ctx.Event()
    writer = ctx.Process(target=_churn, args=(path, 3.0, 7, ready))
    writer.start()
    assert ready.wait(30)
    r = S.SharedIndexReader(path)
    rng = random.Random(1)
    checked = hits = 0
    while writer.is_alive():
        keys = rng.sample(range(N_KEYS), 500)
        found = r.find(keys)
        if found is None:
            continue  # the writer is between tables or stopped: the client would ask the agent
        hit, gva, stride = found
        for k, h, g, s in zip(keys, hit.tolist(), gva.tolist(), stride.tolist(), strict=True):
            if h:
                assert g >> 20 == k, f"key {k} found another key's location {g:#x}"
                assert s == loc(k, g & 0xFFFFF).layer_stride, f"key {k}: torn entry gva {g:#x} stride {s}"
                hits += 1
        checked += 1
    writer.join(10)
    assert writer.exitcode == 0
    assert checked > 20 and hits > 1000


class _WriterBetweenStores(keyindex.Table):
    """A table as a reader meets it while the writer works: before each gather of whole slots
    (``rows``, between the reader's two reads of the sequence numbers) the writer takes its next
    step. A concurrent writer lands in that gap only sometimes (the churn test above catches a
    missing re-read of the sequence in about 4 runs of 5); here every lookup lands in it."""

    def __init__(self, t: keyindex.Table, steps: Iterator[None]) -> None:
        vars(self).update({k: v for k, v in vars(t).items() if k != "rows"})
        self._rows, self._steps = t.rows, steps

    @property  # type: ignore[override]
    def rows(self) -> npt.NDArray[np.uint64]:
        next(self._steps, None)
        return self._rows


def _publish_in_steps(t: keyindex.Table, at: int, row: npt.NDArray[np.uint64]) -> Iterator[None]:
    """The writer publishing ``row`` at an empty slot, stopped after the hashes (``_write_one``'s
    order: sequence odd, then each field, then sequence even)."""
    t.seq[at] += np.uint32(1)
    t.h1[at], t.h2[at] = row[1], row[2]
    yield
    t.gva[at], t.stride[at] = row[3], row[0] >> np.uint64(32)
    t.seq[at] += np.uint32(1)
    yield


def _move_in_steps(t: keyindex.Table, at: int, new: Location) -> Iterator[None]:
    """The writer moving a key's entry to ``new`` in place, stopped between its address and stride."""
    t.seq[at] += np.uint32(1)
    t.gva[at] = new.gva
    yield
    t.stride[at] = new.layer_stride
    t.seq[at] += np.uint32(1)
    yield


@pytest.mark.parametrize("step", ["publish", "move"])
def test_a_reader_never_takes_a_slot_the_writer_is_between_two_stores_of(step: str, tmp_path: Path) -> None:
    """The seqlock, deterministically: the writer stops mid-entry at the moment the reader gathers the
    slot, every time. The reader must return the entry whole (before or after), never the new hashes
    with the old address (``publish``) or the new address with the old stride (``move``). Removing the
    re-read of the sequence after the gather (``s2`` in ``keyindex.probe``) fails both cases."""
    index = S.SharedIndexWriter(tmp_path / "idx", 1024)
    old, new = loc(5, 1), loc(5, 2)
    index.insert(["k"], [old])
    d = keyindex.hash_keys(["k"])
    assert d is not None
    before = index.find(d)
    assert before is not None and before.hit[0]
    at = int(before.slot[0])
    t = index.t
    if step == "publish":
        row = t.rows[at].copy()
        t.rows[at] = 0  # the key not yet stored: its slot empty
        steps, whole = _publish_in_steps(t, at, row), {(old.gva, old.layer_stride)}
    else:
        steps, whole = _move_in_steps(t, at, new), {(old.gva, old.layer_stride), (new.gva, new.layer_stride)}
    found = keyindex.probe(_WriterBetweenStores(t, steps), d[0], d[1])
    assert found is not None and found.hit[0], "the entry is published whole by the time the probe ends"
    got = (int(found.gva[0]), int(found.stride[0]))
    assert got in whole, f"torn entry: address {got[0]:#x}, stride {got[1]} (published: {whole})"
    assert next(steps, "done") == "done", "the writer finished while the reader probed"


def test_recovery_fills_the_index_in_bulk_once_it_has_adopted_every_scope(tmp_path: Path) -> None:
    """Restart: the recovered entries reach the shared index in one bulk insert at the end (one
    insert per scope cost more than the rest of recovery), and every one of them is found there."""
    table = ScopeTable(node_id=1, layers=1, page_bytes=4096, file_bytes=64 * 4096, files=64, dram_slots=0,
                       high_watermark=1.0, low_watermark=1.0)  # fmt: skip
    j = Journal(tmp_path / "j.log", "never")
    first = LocalCatalog(table, PlacementConfig(), j)
    keys = [[f"s{s}-p{p}" for p in range(16)] for s in range(200)]  # 200 scopes
    for scope_keys in keys:
        a = first.allocate(scope_keys, Hints())
        assert a is not None
        first.publish(a.id, list(range(16)))
    j.close()
    again = ScopeTable(node_id=1, layers=1, page_bytes=4096, file_bytes=64 * 4096, files=64, dram_slots=0,
                       high_watermark=1.0, low_watermark=1.0)  # fmt: skip
    writer = S.SharedIndexWriter(tmp_path / "idx", 8192)
    c = LocalCatalog(again, PlacementConfig(), index=writer)
    calls: list[tuple[str, int]] = []
    put, load = writer.put, writer.load
    writer.put = lambda d, *cols: (calls.append(("put", len(d[0]))), put(d, *cols))[1]  # type: ignore[method-assign]
    writer.load = lambda d, *cols: (calls.append(("load", len(d[0]))), load(d, *cols))[1]  # type: ignore[method-assign]
    assert recover(c, tmp_path / "j.log", None).pages == 3200
    assert calls == [("load", 3200)]  # one pass for all 200 scopes, not an insert each
    with pytest.raises(ValueError, match="not empty"):  # a load never mixes with entries already there
        writer.load((np.full(1, 7, np.uint64), np.zeros(1, np.uint64)), [1], [0], [0], [0])
    reader = S.SharedIndexReader(tmp_path / "idx")
    flat = [k for ks in keys for k in ks]
    found = reader.find(flat)
    assert found is not None and found[0].all()
    assert found[1].tolist() == [again.lookup(k).gva for k in flat]  # type: ignore[union-attr]
    # A later free still leaves the index: the bulk insert came first.
    assert again.drop(again.lookup(flat[0]).scope)  # type: ignore[union-attr]
    assert reader.hit_prefix(flat[:16]) == 0 and reader.hit_prefix(flat[16:32]) == 16
    writer.close()
