"""``flatcake bench agent``: the control path's cost. Lookup and allocate+publish round trips through
the node agent, against the same calls on an in-process catalog, measured in one run.

``lookup`` is what a client does (``RemoteCatalog.lookup``: the agent's shared index, read without the
agent); ``lookup_socket`` is the same question asked over the socket, as every lookup was before.

The agent runs as its own process (``flatcake agent serve``), as on a node; each client is a process
with one connection, calling back to back for a fixed time. Latency is per call, from sending the
request to decoding the reply.

Why one module of this size: its parts (latency, throughput, restart at 1 GiB and at 1M/10M keys,
the index's memory, the journal soak) share the agent-process harness and write one JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from flatcake.loadgen.models import PRESETS
from flatcake.node_agent import (
    AgentConfig,
    AgentConnection,
    DramConfig,
    Engine,
    EngineConfig,
    Hints,
    IOConfig,
    PoolFullError,
    SsdConfig,
    aligned_empty,
    connect,
    spawn,
)
from flatcake.node_agent.catalog.local import LocalCatalog
from flatcake.node_agent.catalog.shared_index import SharedIndexWriter
from flatcake.node_agent.constants import JOURNAL_FILE
from flatcake.node_agent.datapath.engine import local_table
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.keyindex import slots_for
from flatcake.node_agent.service import protocol as P
from flatcake.node_agent.service.client import RemoteCatalog, open_index

PARTS = ("latency", "capacity", "restart", "restart_keys", "index", "journal")


@dataclass(frozen=True)
class AgentBenchConfig:
    batches: tuple[int, ...] = (128, 4096)
    clients: tuple[int, ...] = (1, 2, 8)
    seconds: float = 2.0
    stored_keys: int = 8192
    parts: tuple[str, ...] = PARTS
    index_keys: int = 1_000_000
    index_scope_pages: int = 64  # a 4K-token session of 64-token pages
    restart_bytes: tuple[int, ...] = (4 << 30, 16 << 30)  # pools filled with real pages
    # Restarts by key count at SGLang's real page sizes (64-token pages): (model preset, keys).
    restart_keys: tuple[tuple[str, int], ...] = (
        ("dsv4-flash", 1_000_000), ("llama3-70b-tp4", 1_000_000),
        ("dsv4-flash", 10_000_000), ("llama3-70b-tp4", 10_000_000),
    )  # fmt: skip
    soak_puts: int = 20_000


# Quick: every field, smaller: 0.5 s points, 1, 2 and 8 clients at 4,096 keys (2: as many as a CI
# machine's cores, beside 8 that oversubscribe them), restarts at 1/16 of the sizes, the index at 100K
# keys, a shorter soak (the JSON's ``restart``/``index`` rows say what was measured).
QUICK = AgentBenchConfig(batches=(4096,), clients=(1, 2, 8), seconds=0.5, restart_bytes=(256 << 20, 1 << 30),
                         restart_keys=(("dsv4-flash", 100_000), ("llama3-70b-tp4", 100_000)), index_keys=100_000,
                         soak_puts=3000)  # fmt: skip


def engine_config(root: Path) -> EngineConfig:
    # Metadata only: pages are allocated and published, never written, so the pool can be small.
    return EngineConfig(
        layers=4, page_bytes=4096,
        dram=DramConfig(bytes=0, huge_pages=False, shm_dir=str(root), name="bench-dram"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=4 * 4096 * 4096, file_count=64, high_watermark=1.0,
                      low_watermark=1.0),
        io=IOConfig(backend="posix"),
        agent=AgentConfig(socket=str(root / "agent.sock"), metrics_host="127.0.0.1", metrics_port=0),
    )  # fmt: skip


def key_batch(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:058x}" for i in range(n)]  # the length of a SHA-256 hex digest, and then some


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by rank (no interpolation): a value that was measured."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(latencies: list[float], seconds: float) -> dict[str, float]:
    return {
        "calls": len(latencies), "calls_per_s": len(latencies) / seconds if seconds else 0.0,
        "p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
    }  # fmt: skip


def _client(socket_path: str, op: str, batch: int, seconds: float, start: Any, out: Any, tag: str) -> None:
    try:
        out.put(_calls(socket_path, op, batch, seconds, start, tag))
    except Exception as exc:  # report instead of leaving the parent waiting
        out.put(f"{tag}: {exc.__class__.__name__}: {exc}")


def _calls(socket_path: str, op: str, batch: int, seconds: float, start: Any, tag: str) -> tuple[list[float], float]:
    conn = AgentConnection(socket_path)
    info = conn.call("register")
    catalog = RemoteCatalog(conn, index=open_index(info.get("index_path") or ""))
    stored = key_batch("stored", batch)
    lat: list[float] = []
    codec: list[float] = []
    start.wait()
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        if op == "lookup":
            assert catalog.lookup(stored)[0] == batch
        elif op == "lookup_socket":
            r = conn.call("lookup", keys=stored)
            assert r["hit"] == batch
        else:
            keys = key_batch(f"{tag}-{n}", batch)
            alloc = conn.call("allocate", keys=keys, hints={})
            conn.call("publish", id=alloc["id"], crc=[0] * batch)
        lat.append(time.perf_counter() - t0)
        n += 1
    # What encoding and decoding one request and its reply cost, on this side of the socket.
    reply = {"hit": batch, "gva": list(range(1 << 60, (1 << 60) + batch)), "stride": [4096] * batch}
    for _ in range(20):
        t0 = time.perf_counter()
        P.pack(P.request(1, "lookup" if op.startswith("lookup") else op, {"keys": stored}))
        msgpack.unpackb(msgpack.packb(P.ok(1, reply)), raw=False)
        codec.append(time.perf_counter() - t0)
    conn.close()
    return lat, statistics.median(codec)


def through_agent(socket_path: str, op: str, batch: int, clients: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=(socket_path, op, batch, seconds, start, out, f"{batch}x{clients}w{w}"))
        for w in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(0.2)  # let every client connect before the clock starts
    start.set()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(30)
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"a benchmark client failed: {failed[0]}")
    lat = [x for r, _ in results for x in r]
    row = summarize(lat, seconds)
    row["client_codec_ms"] = statistics.fmean(c for _, c in results) * 1e3
    return row


def in_process(op: str, batch: int, seconds: float, root: Path) -> dict[str, Any]:
    cfg = engine_config(root)
    catalog = LocalCatalog(local_table(cfg), cfg.placement)
    stored = key_batch("stored", batch)
    alloc = catalog.allocate(stored, Hints())
    assert alloc is not None
    catalog.publish(alloc.id, [0] * batch)
    lat: list[float] = []
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        if op.startswith("lookup"):
            assert catalog.table.find(stored).hit.all()  # the batch at once, as the agent's lookup op does
        else:
            a = catalog.allocate(key_batch(f"p-{n}", batch), Hints())
            assert a is not None
            catalog.publish(a.id, [0] * batch)
        lat.append(time.perf_counter() - t0)
        n += 1
    return summarize(lat, seconds)


# ---- the other summary fields ------------------------------------------------------------
# Goals from issue 16, beside each value: (field, comparison, target). ``None``: the issue states no
# number (its value is context for another goal); the journal rule is this benchmark's, said so.
GOALS: dict[str, tuple[str, float] | None] = {
    "lookup_4096_p99_ms_1c": None,
    "lookup_4096_p99_ms_8c": ("<=", 1.0),
    "publish_4096_p50_ms_1c": None,
    "publish_4096_p50_ms_8c": ("<=", 5.0),
    "usable_capacity_fraction": (">=", 0.95),
    "usable_capacity_fraction_at_defaults": None,  # reclaim begins at the default high watermark, by design
    "restart_full_verify_bytes_per_s": None,
    "index_bytes_per_key": ("<=", 128.0),
    "journal_bytes_per_live_record": None,  # "proportional to live records": see journal_growth_vs_compacted
    "journal_growth_vs_compacted": ("<=", 2.0),
}


# Every restart point, named by what it measured: ``restart_to_serving_s_<pool size>`` (a pool filled with
# real pages) and ``restart_to_serving_s_<keys>_keys_<model>`` (stored keys at a model's page size).
RESTART_TO_SERVING_GOAL_S = 10.0
RESTART_PREFIX = "restart_to_serving_s_"


def _size_label(n: int) -> str:
    for unit, shift in (("tib", 40), ("gib", 30), ("mib", 20)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}b"


def _count_label(n: int) -> str:
    for unit, scale in (("m", 1_000_000), ("k", 1000)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def sglang_keys(tag: str, start: int, n: int) -> list[str]:
    """Keys shaped like SGLang's: 64 hex characters (a SHA-256 hex digest of the token chain)."""
    prefix = f"{zlib.crc32(tag.encode()):08x}"
    return [f"{prefix}{i:056x}" for i in range(start, start + n)]


def index_memory(keys: int, scope_pages: int, root: Path) -> dict[str, Any]:
    """Bytes per key of the agent's index structures holding ``keys`` published keys, ``scope_pages``
    to a scope (one allocate + publish each, as a session's put): what tracemalloc sees the catalog
    allocate (Python objects and numpy arrays) plus the shared-memory table's bytes. The table is
    sized as the agent sizes it, for a pool that holds exactly these pages."""
    root.mkdir(parents=True, exist_ok=True)
    span_pages = 1 << 14  # pages per pool file
    cfg = EngineConfig(
        layers=1, page_bytes=4096,
        dram=DramConfig(bytes=0, huge_pages=False, shm_dir=str(root), name="bench-index"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=span_pages * 4096, file_count=-(-keys // span_pages),
                      high_watermark=1.0, low_watermark=1.0),
    )  # fmt: skip
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = SharedIndexWriter(root / "bench.index", slots_for(keys))
    catalog = LocalCatalog(local_table(cfg), cfg.placement, index=index)
    hints = Hints()
    for start in range(0, keys, scope_pages):
        batch = sglang_keys("index", start, min(scope_pages, keys - start))
        alloc = catalog.allocate(batch, hints)
        assert alloc is not None
        catalog.publish(alloc.id, [zlib.crc32(k.encode()) for k in batch])
    del batch
    gc.collect()
    python_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    shared = index.shared_bytes()  # the table file clients map (tracemalloc sees the agent-private columns)
    assert catalog.exists(sglang_keys("index", keys - 1, 1)) == 1
    index.close()
    return {"keys": keys, "scope_pages": scope_pages, "python_bytes": python_bytes, "shared_table_bytes": shared,
            "bytes_per_key": (python_bytes + shared) / keys}  # fmt: skip


def usable_capacity(root: Path, watermarks: tuple[float, float] | None = (1.0, 1.0)) -> dict[str, Any]:
    """Fill a small pool with one-page scopes through the engine (real writes) until a put has to
    reclaim; stored bytes / pool bytes. ``watermarks`` (high, low): (1.0, 1.0) measures what the
    allocator can fill; None keeps the defaults (reclaim starts at the high watermark)."""
    high, low = watermarks or (SsdConfig.high_watermark, SsdConfig.low_watermark)
    cfg = EngineConfig(
        layers=8, page_bytes=16384,
        dram=DramConfig(bytes=0, huge_pages=False, shm_dir=str(root), name="bench-capacity"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=4 << 20, file_count=8, high_watermark=high,
                      low_watermark=low),
        io=IOConfig(backend="posix"),
    )  # fmt: skip
    pool_bytes = cfg.ssd.file_bytes * cfg.ssd.file_count
    kv = aligned_empty((cfg.layers, 1, cfg.page_bytes))
    kv[...] = 7
    stored = 0
    with Engine(cfg) as engine:
        reclaimed = engine.table.reclaimed[Medium.SSD]
        while stored * cfg.layers * cfg.page_bytes <= pool_bytes:
            try:
                engine.put([f"capacity-{stored}"], kv)
            except PoolFullError:
                break
            if reclaimed.scopes:
                break
            stored += 1
        scopes = engine.usage()["ssd"]["scopes"]
    span = cfg.layers * cfg.page_bytes
    return {"pool_bytes": pool_bytes, "page_bytes": span, "one_page_scopes": stored, "scopes_held": scopes,
            "high_watermark": high, "fraction": stored * span / pool_bytes}  # fmt: skip


def _restart_config(root: Path, fill_bytes: int) -> EngineConfig:
    file_bytes = 256 << 20
    return EngineConfig(
        layers=8, page_bytes=65536,
        dram=DramConfig(bytes=0, huge_pages=False, shm_dir=str(root), name="bench-restart"),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=file_bytes, file_count=-(-fill_bytes // file_bytes) + 1,
                      high_watermark=1.0, low_watermark=1.0),
        io=IOConfig(backend="posix"),
        agent=AgentConfig(socket=str(root / "agent.sock"), metrics_host="127.0.0.1", metrics_port=0),
    )  # fmt: skip


def _fill_then_kill(cfg: EngineConfig, root: Path, fill: Callable[[str], None], clean: bool = False) -> float:
    """Start an agent, run ``fill`` against its socket, then kill -9 the agent (no clean shutdown), or
    stop it with SIGTERM when ``clean``: the fill's seconds."""
    agent = spawn(cfg, root, timeout=600)
    try:
        started = time.monotonic()
        fill(cfg.agent.socket)
        return time.monotonic() - started
    finally:
        if clean:
            agent.send_signal(signal.SIGTERM)
        else:
            agent.kill()
        agent.wait(120)


@contextlib.contextmanager
def _restarted(cfg: EngineConfig, root: Path, probe: list[str]) -> Iterator[tuple[float, Any, AgentConnection]]:
    """The agent started again after a kill -9: yields the seconds from starting its process to the
    first lookup that finds every ``probe`` key (interpreter start included; it answers only once
    recovered), the process and a registered connection; the agent is stopped after."""
    started = time.monotonic()
    agent = spawn(cfg, root, timeout=600)
    try:
        conn = AgentConnection(cfg.agent.socket)
        conn.call("register")
        while conn.call("exists", keys=probe) != len(probe):
            time.sleep(0.005)
        yield time.monotonic() - started, agent, conn
        conn.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)


def restart(fill_bytes: int, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Fill a pool with ``fill_bytes`` of pages through an agent (64-page puts, real writes), kill -9
    the agent, start it again: seconds from starting the process to the first answered lookup of a
    stored key (interpreter start included), then the background scan's rate over every page."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = _restart_config(root, fill_bytes)
    span = cfg.layers * cfg.page_bytes
    per_put = 64
    puts = max(1, fill_bytes // (span * per_put))
    kv = aligned_empty((cfg.layers, per_put, cfg.page_bytes))
    kv[...] = 1

    def fill(socket: str) -> None:
        with connect(socket) as engine:
            for i in range(puts):
                engine.put(sglang_keys(f"restart-{i}", 0, per_put), kv)
                if i % 64 == 63:
                    log(f"  filled {(i + 1) * per_put * span / (1 << 30):.2f} GiB")

    fill_s = _fill_then_kill(cfg, root, fill)
    with _restarted(cfg, root, sglang_keys(f"restart-{puts - 1}", 0, per_put)) as (serving, _, conn):
        deadline = time.monotonic() + 1800
        while not (rec := conn.call("stats")["recovered"])["scan_done"] and time.monotonic() < deadline:
            time.sleep(0.1)
    stored = puts * per_put * span
    return {"stored_bytes": stored, "fill_s": fill_s, "restart_to_serving_s": serving,
            "scan_bytes": rec["scan_bytes"], "scan_seconds": rec["scan_seconds"], "scan_done": rec["scan_done"],
            "scan_bytes_per_s": rec["scan_bytes"] / rec["scan_seconds"] if rec["scan_seconds"] else 0.0,
            "dropped_pages": rec["dropped_pages"]}  # fmt: skip


TURN_PAGES = 4  # pages an agentic turn appends to its session (a 256-token tool call and reply)


def restart_at_keys(model: str, keys: int, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Restart with ``keys`` pages stored at ``model``'s geometry with 64-token pages (SGLang's page
    size). The pages are allocated and published through the agent, as a put does, but not written,
    in a sparse pool of their real size (recovery reads the journal, not the pages: restart time depends
    on the keys and their extents, not the bytes).

    The journal is left as a restart finds it at its worst: the state compacted (written as columns),
    then as many records as the agent appends before it compacts again (``agent.journal_compact_records``
    - 1), each an agentic turn that appends ``TURN_PAGES`` pages to its session. So: sessions of 64
    pages, one put each; a clean restart, which compacts the journal; the turns; kill -9; start again.
    Measured: seconds from starting the process to the first answered lookup of the last turn's page
    (every page is indexed by then), where recovery spent them, and the agent's resident memory."""
    root.mkdir(parents=True, exist_ok=True)
    preset = dataclasses.replace(PRESETS[model], page_tokens=64)
    span = preset.span_bytes
    file_bytes = 1 << 40
    base = _restart_config(root, keys * span)
    cfg = dataclasses.replace(
        base, layers=preset.layers, page_bytes=preset.page_layer_bytes,
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=file_bytes, file_count=-(-keys * span // file_bytes) + 1,
                      high_watermark=1.0, low_watermark=1.0),
    )  # fmt: skip
    create_pool(cfg.ssd.dir, cfg.ssd.file_count, cfg.ssd.file_bytes, allocate=False)
    zero_crc = zlib.crc32(bytes(span))  # what the background scan reads back from the unwritten pages
    per_put = 64
    turns = min(cfg.agent.journal_compact_records - 1, keys // (2 * TURN_PAGES))
    bulk = keys - turns * TURN_PAGES
    puts = -(-bulk // per_put)

    def sessions(socket: str) -> None:
        conn = AgentConnection(socket)
        conn.call("register")
        for i in range(puts):
            batch = sglang_keys(f"keys-{i}", 0, min(per_put, bulk - i * per_put))
            alloc = conn.call("allocate", keys=batch, hints={})
            conn.call("publish", id=alloc["id"], crc=[zero_crc] * len(alloc["index"]))
            if i % 20_000 == 19_999:
                log(f"  published {(i + 1) * per_put:,} keys")
        conn.close()

    fill_s = _fill_then_kill(cfg, root, sessions, clean=True)
    grown: dict[int, int] = {}  # session -> pages it holds now

    def agentic_turns(socket: str) -> None:
        conn = AgentConnection(socket)
        conn.call("register")
        while conn.call("stats")["journal_compactions"] < 1:  # the restart's compaction: a journal of columns
            time.sleep(0.05)
        for t in range(turns):
            i = (t * 7919) % puts  # sessions in a scattered order, as users come back
            have = grown.get(i, min(per_put, bulk - i * per_put))
            batch = sglang_keys(f"keys-{i}", have - 1, 1 + TURN_PAGES)  # the session's last page, then the turn's
            alloc = conn.call("allocate", keys=batch, hints={})
            conn.call("publish", id=alloc["id"], crc=[zero_crc] * len(alloc["index"]))
            grown[i] = have + TURN_PAGES
            if t % 20_000 == 19_999:
                log(f"  {t + 1:,} turns of {TURN_PAGES} pages")
        conn.close()

    fill_s += _fill_then_kill(cfg, root, agentic_turns)
    last = max(grown, key=lambda i: (grown[i], i)) if grown else puts - 1
    probe = sglang_keys(f"keys-{last}", grown.get(last, 1) - 1, 1)
    journal_bytes = sum(f.stat().st_size for f in Path(cfg.state_dir).glob("journal*"))
    with _restarted(cfg, root, probe) as (serving, agent, conn):
        rss = _rss_bytes(agent.pid)
        rec = conn.call("stats")["recovered"]
    return {"model": model, "page_tokens": preset.page_tokens, "layers": preset.layers,
            "page_layer_bytes": preset.page_layer_bytes, "keys": keys, "pool_bytes": keys * span,
            "turns": turns, "turn_pages": TURN_PAGES, "fill_s": fill_s, "journal_bytes": journal_bytes,
            "journal_records": rec["records"], "journal_tail_records": rec["records"] - rec["snapshot_records"],
            "restart_to_serving_s": serving, "collect_s": rec["collect_seconds"], "adopt_s": rec["adopt_seconds"],
            "index_s": rec["index_seconds"], "recovered_pages": rec["pages"], "agent_rss_bytes": rss}  # fmt: skip


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def journal_soak(puts: int, root: Path) -> dict[str, Any]:
    """Churn a small pool through the agent (8-key scopes, allocate + publish, reclaim at the
    watermarks), then compare the journal's bytes per live scope with what a restart compacts it to."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(
        engine_config(root),
        ssd=SsdConfig(dir=str(root / "pool"), file_bytes=1 << 20, file_count=16, high_watermark=0.9,
                      low_watermark=0.8),
    )  # fmt: skip
    journal = Path(cfg.state_dir) / JOURNAL_FILE

    def live(conn: AgentConnection) -> int:
        return sum(m["scopes"] for m in conn.call("stats")["usage"].values())

    agent = spawn(cfg, root)
    try:
        conn = AgentConnection(cfg.agent.socket)
        conn.call("register")
        started = time.monotonic()
        for i in range(puts):
            alloc = conn.call("allocate", keys=sglang_keys(f"soak-{i}", 0, 8), hints={})
            conn.call("publish", id=alloc["id"], crc=[0] * len(alloc["index"]))
        seconds = time.monotonic() - started
        records, size = live(conn), journal.stat().st_size
        conn.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    agent = spawn(cfg, root)  # the restarted agent compacts the journal to the live records, online
    try:
        conn = AgentConnection(cfg.agent.socket)
        conn.call("register")
        deadline = time.monotonic() + 300
        while conn.call("stats")["journal_compactions"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        compacted, after = journal.stat().st_size, live(conn)
        conn.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    per_live = size / max(1, records)
    per_compacted = compacted / max(1, after)
    return {"puts": puts, "seconds": seconds, "journal_bytes": size, "live_records": records,
            "bytes_per_live_record": per_live, "compacted_bytes": compacted,
            "compacted_bytes_per_live_record": per_compacted,
            "growth_vs_compacted": per_live / per_compacted if per_compacted else 0.0}  # fmt: skip


def run(cfg: AgentBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="flatcake-agent-bench-"))
    try:
        rows = latency(cfg, root / "latency", log) if "latency" in cfg.parts else []
        extra: dict[str, Any] = {}
        if "capacity" in cfg.parts:
            log("capacity: filling a pool with one-page scopes ...")
            extra["capacity"] = usable_capacity(root / "capacity")
            extra["capacity_at_defaults"] = usable_capacity(root / "capacity-defaults", None)
        if "index" in cfg.parts:
            log(f"index: {cfg.index_keys:,} keys in {cfg.index_scope_pages}-page scopes ...")
            extra["index"] = index_memory(cfg.index_keys, cfg.index_scope_pages, root / "index")
        if "journal" in cfg.parts:
            log(f"journal: soak of {cfg.soak_puts:,} puts ...")
            extra["journal"] = journal_soak(cfg.soak_puts, root / "journal")
        if "restart" in cfg.parts:
            extra["restart"] = []
            for size in cfg.restart_bytes:
                log(f"restart: {size / (1 << 30):g} GiB pool ...")
                extra["restart"].append(restart(size, root / f"restart-{size}", log))
                shutil.rmtree(root / f"restart-{size}", ignore_errors=True)
        if "restart_keys" in cfg.parts:
            extra["restart_keys"] = []
            for model, keys in cfg.restart_keys:
                log(f"restart: {keys:,} keys of {model} (64-token pages) ...")
                where = root / f"restart-{model}-{keys}"
                extra["restart_keys"].append(restart_at_keys(model, keys, where, log))
                shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    goal = [r for r in rows if r["op"] == "lookup" and r["batch"] == 4096 and r["clients"] == max(cfg.clients)]
    # The summary keys: 4,096-key points by client count (``_1c``, ``_8c``).
    summary: dict[str, Any] = {
        f"{name}_4096_{stat}_ms_{r['clients']}c": r[f"{stat}_ms"]
        for name, op, stat in (("lookup", "lookup", "p99"), ("lookup_socket", "lookup_socket", "p99"),
                               ("publish", "allocate_publish", "p50"))
        for r in rows if r["op"] == op and r["batch"] == 4096
    }  # fmt: skip
    if "capacity" in extra:
        summary["usable_capacity_fraction"] = extra["capacity"]["fraction"]
        summary["usable_capacity_fraction_at_defaults"] = extra["capacity_at_defaults"]["fraction"]
    if "restart" in extra:
        for r in extra["restart"]:
            summary[RESTART_PREFIX + _size_label(r["stored_bytes"])] = r["restart_to_serving_s"]
        summary["restart_full_verify_bytes_per_s"] = extra["restart"][-1]["scan_bytes_per_s"]
    for r in extra.get("restart_keys", []):
        model = r["model"].replace("-", "_")
        summary[f"{RESTART_PREFIX}{_count_label(r['keys'])}_keys_{model}"] = r["restart_to_serving_s"]
    if "index" in extra:
        summary["index_bytes_per_key"] = extra["index"]["bytes_per_key"]
    if "journal" in extra:
        summary["journal_bytes_per_live_record"] = extra["journal"]["bytes_per_live_record"]
        summary["journal_growth_vs_compacted"] = extra["journal"]["growth_vs_compacted"]
    return {
        "config": {"batches": list(cfg.batches), "clients": list(cfg.clients), "seconds": cfg.seconds,
                   "cpus": os.cpu_count(), "parts": list(cfg.parts), "index_keys": cfg.index_keys,
                   "restart_bytes": list(cfg.restart_bytes),
                   "restart_keys": [list(p) for p in cfg.restart_keys], "soak_puts": cfg.soak_puts},
        "rows": rows,
        **extra,
        "summary": summary,
        "goals": {k: {"value": v, "goal": _goal_text(k), "met": _met(k, v)} for k, v in summary.items()},
        "goal": {"lookup_4096_p99_ms": goal[0]["p99_ms"] if goal else None, "target_ms": 1.0},
    }  # fmt: skip


def goal_of(name: str) -> tuple[str, float] | None:
    """A summary field's goal: GOALS, or the restart goal for every restart point."""
    if name.startswith(RESTART_PREFIX):
        return ("<=", RESTART_TO_SERVING_GOAL_S)
    return GOALS.get(name)


def _goal_text(name: str) -> str:
    g = goal_of(name)
    return f"{g[0]} {g[1]:g}" if g else ""


def _met(name: str, value: float) -> bool | None:
    g = goal_of(name)
    if g is None:
        return None
    return value <= g[1] if g[0] == "<=" else value >= g[1]


def latency(cfg: AgentBenchConfig, root: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Lookup and allocate+publish round trips through an agent process, with the in-process baseline."""
    root.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    agent = spawn(engine_config(root), root)
    try:
        conn = AgentConnection(engine_config(root).agent.socket)
        conn.call("register")
        for batch in cfg.batches:  # what lookups find
            alloc = conn.call("allocate", keys=key_batch("stored", batch), hints={})
            if alloc is not None:
                conn.call("publish", id=alloc["id"], crc=[0] * len(alloc["index"]))
        for op in ("lookup", "lookup_socket", "allocate_publish"):
            for batch in cfg.batches:
                local = in_process(op, batch, cfg.seconds, root / f"local-{op}-{batch}")
                for clients in cfg.clients:
                    log(f"{op}: {batch} keys, {clients} client(s) ...")
                    before = conn.call("stats")
                    row = through_agent(str(root / "agent.sock"), op, batch, clients, cfg.seconds)
                    after = conn.call("stats")
                    wire_op = "lookup" if op.startswith("lookup") else "publish"
                    n0, t0 = before["service_seconds"].get(wire_op, (0, 0.0))
                    n1, t1 = after["service_seconds"].get(wire_op, (0, 0.0))
                    if op == "allocate_publish":  # allocate and publish are two calls
                        s0 = before["service_seconds"].get("allocate", (0, 0.0))[1]
                        s1 = after["service_seconds"].get("allocate", (0, 0.0))[1]
                        t0, t1 = t0 + s0, t1 + s1
                    row["agent_service_ms"] = (t1 - t0) / (n1 - n0) * 1e3 if n1 > n0 else 0.0
                    row.update(op=op, batch=batch, clients=clients, in_process_p50_ms=local["p50_ms"],
                               in_process_calls_per_s=local["calls_per_s"],
                               agent_vs_in_process_p50=row["p50_ms"] / local["p50_ms"] if local["p50_ms"] else 0.0,
                               journal_records=after["journal_appends"] - before["journal_appends"])  # fmt: skip
                    rows.append(row)
        conn.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    return rows


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'op':<17} {'keys':>5} {'clients':>7} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'service ms':>10} {'codec ms':>9} {'in-proc p50':>12} {'x in-proc':>9}"]  # fmt: skip
    for r in report["rows"]:
        lines.append(
            f"{r['op']:<17} {r['batch']:>5} {r['clients']:>7} {r['calls_per_s']:>9.0f} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['agent_service_ms']:>10.3f} {r['client_codec_ms']:>9.3f} "
            f"{r['in_process_p50_ms']:>12.3f} "
            f"{r['agent_vs_in_process_p50']:>9.1f}"
        )
    lines.append(
        "service: the agent's decode + work + encode per call; codec: the client's encode + decode;\n"
        "the rest of a round trip is the socket and, with several clients, waiting for the agent."
    )
    cpus = report["config"].get("cpus") or 0
    if any(r["clients"] > cpus for r in report["rows"]):
        lines.append(f"this machine has {cpus} CPUs: with more client processes than that, a P99 includes waiting "
                     "for a core (compare the lookup rows' P50 and P99 by client count)")  # fmt: skip
    for r in report.get("restart", []):
        lines.append(f"restart with {r['stored_bytes'] / (1 << 30):g} GiB stored: serving after "
                     f"{r['restart_to_serving_s']:.2f} s; full verify {r['scan_bytes'] / (1 << 30):.2f} GiB in "
                     f"{r['scan_seconds']:.1f} s")  # fmt: skip
    for r in report.get("restart_keys", []):
        page_kib = r["page_layer_bytes"] * r["layers"] >> 10
        lines.append(f"restart with {r['keys']:,} keys of {r['model']} ({page_kib} KiB "
                     f"pages, {r['pool_bytes'] / (1 << 40):.2f} TiB): serving after {r['restart_to_serving_s']:.2f} s, "
                     f"journal {r['journal_bytes'] / (1 << 20):.0f} MiB, agent RSS "
                     f"{r['agent_rss_bytes'] / (1 << 30):.2f} GiB")  # fmt: skip
        if "collect_s" in r:  # runs before the journal's columns lack these
            lines.append(f"  {r['journal_tail_records']:,} records appended since the last compaction ({r['turns']:,} "
                         f"turns of {r['turn_pages']} pages); recovery: journal {r['collect_s']:.2f} s, scopes "
                         f"{r['adopt_s']:.2f} s, index {r['index_s']:.2f} s")  # fmt: skip
    if "index" in report:
        i = report["index"]
        heap, shared = i["python_bytes"] / i["keys"], i["shared_table_bytes"] / i["keys"]
        lines.append(f"index: {i['keys']:,} keys ({i['scope_pages']}-page scopes): {heap:.0f} B/key in the agent's "
                     f"heap + {shared:.0f} B/key shared table")  # fmt: skip
    if "journal" in report:
        j = report["journal"]
        lines.append(f"journal after {j['puts']:,} puts: {j['journal_bytes']:,} bytes for {j['live_records']} live "
                     f"scopes; compacted {j['compacted_bytes_per_live_record']:.0f} B/record")  # fmt: skip
    lines.append(f"\n{'summary (issue 16)':<46} {'value':>14}  {'goal':<8} met")
    for name, g in report["goals"].items():
        met = "" if g["met"] is None else ("yes" if g["met"] else "NOT MET")
        lines.append(f"{name:<46} {g['value']:>14.4g}  {g['goal']:<8} {met}")
    return "\n".join(lines)
