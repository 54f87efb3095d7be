"""The agent <-> client control protocol: length-prefixed msgpack frames with a versioned schema.

Frame: ``u32 big-endian length | msgpack map``. Request ``{"v": 1, "id": n, "op": str, "args": map}``;
reply ``{"v": 1, "id": n, "ok": true, "result": ...}`` or ``{"v": 1, "id": n, "ok": false,
"error": {"code": str, "message": str}}``.

Why msgpack: lookups carry thousands of keys per frame and sit on the time-to-first-token path. It is
binary and compact, its C extension (de)serialises a 4,096-key frame in tens of microseconds, and it
carries the three key types natively (SGLang's hex strings, raw bytes, trace ids as integers) where
JSON has no bytes and is several times slower; protobuf or flatbuffers would add a schema compiler
for a dozen small messages.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from flatcake.errors import ProtocolError as ProtocolError  # the error type of this protocol
from flatcake.errors import UnknownHandleError
from flatcake.node_agent.constants import MAX_FRAME as MAX_FRAME

VERSION = 1
HEADER = struct.Struct(">I")
MAX_KEYS = 65_536
KEY_TYPES = {str, bytes, int}

# Error codes a reply can carry.
MALFORMED = "malformed"
OVERSIZED = "oversized"
VERSION_MISMATCH = "version"
UNKNOWN_OP = "unknown_op"
BAD_ARGS = "bad_args"
UNKNOWN_KEY = "unknown_key"
UNKNOWN_HANDLE = "unknown_handle"
POOL_FULL = "pool_full"
NOT_REGISTERED = "not_registered"
BUSY = "busy"  # the agent serves agent.max_clients connections already
UNAUTHORIZED = "unauthorized"  # a peer that did not prove it is an agent of this cache (peer_auth.py)
INTERNAL = "internal"


def pack(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(OVERSIZED, f"frame of {len(body)} bytes exceeds {MAX_FRAME}; send fewer keys per call")
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(MALFORMED, f"frame is not valid msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(MALFORMED, f"frame must be a map, got {type(message).__name__}")
    return message


def request(req_id: int, op: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"v": VERSION, "id": req_id, "op": op, "args": args}


def check_request(message: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """The id, op and args of a request; a ProtocolError names what is wrong."""
    req_id = message.get("id", 0)
    if message.get("v") != VERSION:
        raise ProtocolError(VERSION_MISMATCH, f"v: {message.get('v')!r}; this agent speaks version {VERSION}")
    if not isinstance(req_id, int):
        raise ProtocolError(MALFORMED, "id: must be an integer")
    op, args = message.get("op"), message.get("args", {})
    if not isinstance(op, str):
        raise ProtocolError(MALFORMED, "op: must be a string")
    if not isinstance(args, dict):
        raise ProtocolError(MALFORMED, "args: must be a map")
    return req_id, op, args


def keys_arg(args: dict[str, Any], name: str = "keys") -> list[Any]:
    keys = args.get(name)
    if not isinstance(keys, list):
        raise ProtocolError(BAD_ARGS, f"{name}: must be a list of page keys")
    if len(keys) > MAX_KEYS:
        raise ProtocolError(BAD_ARGS, f"{name}: {len(keys)} keys in one call, more than {MAX_KEYS}; split the batch")
    if not set(map(type, keys)) <= KEY_TYPES:  # one pass in C; find the culprit only on error
        i = next(i for i, k in enumerate(keys) if type(k) not in KEY_TYPES)
        raise ProtocolError(BAD_ARGS, f"{name}[{i}]: {keys[i]!r} is not a page key (str, bytes or int)")
    return keys


def int_arg(args: dict[str, Any], name: str) -> int:
    value = args.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(BAD_ARGS, f"{name}: must be an integer")
    return value


def held_id(held: set[int], args: dict[str, Any], what: str) -> int:
    """The handle ``args["id"]`` names, which this connection must hold (an allocation, a lease, a region)."""
    handle = int_arg(args, "id")
    if handle not in held:
        raise UnknownHandleError(f"id: {what} {handle} is not held by this connection")
    return handle


def ok(req_id: int, result: Any) -> dict[str, Any]:
    return {"v": VERSION, "id": req_id, "ok": True, "result": result}


def error(req_id: int, code: str, message: str) -> dict[str, Any]:
    return {"v": VERSION, "id": req_id, "ok": False, "error": {"code": code, "message": message}}
