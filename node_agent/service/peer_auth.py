"""Who may use the peer port: other agents of the same cache, proven by a secret only agents hold.

Every agent of a cache reads the cache's secret (``cluster.secret_file``: a Kubernetes Secret the
operator creates and mounts into its agents only, never into inference pods). A client on another
node proves it is sent by an agent of the cache without holding the secret itself: its own agent
signs the challenge for it (op ``peer_sign``, on the node's own socket only). The handshake on the
peer port:

1. ``hello``: the serving agent answers a fresh 16-byte nonce for this connection.
2. The client picks a nonce of its own; its agent returns ``auth`` = HMAC-SHA256(secret, "register" |
   nonce | client nonce) and the ``proof`` the serving agent must show.
3. ``register`` with ``auth`` and the client nonce: the serving agent checks ``auth`` (constant time)
   and answers ``proof`` = HMAC-SHA256(secret, "serve" | nonce | client nonce), which the client
   compares before it trusts anything the peer says.

A nonce is used once (per connection), so a recorded handshake cannot be replayed; nothing else on the
port answers before it (``exists``, ``lookup``, ``acquire``: not registered). What this does not cover
is the transfer engine's own port (Mooncake's), which authenticates nobody: over TCP the agent
registers only its staging buffer with it (DRAM pages are staged like SSD pages), over RDMA the DRAM
pool too (docs/operations.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from flatcake.errors import ConfigError

MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
_REGISTER = b"flatcake/peer-register/v1\0"
_SERVE = b"flatcake/peer-serve/v1\0"


def load_secret(path: str) -> bytes:
    """The cache's peer secret from ``path`` (surrounding whitespace dropped); a clear error naming the
    field when it is missing, unreadable or too short."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"cluster.secret_file: cannot read {path}: {exc.strerror}; mount the cache's peer "
            "secret there (the operator's <cache>-peer-secret) or unset cluster.listen"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"cluster.secret_file: {path} holds {len(secret)} bytes; a peer secret needs at least "
                          f"{MIN_SECRET_BYTES} (e.g. head -c 32 /dev/urandom | base64)")  # fmt: skip
    return secret


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def register_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What a client shows the serving agent (its own agent computes it)."""
    return hmac.new(secret, _REGISTER + server_nonce + client_nonce, hashlib.sha256).digest()


def serve_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the serving agent shows the client back."""
    return hmac.new(secret, _SERVE + server_nonce + client_nonce, hashlib.sha256).digest()


def matches(expected: bytes, given: object) -> bool:
    return isinstance(given, bytes) and hmac.compare_digest(expected, given)
