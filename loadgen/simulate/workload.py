"""The simulated workload: trace requests at a target rate, their page keys and the trace's ideal hit.

Page keys come from the trace's prefix-chained block hashes without materialising tokens: page ``j``
(tokens ``[j x P, (j+1) x P)``) is named by the hash of the block holding its last token and where
that token sits in the block. Equal keys mean equal prefixes up to the page's end, as
``emulator.core.page_keys`` gives for token ids derived from the same hashes. A partial last page is
never cached.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flatcake.errors import ConfigError
from flatcake.loadgen.traces.formats import TraceRequest, read_trace

OFFSET_BITS = 21  # a token's offset in its block (block_tokens <= 1 << 20)


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival: float  # seconds, time-scaled
    input_tokens: int
    output_tokens: int
    keys: tuple[int, ...]  # full pages only
    session: str
    turn: int
    prev_reply_tokens: tuple[int, ...]  # this session's earlier replies (known at write time)


def page_keys(req: TraceRequest, page_tokens: int) -> tuple[int, ...]:
    ids, block = req.hash_ids, req.block_tokens
    out = []
    for j in range(req.input_length // page_tokens):
        last = (j + 1) * page_tokens - 1
        out.append((ids[last // block] << OFFSET_BITS) | (last % block))
    return tuple(out)


def load(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    reqs = list(read_trace(path, limit))
    if not reqs:
        raise ConfigError(f"--trace: {path} holds no requests")
    return reqs


def build(trace: Iterable[TraceRequest], page_tokens: int, qps: float | None) -> list[SimRequest]:
    """Requests in arrival order, their times scaled so the mean rate is ``qps`` (None: as recorded)."""
    reqs = sorted(trace, key=lambda r: r.timestamp_ms)
    t0 = reqs[0].timestamp_ms / 1000
    span = reqs[-1].timestamp_ms / 1000 - t0
    scale = 1.0
    if qps is not None:
        if qps <= 0:
            raise ConfigError(f"--qps: {qps} must be > 0")
        scale = (len(reqs) - 1) / qps / span if span > 0 and len(reqs) > 1 else 0.0
    replies: dict[str, list[int]] = {}
    out = []
    for i, r in enumerate(reqs):
        # No session field (Mooncake's traces): the first block names the conversation.
        session = r.session if r.session is not None else f"h{r.hash_ids[0] if r.hash_ids else i}"
        prev = replies.setdefault(session, [])
        turn = r.turn if r.turn is not None else len(prev) + 1
        out.append(
            SimRequest(
                i, (r.timestamp_ms / 1000 - t0) * scale, r.input_length, r.output_length,
                page_keys(r, page_tokens), session, turn, tuple(prev),
            )
        )  # fmt: skip
        prev.append(r.output_length)
    return out


def ideal_hit_pages(reqs: Iterable[SimRequest]) -> tuple[int, int]:
    """(hit pages, prompt pages) of an infinite cache: the leading pages of a prompt seen before."""
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        keys = r.keys
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits += n
        total += len(keys)
        seen.update(keys)
    return hits, total


def route(session: str, buckets: int) -> int:
    """A stable session -> node (or instance) map: a session's turns meet their own cache."""
    return zlib.crc32(session.encode()) % buckets if buckets > 1 else 0
