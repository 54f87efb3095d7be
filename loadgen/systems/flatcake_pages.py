"""FlatCake as SGLang's L3 (``TieredStore(l3=...)``, the emulator's ``flatcake`` mode): FlatCake as it
ships, behind SGLang HiCache's host tier, called as SGLang's cache controller calls its backend
(``node_agent/sglang/backend.py``, interface v1 with prefix keys passed):

- lookups (``batch_exists``, on SGLang's prefetch thread) ask the engine for the stored prefix and feed
  the backend's placement signals with the chain they name;
- writes (``batch_set_v1``, on SGLang's backup thread, write-through) put the pages run by run with the
  Table 2 hints the chain gives (``ChainSignals.write``, as the backend does);
- reads (``batch_get_v1``, on the prefetch I/O thread) restore in place into the host pool's page-major
  rows (a ``PagedTarget``, as the backend writes SGLang's ``page_first`` pool).

The engine may be in process or a node agent's client; faults are misses, never errors, as the
backend reports them to SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flatcake.loadgen.systems.base import Array
from flatcake.node_agent import ChainSignals, FlatCakeError, Key, aligned_empty
from flatcake.node_agent.datapath.target import PagedTarget

FAULTS = (FlatCakeError, ConnectionError, TimeoutError, KeyError, OSError)


class FlatCakePages:
    def __init__(self, engine: Any, page_tokens: int) -> None:
        self.engine = engine
        self.page_tokens = page_tokens
        self.signals = ChainSignals()  # the backend's own: it sees only what SGLang calls it with
        self.failed_puts = 0

    def exists_after(self, prefix: Sequence[Key], keys: Sequence[Key]) -> int:
        self.signals.observe(prefix, keys)
        try:
            return int(self.engine.exists(list(keys)))
        except FAULTS:
            return 0

    def set_after(self, prefix: Sequence[Key], keys: Sequence[Key], kv: Array) -> bool:
        """Put ``kv`` (``[layers][len(keys)][page_bytes]``, aligned) after ``prefix``, run by run."""
        runs = self.signals.write(prefix, keys, self.page_tokens)
        try:
            for run in runs:
                part = kv[:, run.start : run.stop]
                if len(runs) > 1:  # a slice of a layer-major buffer is strided: the engine takes C order
                    part, view = aligned_empty(part.shape), part
                    part[...] = view
                self.engine.put(list(keys[run.start : run.stop]), part, run.hints())
        except FAULTS:
            self.failed_puts += len(keys)
            return False
        self.signals.record(keys, runs)
        return True

    def get_rows(self, keys: Sequence[Key], staging: Array, rows: Sequence[int]) -> list[bool]:
        """Restore ``keys`` into rows ``rows`` of the page-major ``staging`` (``[pages][layers][page_bytes]``),
        in place; which arrived."""
        n = len(keys)
        if not n:
            return []
        _, layers, page_bytes = staging.shape
        span = layers * page_bytes
        target = PagedTarget(staging.reshape(-1), layers, [r * span for r in rows], page_bytes, [0], page_bytes)
        try:  # as the backend's batch_get_v1: the stored prefix, then its restore
            hit = int(self.engine.exists(list(keys)))
            if not hit:
                return [False] * n
            with self.engine.get(list(keys[:hit]), target) as restore:
                missing = set(restore.run())
        except FAULTS:
            return [False] * n
        return [i < hit and i not in missing for i in range(n)]
