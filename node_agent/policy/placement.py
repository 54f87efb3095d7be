"""Write-time placement by reuse scope (FC-GVA, the paper's Table 2; docs/architecture.md). Pure decision logic, no I/O.

A page is placed once, when it is written, and never migrates. The signals are what the serving
engine knows at write time; the decision picks the medium whose cost matches how the page will be
reused.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from flatcake.node_agent.config import PlacementConfig
from flatcake.node_agent.policy.gva import Medium

Key = str | bytes | int


class Reason(StrEnum):
    SHARED_PROMPT = "shared_prompt"
    SHORT_CHAT = "short_chat"
    AGENT_SESSION = "agent_session"
    ONE_SHOT = "one_shot"
    DRAM_FULL = "dram_full"
    INHERITED = "inherited"
    REUSE_WITHIN_DRAM = "reuse_within_dram"  # adaptive: its session comes back well before DRAM reclaims
    REUSE_BEYOND_DRAM = "reuse_beyond_dram"  # adaptive: DRAM would reclaim it before it is read


@dataclass(frozen=True)
class Hints:
    """What the serving engine knows about a run of pages when it writes them.

    ``parent_key`` is the last page of the prefix this run extends; when that page is stored, the run
    joins its session scope (same medium, same files) instead of being placed afresh.
    """

    prefix_refcount: int = 1
    turn: int = 1
    prev_reply_tokens: tuple[int, ...] = ()
    context_tokens: int = 0
    reply_tokens: int = 0
    parent_key: Key | None = None

    def __post_init__(self) -> None:
        for name in ("prefix_refcount", "turn", "context_tokens", "reply_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"hints.{name}: {value!r} must be a non-negative integer")
        if self.turn < 1:
            raise ValueError(f"hints.turn: {self.turn} must be >= 1 (turns count from 1)")
        if any(not isinstance(t, int) or t < 0 for t in self.prev_reply_tokens):
            raise ValueError("hints.prev_reply_tokens: every entry must be a non-negative integer")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hints:
        """Hints from a request's map (unknown fields refused, by name)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"hints: unknown field(s) {unknown}; known fields are {sorted(known)}")
        values = dict(data)
        if "prev_reply_tokens" in values:
            values["prev_reply_tokens"] = tuple(values["prev_reply_tokens"])
        return cls(**values)


@dataclass(frozen=True)
class Decision:
    medium: Medium
    reason: Reason


def decide(hints: Hints, config: PlacementConfig) -> Decision:
    """The medium a new scope is placed on, by Table 2, before capacity is considered."""
    if hints.prefix_refcount > 1:
        return Decision(Medium.DRAM, Reason.SHARED_PROMPT)
    if hints.context_tokens >= config.agent_context_tokens or hints.reply_tokens >= config.agent_reply_tokens:
        return Decision(Medium.SSD, Reason.AGENT_SESSION)
    if hints.turn > 1 and hints.prev_reply_tokens:  # replies unknown: no evidence of a short chat
        if all(t <= config.short_reply_tokens for t in hints.prev_reply_tokens):
            return Decision(Medium.DRAM, Reason.SHORT_CHAT)
        # Later turns after long replies behave like agent work: large, rarely re-read soon.
        return Decision(Medium.SSD, Reason.AGENT_SESSION)
    return Decision(Medium.SSD, Reason.ONE_SHOT)


def overflow(decision: Decision) -> Decision:
    """DRAM had no room: the page goes to SSD, counted as overflow."""
    return Decision(Medium.SSD, Reason.DRAM_FULL) if decision.medium is Medium.DRAM else decision


@dataclass
class PlacementCounts:
    """Pages placed, by medium and reason (thread-safe)."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, decision: Decision, pages: int) -> None:
        with self._lock:
            self.counts[(decision.medium.name.lower(), decision.reason.value)] += pages

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{m}/{r}": n for (m, r), n in sorted(self.counts.items())}
