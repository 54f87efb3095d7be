"""Trace formats: Mooncake's released JSONL and FlatCake's own generic JSONL. Streamed, validated.

Mooncake (FAST'25 release): one object per line, ``timestamp`` (ms from start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block, prefix-chained: a shared id
means a shared prefix up to that block; ``len(hash_ids) == ceil(input_length / 512)``).

FlatCake generic (``"format": "flatcake-trace/1"`` on each line, or detected by ``session``): the
Mooncake fields plus ``session`` (string), ``turn`` (int, from 1) and ``block_tokens`` (tokens per
hash block, default 512), so traces that know their sessions and turns can say so.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from flatcake.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512
GENERIC = "flatcake-trace/1"

BUNDLED_TRACE = Path(__file__).with_name("data") / "agentic_small.jsonl"
"""The agentic trace shipped with the package: the main job's default (see docs/benchmarks.md)."""
MOONCAKE_TRACE = Path(__file__).with_name("data") / "mooncake_conversation_trace.jsonl.xz"
"""Mooncake's released conversation trace, shipped compressed (data/README.md)."""


# Every integer a trace holds is bounded: the stats and the replay carry them in int64 arrays and
# floats, where a 400-digit token count (valid JSON) became an OverflowError traceback.
INT64_MAX = (1 << 63) - 1
MAX_BLOCK_TOKENS = 1 << 20


class TraceError(ConfigError):
    """A trace line that cannot be used, with its file, line number and field (CLI exit code 2)."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None
    turn: int | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def block_token_counts(self) -> list[int]:
        """Tokens in each block: full blocks, then what is left in the last one."""
        n = len(self.hash_ids)
        if n == 0:
            return []
        return [self.block_tokens] * (n - 1) + [self.input_length - self.block_tokens * (n - 1)]

    def to_json(self) -> str:
        data: dict[str, Any] = {"timestamp": self.timestamp_ms, **asdict(self)}
        del data["timestamp_ms"]
        data["hash_ids"] = list(self.hash_ids)
        if self.session is not None:
            data["format"] = GENERIC
        else:
            for k in ("session", "turn", "block_tokens"):
                data.pop(k)
        return json.dumps(data)


def _field(obj: dict[str, Any], name: str, kind: type, where: str, high: int = INT64_MAX) -> Any:
    if name not in obj:
        raise TraceError(f"{where}: missing field '{name}'")
    value = obj[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise TraceError(f"{where}: field '{name}' is {type(value).__name__}, expected {kind.__name__}")
    if kind is float and not math.isfinite(value):  # json reads NaN, Infinity and 1e999 as floats
        raise TraceError(f"{where}: field '{name}' is {value}; expected a finite number")
    if kind in (int, float) and abs(value) > high:
        shown = str(value) if len(str(value)) <= 24 else str(value)[:24] + "..."
        raise TraceError(f"{where}: field '{name}' is {shown}; expected at most {high}")
    return value


def parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    generic = obj.get("format") == GENERIC or "session" in obj
    ts = float(_field(obj, "timestamp", float, where))
    inp = _field(obj, "input_length", int, where)
    out = _field(obj, "output_length", int, where)
    ids = _field(obj, "hash_ids", list, where)
    if ts < 0 or inp < 0 or out < 0:
        raise TraceError(f"{where}: timestamp, input_length and output_length must be >= 0")
    if not all(isinstance(h, int) and not isinstance(h, bool) and -INT64_MAX - 1 <= h <= INT64_MAX for h in ids):
        raise TraceError(f"{where}: field 'hash_ids' must hold integers that fit in 64 bits")
    block = MOONCAKE_BLOCK_TOKENS
    session = turn = None
    if generic:
        if "block_tokens" in obj:
            block = _field(obj, "block_tokens", int, where, high=MAX_BLOCK_TOKENS)
        session = str(_field(obj, "session", str, where))
        turn = _field(obj, "turn", int, where)
        if block <= 0:
            raise TraceError(f"{where}: field 'block_tokens' is {block}; expected 1 to {MAX_BLOCK_TOKENS}")
        if turn < 1:
            raise TraceError(f"{where}: field 'turn' is {turn}; expected >= 1")
    blocks = -(-inp // block)  # integer ceiling: a float quotient overflows on huge lengths
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {inp}; expected ceil({inp} / {block}) = {blocks}"
        )
    return TraceRequest(ts, inp, out, tuple(ids), session, turn, block)


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """Requests in file order (streamed: a trace of millions of lines is never held whole); ``.gz``
    and ``.xz`` files are read as they are."""
    with _open_text(path) as f:
        yield from read_lines(f, str(path), limit)


def _open_text(path: str | Path) -> TextIO:
    suffix = Path(path).suffix
    if suffix == ".gz":
        return gzip.open(path, "rt")
    if suffix == ".xz":
        return lzma.open(path, "rt")
    return open(path)


def read_lines(f: TextIO, name: str, limit: int | None = None) -> Iterator[TraceRequest]:
    count = 0
    for number, line in enumerate(f, 1):
        if limit is not None and count >= limit:
            return
        if not line.strip():
            continue
        yield parse_line(line, f"{name}:{number}")
        count += 1


def write_trace(path: str | Path, requests: Iterator[TraceRequest] | list[TraceRequest]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(r.to_json() + "\n")
            n += 1
    return n
