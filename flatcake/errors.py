"""The FlatCake error family: one base, a handful of meanings, each mapped once to a protocol error
code (what the agent answers on its socket) and a CLI exit code (what ``flatcake`` returns).

class (wire code, exit code): meaning
- ``ConfigError`` (``bad_config``, 2): a configuration, spec or argument field is wrong; the message
  names the field and the fix.
- ``ProtocolError`` (its ``code``, 3): a malformed or refused control message.
- ``CapacityError`` (``pool_full``, 4): no space left; ``PoolFullError``: a pool is full of pinned or
  fresh data.
- ``NotFoundError`` (``unknown_key``, 5): a key is not stored (``UnknownKeyError``), or a handle is not
  held (``UnknownHandleError``, ``unknown_handle``).
- ``StorageIOError`` (``io_error``, 6): the storage failed an I/O; ``StorageWriteError``: nothing of
  the put was published.
- ``FencedError`` (``fenced``, 7): a stale handle from before an agent restart; redo the operation.
- ``PrepareError`` (``prepare``, 8): node preparation refused or failed.

Errors keep a familiar built-in base where callers already catch one (``ValueError``, ``KeyError``,
``OSError``), so ``except ValueError`` around a config load still works. Plain ``ValueError`` and
``TypeError`` from argument checks (numpy style) are answered on the socket as ``bad_args``.
"""

from __future__ import annotations

from typing import ClassVar


class FlatCakeError(Exception):
    code: ClassVar[str] = "internal"
    exit_code: ClassVar[int] = 1


class ConfigError(FlatCakeError, ValueError):
    code = "bad_config"
    exit_code = 2


class ProtocolError(FlatCakeError):
    """``code`` is one of the wire codes of ``flatcake.node_agent.service.protocol``."""

    exit_code = 3

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # type: ignore[misc]  # per instance: which protocol rule was broken


class CapacityError(FlatCakeError, RuntimeError):
    code = "pool_full"
    exit_code = 4


class PoolFullError(CapacityError):
    """A pool (DRAM slots or SSD files) cannot hold the pages asked for; nothing was changed."""


class NotFoundError(FlatCakeError, KeyError):
    code = "unknown_key"
    exit_code = 5

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownKeyError(NotFoundError):
    """A key asked of ``get`` is not stored (never was, or its scope was reclaimed)."""


class UnknownHandleError(NotFoundError):
    """An allocation or lease id that the catalog does not hold (already published, released, or
    dropped when its client disconnected)."""

    code = "unknown_handle"


class StorageIOError(FlatCakeError, OSError):
    code = "io_error"
    exit_code = 6


class StorageWriteError(StorageIOError):
    """A put's write failed; nothing of it was published."""


class FencedError(FlatCakeError):
    code = "fenced"
    exit_code = 7


class PrepareError(FlatCakeError):
    code = "prepare"
    exit_code = 8


# The class a client raises for each wire code: the most specific class the agent itself raises with it.
_WIRE = (ConfigError, PoolFullError, UnknownKeyError, UnknownHandleError, StorageIOError, FencedError, PrepareError)
_BY_CODE: dict[str, type[FlatCakeError]] = {cls.code: cls for cls in _WIRE}


def by_code(code: str) -> type[FlatCakeError] | None:
    """The error class answered with ``code`` on the wire (None: a protocol-level code)."""
    return _BY_CODE.get(code)
