"""Hits beyond this node: where the local cache's prefix ends, another node's agent may go on.

``Cluster(engine)`` wraps a client's engine (``connect``) with the other nodes' agents
(``cluster.peers``, their ``cluster.listen`` addresses):

- ``exists(keys)``: the local prefix (the engine), then, for the rest, the longest prefix any live peer
  holds. Peers are asked in parallel, each within ``cluster.peer_timeout_s``; no coordinator is asked
  on the read path. Who the peers are, this node's agent says (op ``peers``: ``cluster.peers`` and the
  agents it found in their FlatCakeNodes), asked again every ``PEER_REFRESH_S``.
- ``restore(keys, dest)``: the local prefix through the engine (FC-CIO), the rest from the peer that
  holds it: leased there (no reclaim under the read), DRAM pages read one-sided from its pool, SSD
  pages staged by its agent and read one range per layer (``service/peer_service.py``), all over Mooncake's
  transfer engine into a registered landing buffer, checked page by page against the published crc32,
  then written into ``dest`` (numpy ``[layers][slots][page_bytes]`` or a ``PagedTarget``).

Failures turn into misses, never into wrong bytes: a peer that does not answer, whose transfer fails or
times out, whose bytes do not match their crc32, or whose reply is not what the protocol says (a lease
without a crc per page, more hits than asked, indexes out of range: ``_count``, ``_ints``, ``_peer_info``,
``_staged_reply``) yields ``missing`` pages;
a failed peer is left out of lookups for ``peer_timeout_s`` and then reconnected from scratch (a
restarted agent registers anew, with its new pool address). No exception from a peer reaches the
caller (SGLang's or vLLM's thread).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from flatcake.errors import FlatCakeError
from flatcake.node_agent.catalog.checksum import page_checksum
from flatcake.node_agent.config import host_port
from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.target import PagedTarget, host_target
from flatcake.node_agent.datapath.transfer import Transfer
from flatcake.node_agent.policy import gva as G
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.service import peer_auth
from flatcake.node_agent.service.client import AgentConnection

log = logging.getLogger(__name__)


class PeerReplyError(ConnectionError):
    """A peer answered something the protocol does not allow: treated as a peer that failed."""


# What a peer can make happen: besides failures of the connection or the transfer, anything its replies
# can raise in code that reads them (a peer is not trusted to be well-formed, only checked).
PEER_FAULTS = (FlatCakeError, ConnectionError, TimeoutError, OSError, KeyError, TypeError, ValueError, IndexError,
               AttributeError)  # fmt: skip
U32 = (1 << 32) - 1
PEER_REFRESH_S = 10.0  # how often the peer list is asked of this node's agent
Ints = npt.NDArray[np.int64]


@dataclass
class Peer:
    """Another node's agent as this client sees it."""

    address: str  # its cluster.listen
    conn: AgentConnection | None = None
    info: dict[str, Any] = field(default_factory=dict)  # its register reply's "peer": node_id, transfer, ...
    down_until: float = 0.0
    failures: int = 0


@dataclass
class RemoteRead:
    """What one restore took from peers (``Cluster.last``)."""

    node_id: int = -1
    pages: int = 0
    dram_pages: int = 0
    ssd_pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    first_layer_s: float = 0.0  # from the start until layer 0 of the first chunk had landed
    corrupt_pages: int = 0  # arrived, but did not match their crc32 (reported missing)


class Cluster:
    """This client's engine plus the other nodes' agents (see the module's docstring)."""

    def __init__(self, engine: Engine, peers: Sequence[str] | None = None, *, timeout_s: float | None = None,
                 stage_dram: bool | None = None) -> None:  # fmt: skip
        c = engine.config
        # Whether peers stage their DRAM pages too (``_staged``); None: by the transport.
        self.stage_dram = c.cluster.transfer_protocol != "rdma" if stage_dram is None else stage_dram
        self.engine = engine
        self.peers = [Peer(a) for a in (c.cluster.peers if peers is None else peers)]
        # Given no list, the peers are whoever this node's agent names now (its ``peers`` op).
        self._agent: Any = getattr(engine.catalog, "conn", None) if peers is None else None
        self._signer: Any = getattr(engine.catalog, "conn", None)  # this node's agent: answers peers' challenges
        self._refreshed = -float("inf")
        self.refresh_s = PEER_REFRESH_S
        self.timeout_s = timeout_s if timeout_s is not None else c.cluster.peer_timeout_s
        self.layers, self.page_bytes = c.layers, c.page_bytes
        self.span = c.layers * c.page_bytes
        self._landing_bytes = c.cluster.staging_bytes
        self._transfer: Transfer | None = None
        self._landing: npt.NDArray[np.uint8] | None = None
        self._quarantine: list[npt.NDArray[np.uint8]] = []  # landing buffers a timed-out read may still fill
        self._lock = threading.Lock()  # one remote restore at a time through the landing buffer
        self._ask = ThreadPoolExecutor(max_workers=16, thread_name_prefix="flatcake-peers")
        self.last = RemoteRead()
        self.prefill_tokens_per_s = c.cluster.prefill_tokens_per_s
        self.page_tokens = c.page_tokens
        self.link_bytes_per_s: float | None = None  # measured on remote reads (moving average); None: not yet
        self.declined = 0  # peers' continuations slower to fetch than to prefill, not used

    # ---- lookups -----------------------------------------------------------------------------------
    def exists(self, keys: Sequence[Key]) -> int:
        """The stored prefix of ``keys`` across the cluster: this node's, continued by one peer's."""
        local = self.engine.exists(keys)
        self._refresh()
        if local == len(keys) or not self.peers:
            return local
        _, hit = self._find(keys[local:])
        return local + hit

    def _worth_fetching(self, pages: int) -> bool:
        """Whether ``pages`` of a peer arrive sooner than the engine would prefill them: the rule the
        simulator shows is needed (``simulate --cross-node-gbps``: at TCP rates a GPU prefills a prompt
        sooner than the network brings its KV). Without a prefill rate, or before a read has measured the
        link, always."""
        if not self.prefill_tokens_per_s or self.link_bytes_per_s is None:
            return True
        fetch_s = pages * self.span / self.link_bytes_per_s
        return fetch_s < pages * self.page_tokens / self.prefill_tokens_per_s

    def _refresh(self) -> None:
        """Take the peer list this node's agent gives now (keeping the connections of peers still in it)."""
        if self._agent is None or time.monotonic() - self._refreshed < self.refresh_s:
            return
        self._refreshed = time.monotonic()
        try:
            addresses = [str(a) for a in self._agent.call("peers")]
        except PEER_FAULTS as exc:  # an agent without the op, or gone: keep the list as it is
            log.debug("peers: the local agent did not say (%s)", exc)
            return
        known = {p.address: p for p in self.peers}
        for gone in set(known) - set(addresses):
            if known[gone].conn is not None:
                known[gone].conn.close()  # type: ignore[union-attr]
        self.peers = [known.get(a) or Peer(a) for a in addresses]

    def _find(self, keys: Sequence[Key]) -> tuple[Peer | None, int]:
        """The live peer with the longest stored prefix of ``keys``, and its length."""
        live = [p for p in self.peers if p.down_until <= time.monotonic()]
        if not live or not keys:
            return None, 0
        answers = list(self._ask.map(lambda p: (p, self._peer_exists(p, keys)), live))
        best, hit = max(answers, key=lambda a: a[1])
        if hit and not self._worth_fetching(hit):
            self.declined += 1
            return None, 0
        return (best, hit) if hit else (None, 0)

    def _peer_exists(self, peer: Peer, keys: Sequence[Key]) -> int:
        try:
            return _count(self._conn(peer).call("exists", keys=list(keys)), "exists", len(keys))
        except PEER_FAULTS as exc:
            self._down(peer, f"lookup: {exc}")
            return 0

    def _conn(self, peer: Peer) -> AgentConnection:
        if peer.conn is None:
            conn = AgentConnection(peer.address, timeout=self.timeout_s)
            try:
                peer.info = self._handshake(conn, peer)
            except BaseException:
                conn.close()
                raise
            peer.conn = conn
        return peer.conn

    def _handshake(self, conn: AgentConnection, peer: Peer) -> dict[str, Any]:
        """Authenticate to ``peer`` as an agent of this cache (peer_auth.py): its challenge, answered by this
        node's agent, and its proof back; returns what its register says about it."""
        hello = conn.call("hello")
        nonce = hello.get("nonce") if isinstance(hello, dict) else None
        if not isinstance(nonce, bytes) or len(nonce) < peer_auth.NONCE_BYTES:
            raise PeerReplyError(f"hello: {str(hello)[:60]!r} carries no nonce")
        mine = peer_auth.nonce()
        signed = self._signer.call("peer_sign", nonce=nonce, client_nonce=mine) if self._signer is not None else {}
        auth, proof = (signed or {}).get("auth"), (signed or {}).get("proof")
        reply = conn.call("register", layers=self.layers, page_bytes=self.page_bytes, client_nonce=mine, auth=auth)
        if not isinstance(reply, dict) or "peer" not in reply:
            raise ConnectionError(f"{peer.address}: the agent there serves no peers (cluster.listen unset)")
        if proof is not None and not peer_auth.matches(proof, reply.get("proof")):
            raise PeerReplyError(f"register: {peer.address} did not prove it is an agent of this cache")
        return _peer_info(reply["peer"])

    def _down(self, peer: Peer, why: str) -> None:
        """Leave ``peer`` out of lookups for a while; its next use connects (and registers) anew."""
        peer.failures += 1
        peer.down_until = time.monotonic() + self.timeout_s
        if peer.conn is not None:
            peer.conn.close()
            peer.conn = None
        log.warning("peer %s (node %s): %s; left out for %.1f s", peer.address, peer.info.get("node_id", "?"), why,
                    self.timeout_s)  # fmt: skip

    # ---- restores ----------------------------------------------------------------------------------
    def restore(self, keys: Sequence[Key], dest: npt.NDArray[np.uint8] | PagedTarget) -> set[int]:
        """Restore ``keys`` into ``dest`` pages ``0..len(keys)-1``: the local prefix, then a peer's. Returns
        the indexes of ``keys`` whose bytes did not arrive (everything past the stored prefix among them)."""
        target = dest if isinstance(dest, PagedTarget) else host_target(dest)
        local = self.engine.exists(keys)
        self._refresh()
        missing: set[int] = set()
        if local:
            with self.engine.get(keys[:local], target.head(local)) as restore:
                missing |= set(restore.run())
        self.last = RemoteRead()
        if local < len(keys) and self.peers:
            peer, hit = self._find(keys[local:])
            got = self._remote(peer, keys[local : local + hit], target, local) if peer is not None else 0
            missing |= set(range(local + got, len(keys)))
        else:
            missing |= set(range(local, len(keys)))
        return missing

    def _remote(self, peer: Peer, keys: Sequence[Key], target: PagedTarget, first: int) -> int:
        """Read ``keys`` from ``peer`` into ``target`` pages ``first..``; returns how many leading pages
        arrived intact (the rest are misses)."""
        if not keys:
            return 0
        started = time.perf_counter()
        done = 0
        with self._lock:
            try:
                transfer = self._transfer_for(peer)
                chunk = max(1, min(int(peer.info.get("stage_pages", 1)), self._landing_bytes // self.span))
                while done < len(keys):
                    part = keys[done : done + chunk]
                    ok = self._chunk(peer, transfer, part, target, first + done, started)
                    done += ok
                    if ok < len(part):
                        break
            except PEER_FAULTS as exc:  # the chunks before the failing one arrived whole
                self._down(peer, f"restore: {exc}")
        self.last.node_id = int(peer.info.get("node_id", -1))
        self.last.seconds = time.perf_counter() - started
        if self.last.bytes and self.last.seconds > 0:  # the link as reads see it (lookups and leases included)
            rate = self.last.bytes / self.last.seconds
            self.link_bytes_per_s = rate if self.link_bytes_per_s is None else 0.7 * self.link_bytes_per_s + 0.3 * rate
        return done

    def _transfer_for(self, peer: Peer) -> Transfer:
        if self._transfer is None:
            c = self.engine.config.cluster
            self._transfer = Transfer(_route_to(peer.address), c.transfer_protocol, c.transfer_device)
        if self._landing is None:
            self._landing = aligned_empty(self._landing_bytes)
            self._landing[::4096] = 0  # fault it in before the first read lands
            self._transfer.register(int(self._landing.ctypes.data), self._landing.nbytes)
        return self._transfer

    def _chunk(self, peer: Peer, transfer: Transfer, keys: Sequence[Key], target: PagedTarget, first: int,
               started: float) -> int:  # fmt: skip
        """One leased chunk: pages read one-sided or staged by the peer (``_staged``), checked, written to
        ``target``."""
        conn = self._conn(peer)
        n, L, P = len(keys), self.layers, self.page_bytes
        lease = conn.call("acquire", keys=list(keys))
        if not isinstance(lease, dict) or type(lease.get("id")) is not int:
            raise PeerReplyError(f"acquire: the lease {str(lease)[:80]!r} has no id")
        staged: dict[str, Any] | None = None
        try:
            gva_list = _ints(lease.get("gva"), n, "acquire: gva", 0, (1 << 64) - 1)
            # Every page is checked against its published crc32: a lease without one per page is refused.
            crc = _ints(lease.get("crc"), n, "acquire: crc", 0, U32)
            assert self._landing is not None
            landing = self._landing[: n * self.span].reshape(L, n, P)
            gva = np.asarray(gva_list, dtype=np.uint64)
            on_ssd = gva >= np.uint64(G.SSD_THRESHOLD)
            offsets = (gva & np.uint64(G.MAX_OFFSET)).astype(np.int64)
            ssd, dram = np.flatnonzero(on_ssd), np.flatnonzero(~on_ssd)
            stage = self._staged(on_ssd, peer)
            direct = np.flatnonzero(~stage)
            staging = np.flatnonzero(stage)
            staged_missing: set[int] = set()
            if len(staging):
                staged = _staged_reply(conn.call("stage", keys=[keys[int(i)] for i in staging]), len(staging))
                staged_missing = {int(staging[i]) for i in staged["missing"]}
            base = int(landing.ctypes.data)
            dram_base = int(peer.info["dram_base"])
            for layer in range(L):
                local, remote, lengths = _pieces(
                    base + (layer * n) * P, P, direct, dram_base + offsets[direct] + layer * P,
                    staging, (int(staged["address"]) + layer * len(staging) * P) if staged else 0,
                )  # fmt: skip
                if not transfer.read(str(peer.info["transfer"]), local, remote, lengths, self.timeout_s):
                    raise ConnectionError(f"transfer of layer {layer} from {peer.info['transfer']} failed")
                if layer == 0 and not self.last.first_layer_s:
                    self.last.first_layer_s = time.perf_counter() - started
            good = n
            for j in range(n):
                if j in staged_missing or page_checksum(landing, j) != crc[j]:
                    if j not in staged_missing:
                        self.last.corrupt_pages += 1
                    good = j
                    break
            pages = np.arange(good, dtype=np.int64)
            for layer in range(L):
                target.write(layer, first + pages, landing[layer, :good])
            self.last.pages += good
            self.last.dram_pages += int((dram < good).sum())
            self.last.ssd_pages += int((ssd < good).sum())
            self.last.bytes += good * self.span
            return good
        except TimeoutError:
            # The read may still land: this landing buffer is no longer ours to reuse.
            if self._landing is not None:
                self._quarantine.append(self._landing)
                self._landing = None
            raise
        finally:
            with contextlib.suppress(*PEER_FAULTS):
                if staged is not None:
                    conn.call("unstage", id=int(staged["handle"]))
                conn.call("release", id=int(lease["id"]))

    def _staged(self, on_ssd: npt.NDArray[np.bool_], peer: Peer) -> npt.NDArray[np.bool_]:
        """Which pages the peer's agent stages (the rest are read one-sided from its DRAM pool). SSD pages
        always: no transfer engine reads a peer's disk here. DRAM pages too over TCP, where each range
        costs a round of the engine's protocol and a page-layer is one range: staged, a chunk is one range
        per layer (bench remote measures both side by side: docs/benchmarks.md), and whenever the peer
        does not expose its pool to the transfer engine (``dram_base`` 0: cluster.one_sided_dram). Over
        RDMA the NIC reads page-layers one-sided without the peer's CPU, as FC-GVA intends."""
        one_sided = not self.stage_dram and int(peer.info["dram_base"]) != 0
        return on_ssd if one_sided else np.ones_like(on_ssd)

    def close(self) -> None:
        """Close the connections to other nodes' agents and the transfer engine's buffers."""
        self._ask.shutdown(wait=False, cancel_futures=True)
        for peer in self.peers:
            if peer.conn is not None:
                peer.conn.close()
        if self._transfer is not None:
            self._transfer.close()


def _count(value: Any, what: str, most: int) -> int:
    """A peer's hit count: an integer from 0 to what was asked."""
    if type(value) is not int or not 0 <= value <= most:
        raise PeerReplyError(f"{what}: {str(value)[:40]!r} is not a count of 0..{most} pages")
    return value


def _ints(value: Any, n: int | None, what: str, lo: int, hi: int) -> list[int]:
    """A list of ``n`` integers (any number: None) in ``lo..hi`` from a peer."""
    if (not isinstance(value, list) or (n is not None and len(value) != n)
            or not all(type(x) is int and lo <= x <= hi for x in value)):  # fmt: skip
        raise PeerReplyError(f"{what}: expected {n if n is not None else 'any number of'} integers in "
                             f"{lo}..{hi}, got {str(value)[:60]!r}")  # fmt: skip
    return value


def _peer_info(info: Any) -> dict[str, Any]:
    """A peer's register reply: who it is, where its transfer engine and pool are."""
    if not isinstance(info, dict):
        raise PeerReplyError(f"register: peer info {str(info)[:60]!r} is not a map")
    if not isinstance(info.get("transfer"), str) or not info["transfer"]:
        raise PeerReplyError("register: peer info names no transfer endpoint")
    for name, lo in (("node_id", 0), ("dram_base", 0), ("stage_pages", 0)):  # 0: no DRAM pool, no staging
        if type(info.get(name)) is not int or info[name] < lo:
            raise PeerReplyError(f"register: peer info {name} {info.get(name)!r} is not an integer >= {lo}")
    return info


def _staged_reply(reply: Any, n: int) -> dict[str, Any]:
    """A peer's stage reply: a handle, the staging address, and which of the ``n`` pages it could not read."""
    if not isinstance(reply, dict):
        raise PeerReplyError(f"stage: {str(reply)[:60]!r} is not a map")
    for name in ("handle", "address"):
        if type(reply.get(name)) is not int:
            raise PeerReplyError(f"stage: {name} {reply.get(name)!r} is not an integer")
    _ints(reply.get("missing"), None, "stage: missing", 0, n - 1)
    return reply


def _pieces(local_base: int, page_bytes: int, dram: Ints, dram_addr: Ints, ssd: Ints,
            staged_base: int) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """One layer's transfer ranges: page ``j`` lands at ``local_base + j x page_bytes``; DRAM page ``dram[i]``
    comes from ``dram_addr[i]``, SSD page ``ssd[i]`` from ``staged_base + i x page_bytes``. Pages adjacent on
    both sides merge into one range."""
    order = np.concatenate([dram, ssd])
    remote = np.concatenate([dram_addr, staged_base + np.arange(len(ssd), dtype=np.int64) * page_bytes])
    sort = np.argsort(order, kind="stable")
    order, remote = order[sort], remote[sort]
    local = local_base + order * page_bytes
    if not len(order):
        return [], [], []
    cut = np.flatnonzero((np.diff(local) != page_bytes) | (np.diff(remote) != page_bytes)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(order)]])
    return local[starts].tolist(), remote[starts].tolist(), ((ends - starts) * page_bytes).tolist()


def _route_to(address: str) -> str:
    """This host's address on the route to ``address`` (the transfer engine binds and advertises it)."""
    where = host_port(address)
    assert where is not None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((where[0], where[1] or 9))  # UDP connect sends nothing; it picks the route's source
        return str(s.getsockname()[0])


__all__ = ["Cluster", "Peer", "RemoteRead"]
