"""What every restore is to its caller, wherever its bytes land (``host_restore``, ``restore``): an
iterator of layer indexes, each yielded once its bytes are in the destination, closed by the caller."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Generator, Iterator
from typing import Self


class LayerStream(Iterator[int]):
    """Subclasses set their state, then call ``start()``; ``_run`` yields the layers and ends by calling
    ``_finish`` (which must be idempotent: ``close`` calls it too, for a generator that never started)."""

    missing: set[int]
    damaged: set[int]  # of ``missing``: pages whose bytes did not match their published checksum
    staging_peak_bytes: int

    def start(self) -> None:
        self.missing = set()
        self.damaged = set()
        self.staging_peak_bytes = 0
        self._finished = False
        self._gen = self._run()

    def _run(self) -> Generator[int, None, None]:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def __next__(self) -> int:
        return next(self._gen)

    def run(self) -> set[int]:
        """Restore every layer; returns the missing page indexes."""
        for _ in self:
            pass
        return self.missing

    def close(self) -> None:
        """Stop early: reads in flight drain, then staging and the pins are released. Call it (or use the
        restore as a context manager): releasing pins may be a call to the node agent."""
        self._gen.close()
        self._finish()  # the generator's own cleanup does not run if it never started

    def __del__(self) -> None:
        # A safety net only. The finalizer may run in any thread at any point, even one that holds the
        # agent connection's lock, so it never releases here: a short-lived thread does, when it can.
        if not getattr(self, "_finished", True):
            warnings.warn("a Restore was not closed; use it as a context manager", ResourceWarning, stacklevel=1)
            threading.Thread(target=self.close, name="flatcake-restore-finalizer", daemon=True).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
