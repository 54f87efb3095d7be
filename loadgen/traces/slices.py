"""A slice of a trace: skip ``offset`` requests, keep at most ``requests`` and at most ``window_s``
seconds of trace time from the first kept one. Written out as a file so every stage of a benchmark
(Locust, the ideal hit rate, the emulator's sizing) reads the same requests."""

from __future__ import annotations

import itertools
from pathlib import Path

from flatcake.loadgen.traces.formats import TraceRequest, read_trace


def select(trace: str | Path, offset: int = 0, requests: int | None = None,
           window_s: float | None = None) -> list[TraceRequest]:  # fmt: skip
    for name, value in (("offset", offset), ("requests", requests), ("window", window_s)):
        if value is not None and value < 0:
            raise ValueError(f"{name}: {value} must be >= 0")
    out: list[TraceRequest] = []
    for r in itertools.islice(read_trace(trace), offset, None):
        if requests is not None and len(out) >= requests:
            break
        if window_s is not None and out and (r.timestamp_ms - out[0].timestamp_ms) / 1000.0 > window_s:
            break
        out.append(r)
    if not out:
        raise ValueError(f"offset: {offset} leaves no requests of {trace} (lower --offset or widen --window)")
    return out


def write(requests: list[TraceRequest], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.to_json() + "\n" for r in requests))
    return path


def native_qps(requests: list[TraceRequest]) -> float:
    """The slice's own arrival rate (0 when it has no time span)."""
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0 if requests else 0.0
    return (len(requests) - 1) / span if span > 0 else 0.0
