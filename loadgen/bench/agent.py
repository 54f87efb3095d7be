"""``flatcake bench agent``: the control path's cost. Lookup and allocate+publish round trips through
the node agent, against the same calls on an in-process catalog, measured in one run.

``lookup`` is what a client does (``RemoteCatalog.lookup``: the agent's shared index, read without the
agent); ``lookup_socket`` is the same question asked over the socket, as every lookup was before.

The agent runs as its own process (``flatcake agent serve``), as on a node; each client is a process
with one connection, calling back to back for a fixed time. Latency is per call, from sending the
request to decoding the reply.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from flatcake.node_agent import (
    AgentConfig,
    AgentConnection,
    DramConfig,
    EngineConfig,
    Hints,
    IOConfig,
    LocalCatalog,
    RemoteCatalog,
    SsdConfig,
    local_table,
    open_index,
    spawn,
)
from flatcake.node_agent import protocol as P


@dataclass(frozen=True)
class AgentBenchConfig:
    batches: tuple[int, ...] = (128, 4096)
    clients: tuple[int, ...] = (1, 2, 8)
    seconds: float = 2.0
    stored_keys: int = 8192


QUICK = AgentBenchConfig(seconds=0.5)


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
            locs = [catalog.table.lookup(k) for k in stored]
            assert locs[-1] is not None
        else:
            a = catalog.allocate(key_batch(f"p-{n}", batch), Hints())
            assert a is not None
            catalog.publish(a.id, [0] * batch)
        lat.append(time.perf_counter() - t0)
        n += 1
    return summarize(lat, seconds)


def run(cfg: AgentBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="flatcake-agent-bench-"))
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
                               journal_records=after["journal_records"] - before["journal_records"])  # fmt: skip
                    rows.append(row)
        conn.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    goal = [r for r in rows if r["op"] == "lookup" and r["batch"] == 4096 and r["clients"] == max(cfg.clients)]
    # The summary keys: 4,096-key points by client count (``_1c``, ``_8c``).
    summary = {
        f"{name}_4096_{stat}_ms_{r['clients']}c": r[f"{stat}_ms"]
        for name, op, stat in (("lookup", "lookup", "p99"), ("lookup_socket", "lookup_socket", "p99"),
                               ("publish", "allocate_publish", "p50"))
        for r in rows if r["op"] == op and r["batch"] == 4096
    }  # fmt: skip
    return {
        "config": {"batches": list(cfg.batches), "clients": list(cfg.clients), "seconds": cfg.seconds,
                   "cpus": os.cpu_count()},
        "rows": rows,
        "summary": summary,
        "goal": {"lookup_4096_p99_ms": goal[0]["p99_ms"] if goal else None, "target_ms": 1.0},
    }  # fmt: skip


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
    g = report["goal"]
    lines.append(
        "service: the agent's decode + work + encode per call; codec: the client's encode + decode;\n"
        "the rest of a round trip is the socket and, with several clients, waiting for the agent."
    )
    lines.append(f"\n4,096-key lookup P99 with {max(report['config']['clients'])} clients: "
                 f"{g['lookup_4096_p99_ms']:.3f} ms (goal < {g['target_ms']} ms)")  # fmt: skip
    return "\n".join(lines)
