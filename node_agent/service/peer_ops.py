"""The control-protocol ops that concern other nodes, apart from the agent's own (``server.Agent`` takes
them in): a peer's challenge and authenticated register (``peer_auth.py``), signing this node's
clients' answers to other nodes, staging SSD pages for a peer to read (``peer_service.PeerService``), and the
list of other nodes' agents this node's clients may read from."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.service import peer_auth
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service.peer_service import PeerService

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    id: int
    pid: int = 0  # the socket peer's process (SO_PEERCRED); 0 when the platform does not say
    client: str = ""  # whose connections agent.max_clients_per_process counts: "pid N", "uid N" or "pod NS/NAME"
    registered: bool = False
    allocs: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)
    remote: bool = False  # a connection from another node (cluster.listen): read ops only
    nonce: bytes = b""  # a peer's challenge (op hello), answered by its register (peer_auth.py)
    staged: set[int] = field(default_factory=set)  # staging regions it holds (peer_service.py)


class PeerOps:
    """Cross-node ops, as methods of the agent (``op_*``, collected into its ops table)."""

    config: EngineConfig
    peer_secret: bytes | None
    peers: PeerService | None
    peer_address: str
    discovered_peers: tuple[str, ...]
    sessions: dict[int, Session]
    dropped: Counter[str]

    def op_hello(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        """A peer's challenge: a fresh nonce for this connection, to be answered by its register."""
        if not session.remote:
            raise P.ProtocolError(P.UNKNOWN_OP, "hello: only other nodes' connections authenticate")
        session.nonce = peer_auth.nonce()
        return {"nonce": session.nonce}

    def op_peer_sign(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        """For a client of this node: the answer to another node's challenge, and the proof that node must
        show back (peer_auth.py). The secret never leaves the agent."""
        nonce, mine = args.get("nonce"), args.get("client_nonce")
        if not isinstance(nonce, bytes) or not isinstance(mine, bytes) or len(mine) < peer_auth.NONCE_BYTES:
            raise P.ProtocolError(P.BAD_ARGS, "nonce, client_nonce: bytes (the peer's hello, and 16 of your own)")
        if self.peer_secret is None:
            return {"auth": None, "proof": None}
        return {"auth": peer_auth.register_mac(self.peer_secret, nonce, mine),
                "proof": peer_auth.serve_mac(self.peer_secret, nonce, mine)}  # fmt: skip

    def _authenticate(self, session: Session, args: dict[str, Any]) -> bytes | None:
        """A peer's register: its answer to this connection's challenge. Returns the proof to answer."""
        if self.peer_secret is None:  # cluster.insecure_peers
            return None
        mine, nonce = args.get("client_nonce"), session.nonce
        session.nonce = b""  # one answer per challenge
        if not (nonce and isinstance(mine, bytes) and len(mine) >= peer_auth.NONCE_BYTES) or not peer_auth.matches(
            peer_auth.register_mac(self.peer_secret, nonce, mine), args.get("auth")
        ):
            self.dropped["unauthenticated"] += 1
            raise P.ProtocolError(P.UNAUTHORIZED, "register: not authenticated as an agent of this cache (ask "
                                  "hello, then register with auth from your agent's peer_sign)")  # fmt: skip
        return peer_auth.serve_mac(self.peer_secret, nonce, mine)

    async def op_stage(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        """Restore SSD pages into a staging region a peer reads over the transfer engine (peer_service.py)."""
        peers = self._peer_service("stage")
        keys = P.keys_arg(args)
        staged = await asyncio.to_thread(peers.stage, keys)  # disk reads: off the loop
        if session.id in self.sessions:
            session.staged.add(staged["handle"])
        else:  # the peer left while its pages were read: nobody will unstage them
            peers.staging.give(staged["handle"])
        return staged

    def op_unstage(self, session: Session, args: dict[str, Any]) -> None:
        handle = P.held_id(session.staged, args, "staging region")
        session.staged.discard(handle)
        self._peer_service("unstage").staging.give(handle)

    def op_peers(self, session: Session, args: dict[str, Any]) -> list[str]:
        """The other nodes' agents this node's clients may read from: configured and discovered."""
        return sorted((set(self.config.cluster.peers) | set(self.discovered_peers)) - {self.peer_address})

    def set_discovered_peers(self, peers: list[str]) -> None:
        if tuple(peers) != self.discovered_peers:
            log.info("peers: %s", ", ".join(peers) or "none")
        self.discovered_peers = tuple(peers)

    def _peer_service(self, op: str) -> PeerService:
        if self.peers is None:
            raise P.ProtocolError(P.UNKNOWN_OP, f"{op}: this agent serves no other nodes (set cluster.listen)")
        return self.peers
