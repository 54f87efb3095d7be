"""Cross-node reads on one machine (loopback): two real agent processes, one serving its pages to the
other's client over TCP and Mooncake's transfer engine. The same path across network namespaces is in
tests/loadgen/test_bench_remote.py."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flatcake.errors import ConfigError, ProtocolError
from flatcake.net import free_port
from flatcake.node_agent.config import ClusterConfig, EngineConfig
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import AgentConnection, connect
from flatcake.node_agent.service.cluster import Cluster
from flatcake.node_agent.service.main import spawn
from tests.support.agents import AgentThread
from tests.support.engines import small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

LAYERS, PAGE = 4, 8192
SHARED, SESSION = Hints(prefix_refcount=2), Hints(context_tokens=100_000)  # DRAM, SSD (Table 2)


def config(tmp: Path, node_id: int, cluster: ClusterConfig) -> EngineConfig:
    return small_config(tmp, layers=LAYERS, page_bytes=PAGE, node_id=node_id, dram_bytes=128 * LAYERS * PAGE,
                        file_bytes=4 << 20, files=4, cluster=cluster)  # fmt: skip


def pages(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    kv = aligned_empty((LAYERS, n, PAGE))
    kv[...] = np.random.default_rng(seed).integers(0, 256, kv.shape, dtype=np.uint8)
    return kv


def secret_file(path: Path, secret: bytes = b"the-cache-peer-secret-0123456789") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(secret)
    path.chmod(0o400)
    return str(path)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Agent A serves other nodes on loopback; agent B's config names A as its peer. Both hold the cache's
    peer secret; A registers its DRAM pool with the transfer engine (one-sided reads, as over RDMA)."""
    listen = f"127.0.0.1:{free_port()}"
    secret = secret_file(tmp_path / "secret")
    a = config(tmp_path / "a", 1, ClusterConfig(listen=listen, staging_bytes=8 * LAYERS * PAGE, peer_timeout_s=2,
                                                secret_file=secret, one_sided_dram="on"))  # fmt: skip
    b = config(tmp_path / "b", 2, ClusterConfig(peers=(listen,), staging_bytes=8 * LAYERS * PAGE, peer_timeout_s=2,
                                                secret_file=secret))  # fmt: skip
    logs = {n: (tmp_path / f"{n}.log").open("w") for n in "ab"}
    procs = {"a": spawn(a, tmp_path / "a", output=logs["a"]), "b": spawn(b, tmp_path / "b", output=logs["b"])}
    yield {"a": a, "b": b, "procs": procs, "tmp": tmp_path, "listen": listen}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("one_sided", [False, True], ids=["staged", "one-sided-dram"])
def test_a_session_written_on_one_node_is_restored_on_another_bit_exact(two_nodes: dict[str, Any],
                                                                         one_sided: bool) -> None:  # fmt: skip
    """Over TCP the peer stages every page (one range per layer); over RDMA DRAM pages are read one-sided
    from its pool (forced here: the same transfer engine path, on TCP)."""
    writer = connect(two_nodes["a"].agent.socket)
    shared, session = pages(20, 1), pages(30, 2)
    keys = [f"p{i}" for i in range(50)]
    assert writer.put(keys[:20], shared, SHARED).medium.name == "DRAM"
    assert writer.put(keys[20:], session, Hints(context_tokens=100_000, parent_key=keys[19])).medium.name == "SSD"
    reader = Cluster(connect(two_nodes["b"].agent.socket), stage_dram=not one_sided)
    try:
        assert reader.engine.exists(keys) == 0 and reader.exists(keys) == 50  # none local, all on A
        assert reader.exists([*keys, "unknown"]) == 50
        dest = aligned_empty((LAYERS, 50, PAGE))
        dest[...] = 0
        assert reader.restore(keys, dest) == set()
        assert np.array_equal(dest[:, :20], shared) and np.array_equal(dest[:, 20:], session)
        got = reader.last
        assert (got.node_id, got.pages, got.dram_pages, got.ssd_pages, got.corrupt_pages) == (1, 50, 20, 30, 0)
        assert got.bytes == 50 * LAYERS * PAGE and 0 < got.first_layer_s <= got.seconds
        # The local prefix first, then the peer's continuation: the first pages come from B itself.
        local = connect(two_nodes["b"].agent.socket)
        head = aligned_empty((LAYERS, 5, PAGE))
        head[...] = shared[:, :5]
        local.put(keys[:5], head, SHARED)
        dest[...] = 0
        assert reader.restore([*keys, "unknown"], aligned_empty((LAYERS, 51, PAGE))) == {50}
        assert reader.restore(keys, dest) == set() and reader.last.pages == 45
        assert np.array_equal(dest[:, 20:], session)
        # Nothing is left pinned or staged on A once the restores are done.
        stats = AgentConnection(two_nodes["a"].agent.socket)
        stats.call("register")
        assert stats.call("stats")["leases"] == 0
        local.close()
    finally:
        reader.close()
        writer.close()


def handshake(address: str, signer: AgentConnection | None, **register: Any) -> tuple[AgentConnection, Any]:
    """Connect to a peer port as a Cluster does: its challenge, answered by ``signer`` (an agent)."""
    peer = AgentConnection(address, timeout=5)
    nonce = peer.call("hello")["nonce"]
    mine = b"c" * 16
    signed = signer.call("peer_sign", nonce=nonce, client_nonce=mine) if signer is not None else {"auth": None}
    args = {"layers": LAYERS, "page_bytes": PAGE, **register}
    try:
        return peer, peer.call("register", client_nonce=mine, auth=signed["auth"], **args)
    except BaseException:
        peer.close()
        raise


def test_other_nodes_may_only_read(two_nodes: dict[str, Any]) -> None:
    signer = AgentConnection(two_nodes["b"].agent.socket)
    signer.call("register")
    peer, reply = handshake(two_nodes["listen"], signer)
    assert reply["peer"]["node_id"] == 1 and reply["peer"]["dram_base"] > 0
    assert "config" not in reply  # a peer learns where to read, not this agent's configuration
    with pytest.raises(ProtocolError, match="'allocate' is not served to other nodes"):
        peer.call("allocate", keys=["x"], hints={})
    with pytest.raises(ProtocolError, match="'peer_sign' is not served to other nodes"):
        peer.call("peer_sign", nonce=b"n" * 16, client_nonce=b"c" * 16)
    with pytest.raises(ValueError, match="page_bytes: the client.s model has 4096"):
        handshake(two_nodes["listen"], signer, page_bytes=4096)
    # Leases pin pages against reclaim: a peer connection holds at most cluster.max_peer_leases of them.
    writer = connect(two_nodes["a"].agent.socket)
    writer.put(["l0"], pages(1, 8), SHARED)
    leases = [peer.call("acquire", keys=["l0"])["id"] for _ in range(two_nodes["a"].cluster.max_peer_leases)]
    with pytest.raises(ProtocolError, match="cluster.max_peer_leases=64"):
        peer.call("acquire", keys=["l0"])
    peer.call("release", id=leases[0])
    assert peer.call("acquire", keys=["l0"])["id"] > leases[-1]
    writer.close()
    peer.close()
    signer.close()


def test_only_agents_of_the_cache_are_served(two_nodes: dict[str, Any], tmp_path: Path) -> None:
    """Without the cache's secret nothing is answered on the peer port but the challenge: no lookup, no
    lease, no key's presence; a wrong secret or a replayed answer is refused the same way."""
    writer = connect(two_nodes["a"].agent.socket)
    writer.put(["s0", "s1"], pages(2, 9), SHARED)
    stranger = AgentConnection(two_nodes["listen"], timeout=5)
    with pytest.raises(ProtocolError, match="register first"):
        stranger.call("exists", keys=["s0", "s1"])
    with pytest.raises(ProtocolError, match="not authenticated as an agent of this cache"):
        stranger.call("register", layers=LAYERS, page_bytes=PAGE)
    stranger.close()
    # An agent of another cache (another secret) signs for its client: refused.
    other = AgentThread(config(tmp_path / "c", 3, ClusterConfig(listen=f"127.0.0.1:{free_port()}",
                                                                secret_file=secret_file(tmp_path / "other", b"x" * 32),
                                                                staging_bytes=8 * LAYERS * PAGE)))  # fmt: skip
    try:
        signer = AgentConnection(other.socket)
        signer.call("register")
        with pytest.raises(ProtocolError, match="not authenticated"):
            handshake(two_nodes["listen"], signer)
        reader = Cluster(connect(other.socket), peers=[two_nodes["listen"]], timeout_s=2)
        dest = aligned_empty((LAYERS, 2, PAGE))
        assert reader.exists(["s0", "s1"]) == 0 and reader.restore(["s0", "s1"], dest) == {0, 1}
        reader.close()
        signer.close()
    finally:
        other.stop()
    # A recorded answer does not open a new connection: each challenge is fresh.
    good = AgentConnection(two_nodes["b"].agent.socket)
    good.call("register")
    first = AgentConnection(two_nodes["listen"], timeout=5)
    nonce = first.call("hello")["nonce"]
    answer = good.call("peer_sign", nonce=nonce, client_nonce=b"c" * 16)["auth"]
    first.call("register", layers=LAYERS, page_bytes=PAGE, client_nonce=b"c" * 16, auth=answer)
    replay = AgentConnection(two_nodes["listen"], timeout=5)
    replay.call("hello")
    with pytest.raises(ProtocolError, match="not authenticated"):
        replay.call("register", layers=LAYERS, page_bytes=PAGE, client_nonce=b"c" * 16, auth=answer)
    for conn in (first, replay, good):
        conn.close()
    writer.close()


def test_over_tcp_the_transfer_engine_exposes_no_dram_pool(tmp_path: Path) -> None:
    """By default (cluster.one_sided_dram auto) only RDMA registers the pool with the transfer engine,
    whose own port checks nobody: over TCP a one-sided read of the pool's pages fails, whoever asks."""
    from flatcake.node_agent.datapath.transfer import Transfer

    secret = secret_file(tmp_path / "secret")
    node = AgentThread(config(tmp_path / "a", 1, ClusterConfig(listen=f"127.0.0.1:{free_port()}", secret_file=secret,
                                                               staging_bytes=8 * LAYERS * PAGE)))  # fmt: skip
    try:
        writer = connect(node.socket)
        writer.put(["d0"], pages(1, 4), SHARED)
        signer = AgentConnection(node.socket)
        signer.call("register")
        peer, reply = handshake(node.agent.peer_address, signer)
        assert reply["peer"]["dram_base"] == 0  # peers are told to stage DRAM pages
        attacker = Transfer("127.0.0.1", "tcp", "")
        landing = aligned_empty(LAYERS * PAGE)
        attacker.register(int(landing.ctypes.data), landing.nbytes)
        pool = int(node.agent.dram.view.ctypes.data)  # the address, as if guessed
        assert not attacker.read(reply["peer"]["transfer"], [int(landing.ctypes.data)], [pool], [PAGE], 2.0)
        attacker.close()
        peer.close()
        signer.close()
        writer.close()
    finally:
        node.stop()


def test_a_corrupt_remote_page_is_a_miss_never_wrong_bytes(two_nodes: dict[str, Any]) -> None:
    writer = connect(two_nodes["a"].agent.socket)
    kv = pages(6, 3)
    keys = [f"c{i}" for i in range(6)]
    writer.put(keys, kv, SHARED)
    # Flip one byte of page 3 in A's DRAM pool, where the transfer engine reads it.
    loc = writer.catalog.lookup(keys)
    slot = (loc[1][3] & ((1 << 48) - 1)) // (LAYERS * PAGE)
    writer._dram3[slot, 2, 100] ^= 0xFF
    reader = Cluster(connect(two_nodes["b"].agent.socket))
    dest = aligned_empty((LAYERS, 6, PAGE))
    dest[...] = 0
    assert reader.restore(keys, dest) == {3, 4, 5}  # a prefix: pages after a bad one are not used either
    assert reader.last.corrupt_pages == 1 and np.array_equal(dest[:, :3], kv[:, :3])
    assert not dest[:, 3:].any()  # nothing of the bad page (or after it) reached the destination
    reader.close()
    writer.close()


def test_a_peer_killed_mid_restore_gives_misses_within_the_timeout(two_nodes: dict[str, Any]) -> None:
    writer = connect(two_nodes["a"].agent.socket)
    n = 400  # 50 chunks of 8 pages (cluster.staging_bytes): the kill lands between chunks or inside one
    kv = pages(n, 4)
    keys = [f"k{i}" for i in range(n)]
    writer.put(keys, kv, Hints(context_tokens=100_000))  # SSD: every chunk is staged by A's agent
    writer.close()
    reader = Cluster(connect(two_nodes["b"].agent.socket))
    dest = aligned_empty((LAYERS, n, PAGE))
    dest[...] = 0
    result: dict[str, Any] = {}

    def restore() -> None:
        t = time.monotonic()
        result["missing"] = reader.restore(keys, dest)
        result["seconds"] = time.monotonic() - t

    thread = threading.Thread(target=restore)
    thread.start()
    wait_until(lambda: reader.last.pages > 0, what="the first remote chunk to land")
    two_nodes["procs"]["a"].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    thread.join(60)
    assert not thread.is_alive()
    assert time.monotonic() - killed < reader.timeout_s + 10  # misses within the timeout, no hang
    missing = result["missing"]
    assert missing, "the restore finished before the kill; the test did not exercise a dead peer"
    arrived = sorted(set(range(n)) - missing)
    assert arrived == list(range(len(arrived)))  # a prefix arrived ...
    assert np.array_equal(dest[:, : len(arrived)], kv[:, : len(arrived)])  # ... bit-exact
    assert not dest[:, len(arrived) :].any()  # and nothing else was written
    # The dead peer leaves lookups: misses at once, no wait on a dead node.
    t = time.monotonic()
    assert reader.exists(keys) == 0 and time.monotonic() - t < reader.timeout_s
    # A restarted peer serves again, once its time out of lookups has passed.
    two_nodes["procs"]["a"] = spawn(two_nodes["a"], two_nodes["tmp"] / "a")
    wait_until(lambda: reader.exists(keys) == n, what="the restarted peer to answer lookups", timeout=60)
    again = aligned_empty((LAYERS, 10, PAGE))
    assert reader.restore(keys[:10], again) == set() and np.array_equal(again, kv[:, :10])
    reader.close()


def test_clients_take_their_peers_from_their_agent(two_nodes: dict[str, Any], tmp_path: Path) -> None:
    """With no peer list of its own, a Cluster asks this node's agent (op ``peers``: configured, and found
    in the other agents' FlatCakeNodes), again every refresh_s: a peer that comes or goes is followed."""
    writer = connect(two_nodes["a"].agent.socket)
    writer.put(["d0", "d1"], pages(2, 5), SHARED)
    node = AgentThread(config(tmp_path / "c", 3, ClusterConfig(staging_bytes=8 * LAYERS * PAGE,
                                                               secret_file=str(tmp_path / "secret"))))  # fmt: skip
    reader = Cluster(connect(node.socket))
    try:
        assert reader.exists(["d0", "d1"]) == 0 and reader.peers == []
        node.agent.set_discovered_peers([two_nodes["listen"]])  # what the FlatCakeNode reporter finds
        reader.refresh_s = 0.0
        assert reader.exists(["d0", "d1"]) == 2 and [p.address for p in reader.peers] == [two_nodes["listen"]]
        node.agent.set_discovered_peers([])
        assert reader.exists(["d0", "d1"]) == 0 and reader.peers == []
    finally:
        reader.close()
        node.stop()
        writer.close()


def test_a_peers_pages_slower_to_fetch_than_to_prefill_are_not_used(two_nodes: dict[str, Any]) -> None:
    """cluster.prefill_tokens_per_s: once a read has measured the link, a continuation that would arrive
    later than the engine prefills it is left out of lookups (the simulator's rule)."""
    writer = connect(two_nodes["a"].agent.socket)
    keys = [f"f{i}" for i in range(8)]
    writer.put(keys, pages(8, 6), SHARED)
    reader = Cluster(connect(two_nodes["b"].agent.socket))
    try:
        reader.prefill_tokens_per_s = 1e15  # a GPU that prefills faster than any link moves KV
        assert reader.exists(keys) == 8  # the link is not measured yet: fetched
        assert reader.restore(keys, aligned_empty((LAYERS, 8, PAGE))) == set()
        assert reader.link_bytes_per_s is not None and reader.link_bytes_per_s > 0
        assert reader.exists(keys) == 0 and reader.declined == 1  # now measured: not worth fetching
        reader.prefill_tokens_per_s = 1.0  # a slow engine: the peer's pages win
        assert reader.exists(keys) == 8
    finally:
        reader.close()
        writer.close()


def test_cluster_settings_are_checked_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster.listen: 'nowhere' must be host:port"):
        config(tmp_path, 1, ClusterConfig(listen="nowhere"))
    with pytest.raises(ConfigError, match=r"cluster.peers: '10.0.0.1:99999' must be host:port"):
        config(tmp_path, 1, ClusterConfig(peers=("10.0.0.1:99999",)))
    with pytest.raises(ConfigError, match="cluster.transfer_protocol: 'udp' must be one of tcp, rdma"):
        config(tmp_path, 1, ClusterConfig(transfer_protocol="udp"))
    with pytest.raises(ConfigError, match="cluster.staging_bytes: 4096 must be a multiple of 4096 and hold"):
        config(tmp_path, 1, ClusterConfig(staging_bytes=4096))
    with pytest.raises(ConfigError, match="cluster.prefill_tokens_per_s: -1.0 must be >= 0"):
        config(tmp_path, 1, ClusterConfig(prefill_tokens_per_s=-1.0))
    with pytest.raises(ConfigError, match="cluster.secret_file: required with cluster.listen"):
        config(tmp_path, 1, ClusterConfig(listen="127.0.0.1:7471"))
    with pytest.raises(ConfigError, match="cluster.one_sided_dram: 'yes' must be one of auto, on, off"):
        config(tmp_path, 1, ClusterConfig(one_sided_dram="yes"))
