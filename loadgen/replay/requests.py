"""Trace replay, independent of Locust: the schedule, the token ids and one streamed request.

A request's prompt is built from its ``hash_ids``: block ``h`` always becomes the same token ids,
so requests that share blocks share token prefixes and an engine's prefix cache sees the trace's
reuse. Timestamps are scaled to a target rate: the trace's own rate times ``qps / native_qps``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from flatcake.loadgen.tokens import VOCAB, decode
from flatcake.loadgen.traces.formats import TraceRequest


def block_tokens(hash_id: int, n: int) -> list[int]:
    # Reduced in Python first: a merged trace's block ids (user k's start at k << 40) times the
    # multiplier overflow int64; (a mod V + i) mod V is the same ids for every id that did not.
    return ((hash_id * 2_654_435_761 % VOCAB + np.arange(n, dtype=np.int64)) % VOCAB).tolist()


def prompt_tokens(r: TraceRequest, vocab: int = 0) -> list[int]:
    """The request's token ids; ``vocab`` (a served model's smaller vocabulary) folds them below it,
    keeping every shared prefix shared."""
    out: list[int] = []
    for h, n in zip(r.hash_ids, r.block_token_counts(), strict=True):
        out += block_tokens(h, n)
    return [t % vocab for t in out] if vocab else out


@dataclass(frozen=True)
class Item:
    index: int
    at: float  # seconds after the start of the replay
    request: TraceRequest


def schedule(requests: list[TraceRequest], qps: float) -> list[Item]:
    """Send times scaled so the whole slice arrives at ``qps`` on average, keeping its burstiness."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    span = (requests[-1].timestamp_ms - t0) / 1000.0
    native = (len(requests) - 1) / span if span > 0 else 0.0
    scale = native / qps if native > 0 else 0.0
    return [Item(i, (r.timestamp_ms - t0) / 1000.0 * scale if scale else i / qps, r) for i, r in enumerate(requests)]


@dataclass
class Record:
    """What the load generator saw of one request."""

    index: int
    system: str
    qps: float
    scheduled: float
    sent: float
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    hit_tokens: dict[str, int]
    ok: bool
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# openai: /v1/completions; chat: /v1/chat/completions (one user message); sglang: /generate.
APIS = {"openai": "/v1/completions", "chat": "/v1/chat/completions", "sglang": "/generate"}


def body(api: str, tokens: list[int], max_tokens: int, text: bool = False) -> dict[str, Any]:
    """The request for ``tokens``; ``text``: sent as text under the shared tokenization rule
    (flatcake.loadgen.tokens: the emulator counts and caches it as exactly these token ids). ``chat``
    always sends text, as one user message (the server's chat template adds its own few tokens, the
    same before every prompt, so prompts that share a prefix still do)."""
    prompt: str | list[int] = decode(tokens) if text or api == "chat" else tokens
    if api == "openai":
        return {"model": "flatcake", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "chat":
        return {"model": "flatcake", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "sglang":
        return {"text" if text else "input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens},
                "stream": True}  # fmt: skip
    raise ValueError(f"api: {api!r} must be one of {', '.join(APIS)}")


def path(api: str) -> str:
    return APIS[api]


def read_stream(api: str, lines: Iterator[bytes], started: float) -> tuple[float | None, int, dict[str, Any]]:
    """Consume server-sent events; returns (TTFT, output chunks, usage details)."""
    ttft: float | None = None
    chunks = 0
    usage: dict[str, Any] = {}
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if api in ("openai", "chat"):
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
            if event.get("usage"):
                u = event["usage"]
                usage = {
                    "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "hits": (u.get("flatcake") or {}).get("hit_tokens", {}),
                    "output": u.get("completion_tokens", 0),
                }
        else:
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - started
            m = event.get("meta_info", {})
            usage = {"cached": m.get("cached_tokens", 0), "hits": (m.get("flatcake") or {}).get("hit_tokens", {}),
                     "output": m.get("completion_tokens", 0)}  # fmt: skip
            # A real SGLang server says where the cached tokens came from (HiCache's tiers) instead.
            if not usage["hits"] and isinstance(details := m.get("cached_tokens_details"), dict):
                usage["hits"] = {tier: int(details.get(tier) or 0) for tier in ("device", "host", "storage")}
    return ttft, chunks, usage
