"""``flatcake trace synth``: seeded traces with the shapes of the paper's workloads.

Profiles (tokens per block 512; ids prefix-chained as in Mooncake's traces):
- ``agentic`` (Claude Code-like): long sessions run one after another, each turn resending the whole
  history plus a tool result and a reply; contexts grow to ~219K tokens (~430 blocks) on average; a
  sub-agent sometimes forks from the current prefix. Reuse distance averages under one request.
- ``chat``: many interleaved short conversations behind one shared system prompt; 1-10 turns,
  replies of a few hundred tokens.
- ``api``: one-shot calls: a few popular prompt templates (Zipf) followed by unique content; about
  94% of blocks are touched once and reuse is heavy-tailed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from flatcake.loadgen.traces.formats import TraceRequest

BLOCK = 512
PROFILES = ("agentic", "chat", "api")


@dataclass(frozen=True)
class SynthConfig:
    profile: str
    requests: int = 1000
    seed: int = 0
    qps: float = 1.0  # mean arrival rate of the synthetic clock
    scale: float = 1.0  # multiplies context and turn lengths (0.1: agentic contexts of ~20K tokens)
    # Independent users merged by time, user k seeded ``seed + k`` with its own ids and sessions ("uK-");
    # ``requests`` and ``qps`` are each user's.
    users: int = 1


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count(1)

    def new(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _request(ts: float, context: list[int], tokens: int, output: int, session: str, turn: int) -> TraceRequest:
    return TraceRequest(ts, tokens, output, tuple(context[: math.ceil(tokens / BLOCK)]), session, turn, BLOCK)


USER_ID_STRIDE = 1 << 40  # user k's block ids start at k x this: no two users share a block


def synthesize(cfg: SynthConfig) -> Iterator[TraceRequest]:
    if cfg.profile not in PROFILES:
        raise ValueError(f"profile: {cfg.profile!r} must be one of {PROFILES}")
    if cfg.users < 1:
        raise ValueError(f"users: {cfg.users} must be >= 1")
    if cfg.users > 1:
        merged = []
        for k in range(cfg.users):
            one = dataclasses.replace(cfg, seed=cfg.seed + k, users=1)
            merged += [dataclasses.replace(r, hash_ids=tuple(h + k * USER_ID_STRIDE for h in r.hash_ids),
                                           session=f"u{k}-{r.session}") for r in synthesize(one)]  # fmt: skip
        yield from sorted(merged, key=lambda r: r.timestamp_ms)
        return
    rng = np.random.default_rng(cfg.seed)
    ids = _Ids()
    if cfg.scale <= 0:
        raise ValueError(f"scale: {cfg.scale} must be > 0")
    gen = {"agentic": _agentic, "chat": _chat, "api": _api}[cfg.profile]
    yield from itertools.islice(gen(rng, ids, cfg.qps, cfg.scale), cfg.requests)


def _arrivals(rng: np.random.Generator, qps: float) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.exponential(1000.0 / qps)
        yield t


def _agent_session(
    rng: np.random.Generator, ids: _Ids, s: int, scale: float
) -> Iterator[tuple[list[int], int, int, str, int]]:
    """One agent session's requests: (context ids, tokens, output tokens, session, turn)."""
    tokens = int(rng.integers(20_000, 40_000) * scale)  # system prompt, tools and the task
    context = ids.new(math.ceil(tokens / BLOCK))
    for turn in range(1, int(rng.integers(20, 50)) + 1):
        output = int(rng.integers(50, 800))
        yield context, tokens, output, f"agent-{s}", turn
        # The reply and a tool result join the history; the next turn resends all of it.
        full = tokens // BLOCK  # the partial last block is rewritten with the new tokens
        tokens += int((output + rng.lognormal(8.9, 0.8)) * scale)
        context = context[:full] + ids.new(math.ceil(tokens / BLOCK) - full)
        if rng.random() < 0.08:  # a sub-agent forks from this prefix for a few turns
            fork_tokens = tokens + int(rng.integers(500, 3_000) * scale) + 1
            fork = context[: tokens // BLOCK] + ids.new(math.ceil(fork_tokens / BLOCK) - tokens // BLOCK)
            for k in range(int(rng.integers(1, 4))):
                yield fork, fork_tokens, int(rng.integers(50, 400)), f"agent-{s}-sub", k + 1


def _agentic(rng: np.random.Generator, ids: _Ids, qps: float, scale: float) -> Iterator[TraceRequest]:
    clock = _arrivals(rng, qps)
    sessions = itertools.count()
    live = [_agent_session(rng, ids, next(sessions), scale) for _ in range(2)]
    current = 0
    while True:
        if rng.random() > 0.85:  # now and then another session's turn comes in between
            current = int(rng.integers(0, len(live)))
        step = next(live[current], None)
        if step is None:
            live[current] = _agent_session(rng, ids, next(sessions), scale)
            continue
        context, tokens, output, session, turn = step
        yield _request(next(clock), context, tokens, output, session, turn)


def _chat(rng: np.random.Generator, ids: _Ids, qps: float, scale: float) -> Iterator[TraceRequest]:
    clock = _arrivals(rng, qps)
    system = ids.new(4)  # one shared 2K-token system prompt
    live: dict[int, tuple[list[int], int, int]] = {}  # session -> (context, tokens, turn)
    sessions = itertools.count()
    while True:
        if len(live) < 32 or rng.random() < 0.2:
            s = next(sessions)
            user = int(rng.integers(50, 600) * scale) + 1
            tokens = 4 * BLOCK + user
            live[s] = (system + ids.new(math.ceil(tokens / BLOCK) - 4), tokens, 1)
        s = int(rng.choice(list(live)))
        context, tokens, turn = live[s]
        output = int(rng.integers(50, 500))
        yield _request(next(clock), context, tokens, output, f"chat-{s}", turn)
        if turn >= int(rng.integers(1, 11)):
            del live[s]
            continue
        full = tokens // BLOCK
        tokens += output + int(rng.integers(20, 300))
        live[s] = (context[:full] + ids.new(math.ceil(tokens / BLOCK) - full), tokens, turn + 1)


def _api(rng: np.random.Generator, ids: _Ids, qps: float, scale: float) -> Iterator[TraceRequest]:
    clock = _arrivals(rng, qps)
    templates = [ids.new(int(rng.integers(1, 5))) for _ in range(200)]
    weights = 1.0 / np.arange(1, len(templates) + 1) ** 1.1
    weights /= weights.sum()
    history: list[list[int]] = []
    for n in itertools.count():
        template = templates[int(rng.choice(len(templates), p=weights))]
        unique = int(rng.integers(2_000, 16_000) * scale) + 1
        tokens = len(template) * BLOCK + unique
        context = template + ids.new(math.ceil(tokens / BLOCK) - len(template))
        if history and rng.random() < 0.05:  # the same document again, any time later: heavy-tailed reuse
            context = history[int(rng.integers(0, len(history)))]
            tokens = len(context) * BLOCK
        history.append(context)
        yield _request(next(clock), context, tokens, int(rng.integers(10, 300)), f"api-{n}", 1)
