"""Sessions recovered from a trace: which requests continue which, and the pages each turn appends.

A Mooncake-style trace has no session ids, but its block hashes are prefix-chained: a request whose
``hash_ids`` begin with an earlier request's (all of them, or all but its partial last block)
continues that conversation. Each
turn's new pages are the blocks past that prefix (a block of ``block_tokens`` tokens is
``block_tokens / page_tokens`` pages). Traces that name their sessions (FlatCake's generic format)
are grouped by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flatcake.loadgen.traces.formats import TraceRequest


@dataclass(eq=False)
class Session:
    id: int
    turns: list[list[str]] = field(default_factory=list)  # the page keys each turn appends, in order

    @property
    def pages(self) -> list[str]:
        return [k for turn in self.turns for k in turn]


def sessions(requests: Iterable[TraceRequest], page_tokens: int) -> list[Session]:
    """Every session of the trace in order of first appearance; turns append pages in trace order.

    An earlier request is continued at most once (a conversation is a line, not a tree), and only by a
    request at least as long as its prompt plus its reply: that history is what the next turn resends.
    Two requests that merely share a system prompt are different sessions."""
    found: list[Session] = []
    open_ends: dict[tuple[int, ...], tuple[Session, TraceRequest]] = {}  # a request's chain -> it
    by_name: dict[str, Session] = {}
    for req in requests:
        if req.block_tokens % page_tokens:
            raise ValueError(f"page_tokens: {page_tokens} does not divide the trace's {req.block_tokens}-token blocks")
        per_block = req.block_tokens // page_tokens
        chain = tuple(req.hash_ids)
        session = by_name.get(req.session) if req.session is not None else None
        start = 0
        if session is None and req.session is None:
            for k in range(len(chain) - 1, 0, -1):  # the longest earlier request this one extends
                hit = open_ends.get(chain[:k])
                if hit is not None and req.input_length >= hit[1].input_length + hit[1].output_length:
                    session, start = hit[0], k
                    earlier = tuple(hit[1].hash_ids)
                    open_ends.pop(earlier, None)
                    open_ends.pop(earlier[:-1], None)
                    break
        elif session is not None:
            start = len(session.pages) // per_block
        if session is None:
            session = Session(len(found))
            found.append(session)
            if req.session is not None:
                by_name[req.session] = session
        if chain[start:]:
            session.turns.append([f"b{h}.{j}" for h in chain[start:] for j in range(per_block)])
        # The last block is usually partial: the next turn re-hashes it with more tokens, so its
        # continuation shares every block but the last.
        open_ends[chain] = open_ends[chain[:-1]] = (session, req)
    return found


def pick(all_sessions: list[Session], count: int, turns: int, pages_per_turn: int) -> list[Session]:
    """``count`` sessions with the most turns (multi-turn conversations first, then trace order), each
    cut to ``turns`` turns of at most ``pages_per_turn`` pages: the same work for every system."""
    ranked = sorted(all_sessions, key=lambda s: (-min(len(s.turns), turns), s.id))[:count]
    return [Session(s.id, [t[:pages_per_turn] for t in s.turns[:turns]]) for s in sorted(ranked, key=lambda s: s.id)]
