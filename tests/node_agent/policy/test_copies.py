"""DRAM copies over an SSD home (``placement.mode: copies``) in the agent's catalog, without I/O: which
pages get copies, where a lease finds them, and that dropping one never loses its page."""

from __future__ import annotations

import pytest

from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy.adaptive import ReuseModel
from flatcake.node_agent.policy.copies import EXPLORE, MIN_READ_SHARE, RESTORE, WRITE, Accuracy
from flatcake.node_agent.policy.gva import SSD_THRESHOLD, Medium
from flatcake.node_agent.policy.placement import Decision, Hints, Reason
from flatcake.node_agent.policy.scopes import ScopeTable

pytestmark = pytest.mark.unit

LAYERS, PAGE = 2, 4096
SSD = Decision(Medium.SSD, Reason.AGENT_SESSION)


def table(dram_slots: int, mode: str = "copies") -> ScopeTable:
    return ScopeTable(node_id=1, layers=LAYERS, page_bytes=PAGE, file_bytes=64 * LAYERS * PAGE, files=16,
                      dram_slots=dram_slots, adaptive=mode == "adaptive", copies=mode == "copies")  # fmt: skip


def media(locations: list) -> list[str]:
    return ["ssd" if loc.gva >= SSD_THRESHOLD else "dram" for loc in locations]


def read(cat: LocalCatalog, keys: list[str], fill: bool = True) -> list[str]:
    """A reader: leases ``keys`` (asking for copies), reads them, fills what it was asked to copy."""
    lease = cat.acquire(keys, copy=True)
    cat.release(lease.id, [7 for slot in lease.copies if slot >= 0] if fill else None)
    return media(lease.locations)


def test_new_pages_are_copied_while_dram_has_room_and_a_lease_mixes_copies_and_ssd() -> None:
    t = table(dram_slots=3)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    first = cat.allocate(["a0", "a1", "a2", "a3"], Hints(context_tokens=100_000))
    assert first is not None and first.medium is Medium.SSD
    # DRAM has room for three copies, not four: a write's copies are all or nothing.
    assert first.copy_slots == []
    cat.publish(first.id, [1, 2, 3, 4])
    second = cat.allocate(["a4", "a5"], Hints(context_tokens=100_000, parent_key="a3"))
    assert second is not None and second.medium is Medium.SSD and len(second.copy_slots) == 2
    cat.publish(second.id, [5, 6])
    # One lease: the copied pages from DRAM (their home is still the SSD scope), the rest from SSD.
    lease = cat.acquire([f"a{i}" for i in range(6)])
    assert media(lease.locations) == ["ssd"] * 4 + ["dram"] * 2
    assert {loc.scope for loc in lease.locations} == {first_scope(t)}
    assert lease.checksums == [1, 2, 3, 4, 5, 6]
    cat.release(lease.id)
    # The home index still names SSD: the journal, compaction and the scan see homes only.
    assert media([t.lookup(f"a{i}") for i in range(6)]) == ["ssd"] * 6
    assert t.copy_stats.admitted_write == 2 and t.copy_stats.served == 2
    assert t.usage()["dram"]["copy_pages"] == 2 and t.usage()["ssd"]["pages"] == 6


def first_scope(t: ScopeTable) -> int:
    return min(t.scopes)


def test_a_copy_is_dropped_under_dram_pressure_without_losing_its_page() -> None:
    t = table(dram_slots=4)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    alloc = cat.allocate(["s0", "s1", "s2"], Hints(context_tokens=100_000))
    assert alloc is not None and len(alloc.copy_slots) == 3
    cat.publish(alloc.id, [0, 0, 0])
    assert read(cat, ["s0", "s1", "s2"]) == ["dram"] * 3
    # A shared prompt is homed in DRAM (its only copy): it displaces the copies, not the reverse.
    shared = cat.allocate(["p0", "p1", "p2"], Hints(prefix_refcount=3))
    assert shared is not None and shared.medium is Medium.DRAM
    cat.publish(shared.id, [0, 0, 0])
    assert t.copy_stats.evicted == 3 and t.copy_stats.evicted_unread == 0  # all three had been read
    assert t.reclaimed[Medium.DRAM].scopes == 0 and t.usage()["dram"]["copy_pages"] == 0  # no home was lost
    assert cat.exists(["s0", "s1", "s2"]) == 3
    assert read(cat, ["s0", "s1", "s2"], fill=False) == ["ssd"] * 3  # served from the home, nothing lost
    assert read(cat, ["p0", "p1", "p2"]) == ["dram"] * 3
    # A copy never displaces a home: DRAM holds the shared prompt and one free slot, the session's
    # reads ask for three copies and get none.
    assert read(cat, ["s0", "s1", "s2"]) == ["ssd"] * 3
    assert t.dram.free == 1 and cat.exists(["p0", "p1", "p2"]) == 3


def test_restore_copies_are_served_once_filled_and_freed_when_not() -> None:
    t = table(dram_slots=8)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    big = cat.allocate([f"k{i}" for i in range(10)], Hints(context_tokens=100_000))  # too big to copy
    assert big is not None and big.copy_slots == []
    cat.publish(big.id, list(range(10)))
    keys = [f"k{i}" for i in range(4)]
    lease = cat.acquire(keys, copy=True)
    assert sorted(lease.copies) == sorted(s for s in lease.copies if s >= 0) and len(lease.copies) == 4
    assert t.dram.free == 4  # taken for the copies, invisible to readers until filled
    assert media(cat.acquire(keys).locations) == ["ssd"] * 4  # (a second reader meanwhile: homes)
    # The reader filled the first two (their crc32s), not the others (a failed or missing page).
    cat.release(lease.id, [11, 12, -1, -1])
    assert t.dram.free == 6 and t.copy_stats.admitted_restore == 2 and t.copy_stats.unfilled == 2
    again = cat.acquire(keys)
    assert media(again.locations) == ["dram", "dram", "ssd", "ssd"]
    assert again.checksums == [11, 12, 2, 3]  # a copy is checked against its own bytes' crc
    cat.release(again.id)
    # A reader that says nothing (it died; its connection dropped) fills nothing.
    lease = cat.acquire(keys[2:], copy=True)
    cat.release(lease.id)
    # A reader that says the wrong number of things fills nothing either.
    lease = cat.acquire(keys[2:], copy=True)
    cat.release(lease.id, [1])
    assert t.dram.free == 6 and t.copy_stats.admitted_restore == 2
    # Without copy=True (a device restore, a peer) no slot is taken.
    assert cat.acquire(keys[2:]).copies == []


def test_copies_only_in_copies_mode() -> None:
    for mode in ("table2", "adaptive"):
        t = table(dram_slots=8, mode=mode)
        cat = LocalCatalog(t, PlacementConfig(mode=mode))
        alloc = cat.allocate(["a0", "a1"], Hints(context_tokens=100_000))
        assert alloc is not None and alloc.copy_slots == []
        cat.publish(alloc.id, [0, 0])
        assert cat.acquire(["a0", "a1"], copy=True).copies == []
        assert t.copies is None


def test_admission_follows_reuse_distance_against_dram_residence() -> None:
    model = ReuseModel()
    assert not model.copy_pays(None)  # no evidence: the session never came back
    assert model.copy_pays(10_000)  # DRAM has never dropped a copy: it keeps what it takes
    model.reclaimed(10)  # a home reclaimed: that says how long homes stay, not copies
    assert model.copy_pays(10_000)
    model.copy_evicted(100)
    assert model.copy_pays(50) and not model.copy_pays(150)
    assert model.copy_pays(150, oldest_idle=400)  # DRAM still holds a copy idle that long

    # In a table whose DRAM is full of copies and has reclaimed after ~6 ticks: a session that comes
    # back within that gets copies over the older ones; one that comes back much later does not.
    t = table(dram_slots=4)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))

    def session(name: str, pages: int) -> list[str]:
        keys = [f"{name}{i}" for i in range(pages)]
        alloc = cat.allocate(keys, Hints(context_tokens=100_000))
        assert alloc is not None
        cat.publish(alloc.id, [0] * pages)
        return keys

    old = session("old", 4)  # copied: DRAM had room
    assert t.usage()["dram"]["copy_pages"] == 4
    assert t.reuse is not None
    t.reuse.copy_evicted(6)
    soon = session("soon", 2)  # no room, no evidence yet: SSD only
    assert t.usage()["dram"]["copy_pages"] == 4
    # It came back right after its write, but `old`'s copies still wait for their first read: a restore's
    # copy does not displace those (copies module doc).
    assert read(cat, soon) == ["ssd", "ssd"] and t.usage()["dram"]["copy_pages"] == 4
    assert read(cat, old) == ["dram"] * 4  # read: from now on older copies like any other
    assert read(cat, soon) == ["ssd", "ssd"]  # so copied over them
    assert read(cat, soon) == ["dram", "dram"]
    home = cat.acquire(old)  # (a reader that asks for no copies)
    assert media(home.locations) == ["ssd"] * 4  # served from its home
    cat.release(home.id)
    assert t.copy_stats.evicted == 4 and t.copy_stats.evicted_unread == 0
    # DRAM has room for two: a new session is copied as written, the next one is not (no room, no evidence).
    fill = session("fill", 2)
    late = session("late", 2)
    assert t.usage()["dram"]["copy_pages"] == 4 and t.copy_stats.admitted_write == 6
    for _ in range(20):  # the copies in DRAM keep being read; the table's clock moves on
        cat.release(cat.acquire(soon + fill).id)
    assert read(cat, late) == ["ssd", "ssd"]  # back 20+ ticks after its write: DRAM keeps copies ~6
    assert read(cat, late) == ["ssd", "ssd"]  # so it was not copied over the ones being read
    assert read(cat, soon) == ["dram", "dram"] and read(cat, fill) == ["dram", "dram"]


def test_a_restore_copies_over_copies_already_read_never_over_written_ones_awaiting_their_first_read() -> None:
    """Sessions written in turn and restored once each, in another order (bench peers' pattern): under plain
    LRU each restore's copies displaced the written copies of the sessions restored next, before their
    first read. Sparing those, every session written into DRAM's room is read from its copies."""
    t = table(dram_slots=6)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    sessions = {}
    for name in "abcd":
        keys = [f"{name}{i}" for i in range(2)]
        alloc = cat.allocate(keys, Hints(context_tokens=100_000))
        assert alloc is not None
        cat.publish(alloc.id, [0, 0])
        sessions[name] = keys
    assert t.usage()["dram"]["copy_pages"] == 6  # a, b, c copied as written; d found no room
    assert read(cat, sessions["d"]) == ["ssd", "ssd"]  # restored first: no copy displaced for it
    assert [read(cat, sessions[n]) for n in "abc"] == [["dram", "dram"]] * 3
    assert t.copy_stats.served == 6 and t.copy_stats.evicted_unread == 0
    # Once read, written copies are older copies like any other: d came back within DRAM's residence.
    assert read(cat, sessions["d"]) == ["ssd", "ssd"]  # copied now, over a's (the least recently used)
    assert read(cat, sessions["d"]) == ["dram", "dram"] and t.copy_stats.evicted == 2
    assert cat.exists(sessions["a"]) == 2  # nothing lost: a's copies' home is SSD


def test_a_way_of_copying_whose_copies_go_unread_stops_and_is_still_sampled() -> None:
    acc = Accuracy()
    assert acc.share(WRITE) is None and acc.admits(WRITE)  # nothing measured yet: copy
    acc.evicted_copies(WRITE, read=1, unread=9)
    assert acc.share(WRITE) == pytest.approx(0.1)
    decisions = [acc.admits(WRITE) for _ in range(2 * EXPLORE)]
    assert decisions.count(True) == 2 and decisions[EXPLORE - 1] and decisions[-1]  # one in EXPLORE samples
    assert acc.admits(RESTORE)  # each way is judged on its own copies
    for _ in range(12):  # the workload changed: the sampled copies are read now
        acc.evicted_copies(WRITE, read=10, unread=0)
    assert acc.share(WRITE) > MIN_READ_SHARE and all(acc.admits(WRITE) for _ in range(EXPLORE))
    acc.evicted_copies(RESTORE, read=0, unread=0)  # an eviction of no copies of that way teaches nothing
    assert acc.share(RESTORE) is None


def test_copies_made_at_writes_stop_when_dram_drops_them_unread_while_restore_copies_go_on() -> None:
    t = table(dram_slots=2)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    # Two sessions take turns, one page a turn, and nobody reads them: each continuation is evidence that
    # its session comes back, so its copy displaces the other session's, which was never read.
    last = {"a": None, "b": None}
    turns = 4 * EXPLORE
    for i in range(turns):
        name = "ab"[i % 2]
        key = f"{name}{i}"
        alloc = cat.allocate([key], Hints(context_tokens=100_000, parent_key=last[name]))
        assert alloc is not None and alloc.medium is Medium.SSD
        cat.publish(alloc.id, [i])
        last[name] = key
    s = t.copy_stats
    assert s.evicted_write == s.evicted_unread_write == s.evicted_unread >= 1
    # Once copies made at writes were dropped unread, all writes but one in EXPLORE were declined.
    assert s.admitted_write <= 3 + turns // EXPLORE and s.declined >= turns - 3 - turns // EXPLORE
    assert cat.exists(list(last.values())) == 2  # nothing lost: dropped copies leave their homes

    # Each way is judged on its own copies: with copies made at writes going unread, a page is not copied
    # as it is written, but is as it is restored.
    t = table(dram_slots=4)
    cat = LocalCatalog(t, PlacementConfig(mode="copies"))
    assert t.copies is not None
    t.copies.accuracy.evicted_copies(WRITE, read=0, unread=4)
    alloc = cat.allocate(["p0", "p1"], Hints(context_tokens=100_000))
    assert alloc is not None and alloc.copy_slots == [] and t.copy_stats.declined == 2
    cat.publish(alloc.id, [1, 2])
    cat.release(cat.acquire(["p0"]).id)  # it came back (evidence), read from SSD without asking for copies
    assert read(cat, ["p0", "p1"]) == ["ssd", "ssd"] and t.copy_stats.admitted_restore == 2
    assert read(cat, ["p0", "p1"]) == ["dram", "dram"]
