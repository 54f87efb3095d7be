"""The node agent's server: one catalog per node, shared by every inference process on it.

The agent owns the metadata (index, allocation, scopes, reclaim, journal) and serves it on a Unix
socket; clients map the DRAM pool and open the pool files themselves, so KV bytes never pass through
the agent. A client's unpublished allocations and pins belong to its connection: when the connection
drops (the process exited or was killed) they are aborted and released.

Each protocol op is one method, found through the ``OPS`` table (the cross-node ones are in
``peer_ops.py``); ``handle_frame`` turns every ``FlatCakeError`` into its wire code and is the only place
a broad ``except`` answers for a bug. Why one module this size: the agent's lifecycle (open, recover,
serve, close), its ops and its connection handling share the agent's state and its locks; the
cross-node ops, peer authentication, the peer service and the HTTP side are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import logging
import operator
import os
import platform
import signal
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from flatcake import metrics as M
from flatcake.errors import ConfigError, FlatCakeError, UnknownHandleError
from flatcake.node_agent.catalog.epoch import advance as advance_epoch
from flatcake.node_agent.catalog.epoch import current as current_epoch
from flatcake.node_agent.catalog.files import resolve_gid, share_path
from flatcake.node_agent.catalog.journal import Journal
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.owner import PoolOwner, lock_paths
from flatcake.node_agent.catalog.recheck import Rechecker
from flatcake.node_agent.catalog.recovery import Recovered, close_fds, page_crc_reader, recover, scan
from flatcake.node_agent.catalog.shared_index import SharedIndexWriter, seqlock_safe
from flatcake.node_agent.catalog.state_dir import adopt_legacy
from flatcake.node_agent.config import EngineConfig, host_port
from flatcake.node_agent.constants import JOURNAL_FILE
from flatcake.node_agent.datapath.dram_pool import DramPool
from flatcake.node_agent.datapath.engine import local_table
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.policy.keyindex import slots_for
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.policy.scope import Location
from flatcake.node_agent.service import client_identity, http, peer_auth
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service.peer_ops import PeerOps, Session
from flatcake.node_agent.service.peer_service import PEER_OPS, PeerService

log = logging.getLogger(__name__)

# A request frame this small is read without taking agent.frame_budget_bytes: the reader's own buffer
# holds about as much (asyncio's default limit), so the budget only has large frames to bound.
SMALL_FRAME = 64 * 1024


class Agent(PeerOps):
    """The node agent. Construction maps the pools (fast); ``recover`` rebuilds the catalog from the
    journal (slow on a large cache) and ``serve`` runs it first if nobody has, so the HTTP endpoints
    can answer probes throughout recovery."""

    def __init__(self, config: EngineConfig) -> None:
        c = self.config = config
        self.ready = False
        self.gid = resolve_gid(c.agent.group)
        # What can be refused without touching the pool is checked first, naming the field and the fix.
        _usable_dir(Path(c.agent.socket).parent, "agent.socket")
        self.peer_secret = peer_auth.load_secret(c.cluster.secret_file) if c.cluster.secret_file else None
        # One agent per pool, before anything is touched: a second one is refused here, naming the first,
        # instead of advancing the epoch (fencing the first) and failing later on a port (catalog/owner.py).
        self.owner = PoolOwner.take(lock_paths(c.state_dir, c.dram.shm_dir, c.dram.name))
        try:
            adopt_legacy(c.ssd.dir, c.state_dir)
            self._open()
        except BaseException:
            self.owner.release(remove_created=True)
            raise

    def _open(self) -> None:
        """Map the pools, start a new epoch, make the catalog: everything the owner locks guard."""
        c = self.config
        self.pool = create_pool(c.ssd.dir, c.ssd.file_count, c.ssd.file_bytes, extent_policy=c.ssd.extent_policy,
                                gid=self.gid)  # fmt: skip
        # The pool file is reused when it exists: DRAM pages survive an agent restart (not a reboot).
        self.dram = DramPool(
            c.layers * c.page_bytes, c.dram_slots, name=c.dram.name, want_huge_pages=c.dram.huge_pages,
            shm_dir=c.dram.shm_dir, hugetlbfs_dir=c.dram.hugetlbfs_dir, gid=self.gid,
        )  # fmt: skip
        # A new epoch before anything is served: writers holding allocations of the previous agent are
        # refused from here on (catalog/epoch.py).
        self.epoch = advance_epoch(c.state_dir, self.gid, c.agent.epoch_wait_s)
        table = local_table(c)
        self.index = self._shared_index(table.dram.slots + table.ssd.capacity // table.page_span)
        self.catalog = LocalCatalog(table, c.placement, epoch=self.epoch, index=self.index)
        self.recovered = Recovered()
        self.journal: Journal | None = None
        self.client_stats: Counter[str] = Counter()  # data-path counters reported by clients
        self.sessions: dict[int, Session] = {}
        self._next_session = 0
        self.registry = CollectorRegistry()
        self.registry.register(http.AgentCollector(self))
        self.latency = M.histogram("flatcake_agent_request_seconds", self.registry)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.dropped: Counter[str] = Counter()  # connections closed by the agent, by reason
        # Request bytes being received across connections, and the condition a frame waits on for room:
        # one of each for this node's clients (False) and for other nodes (True).
        self._frame_bytes = {False: 0, True: 0}
        self._frame_rooms: dict[bool, asyncio.Condition] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self.http_server: http.Server | None = None
        self.metrics_port = c.agent.metrics_port
        self._stopping = threading.Event()  # set by close: ends the recovery scan and the journal compactor
        self._scanner: threading.Thread | None = None
        self._recheck_fds: dict[int, int] = {}  # pool files the rechecker reads, closed by close()
        pool_paths = [Path(c.ssd.dir) / name for name in self.pool.files]
        self.rechecker = Rechecker(self.catalog, page_crc_reader(c, self.dram.view, pool_paths, self._recheck_fds),
                                   self._stopping)  # fmt: skip
        self.catalog.on_damaged = self.rechecker.suspect
        self._compactor: threading.Thread | None = None
        self.peers: PeerService | None = None  # serving other nodes (cluster.listen), made by serve
        self.peer_address = ""  # host:port the peer service listens on, once bound
        self.discovered_peers: tuple[str, ...] = ()  # other nodes' agents, from their FlatCakeNodes

    def _shared_index(self, max_pages: int) -> SharedIndexWriter | None:
        """The shared-memory index clients look keys up in (catalog/shared_index.py), next to the DRAM
        pool; None when turned off or it cannot be made (clients then ask over the socket)."""
        c = self.config
        if not c.agent.shared_index:
            return None
        if not seqlock_safe():
            log.warning("shared index: off on %s, a weakly ordered CPU (its seqlock would need memory barriers); "
                        "clients look keys up over the socket", platform.machine())  # fmt: skip
            return None
        path = Path(c.dram.shm_dir) / f"{c.dram.name}.index"
        try:
            return SharedIndexWriter(path, c.agent.shared_index_slots or slots_for(max_pages), epoch=self.epoch,
                                     gid=self.gid)  # fmt: skip
        except OSError as exc:
            log.error("shared index %s: cannot create it (%s); clients look keys up over the socket", path, exc)
            return None

    def fenced(self) -> int:
        """The pool's epoch when another agent has advanced it past this one's (0: not fenced). The pool
        lock keeps a second agent out, so only a process that ignores it (or a restored backup of the
        pool's files) gets here; this agent's allocations and leases are refused from then on, and
        /readyz says so."""
        now = current_epoch(self.config.state_dir)
        return now if now != self.epoch else 0

    def recover(self) -> Recovered:
        """Rebuild the catalog from the journal and start journaling (once); compaction follows online."""
        if self.journal is not None:
            return self.recovered
        c = self.config
        journal_path = Path(c.state_dir) / JOURNAL_FILE
        started = time.monotonic()
        # No page is read here: restart is O(journal records). The bytes are checked after the socket
        # opens, by the background scan and by readers of not-yet-scanned scopes (catalog/recovery.py).
        recover(self.catalog, journal_path, None, self.recovered)
        if c.agent.verify_on_recovery:
            self.catalog.unverified = set(self.catalog.table.scopes)
        else:
            self.recovered.scan_done = True
        journal = Journal(journal_path, c.agent.journal_fsync, c.agent.journal_fsync_ms, gid=self.gid,
                          compact_min_bytes=c.agent.journal_compact_bytes, compact_ratio=c.agent.journal_compact_ratio,
                          compact_records=c.agent.journal_compact_records,
                          records=(self.recovered.records, self.recovered.snapshot_records))  # fmt: skip
        r = self.recovered
        # Records beyond the compacted state (appends since the last compaction, frees, damage): compact
        # to the live state, online, after serving starts (its cost grows with the keys: 10M keys
        # would hold start-up for seconds). A journal of the first format is rewritten before the
        # first append, which must not follow a record of the old format.
        compact_now = not r.legacy_journal and (r.records > r.snapshot_records or r.skipped_records > 0)
        if r.legacy_journal:
            try:
                journal.rewrite(self.catalog.snapshot_records())
            except OSError as exc:  # a full disk at start: keep the (valid, tail-trimmed) journal as it is
                log.error("journal compaction failed, continuing with the uncompacted journal: %s", exc)
        self.catalog.journal = self.journal = journal
        self._compactor = threading.Thread(target=self._compact_loop, args=(journal, compact_now),
                                           name="flatcake-journal-compactor", daemon=True)  # fmt: skip
        self._compactor.start()
        log.info(
            "recovered %d pages in %d scopes from %d journal records (%d dropped, %d superseded, %d damaged "
            "records skipped) in %.2fs; epoch %d",
            r.pages, r.scopes, r.records, r.dropped_pages, r.superseded_pages, r.skipped_records,
            time.monotonic() - started, self.epoch,
        )  # fmt: skip
        return r

    # ---- control protocol: one method per op -----------------------------------------------------
    def dispatch(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        handler = OPS.get(op)
        if handler is None:
            raise P.ProtocolError(P.UNKNOWN_OP, f"op: {op!r} is not one of {', '.join(sorted(OPS))}")
        if op not in ("register", "hello") and not session.registered:
            raise P.ProtocolError(P.NOT_REGISTERED, f"{op}: register first (send op 'register')")
        if session.remote and op not in PEER_OPS:
            raise P.ProtocolError(P.UNKNOWN_OP, f"op: {op!r} is not served to other nodes (only "
                                  f"{', '.join(sorted(PEER_OPS))}); write through this node's own agent")  # fmt: skip
        return handler(self, session, args)

    def op_register(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        proof = self._authenticate(session, args) if session.remote else None
        if args.get("client") is not None and not session.remote and not session.pid:  # a pid the kernel gave wins
            key = client_identity.claimed(args["client"])
            if key != session.client and self._held_by(key) >= c.agent.max_clients_per_process:
                raise P.ProtocolError(P.BUSY, client_identity.too_many(key, c.agent.max_clients_per_process))
            session.client = key
        for name in ("layers", "page_bytes"):
            if name in args and args[name] != getattr(c, name):
                raise P.ProtocolError(
                    P.BAD_ARGS, f"{name}: the client's model has {args[name]}, this agent's pool {getattr(c, name)}; "
                    "run one agent (cache) per model geometry",
                )  # fmt: skip
        session.registered = True
        index = self.catalog.index
        reply = {"config": c.to_dict(), "dram_path": self.dram.info.path, "session": session.id, "epoch": self.epoch,
                 "index_path": str(index.path) if index is not None else ""}  # fmt: skip
        if self.peers is not None:
            reply["peer"] = self.peers.info()
        if session.remote:  # a peer learns what it needs to read, not this node's configuration
            reply = {"session": session.id, "epoch": self.epoch, "peer": reply.get("peer"), "proof": proof}
        return reply

    def op_exists(self, session: Session, args: dict[str, Any]) -> int:
        return self.catalog.exists(P.keys_arg(args))

    def op_lookup(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        found = self.catalog.table.find(P.keys_arg(args))
        miss = np.flatnonzero(~found.hit)
        hit = int(miss[0]) if miss.size else len(found.hit)
        return {"hit": hit, "gva": found.gva[:hit].tolist(), "stride": found.stride[:hit].tolist()}

    def op_allocate(self, session: Session, args: dict[str, Any]) -> dict[str, Any] | None:
        hints = args.get("hints", {})
        if not isinstance(hints, dict):
            raise P.ProtocolError(P.BAD_ARGS, "hints: must be a map")
        alloc = self.catalog.allocate(P.keys_arg(args), Hints.from_dict(hints))
        if alloc is None:
            return None
        session.allocs.add(alloc.id)
        return {
            "id": alloc.id, "index": alloc.index, "medium": int(alloc.medium), "reason": alloc.reason,
            "segments": [[s.file, s.offset, s.first_page, s.pages] for s in alloc.segments], "slots": alloc.slots,
            "epoch": alloc.epoch, **({"copies": alloc.copy_slots} if alloc.copy_slots else {}),
        }  # fmt: skip

    def op_publish(self, session: Session, args: dict[str, Any]) -> None:
        alloc_id = P.held_id(session.allocs, args, "allocation")
        crc = args.get("crc")
        if not isinstance(crc, list) or not all(isinstance(x, int) for x in crc):
            raise P.ProtocolError(P.BAD_ARGS, "crc: must be a list of integers, one per page")
        epoch = args.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise P.ProtocolError(P.BAD_ARGS, "epoch: must be an integer (the allocation's)")
        session.allocs.discard(alloc_id)
        self.catalog.publish(alloc_id, crc, epoch)

    def op_abort(self, session: Session, args: dict[str, Any]) -> None:
        alloc_id = P.held_id(session.allocs, args, "allocation")
        session.allocs.discard(alloc_id)
        self.catalog.abort(alloc_id)

    def op_acquire(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        cap = self.config.cluster.max_peer_leases
        if session.remote and len(session.leases) >= cap:  # pins block reclaim: a peer holds only so many
            raise P.ProtocolError(P.BUSY, f"acquire: this connection holds cluster.max_peer_leases={cap} leases "
                                  "already; release some")  # fmt: skip
        copy = args.get("copy", False)
        if not isinstance(copy, bool):
            raise P.ProtocolError(P.BAD_ARGS, "copy: must be true or false (whether the reader fills DRAM copies)")
        # A peer reads pages into its own node's memory: it cannot fill this node's DRAM copies.
        lease = self.catalog.acquire(P.keys_arg(args), copy=copy and not session.remote)
        session.leases.add(lease.id)
        return {"id": lease.id, **_columns(lease.locations, scope=0, gva=1, stride=2), "crc": lease.checksums,
                "verify": lease.verify, "epoch": self.epoch,
                **({"copies": lease.copies} if lease.copies else {})}  # fmt: skip

    def op_release(self, session: Session, args: dict[str, Any]) -> None:
        lease_id = P.held_id(session.leases, args, "lease")
        session.leases.discard(lease_id)
        copied = args.get("copied")
        if copied is not None and (not isinstance(copied, list) or not all(type(x) is int for x in copied)):
            copied = None  # filled nothing that can be trusted: the copies are freed, the lease still ends
            log.warning(
                "release of lease %d: copied must be a list of integers (crc32 or -1); copies dropped", lease_id
            )
        damaged = args.get("damaged")
        if damaged is not None and (not isinstance(damaged, list) or not all(type(x) is int for x in damaged)):
            damaged = None  # the agent checks what a reader reports; a malformed report is ignored, not fatal
            log.warning("release of lease %d: damaged must be a list of page indexes; ignored", lease_id)
        self.catalog.release(lease_id, copied, damaged)  # first: a bad stats map must not leave the pages pinned
        self._merge_stats(args.get("stats", {}))

    def op_report(self, session: Session, args: dict[str, Any]) -> None:
        self._merge_stats(args.get("stats", {}))

    def op_stats(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return self.snapshot()

    def _merge_stats(self, stats: Any) -> None:
        """Add a client's counter deltas. Only the engine's own counter names and sane values are taken
        (all or nothing): each name is a Prometheus series, so a client must not be able to make more."""
        if not isinstance(stats, dict):
            raise P.ProtocolError(P.BAD_ARGS, "stats: must be a map of counter name to integer")
        for name, value in stats.items():
            if not M.is_client_stat(name):
                shown = repr(name)[:80]
                raise P.ProtocolError(P.BAD_ARGS, f"stats: {shown} is not a FlatCake data-path counter "
                                      "(flatcake/metrics.py:CLIENT_STATS); nothing was counted")  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= M.MAX_STAT_DELTA:
                raise P.ProtocolError(P.BAD_ARGS, f"stats[{name!r}]: {value!r} must be an integer within "
                                      f"0..{M.MAX_STAT_DELTA}; nothing was counted")  # fmt: skip
        self.client_stats.update(stats)

    def service_seconds(self) -> dict[str, tuple[float, float]]:
        """Per op: (count, total seconds) of service time, from the request histogram."""
        out: dict[str, tuple[float, float]] = {}
        for metric in self.registry.collect():
            if metric.name != "flatcake_agent_request_seconds":
                continue
            for sample in metric.samples:
                op = sample.labels.get("op", "")
                count, total = out.get(op, (0.0, 0.0))
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
                out[op] = (count, total)
        return out

    def snapshot(self) -> dict[str, Any]:
        allocs, leases = self.catalog.handles()
        return {
            "usage": self.catalog.table.usage(), "placements": self.catalog.placements.snapshot(),
            "clients": len(self.sessions), "open_allocations": allocs, "leases": leases,
            "connections_by_client": dict(Counter(s.client for s in self.sessions.values() if not s.remote)),
            "recovered": asdict(self.recovered), "client_stats": dict(self.client_stats),
            "journal_records": self.journal.records if self.journal else 0, "epoch": self.epoch,
            "journal_bytes": self.journal.size if self.journal else 0,
            "journal_appends": self.journal.appended if self.journal else 0,
            "journal_compactions": self.journal.compactions if self.journal else 0,
            "journal_errors": self.journal_errors(), "dropped_connections": dict(self.dropped),
            "service_seconds": self.service_seconds(), "recheck": self.rechecker.stats(),
        }  # fmt: skip

    def journal_errors(self) -> dict[str, int]:
        j = self.journal
        return {"append": j.append_errors if j else 0, "sync": j.sync_errors if j else 0,
                "compact": j.compact_errors if j else 0}  # fmt: skip

    async def handle_frame(self, session: Session, body: bytes) -> tuple[str, dict[str, Any]]:
        """The reply to one request frame, and the op it was (for metrics); never raises. Ops are answered
        on the loop; an op that must wait (``stage`` reads disks) is a coroutine, awaited here."""
        req_id, op = 0, "?"
        try:
            req_id, op, args = P.check_request(P.unpack(body))
            result = self.dispatch(session, op, args)
            if inspect.isawaitable(result):
                result = await result
            reply = P.ok(req_id, result)
        except FlatCakeError as exc:
            reply = P.error(req_id, exc.code, str(exc))
        except (ValueError, TypeError) as exc:  # argument checks, numpy style: the message names the field
            reply = P.error(req_id, P.BAD_ARGS, str(exc))
        except Exception as exc:  # a bug: answer, log, count (below), keep serving
            log.exception("op %s failed", op)
            reply = P.error(req_id, P.INTERNAL, f"{exc.__class__.__name__}: {exc}")
        op = op if op in OPS else "other"
        self.requests[op] += 1
        if not reply["ok"]:
            self.errors[(op, reply["error"]["code"])] += 1
        return op, reply

    def drop(self, session: Session) -> None:
        """The client is gone: abort what it never published, release what it pinned."""
        for alloc_id in list(session.allocs):
            with contextlib.suppress(UnknownHandleError):
                self.catalog.abort(alloc_id)
        for lease_id in list(session.leases):
            with contextlib.suppress(UnknownHandleError):
                self.catalog.release(lease_id)
        if self.peers is not None:
            for handle in session.staged:
                self.peers.staging.give(handle)
        if session.allocs or session.leases:
            log.info("client %d left: aborted %d allocations, released %d leases",
                     session.id, len(session.allocs), len(session.leases))  # fmt: skip
        session.allocs.clear()
        session.leases.clear()
        self.sessions.pop(session.id, None)

    def _held_by(self, client: str) -> int:
        """Connections ``client`` holds (``Session.client``: a pid, a uid or a pod)."""
        return sum(1 for s in self.sessions.values() if s.client == client)

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve_connection(reader, writer, remote=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                remote: bool = False) -> None:  # fmt: skip
        a, c = self.config.agent, self.config.cluster
        pid, client = client_identity.connected(writer, remote)  # service/client_identity.py
        busy = None
        # Local clients and other nodes each have budgets of their own: peers cannot take the local ones.
        if remote and sum(1 for s in self.sessions.values() if s.remote) >= c.max_peer_clients:
            busy = (f"the agent serves cluster.max_peer_clients={c.max_peer_clients} connections from other "
                    "nodes already; retry later")  # fmt: skip
        elif not remote and sum(1 for s in self.sessions.values() if not s.remote) >= a.max_clients:
            busy = (f"the agent serves agent.max_clients={a.max_clients} connections already; retry later or "
                    "raise the limit")  # fmt: skip
        elif client and self._held_by(client) >= a.max_clients_per_process:
            busy = client_identity.too_many(client, a.max_clients_per_process)
        if busy is not None:  # answered, not silently dropped, so the client can say why
            self.dropped["busy"] += 1
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                writer.write(P.pack(P.error(0, P.BUSY, busy)))
                await asyncio.wait_for(writer.drain(), a.frame_timeout_s)
            writer.close()
            return
        self._next_session += 1
        session = self.sessions[self._next_session] = Session(self._next_session, pid, client, remote=remote)
        self._writers.add(writer)
        try:
            while True:
                # Unregistered connections get frame_timeout_s to speak; registered clients may stay idle
                # (inference processes keep one connection for their life) unless idle_timeout_s is set;
                # other nodes' connections always idle out (cluster.peer_idle_timeout_s).
                if not session.registered:
                    idle: float | None = a.frame_timeout_s
                else:
                    idle = c.peer_idle_timeout_s if remote else (a.idle_timeout_s or None)
                try:
                    header = await asyncio.wait_for(reader.readexactly(P.HEADER.size), idle)
                except asyncio.IncompleteReadError:
                    break
                except TimeoutError:
                    self.dropped["idle_timeout"] += 1
                    break
                (length,) = P.HEADER.unpack(header)
                if length > P.MAX_FRAME:
                    # Skip the body to stay in step with the stream, then say why it was refused.
                    await asyncio.wait_for(self._skip(reader, length), a.frame_timeout_s)
                    self.errors[("other", P.OVERSIZED)] += 1
                    reply = P.error(0, P.OVERSIZED, f"frame of {length} bytes exceeds {P.MAX_FRAME}; send fewer keys")
                    writer.write(P.pack(reply))
                else:
                    body = await self._receive(reader, length, remote)
                    started = time.perf_counter()
                    op, reply = await self.handle_frame(session, body)
                    del body
                    writer.write(P.pack(reply))
                    if session.remote and op == "register" and not session.registered:
                        await asyncio.wait_for(writer.drain(), a.frame_timeout_s)
                        break  # a peer whose register failed (unauthenticated, wrong geometry) gets one try
                    # Service time: decode, work, encode (the socket and queueing are the client's view).
                    self.latency.labels(op).observe(time.perf_counter() - started)
                # A client that stops reading its replies is cut off rather than buffered for.
                await asyncio.wait_for(writer.drain(), a.frame_timeout_s)
                # Pipelined frames already buffered are read without suspending: yield after each reply
                # so that one flooding client takes turns with the others instead of holding the loop.
                await asyncio.sleep(0)
        except TimeoutError:
            self.dropped["frame_timeout"] += 1
            log.warning("client %d: a frame or reply did not move within agent.frame_timeout_s=%s; closed",
                        session.id, a.frame_timeout_s)  # fmt: skip
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            self.drop(session)
            writer.close()

    @staticmethod
    async def _skip(reader: asyncio.StreamReader, length: int) -> None:
        remaining = length
        while remaining:
            chunk = await reader.read(min(remaining, 1 << 20))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(chunk)

    async def _receive(self, reader: asyncio.StreamReader, length: int, remote: bool = False) -> bytes:
        """One frame body. The bytes being received across all connections of a class (this node's
        clients: agent.frame_budget_bytes; other nodes: cluster.peer_frame_budget_bytes) stay within its
        budget (a frame waits for room), and a frame must arrive within agent.frame_timeout_s: slow
        senders cannot pile up buffers, and peers' frames never wait on local ones' room or the reverse.
        Small frames (lookups, leases, publishes of a few keys) take no budget, so large frames that
        stall cannot hold them up."""
        a = self.config.agent
        if length <= SMALL_FRAME:  # bounded by the connections (max_clients x SMALL_FRAME), never queued
            return await asyncio.wait_for(reader.readexactly(length), a.frame_timeout_s)
        budget = self.config.cluster.peer_frame_budget_bytes if remote else a.frame_budget_bytes
        if remote not in self._frame_rooms:
            self._frame_rooms[remote] = asyncio.Condition()
        room = self._frame_rooms[remote]
        async with room:
            await asyncio.wait_for(
                room.wait_for(lambda: self._frame_bytes[remote] + length <= budget), a.frame_timeout_s
            )
            self._frame_bytes[remote] += length
        try:
            return await asyncio.wait_for(reader.readexactly(length), a.frame_timeout_s)
        finally:
            async with room:
                self._frame_bytes[remote] -= length
                room.notify_all()

    # ---- process lifecycle -----------------------------------------------------------------------
    def start_http(self) -> int:
        """Serve /metrics, /healthz and /readyz from threads; returns the bound port."""
        a = self.config.agent
        try:
            self.http_server = http.start(self, a.metrics_host, self.metrics_port, a.http_timeout_s,
                                          a.http_max_connections)  # fmt: skip
        except OSError as exc:
            raise _bind_error("agent.metrics_port", f"{a.metrics_host}:{self.metrics_port}", exc) from None
        self.metrics_port = self.http_server.server_port
        return self.metrics_port

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        await asyncio.to_thread(self.recover)  # no-op when done already; probes answer meanwhile
        path = Path(self.config.agent.socket)  # its directory was made and checked at construction
        _remove_stale_socket(path)
        peer_server = await self._serve_peers()  # first: a client that reaches the socket may ask peers
        try:
            server = await asyncio.start_unix_server(self._serve_connection, path=str(path))
        except OSError as exc:
            raise _bind_error("agent.socket", str(path), exc) from None
        share_path(path, self.gid)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError, ValueError):  # not the main thread (tests)
                loop.add_signal_handler(sig, stop.set)
        self.ready = True
        log.info("serving %s; metrics on port %d", path, self.metrics_port)
        self.start_scan()
        async with server:
            await stop.wait()
        if peer_server is not None:
            peer_server.close()
        self.ready = False
        for writer in list(self._writers):  # end the connections too, so their handlers finish here
            writer.close()
        deadline = time.monotonic() + 5
        while self._writers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _serve_peers(self) -> asyncio.Server | None:
        """The read ops on TCP for other nodes, and the transfer engine behind them (cluster.listen)."""
        c = self.config.cluster
        where = host_port(c.listen) if c.listen else None
        if where is None:
            return None
        if self.peer_secret is None:
            log.warning("cluster.insecure_peers: %s serves anyone who reaches it", c.listen)
        self.peers = await asyncio.to_thread(PeerService, self.config, self.catalog, self.dram)
        try:
            server = await asyncio.start_server(self._serve_peer, where[0], where[1])
        except OSError as exc:
            raise _bind_error("cluster.listen", c.listen, exc) from None
        port = server.sockets[0].getsockname()[1]
        self.peer_address = f"{where[0]}:{port}"
        log.info("serving other nodes on %s; transfer engine %s over %s", self.peer_address,
                 self.peers.transfer.endpoint, c.transfer_protocol)  # fmt: skip
        return server

    def start_scan(self) -> None:
        """Check the recovered pages in the background (once), now that clients are served."""
        if self._scanner is not None or self.recovered.scan_done or not self.recovered.done:
            return
        self._scanner = threading.Thread(target=self._scan, name="flatcake-recovery-scan", daemon=True)
        self._scanner.start()

    def _scan(self) -> None:
        c = self.config
        fds: dict[int, int] = {}
        paths = [Path(c.ssd.dir) / name for name in self.pool.files]
        try:
            scan(self.catalog, page_crc_reader(c, self.dram.view, paths, fds), self.recovered, self._stopping,
                 workers=max(4, c.io.workers), page_bytes=c.layers * c.page_bytes)  # fmt: skip
        except Exception:  # a bug or an unreadable pool: readers keep checking what they read
            log.exception("recovery scan failed; unscanned scopes stay checked on every read")
        finally:
            close_fds(fds)

    def _compact_loop(self, journal: Journal, now: bool = False) -> None:
        """Compact the journal online whenever an append makes it due (and at once with ``now``): its
        size stays within ``journal_compact_ratio`` of the live records' (plus ``journal_compact_bytes``)."""
        while True:
            if not now:
                journal.due_event.wait()
            if self._stopping.is_set():
                return
            journal.due_event.clear()
            force, now = now, False
            try:
                self.catalog.compact_journal(force)
            except OSError as exc:  # a full disk: the old journal stays in use; retried after as much growth
                journal.compact_errors += 1
                log.error("journal %s: online compaction failed, keeping the journal as it is: %s", journal.path, exc)
            except Exception:  # a bug: counted and logged whole; the thread lives on for the next due compaction
                journal.compact_errors += 1
                log.exception("journal %s: online compaction failed unexpectedly, keeping the journal as it is",
                              journal.path)  # fmt: skip

    def close(self) -> None:
        self._stopping.set()
        if self._scanner is not None:
            self._scanner.join(30)
        self.rechecker.join(30)
        close_fds(self._recheck_fds)
        if self._compactor is not None and self.journal is not None:
            self.journal.due_event.set()
            self._compactor.join(30)
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()
        if self.journal is not None:
            self.journal.close()
        if self.catalog.index is not None:
            self.catalog.index.close()
        if self.peers is not None:
            self.peers.close()
        self.dram.close(unlink=False)  # the pool outlives the agent process
        self.owner.release()


Handler = Callable[[Agent, Session, dict[str, Any]], Any]
OPS: dict[str, Handler] = {  # the agent's own ops and the cross-node ones (PeerOps)
    name.removeprefix("op_"): getattr(Agent, name) for name in dir(Agent) if name.startswith("op_")
}


def _usable_dir(directory: Path, field: str) -> None:
    """``directory`` exists (made if need be) and the agent may create files in it; else a ConfigError
    naming ``field``, the path and the fix."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot create {directory}: {exc.strerror}; run the agent as a user that may "
                          f"write there, or set {field} under a directory it owns") from None  # fmt: skip
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: {directory} is not writable by this agent (uid {os.getuid()}); grant it write "
                          f"access, or set {field} under a directory it owns")  # fmt: skip


def _bind_error(field: str, where: str, exc: OSError) -> ConfigError:
    """An address or socket the agent could not listen on, named with the field that sets it."""
    if exc.errno == errno.EADDRINUSE:
        why = "is in use (another agent, or another process): stop it or choose another"
        if field != "agent.socket":
            why += " (port 0 picks a free one)"
    elif exc.errno == errno.EACCES:
        why = "is not allowed for this agent (a port below 1024 needs privilege; a socket, write access)"
    else:
        why = f"cannot be listened on: {exc.strerror}"
    return ConfigError(f"{field}: {where} {why}")


def _remove_stale_socket(path: Path) -> None:
    """Remove the socket a killed agent left behind, and nothing else: a regular file (or anything
    that is not a socket) at the configured path is someone's data, so the agent refuses to start."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"agent.socket: {path} exists and is not a socket; move it away or point "
                          "agent.socket elsewhere (the agent deletes only a stale socket)")  # fmt: skip
    path.unlink()


def _columns(rows: Sequence[Location], **fields: int) -> dict[str, list[int]]:
    """Columns of Location tuples (``itemgetter`` keeps the per-row cost in C; ``zip(*rows)`` does not)."""
    return {name: list(map(operator.itemgetter(i), rows)) for name, i in fields.items()}
