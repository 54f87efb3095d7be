"""Table 2's write-time signals, derived from what SGLang hands a storage backend: the key chain.

SGLang 0.5.23 passes ``extra_info.prefix_keys`` (the page hashes from the sequence start up to a call's
first key) to ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` and the v2 methods, but only when
``hicache_storage_pass_prefix_keys`` is true in the storage extra config
(``mem_cache/hybrid_cache/hybrid_cache_controller.py`` ``parse_storage_backend_extra_config``; the
calls are ``managers/cache_controller.py`` ``_storage_hit_query``, ``_page_transfer``, ``_page_backup``).
It forwards no per-request metadata (every ``HiCacheStorageExtraInfo`` it builds there carries only
``prefix_keys``), so what a chain cannot tell comes from configuration (``backend.py``).

From the chains this process sees, ``ChainSignals`` keeps, in bounded memory:

- the **continuations** of each page: the distinct pages seen right after it in any chain (capped at
  ``MAX_CHILDREN``). A page with more than one continuation is a branch point: every page up to it
  is shared by that many live requests, which is the prefix refcount of Table 2's shared-prompt rule.
  Lookups (``batch_exists``, prefetch reads) count too, so requests waiting on a prompt that is being
  written make it shared before it is placed.
- per written page, its **session**: the root key of its session, its turn, and the tokens each of
  its turns appended. A write whose parent (``prefix_keys[-1]``) is a known page of a session is that
  session's next turn; SGLang splits one write into batches of ``STORAGE_BATCH_SIZE`` pages, so a
  parent that ended a full batch continues the same turn.

Pure bookkeeping: no I/O, no SGLang import. The emulator, the simulator and ``bench peers`` derive
their puts' hints here too (through ``flatcake.node_agent.ChainSignals``), so every benchmark places
pages by what the backend would tell the agent, not by what a trace knows.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flatcake.node_agent.policy.placement import Hints, Key

STORAGE_BATCH_SIZE = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE in 0.5.23
MAX_CHILDREN = 16  # a refcount only needs to tell 1 from "more"; past this the count saturates
REPLY_HISTORY = 8  # earlier turns remembered per session (prev_reply_tokens)


@dataclass(frozen=True)
class Session:
    """What a written page knows of its session."""

    root: Key  # the session's first page: the scope every later turn joins
    turn: int
    turn_pages: int  # pages this turn has appended so far
    appended: tuple[int, ...]  # tokens appended by turns 2..turn (reply + next message: an upper bound)
    open_batch: bool  # the page ended a full STORAGE_BATCH_SIZE batch: the next batch is the same turn


@dataclass(frozen=True)
class Run:
    """A slice ``keys[start:stop]`` of one write with its derived Table 2 fields."""

    start: int
    stop: int
    fields: dict[str, Any]
    session: Session

    def hints(self) -> Hints:
        """The run's hints as derived (the backend layers configured and per-request fields on top)."""
        return Hints.from_dict(self.fields)


class ChainSignals:
    """Continuation counts and sessions over the key chains one backend sees (thread-safe, LRU-bounded:
    ``capacity`` pages for each of the two maps; what is forgotten degrades to the no-history case)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"signal_capacity: {capacity} must be >= 1")
        self.capacity = capacity
        self._children: OrderedDict[Key, set[Key]] = OrderedDict()
        self._sessions: OrderedDict[Key, Session] = OrderedDict()
        self._lock = threading.Lock()

    # ---- observation -----------------------------------------------------------------------------
    def observe(self, prefix: Sequence[Key], keys: Sequence[Key]) -> None:
        """Record the chain ``prefix + keys``: each page's continuation. Edges inside ``prefix`` were
        recorded when those pages were themselves keys, so only the join and ``keys`` are walked."""
        if not keys:
            return
        with self._lock:
            if prefix:
                self._edge(prefix[-1], keys[0])
            for a, b in itertools.pairwise(keys):
                self._edge(a, b)

    def _edge(self, parent: Key, child: Key) -> None:
        kids = self._children.get(parent)
        if kids is None:
            kids = self._children[parent] = set()
            if len(self._children) > self.capacity:
                self._children.popitem(last=False)
        else:
            self._children.move_to_end(parent)
        if len(kids) < MAX_CHILDREN:
            kids.add(child)

    def continuations(self, key: Key) -> int:
        """How many different next keys have followed ``key`` (more than one: a shared prefix)."""
        with self._lock:
            kids = self._children.get(key)
            return len(kids) if kids else 0

    def session(self, key: Key) -> Session | None:
        """The session state recorded when page ``key`` was written (its root, turn and pages), if known."""
        with self._lock:
            return self._sessions.get(key)

    # ---- derivation ------------------------------------------------------------------------------
    def derive(self, prefix: Sequence[Key], keys: Sequence[Key], page_tokens: int) -> list[Run]:
        """Split one write into runs with their signals: a leading run of pages shared by several live
        requests (up to the last branch point among ``keys``), then the request's own pages. Call
        ``observe`` first so this write's own continuation counts."""
        with self._lock:
            kids = [len(self._children.get(k, ())) for k in keys]
            parent = prefix[-1] if prefix else None
            parent_kids = len(self._children.get(parent, ())) if parent is not None else 0
            parent_session = self._sessions.get(parent) if parent is not None else None
        branch = max((i for i, n in enumerate(kids) if n > 1), default=-1)
        runs: list[Run] = []
        fields: dict[str, Any]
        depth = len(prefix)
        if branch >= 0:
            shared = kids[branch]
            root = keys[0] if parent is None or parent_kids > 1 else (parent_session.root if parent_session else parent)
            session = Session(root, 1, branch + 1, (), False)
            fields = {
                "prefix_refcount": shared,
                "turn": 1,
                "context_tokens": (depth + branch + 1) * page_tokens,
                # A shared prompt extends its parent's scope only when the parent is not shared itself.
                "parent_key": parent if parent is not None and parent_kids <= 1 else None,
            }
            runs.append(Run(0, branch + 1, fields, session))
            if branch + 1 == len(keys):
                return runs
        start = branch + 1
        own = keys[start:]
        if start > 0 or parent is None or parent_kids > 1:
            # A request's own pages after a shared prompt begin a session of their own (turn 1): joining
            # the prompt's scope would bind every user's history to one shared scope.
            session = Session(own[0], 1, len(own), (), False)
            parent_key = None
        elif parent_session is None:
            # The parent was written elsewhere (another process, before a restart) or forgotten.
            session = Session(parent, 2, len(own), (len(own) * page_tokens,), False)
            parent_key = parent
        elif parent_session.open_batch:  # the same turn, continued in the next batch
            s = parent_session
            appended = (*s.appended[:-1], s.appended[-1] + len(own) * page_tokens) if s.appended else ()
            session = Session(s.root, s.turn, s.turn_pages + len(own), appended, False)
            parent_key = parent
        else:
            s = parent_session
            appended = (*s.appended, len(own) * page_tokens)[-REPLY_HISTORY:]
            session = Session(s.root, s.turn + 1, len(own), appended, False)
            parent_key = parent
        fields = {
            "prefix_refcount": 1,
            "turn": session.turn,
            "context_tokens": (depth + len(keys)) * page_tokens,
            "prev_reply_tokens": session.appended,
            "parent_key": parent_key,
        }
        runs.append(Run(start, len(keys), fields, session))
        return runs

    def write(self, prefix: Sequence[Key], keys: Sequence[Key], page_tokens: int) -> list[Run]:
        """``observe`` then ``derive``: what a put of ``keys`` after ``prefix`` is told. ``record`` the runs
        once the put has succeeded."""
        self.observe(prefix, keys)
        return self.derive(prefix, keys, page_tokens)

    def record(self, keys: Sequence[Key], runs: Sequence[Run], open_turn: bool | None = None) -> None:
        """Remember the sessions of pages just written. The last page stays open (its turn goes on in the next
        write) when ``open_turn`` says so, or by default when the write was one full SGLang batch (vLLM's
        connector knows: a prompt prefilled in chunks)."""
        full = len(keys) == STORAGE_BATCH_SIZE if open_turn is None else open_turn
        with self._lock:
            for run in runs:
                for i in range(run.start, run.stop):
                    last = i == len(keys) - 1
                    s = run.session
                    self._sessions[keys[i]] = Session(s.root, s.turn, s.turn_pages, s.appended, full and last)
                    self._sessions.move_to_end(keys[i])
            while len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)
