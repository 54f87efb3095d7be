"""Scopes a reader found damaged pages in, checked again by the agent (``LocalCatalog.on_damaged``).

A reader that verifies what it read reports the pages whose bytes did not match their checksum when it
releases its lease. Without this the page stays in the index and every later reader pays a failed read
for it, until a restart's scan. The reader is not trusted to drop pages (another tenant's, a bug):
its report only makes the scopes unverified (every reader checks them) and queues them here, where the
agent reads each page of the scope itself and drops those that fail (``recovery.check_pages``, as the
post-restart scan does). A scope whose pages all pass leaves ``unverified`` again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.recovery import check_pages, drop_pages
from flatcake.node_agent.policy.scope import Location

log = logging.getLogger(__name__)


class Rechecker:
    """One daemon thread, started with the first report; scopes are checked in the order reported."""

    def __init__(self, catalog: LocalCatalog, read_page: Callable[[Location], int], stop: threading.Event) -> None:
        self.catalog, self.read_page, self.stop = catalog, read_page, stop
        self.checked_scopes = self.dropped_pages = self.passed_pages = 0
        self._cond = threading.Condition()
        self._queue: dict[int, None] = {}  # insertion-ordered: a scope reported twice is checked once
        self._thread: threading.Thread | None = None

    def suspect(self, scopes: set[int]) -> None:
        """Queue ``scopes`` for a check (the catalog has marked them unverified)."""
        with self._cond:
            self._queue.update(dict.fromkeys(sorted(scopes)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flatcake-recheck", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self._cond:
                while not self._queue and not self.stop.is_set():
                    self._cond.wait(1.0)  # bounded: ``stop`` is an Event, not this condition
                if not self._queue:
                    return
                sid = next(iter(self._queue))
                del self._queue[sid]
            try:
                self._check(sid)
            except Exception:  # an unreadable pool file: readers keep checking what they read
                log.exception("recheck of scope %d failed; its pages stay checked on every read", sid)

    def _check(self, sid: int) -> None:
        pages = self.catalog.pages_of(sid)  # empty once the scope is gone
        checked, damaged = check_pages(pages, self.read_page, self.stop)
        dropped = drop_pages(self.catalog, damaged)
        with self._cond:
            self.checked_scopes += 1
            self.dropped_pages += dropped
            self.passed_pages += checked - len(damaged)
            if checked == len(pages) and sid not in self._queue:  # reported again meanwhile: stays unverified
                self.catalog.unverified.discard(sid)
        if dropped:
            log.warning("a reader reported damaged pages in scope %d: %d of %d no longer match their checksum; "
                        "dropped", sid, dropped, len(pages))  # fmt: skip

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"scopes": self.checked_scopes, "dropped_pages": self.dropped_pages,
                    "passed_pages": self.passed_pages, "queued_scopes": len(self._queue)}  # fmt: skip

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (once ``stop`` is set)."""
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
