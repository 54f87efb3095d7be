"""Agent faults: a stale writer across a restart, corruption while running, oversized puts, a DRAM
pool larger than its tmpfs, stalled and idle connections, forged client counters, probes during
recovery, permissions, and hostile paths. Each provokes the fault the way issue 17 describes it."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest

from flatcake.errors import CapacityError, ConfigError, FencedError, PoolFullError
from flatcake.node_agent.catalog import epoch as E
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service import server as S
from flatcake.node_agent.service.client import connect
from tests.support.agents import AgentThread
from tests.support.engines import small_config
from tests.support.faults import audit, stat_mode, tmpfs
from tests.support.kv_client import fill, page_bytes_for
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

SSD = Hints(context_tokens=1 << 20)
DRAM = Hints(prefix_refcount=2)
Start = Callable[..., AgentThread]


def expected(key: str) -> np.ndarray:
    return page_bytes_for(key, 4, 4096)


def put(e: object, keys: list[str], hints: Hints | None = None) -> None:
    e.put(keys, fill(keys, 4, 4096), hints)  # type: ignore[attr-defined]


def http_get(port: int, path: str, timeout: float = 3) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# ---- item 4: fencing across an agent restart ---------------------------------------------------
@pytest.mark.parametrize("hints", [SSD, DRAM], ids=["ssd", "dram"])
def test_a_writer_that_allocated_before_a_restart_is_refused_after_it(tmp_path: Path, hints: Hints) -> None:
    config = small_config(tmp_path / "node", files=4, dram_bytes=4 * 4 * 4096)
    agents = [AgentThread(config)]
    stale = connect(config.agent.socket)
    real_allocate = stale.catalog.allocate
    taken: dict[str, object] = {}

    def allocate_then_restart(keys: object, h: Hints) -> object:
        alloc = real_allocate(keys, h)  # type: ignore[arg-type]
        taken["stale"] = alloc
        agents[0].stop()  # the agent restarts between this writer's allocate and its write
        agents.append(AgentThread(config))
        with connect(config.agent.socket) as other:
            put(other, ["victim-0", "victim-1"], hints)
            taken["victim"] = other.catalog.conn.call("lookup", keys=["victim-0"])  # type: ignore[attr-defined]
        return alloc

    stale.catalog.allocate = allocate_then_restart  # type: ignore[method-assign]
    try:
        with pytest.raises(FencedError, match="restarted"):
            put(stale, ["stale-0", "stale-1"], hints)
        assert stale.stats.get("fenced_writes") == 1
        stale_alloc, victim = taken["stale"], taken["victim"]
        # The fault was real: the new agent gave the victim the very space the stale writer held.
        if stale_alloc.slots:  # type: ignore[attr-defined]
            slot = G.decode(victim["gva"][0]).offset // (4 * 4096)  # type: ignore[index]
            assert slot in stale_alloc.slots  # type: ignore[attr-defined]
        else:
            file = G.decode(victim["gva"][0]).offset // config.ssd.file_bytes  # type: ignore[index]
            assert file == stale_alloc.segments[0].file  # type: ignore[attr-defined]
        assert audit(config, ["victim-0", "victim-1"], expected, what="stale writer") == (0, 0)
    finally:
        stale.io.close()
        agents[-1].stop()


def restart_held_back(
    agents: list[AgentThread], config: EngineConfig, caplog: pytest.LogCaptureFixture, what: str
) -> threading.Thread:
    """Stop the agent and start a new one in a thread, returned once the new agent waits for ``what``
    (the log says so) with the epoch not yet raised; the new agent is appended to ``agents``."""
    old_epoch = agents[0].agent.epoch
    agents[0].stop()
    caplog.set_level("INFO", logger="flatcake.node_agent.catalog.epoch")
    restarting = threading.Thread(target=lambda: agents.append(AgentThread(config)))
    restarting.start()
    wait_until(lambda: "waiting up to" in caplog.text, what=f"the new agent to wait for {what}")
    assert E.current(config.ssd.dir) == old_epoch  # not raised while it is on its way
    return restarting


@pytest.mark.parametrize("hints", [SSD, DRAM], ids=["ssd", "dram"])
def test_a_write_in_flight_at_a_restart_lands_before_the_new_epoch_begins(
    tmp_path: Path, hints: Hints, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29 item 2: a writer passed the epoch check, then the agent restarts while its bytes are
    still on their way. The new agent waits for them before it raises the epoch, so they cannot land
    over space it has since given to another writer: that writer's pages read back bit-exact."""
    config = small_config(tmp_path / "node", files=4, dram_bytes=4 * 4 * 4096)
    agents = [AgentThread(config)]
    stale = connect(config.agent.socket)
    real_write, started, release = stale._write, threading.Event(), threading.Event()
    landed: dict[str, int] = {}

    def slow_write(alloc: object, pages: np.ndarray) -> None:
        started.set()
        assert release.wait(60), "the test never released the write in flight"
        pages[...] = 0xEE  # what the stale writer's bytes look like where they land
        real_write(alloc, pages)  # type: ignore[arg-type]
        landed["epoch"] = E.current(config.ssd.dir)

    stale._write = slow_write  # type: ignore[method-assign]
    outcome: dict[str, BaseException | None] = {}

    def stale_put() -> None:
        try:
            put(stale, ["stale-0", "stale-1"], hints)
            outcome["error"] = None
        except BaseException as exc:  # the old agent is gone: its publish cannot succeed
            outcome["error"] = exc

    writer = threading.Thread(target=stale_put)
    writer.start()
    assert started.wait(30), "the stale writer never reached its write"
    old_epoch = agents[0].agent.epoch
    restarting = restart_held_back(agents, config, caplog, "the write in flight")
    try:
        release.set()
        writer.join(30)
        restarting.join(60)
        assert landed["epoch"] == old_epoch  # the stale bytes landed inside the old epoch
        # The stale publish went to the agent that is gone and is not retried on the new one: named as such,
        # not any exception (a bug in the write path would pass that), and nothing of it is published.
        error = outcome["error"]
        assert isinstance(error, ConnectionError) and "during 'publish'" in str(error), repr(error)
        assert len(agents) == 2 and agents[1].agent.epoch == old_epoch + 1
        with connect(config.agent.socket) as other:  # the space the stale writer held is reused now
            assert other.exists(["stale-0", "stale-1"]) == 0  # the stale pages were never published
            put(other, ["victim-0", "victim-1"], hints)
        assert audit(config, ["victim-0", "victim-1"], expected, what="write in flight") == (0, 0)
    finally:
        release.set()
        stale.io.close()
        agents[-1].stop()


@pytest.mark.parametrize("hints", [SSD, DRAM], ids=["ssd", "dram"])
def test_a_restore_in_flight_at_a_restart_ends_before_the_new_epoch_begins(
    tmp_path: Path, hints: Hints, caplog: pytest.LogCaptureFixture
) -> None:
    """The read side of the fence: a restore is open (its lease granted, its pages not yet copied) when
    the agent restarts. The new agent, whose writers could reuse those pages (a DRAM page is not
    checksummed by default), begins only once the restore has closed, and the restore reads its
    pages bit-exact."""
    config = small_config(tmp_path / "node", files=4, dram_bytes=4 * 4 * 4096)
    agents = [AgentThread(config)]
    reader = connect(config.agent.socket)
    keys = ["r-0", "r-1"]
    put(reader, keys, hints)
    dest = np.zeros((4, len(keys), 4096), np.uint8)
    restore = reader.get(keys, dest)  # holds the epoch until closed
    old_epoch = agents[0].agent.epoch
    restarting = restart_held_back(agents, config, caplog, "the restore in flight")
    try:
        with restore:
            missing = restore.run()
        restarting.join(60)
        assert not restarting.is_alive() and agents[1].agent.epoch == old_epoch + 1
        assert missing == [] or not len(missing)
        for j, key in enumerate(keys):
            assert np.array_equal(dest[:, j], expected(key)), f"{key}: wrong bytes restored"
    finally:
        if restarting.is_alive():
            restore.close()
            restarting.join(60)
        reader.io.close()
        agents[-1].stop()


def test_a_restore_that_outlives_the_restarts_wait_counts_its_dram_pages_as_misses(tmp_path: Path) -> None:
    """A restore (lease granted, pages not yet copied) is still open when the agent restarts and the new
    agent's wait for it (agent.epoch_wait_s) runs out: the new agent starts, and its writer is given the
    very DRAM slots the restore is about to copy. The restore counts those pages as misses; before, it
    returned the new writer's bytes under the old keys, without error."""
    # Room for two DRAM pages: the new writer's pages must take the old ones' slots.
    config = small_config(tmp_path / "node", files=4, dram_bytes=2 * 4 * 4096, agent={"epoch_wait_s": 0.2})
    agents = [AgentThread(config)]
    reader = connect(config.agent.socket)
    keys = ["old-0", "old-1"]
    put(reader, keys, DRAM)
    old = reader.catalog.conn.call("lookup", keys=keys)["gva"]  # type: ignore[attr-defined]
    assert all(G.decode(g).medium is G.Medium.DRAM for g in old)
    dest = np.zeros((4, 2, 4096), np.uint8)
    restore = reader.get(keys, dest)  # holds the epoch until closed; nothing copied yet
    try:
        agents[0].stop()
        agents.append(AgentThread(config))  # waits 0.2 s for the restore, then starts anyway
        with connect(config.agent.socket) as other:
            put(other, ["new-0", "new-1"], DRAM)
            new = other.catalog.conn.call("lookup", keys=["new-0", "new-1"])["gva"]  # type: ignore[attr-defined]
        assert set(new) == set(old)  # the fault is real: the new pages lie where the open restore points
        with restore:
            missing = restore.run()
        assert set(missing) == {0, 1}, "DRAM pages copied across a restart were handed over as good"
        assert reader.stats.get("epoch_rechecks") == 1
    finally:
        restore.close()
        reader.io.close()
        agents[-1].stop()


@pytest.mark.parametrize("hints", [SSD, DRAM], ids=["ssd", "dram"])
def test_a_lease_granted_before_a_restart_is_refused_before_anything_is_read(tmp_path: Path, hints: Hints) -> None:
    """The agent restarts between a reader's lease and its restore, and a new writer is given the very
    space the lease named. The restore is refused (a miss for the caller), the destination untouched;
    without the fence it would have copied the new writer's bytes as the old keys' pages."""
    # Room for two pages on each medium: the new writer's pages must take the old ones' space.
    config = small_config(tmp_path / "node", files=1, file_bytes=2 * 4 * 4096, dram_bytes=2 * 4 * 4096)
    agents = [AgentThread(config)]
    reader = connect(config.agent.socket)
    put(reader, ["old-0", "old-1"], hints)
    real_acquire = reader.catalog.acquire
    seen: dict[str, object] = {}

    def acquire_then_restart(keys: object, copy: bool = False) -> object:
        lease = real_acquire(keys, copy)  # type: ignore[arg-type]
        agents[0].stop()
        agents.append(AgentThread(config))
        with connect(config.agent.socket) as other:  # no pin survives the restart: reclaim reuses the space
            put(other, ["new-0", "new-1"], hints)
            seen["new"] = other.catalog.conn.call("lookup", keys=["new-0", "new-1"])  # type: ignore[attr-defined]
        seen["lease"] = lease
        return lease

    reader.catalog.acquire = acquire_then_restart  # type: ignore[method-assign]
    dest = np.zeros((4, 2, 4096), np.uint8)
    try:
        with pytest.raises(FencedError, match="restarted"):
            reader.get(["old-0", "old-1"], dest)
        assert reader.stats.get("fenced_reads") == 1 and not dest.any()
        # The fault was real: the new pages lie where the stale lease pointed.
        stale = {loc.gva for loc in seen["lease"].locations}  # type: ignore[attr-defined]
        assert set(seen["new"]["gva"]) == stale  # type: ignore[index]
    finally:
        reader.io.close()
        agents[-1].stop()


def test_the_agent_refuses_to_publish_an_allocation_of_another_epoch(agent_thread: Start) -> None:
    a = agent_thread()
    assert E.current(a.config.ssd.dir) == a.agent.epoch >= 1
    with connect(a.socket) as e:
        alloc = e.catalog.allocate(["k"], Hints())
        assert alloc is not None and alloc.epoch == a.agent.epoch
        with pytest.raises(FencedError, match="epoch"):
            e.catalog.conn.call("publish", id=alloc.id, crc=[0], epoch=alloc.epoch - 1)  # type: ignore[attr-defined]
        assert e.exists(["k"]) == 0


# ---- item 13: corruption while running is never served ----------------------------------------
@pytest.mark.parametrize("where", ["ssd", "dram"])
def test_a_page_corrupted_while_running_is_a_miss_and_counted(tmp_path: Path, where: str) -> None:
    config = small_config(tmp_path / "node", io={"verify_reads": "all"} if where == "dram" else {})
    a = AgentThread(config)
    try:
        keys = [f"{where}-{i}" for i in range(4)]
        with connect(a.socket) as e:
            put(e, keys, SSD if where == "ssd" else DRAM)
            loc = a.agent.catalog.table.lookup(keys[2])
            assert loc is not None
            offset = G.decode(loc.gva).offset + 3 * loc.layer_stride + 100  # a byte of layer 3
            if where == "ssd":
                file, at = divmod(offset, config.ssd.file_bytes)
                with open(Path(config.ssd.dir) / f"pool-{file:05d}.dat", "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0x01]))
            else:
                a.agent.dram.view[offset] ^= 0x01
            dest = np.zeros((4, 4, 4096), np.uint8)
            with e.get(keys, dest) as restore:
                missing = restore.run()
            assert missing == {2}
            assert e.stats.get("verify_failures") == 1
            for j in (0, 1, 3):
                assert np.array_equal(dest[:, j], expected(keys[j]))
            # The reader reported the page with its release: the agent read the scope again itself and
            # stopped serving the damaged page; the others are still served.
            wait_until(lambda: a.agent.rechecker.stats()["scopes"] >= 1, what="the agent to recheck the scope")
            assert a.agent.rechecker.stats()["dropped_pages"] == 1
            assert e.exists(keys) == 2 and e.exists([keys[3]]) == 1
            with e.get([keys[3]], dest) as restore:
                assert restore.run() == set()
            assert np.array_equal(dest[:, 0], expected(keys[3]))
        _, text = http_get(a.port, "/metrics")
        assert "flatcake_verify_failures_total 1.0" in text
        assert 'flatcake_recheck_pages_total{outcome="dropped"} 1.0' in text
    finally:
        a.stop()


def test_a_reader_cannot_drop_a_page_by_calling_it_damaged(agent_thread: Start) -> None:
    """The agent checks what a reader reports: a healthy page called damaged stays served (its scope is read
    again and passes, and its readers stop being asked to verify it)."""
    a = agent_thread()
    keys = [f"fine-{i}" for i in range(3)]
    with connect(a.socket) as e:
        put(e, keys, SSD)
        lease = e.catalog.acquire(keys)
        e.catalog.release(lease.id, damaged=[0, 1, 2])
        wait_until(lambda: a.agent.rechecker.stats()["scopes"] >= 1, what="the agent to recheck the scope")
        stats = a.agent.rechecker.stats()
        assert stats["dropped_pages"] == 0 and stats["passed_pages"] == 3
        assert e.exists(keys) == 3 and not a.agent.catalog.unverified
        # A malformed report is ignored, and the lease still ends.
        lease = e.catalog.acquire(keys)
        e.catalog.conn.call("release", id=lease.id, damaged="all of them")  # type: ignore[attr-defined]
        assert a.agent.catalog.handles() == (0, 0) and a.agent.rechecker.stats()["scopes"] == 1


# ---- item 9: a put larger than the whole pool ---------------------------------------------------
def test_a_put_larger_than_the_pool_is_refused_touching_nothing(agent_thread: Start) -> None:
    a = agent_thread(files=4, file_bytes=4 * 4 * 4096, dram_bytes=8 * 4 * 4096)
    with connect(a.socket) as e:
        put(e, ["d0", "d1"], DRAM)
        put(e, ["s0", "s1"], SSD)
        big = [f"big-{i}" for i in range(17)]  # 17 pages: more than 4 files of 4 pages, and than DRAM
        with pytest.raises(PoolFullError, match=r"ssd.file_count"):
            put(e, big, SSD)
        with pytest.raises(PoolFullError, match=r"ssd.file_count"):
            put(e, big, DRAM)  # too big for DRAM too: overflows to SSD without evicting DRAM first
        assert e.exists(big) == 0
        usage = a.agent.catalog.table.usage()
        assert usage["ssd"]["reclaimed_scopes"] == usage["dram"]["reclaimed_scopes"] == 0
        assert audit(a.config, ["d0", "d1", "s0", "s1"], expected, what="oversized put") == (0, 0)


# ---- item 10: a DRAM pool larger than its tmpfs ---------------------------------------------------
def test_a_dram_pool_larger_than_its_tmpfs_refuses_to_start(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "shm", "1m") as shm:
        config = small_config(tmp_path / "node", dram_bytes=128 * 4 * 4096)  # 2 MiB on a 1 MiB tmpfs
        config = type(config).from_dict({**config.to_dict(), "dram": {**config.to_dict()["dram"], "shm_dir": str(shm)}})
        with pytest.raises(CapacityError, match=r"dram.bytes: .* needs 2097152 bytes but .* free"):
            S.Agent(config)
        assert list(shm.iterdir()) == []  # nothing half-made left behind


# ---- items 1 and 11: stalled and idle connections -------------------------------------------------
def test_idle_and_stalled_http_clients_never_block_healthz(agent_thread: Start) -> None:
    a = agent_thread(agent={"http_timeout_s": 0.5, "http_max_connections": 4})
    idle = socket.create_connection(("127.0.0.1", a.port))  # says nothing
    half = socket.create_connection(("127.0.0.1", a.port))
    half.sendall(b"GET /heal")  # half a request line
    started = time.monotonic()
    assert http_get(a.port, "/healthz") == (200, "ok\n")
    assert time.monotonic() - started < 2
    for s in (idle, half):  # both are cut off after http_timeout_s
        s.settimeout(10)
        assert s.recv(1) == b""
    hogs = [socket.create_connection(("127.0.0.1", a.port)) for _ in range(6)]  # over the cap of 4
    wait_until(lambda: a.agent.http_server is not None and a.agent.http_server.refused >= 2, what="refusals")
    for s in hogs:
        s.close()

    def healthy() -> bool:  # until the server has seen the hogs go, a new connection may still be turned away
        try:
            return http_get(a.port, "/healthz")[0] == 200
        except OSError:
            return False

    assert wait_until(healthy, what="healthz after the hogs")
    assert 'flatcake_agent_dropped_connections_total{reason="http_busy"}' in http_get(a.port, "/metrics")[1]


def test_metrics_bind_address_is_configurable(agent_thread: Start) -> None:
    a = agent_thread(agent={"metrics_host": "127.0.0.1"})
    assert a.agent.http_server is not None and a.agent.http_server.server_address[0] == "127.0.0.1"


class Raw:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def call(self, op: str, **args: object) -> dict:
        body = msgpack.packb(P.request(1, op, args), use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)
        return self.reply()

    def reply(self) -> dict:
        buf = b""
        while len(buf) < 4:
            buf += self.sock.recv(4 - len(buf))
        (n,) = struct.unpack(">I", buf)
        body = b""
        while len(body) < n:
            chunk = self.sock.recv(n - len(body))
            assert chunk
            body += chunk
        return msgpack.unpackb(body, raw=False, strict_map_key=False)

    def closed(self) -> bool:
        return self.sock.recv(1) == b""


def test_control_socket_caps_connections_and_times_out_stalled_frames(agent_thread: Start) -> None:
    a = agent_thread(agent={"max_clients": 3, "frame_timeout_s": 0.5, "frame_budget_bytes": P.MAX_FRAME})
    clients = [Raw(a.socket) for _ in range(3)]
    for c in clients:
        assert c.call("register")["ok"]
    extra = Raw(a.socket)
    assert extra.reply()["error"]["code"] == P.BUSY and extra.closed()
    # A frame that starts and stalls (header of 8 MiB, 10 bytes of body) holds its buffer only until
    # frame_timeout_s; a second such frame waits for budget meanwhile, so memory stays bounded.
    for c in clients[:2]:
        c.sock.sendall(struct.pack(">I", 8 << 20) + b"x" * 10)
    wait_until(lambda: a.agent._frame_bytes[False] > 0, what="a stalled frame to hold budget")
    assert a.agent._frame_bytes[False] <= P.MAX_FRAME
    assert clients[0].closed() and clients[1].closed()
    assert a.agent.dropped["frame_timeout"] == 2 and a.agent._frame_bytes[False] == 0
    # An unregistered connection that never speaks is closed too; the registered one stays.
    silent = Raw(a.socket)
    assert silent.closed()
    assert a.agent.dropped["idle_timeout"] == 1
    assert clients[2].call("exists", keys=["a"])["ok"]


# ---- item 12: forged client counters ---------------------------------------------------------------
def test_client_counters_are_validated(agent_thread: Start) -> None:
    a = agent_thread()
    raw = Raw(a.socket)
    assert raw.call("register")["ok"]
    forged = {f"evil_{i}": 1 for i in range(1000)}
    r = raw.call("report", stats=forged)
    assert r["error"]["code"] == P.BAD_ARGS and "evil_" in r["error"]["message"]
    for bad in ({"read_bytes": -5}, {"read_bytes": 1.5}, {"io_errors_" + "x" * 100: 1}, {"read_bytes": True}):
        assert raw.call("report", stats=bad)["error"]["code"] == P.BAD_ARGS
    assert raw.call("report", stats={"read_bytes": 7, "io_errors_eio": 1})["ok"]
    assert dict(a.agent.client_stats) == {"read_bytes": 7, "io_errors_eio": 1}
    # A bad stats map on release still releases the lease: nothing stays pinned.
    with connect(a.socket) as e:
        put(e, ["r0"])
    lease = raw.call("acquire", keys=["r0"])["result"]
    assert raw.call("release", id=lease["id"], stats={"bogus": 1})["error"]["code"] == P.BAD_ARGS
    assert a.agent.catalog.handles() == (0, 0)
    metrics = http_get(a.port, "/metrics")[1]
    assert "evil_" not in metrics and len(metrics) < 40_000


# ---- item 2: probes answer during recovery ----------------------------------------------------------
def _stalled_scan(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the agent's page checks wait for the returned gate, as a large cache's scan would."""
    gate = threading.Event()
    real = S.page_crc_reader

    def slow_reader(*args: object) -> Callable[[object], int]:
        read = real(*args)  # type: ignore[arg-type]

        def crc(loc: object) -> int:
            gate.wait(30)
            return read(loc)  # type: ignore[arg-type]

        return crc

    monkeypatch.setattr(S, "page_crc_reader", slow_reader)
    return gate


def test_healthz_answers_and_readyz_reports_progress_during_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery reads no page (O(journal records)): the agent is ready at once and checks the pages
    in the background, reporting progress on /readyz and in the metrics."""
    config = small_config(tmp_path / "node", files=16)
    a = AgentThread(config)
    with connect(a.socket) as e:
        for i in range(6):
            put(e, [f"r{i}"], SSD)
    a.stop()
    gate = _stalled_scan(monkeypatch)
    agent = S.Agent(config)
    port = agent.start_http()
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(agent.serve(stop),))
    thread.start()
    try:
        assert http_get(port, "/healthz") == (200, "ok\n")

        def progress() -> tuple[int, str] | None:
            got = http_get(port, "/readyz")
            return got if "of 6" in got[1] else None

        status, text = wait_until(progress, what="readyz to show the scan's progress")
        assert status == 200 and text.startswith("ready; checking recovered pages in the background: 0 of 6")
        assert agent.recovered.pages == 6 and "flatcake_recovery_unchecked_pages 6.0" in http_get(port, "/metrics")[1]
        gate.set()
        wait_until(lambda: http_get(port, "/readyz")[1] == "ready\n", what="the scan to finish")
        assert agent.recovered.verified_pages == 6 and agent.recovered.dropped_pages == 0
    finally:
        gate.set()
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        agent.close()


def test_a_corrupted_page_is_never_served_before_or_after_the_scan_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_config(tmp_path / "node", files=16, io={"verify_reads": "off"})
    a = AgentThread(config)
    keys = ["c0", "c1", "c2"]
    with connect(a.socket) as e:
        put(e, keys, SSD)
        loc = a.agent.catalog.table.lookup("c1")
    assert loc is not None
    a.stop()
    file, at = divmod(G.decode(loc.gva).offset, config.ssd.file_bytes)
    with open(Path(config.ssd.dir) / f"pool-{file:05d}.dat", "r+b") as f:  # one layer of c1 rots
        f.seek(at + 3 * loc.layer_stride)
        f.write(b"\xff" * 4096)
    gate = _stalled_scan(monkeypatch)
    b = AgentThread(config)
    try:
        with connect(b.socket) as e:
            # Before the scan reaches it: the lease makes the reader check every page (even with
            # io.verify_reads off), so the damaged page is a miss and the others are served.
            dest = np.zeros((4, 3, 4096), np.uint8)
            restore = e.get(keys, dest)
            restore.run()
            assert restore.missing == {1}
            want = fill(keys, 4, 4096)
            assert np.array_equal(dest[:, 0], want[:, 0]) and np.array_equal(dest[:, 2], want[:, 2])
            gate.set()
            wait_until(lambda: b.agent.recovered.scan_done, what="the scan to finish")
            # The reader reported the page too: whichever of the scan and the agent's recheck read it first
            # dropped it, once.
            wait_until(lambda: b.agent.rechecker.stats()["scopes"] >= 1, what="the recheck of the reported scope")
            assert b.agent.recovered.dropped_pages + b.agent.rechecker.stats()["dropped_pages"] == 1
            assert e.exists(keys) == 1 and e.exists(["c2"]) == 1  # c1 is gone, c2 still served
            assert not b.agent.catalog.unverified  # scanned: leases no longer ask for checks
            dest2 = np.zeros((4, 2, 4096), np.uint8)
            e.get(["c0", "c2"], dest2).run()
            assert np.array_equal(dest2[:, 1], want[:, 2])
    finally:
        gate.set()
        b.stop()


# ---- item 16 and the smaller ones: permissions and hostile paths ----------------------------------------
def test_one_permission_policy_for_everything_the_agent_creates(tmp_path: Path) -> None:
    import os

    node = tmp_path / "node"
    pool = node / "pool"
    pool.mkdir(parents=True)
    old = pool / "pool-00000.dat"
    old.write_bytes(b"")
    os.chmod(old, 0o600)  # made by an older version
    gid = os.getgid() + 1 if os.getuid() == 0 else os.getgid()
    a = AgentThread(small_config(node, agent={"group": str(gid)}))
    try:
        c = a.config
        paths = [c.agent.socket, a.agent.dram.info.path, pool / "journal.log", pool / "epoch", pool / "pool.json",
                 *(pool / n for n in a.agent.pool.files)]  # fmt: skip
        assert {str(p): stat_mode(p) for p in paths} == {str(p): 0o660 for p in paths}
        assert {os.stat(p).st_gid for p in paths} == {gid}
    finally:
        a.stop()


def test_a_regular_file_at_the_socket_path_is_left_alone(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node")
    Path(config.agent.socket).write_text("someone's data")
    agent = S.Agent(config)
    try:
        import asyncio

        with pytest.raises(ConfigError, match="agent.socket: .* is not a socket"):
            asyncio.run(agent.serve(asyncio.Event()))
        assert Path(config.agent.socket).read_text() == "someone's data"
    finally:
        agent.close()


def test_dram_name_cannot_escape_shm_dir(tmp_path: Path) -> None:
    for name in ("../x", "a/b", "..", "."):
        with pytest.raises(ConfigError, match="dram.name"):
            small_config(tmp_path, dram_bytes=16 * 4 * 4096).__class__.from_dict(
                {**small_config(tmp_path).to_dict(), "dram": {**small_config(tmp_path).to_dict()["dram"], "name": name}}
            )


@pytest.mark.parametrize("damage", ["{", "[]", '{"version": 1}', '{"version": 1, "file_bytes": "x", "files": []}'])
def test_a_damaged_pool_manifest_is_a_clear_error_not_a_traceback(tmp_path: Path, damage: str) -> None:
    config = small_config(tmp_path / "node")
    pool = Path(config.ssd.dir)
    pool.mkdir(parents=True)
    (pool / "pool.json").write_text(damage)
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    exe = Path(sys.executable).parent / "flatcake"
    r = subprocess.run([str(exe), "agent", "serve", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == ConfigError.exit_code, r.stderr
    assert "pool.json" in r.stderr and "Traceback" not in r.stderr


def test_a_client_reconnects_to_a_restarted_agent_and_refuses_a_different_one(tmp_path: Path) -> None:
    """Issue 29 item 9, the client's half: calls while the agent is away fail (a miss to the caller);
    once the agent is back the same engine registers again and serves the stored pages bit-exact; an
    agent restarted with another configuration is refused, not mapped over."""
    import dataclasses

    config = small_config(tmp_path / "node", files=8, dram_bytes=16 * 4 * 4096)
    a = AgentThread(config)
    e = connect(config.agent.socket)
    keys = ["r0", "r1", "r2"]
    try:
        put(e, keys, SSD)
        a.stop()
        dest = np.zeros((4, len(keys), 4096), np.uint8)
        with pytest.raises(ConnectionError):
            e.get(keys, dest).run()
        with pytest.raises(ConnectionError):  # still away: every call is a miss, none hangs
            e.get(keys, dest).run()
        a = AgentThread(config)
        with e.get(keys, dest) as restore:
            assert restore.run() == set()
        assert all(np.array_equal(dest[:, i], expected(k)) for i, k in enumerate(keys))
        assert e.catalog.conn.reconnects == 1  # type: ignore[attr-defined]
        a.stop()
        other = dataclasses.replace(config, dram=dataclasses.replace(config.dram, bytes=32 * 4 * 4096))
        a = AgentThread(other)
        with pytest.raises(ConnectionError, match="went away"):  # the call that meets the break
            e.get(keys, dest).run()
        with pytest.raises(ConnectionError, match="cannot be used"):
            e.get(keys, dest).run()
    finally:
        e.io.close()
        a.stop()


# ---- issue 45 item 1: one agent per pool -------------------------------------------------------------
@pytest.mark.parametrize("fixed_port", [False, True], ids=["metrics-port-0", "metrics-port-fixed"])
def test_a_second_agent_on_a_serving_pool_is_refused_and_the_first_keeps_serving(
    tmp_path: Path, fixed_port: bool
) -> None:
    """Before, a second agent advanced the pool's epoch and replaced its shared index, then failed on the
    port (or, with metrics_port 0, took over the socket): the first was fenced while it said ready. Now it
    is refused before it touches anything, naming the first agent's pid and the pool; the first agent's
    epoch, socket and pages are as they were."""
    import dataclasses

    from flatcake.net import free_port
    from flatcake.node_agent.service.main import spawn

    config = small_config(tmp_path / "node", files=4)
    if fixed_port:
        config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, metrics_port=free_port()))
    with (tmp_path / "first.log").open("wb") as log:
        first = spawn(config, tmp_path / "node", log)
    try:
        epoch = E.current(config.ssd.dir)
        with connect(config.agent.socket) as e:
            put(e, ["one-0", "one-1"], SSD)
        (tmp_path / "second.json").write_text(json.dumps(config.to_dict()))
        exe = Path(sys.executable).parent / "flatcake"
        second = subprocess.run([str(exe), "agent", "serve", "--config", str(tmp_path / "second.json")],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode == ConfigError.exit_code, second.stderr
        assert f"pid {first.pid}" in second.stderr and config.ssd.dir in second.stderr, second.stderr
        assert E.current(config.ssd.dir) == epoch  # the first agent was not fenced
        with connect(config.agent.socket) as e:  # and still serves, bit-exact, writes included
            put(e, ["two-0"], SSD)
            dest = np.zeros((4, 3, 4096), np.uint8)
            with e.get(["one-0", "one-1", "two-0"], dest) as restore:
                assert restore.run() == set()
        assert all(np.array_equal(dest[:, i], expected(k)) for i, k in enumerate(["one-0", "one-1", "two-0"]))
    finally:
        first.terminate()
        first.wait(30)


def test_an_agent_whose_pool_was_taken_says_so_on_readyz_and_serves_nothing(tmp_path: Path) -> None:
    """A process that ignores the pool lock advances the epoch under a serving agent: /readyz turns 503
    naming both epochs (it said ready while refusing every lease), the ready gauge drops to 0, and a
    restore is refused before anything is read."""
    config = small_config(tmp_path / "node", files=4)
    a = AgentThread(config)
    try:
        with connect(a.socket) as e:
            put(e, ["p-0"], SSD)
            assert http_get(a.port, "/readyz")[0] == 200
            taken = E.advance(config.ssd.dir)
            status, text = http_get(a.port, "/readyz")
            assert status == 503 and text.startswith(f"fenced: the pool's epoch is {taken}, this agent's {taken - 1}")
            assert "flatcake_agent_ready 0.0" in http_get(a.port, "/metrics")[1]
            with pytest.raises(FencedError, match="the agent is now in epoch"):
                e.get(["p-0"], np.zeros((4, 1, 4096), np.uint8))
    finally:
        a.stop()


def test_os_errors_name_the_field_the_address_and_the_fix(tmp_path: Path) -> None:
    """What the agent cannot listen on or create is a ConfigError naming the setting, not a bare errno
    (issue 45); a socket directory it cannot create is refused before the pool is touched."""
    import dataclasses

    from flatcake.node_agent.config import ClusterConfig

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the socket's directory should be")
    bad = small_config(tmp_path / "a", agent={"socket": str(blocker / "agent.sock")})
    with pytest.raises(ConfigError, match=rf"agent.socket: cannot create {blocker}"):
        S.Agent(bad)
    assert not Path(bad.ssd.dir).exists()  # nothing touched
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    config = small_config(tmp_path / "b", agent={"metrics_port": port})
    agent = S.Agent(config)
    try:
        with pytest.raises(ConfigError, match=rf"agent.metrics_port: 127.0.0.1:{port} is in use .*port 0 picks"):
            agent.start_http()
    finally:
        agent.close()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    peers = dataclasses.replace(config, cluster=ClusterConfig(listen=f"127.0.0.1:{port}", secret_file=str(secret)))
    agent = S.Agent(peers)
    try:
        with pytest.raises(ConfigError, match=rf"cluster.listen: 127.0.0.1:{port} is in use"):
            asyncio.run(agent._serve_peers())
    finally:
        agent.close()
        held.close()
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="cluster.secret_file: .* holds 4 bytes"):
        S.Agent(dataclasses.replace(config, cluster=ClusterConfig(secret_file=str(short))))
