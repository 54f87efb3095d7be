"""``flatcake bench remote``: restores across nodes, two hosts made of network namespaces on this machine.

Two namespaces joined by a veth pair (addresses only inside them, from 198.18.0.0/15, the benchmarking
range) each run a real node agent: A serves its pages to other nodes (``cluster.listen``), B names A
as its peer. A worker in A's namespace writes a shared prompt (placed on DRAM by Table 2) and an agent
session (placed on SSD); a worker in B's namespace writes the same shapes locally, then restores A's
sets through ``Cluster`` (remote DRAM: staged by A's agent, as over TCP by default, and
``remote_dram_onesided``: read page-layer by page-layer from A's pool, as over RDMA; remote SSD: staged
by A's agent) and its own sets through its engine, alternating, each set ``repeats`` times. Every restored page is
compared with the bytes written (regenerated from the seed): ``corrupt_pages`` counts the ones that
differ or failed their crc32 on arrival. Last, A's agent is killed (SIGKILL) while B restores A's
session: ``peer_killed`` says how long after the kill B had its answer, how many pages were misses,
and how many arrived wrong (none may).

What it cannot show here: both namespaces share one kernel, one memory bus and one disk, and the
transfer engine runs over TCP on a veth pair (RDMA and NVMe-oF would move the bytes without the
peer's CPU, where TCP copies them through both kernels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flatcake.loadgen.bench import worker

MiB = 1 << 20
PORT = 7471  # each namespace has its own ports: a fixed one cannot clash


@dataclass(frozen=True)
class RemoteConfig:
    pages: int = 512  # per set: the shared prompt and the agent session each
    layers: int = 16
    page_bytes: int = 64 * 1024
    repeats: int = 5
    staging_bytes: int = 64 * MiB
    timeout_s: float = 10.0


QUICK = RemoteConfig(pages=64, layers=8, page_bytes=32 * 1024, repeats=2, staging_bytes=8 * MiB)
PATHS = ("remote_dram", "remote_dram_onesided", "remote_ssd", "local_dram", "local_ssd")


@dataclass(frozen=True)
class Hosts:
    names: tuple[str, str]
    addresses: tuple[str, str]

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Two network namespaces joined by a veth pair; removed (with the pair) on exit. Needs root and
    iproute2's ``ip``."""
    if shutil.which("ip") is None:
        raise RuntimeError("bench remote needs iproute2's `ip` (apt-get install iproute2) to make network namespaces")
    tag = f"fc{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    net = f"198.18.{os.getpid() % 256}"
    addresses = (f"{net}.1", f"{net}.2")
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for name, dev, addr in zip(names, (f"{tag}va", f"{tag}vb"), addresses, strict=True):
            _ip("link", "set", dev, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield Hosts(names, addresses)
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()} (network namespaces need root)")


def agent_config(cfg: RemoteConfig, directory: Path, node_id: int, **cluster: Any) -> Any:
    from flatcake.node_agent import EngineConfig

    span = cfg.layers * cfg.page_bytes
    pool_bytes = max(8 * MiB, -(-4 * cfg.pages * span // 4 // MiB) * MiB)  # a quarter of the pool per file
    return EngineConfig.from_dict({
        "layers": cfg.layers, "page_bytes": cfg.page_bytes, "node_id": node_id,
        "dram": {"bytes": 2 * cfg.pages * span + 16 * span, "huge_pages": False,
                 "name": f"flatcake-remote-{os.getpid()}-{node_id}"},
        "ssd": {"dir": str(directory / "pool"), "file_bytes": pool_bytes, "file_count": 4},
        "io": {"backend": "posix"},
        "agent": {"socket": str(directory / "agent.sock"), "metrics_port": 0},
        "cluster": {"staging_bytes": cfg.staging_bytes, "peer_timeout_s": cfg.timeout_s, **cluster},
    })  # fmt: skip


def run(cfg: RemoteConfig, directory: Path, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from flatcake.node_agent import spawn

    directory = directory.resolve()
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    with two_hosts() as hosts, contextlib.ExitStack() as stack:
        listen = f"{hosts.addresses[0]}:{PORT}"
        # The cache's peer secret, held by both agents only; A registers its DRAM pool for one-sided reads
        # (what RDMA would do) so that they are measured beside staged ones.
        directory.mkdir(parents=True)
        secret = directory / "peer-secret"
        secret.write_bytes(secrets.token_hex(32).encode())
        secret.chmod(0o400)
        configs = [
            agent_config(cfg, directory / "a", 1, listen=listen, secret_file=str(secret), one_sided_dram="on"),
            agent_config(cfg, directory / "b", 2, peers=[listen], secret_file=str(secret)),
        ]
        procs = []
        for i, c in enumerate(configs):
            where = Path(c.ssd.dir).parent
            where.mkdir(parents=True)
            output = stack.enter_context((directory / f"agent-{'ab'[i]}.log").open("w"))
            for leftover in (c.dram.name, f"{c.dram.name}.index"):  # the pool and shared index, once it stops
                stack.callback(Path(c.dram.shm_dir, leftover).unlink, missing_ok=True)
            procs.append(spawn(c, where, output=output, prefix=hosts.prefix(i)))
            stack.callback(_stop, procs[-1])
        log(f"agents up in namespaces {hosts.names[0]} ({hosts.addresses[0]}) and {hosts.names[1]} "
            f"({hosts.addresses[1]})")  # fmt: skip
        job = {"config": dataclasses.asdict(cfg)}
        for i, c in enumerate(configs):
            wrote = worker.call(__name__, {**job, "op": "write", "socket": c.agent.socket}, prefix=hosts.prefix(i))
            if not wrote.get("ran", True):
                raise RuntimeError(f"writing on node {'AB'[i]}: {wrote['why_not']}")
        log(f"wrote {cfg.pages} DRAM and {cfg.pages} SSD pages on each node; restoring on B")
        result = worker.call(__name__, {**job, "op": "read", "socket": configs[1].agent.socket}, prefix=hosts.prefix(1))
        if not result.get("ran", True):
            raise RuntimeError(f"restoring on node B: {result['why_not']}")
        log("killing A's agent while B restores from it")
        killed = _kill_mid_restore(job, configs, hosts, directory, procs[0])
    local = result["local_ssd"]["bytes_per_s"]
    return {
        "config": dataclasses.asdict(cfg),
        "hosts": {"a": hosts.addresses[0], "b": hosts.addresses[1], "namespaces": list(hosts.names)},
        "transport": "tcp over a veth pair (Mooncake transfer engine)", **result,
        "remote_dram_bytes_per_s": result["remote_dram"]["bytes_per_s"],
        "remote_ssd_bytes_per_s": result["remote_ssd"]["bytes_per_s"],
        "local_bytes_per_s": local,
        "remote_ssd_vs_local_ssd": round(result["remote_ssd"]["bytes_per_s"] / local, 3) if local else None,
        "corrupt_pages": sum(result[p]["corrupt_pages"] for p in PATHS) + killed["wrong_pages"],
        "peer_killed": killed, "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def _kill_mid_restore(job: dict[str, Any], configs: list[Any], hosts: Hosts, directory: Path,
                      agent_a: Any) -> dict[str, Any]:  # fmt: skip
    """B restores A's session again and again; once a chunk has landed, A's agent gets SIGKILL. B's answer:
    the first restore that met the dead peer (its misses, wrong pages, seconds after the kill)."""
    progress = directory / "progress"
    args = {**job, "op": "read_killed", "socket": configs[1].agent.socket, "progress": str(progress)}
    reader = subprocess.Popen([*hosts.prefix(1), sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert reader.stdin is not None
    reader.stdin.write(json.dumps(args))
    reader.stdin.close()
    deadline = time.monotonic() + 120
    while not progress.exists():  # the reader's first remote chunk has landed
        if reader.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the reader on B never landed a remote chunk")
        time.sleep(0.005)
    agent_a.send_signal(signal.SIGKILL)  # `ip netns exec` execs the agent: this is its pid
    (directory / "killed").write_text(repr(time.time()))
    assert reader.stdout is not None
    out = reader.stdout.read()  # the reader ends within its own deadline
    reader.wait(30)
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if not answer.get("ran", True):
        raise RuntimeError(f"the reader on B: {answer['why_not']}")
    return answer


def _stop(proc: Any) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- the workers (one process each, inside a namespace) -------------------------------------------------
def _pages(cfg: RemoteConfig, seed: int) -> Any:
    from flatcake.node_agent import aligned_empty

    kv = aligned_empty((cfg.layers, cfg.pages, cfg.page_bytes))
    kv[...] = np.random.default_rng(seed).integers(0, 256, kv.shape, dtype=np.uint8)
    return kv


SETS = {"dram": 1, "ssd": 2}  # set -> seed of its bytes


def _keys(node: str, which: str, cfg: RemoteConfig) -> list[str]:
    return [f"{node}-{which}-{i}" for i in range(cfg.pages)]


def measure(job: dict[str, Any]) -> dict[str, Any]:
    from flatcake.node_agent import Cluster, Hints, connect

    cfg = worker.config(RemoteConfig, job["config"])
    engine = connect(job["socket"], layers=cfg.layers, page_bytes=cfg.page_bytes)
    node = "A" if engine.config.cluster.listen else "B"
    try:
        if job["op"] == "write":
            for which, seed in SETS.items():
                hints = Hints(prefix_refcount=2) if which == "dram" else Hints(context_tokens=1 << 20)
                put = engine.put(_keys(node, which, cfg), _pages(cfg, seed), hints)
                if put.medium is None or put.medium.name.lower() != which:
                    raise RuntimeError(f"the {which} set was placed on {put.medium} ({put.reason})")
            return {"ran": True}
        cluster = Cluster(engine)
        if job["op"] == "read_killed":
            return _read_killed(cluster, cfg, Path(job["progress"]))
        one_sided = Cluster(engine, stage_dram=False)  # DRAM pages read from A's pool, as over RDMA
        runs: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
        expected = {which: _pages(cfg, seed) for which, seed in SETS.items()}
        for _ in range(cfg.repeats):
            for path in PATHS:  # alternating: the machine's noise falls on every path alike
                where, which = path.split("_")[:2]
                reader = one_sided if path.endswith("onesided") else cluster
                runs[path].append(_restore(reader, "A" if where == "remote" else "B", which, cfg, expected[which]))
        one_sided.close()
        cluster.close()
        return {path: _summary(rs, cfg) for path, rs in runs.items()}
    finally:
        engine.close()


def _read_killed(cluster: Any, cfg: RemoteConfig, progress: Path) -> dict[str, Any]:
    """Restore A's session until a restore meets the dead peer; say so once the first chunk has landed."""
    from flatcake.node_agent import aligned_empty

    keys, expected = _keys("A", "ssd", cfg), _pages(cfg, SETS["ssd"])
    dest = aligned_empty((cfg.layers, cfg.pages, cfg.page_bytes))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        dest[...] = 0
        done: dict[str, Any] = {}
        thread = threading.Thread(target=lambda out=done: out.update(missing=cluster.restore(keys, dest)))
        thread.start()
        while thread.is_alive():
            if cluster.last.pages and not progress.exists():
                progress.write_text("a chunk landed")
            thread.join(0.001)
        answered = time.time()
        missing = done["missing"]
        if not missing:
            progress.write_text("a restore completed")
            continue
        arrived = [j for j in range(cfg.pages) if j not in missing]
        wrong = sum(1 for j in arrived if not np.array_equal(dest[:, j], expected[:, j]))
        wrong += int(dest[:, sorted(missing)].any(axis=(0, 2)).sum())  # a miss must leave its page untouched
        killed = float((progress.parent / "killed").read_text()) if (progress.parent / "killed").exists() else answered
        return {"missing_pages": len(missing), "arrived_pages": len(arrived), "wrong_pages": wrong,
                "answered_after_kill_s": round(max(0.0, answered - killed), 3), "timeout_s": cfg.timeout_s}  # fmt: skip
    raise RuntimeError("no restore met the killed peer within 120 s")


def _restore(cluster: Any, node: str, which: str, cfg: RemoteConfig, expected: Any) -> dict[str, float]:
    from flatcake.node_agent import aligned_empty

    keys = _keys(node, which, cfg)
    dest = aligned_empty((cfg.layers, cfg.pages, cfg.page_bytes))
    dest[...] = 0
    if node == "B":  # local: the engine's restore, its layers yielded as they land
        started = time.perf_counter()
        first = 0.0
        with cluster.engine.get(keys, dest) as restore:
            for _layer in restore:
                first = first or time.perf_counter() - started
            missing = set(restore.missing)
        seconds, corrupt_on_arrival = time.perf_counter() - started, 0
    else:
        started = time.perf_counter()
        missing = cluster.restore(keys, dest)
        seconds = time.perf_counter() - started
        first, corrupt_on_arrival = cluster.last.first_layer_s, cluster.last.corrupt_pages
    differ = int((dest != expected).reshape(cfg.layers, cfg.pages, -1).any(axis=(0, 2)).sum())
    return {"seconds": seconds, "first_layer_s": first, "missing": len(missing),
            "corrupt_pages": corrupt_on_arrival + differ - len(missing)}  # fmt: skip


def _summary(runs: list[dict[str, float]], cfg: RemoteConfig) -> dict[str, Any]:
    nbytes = cfg.pages * cfg.layers * cfg.page_bytes
    seconds = statistics.median(r["seconds"] for r in runs)
    first = statistics.median(r["first_layer_s"] for r in runs)
    return {
        "bytes": nbytes, "repeats": len(runs), "seconds": round(seconds, 6), "bytes_per_s": round(nbytes / seconds),
        "time_to_first_layer_s": round(first, 6), "missing_pages": int(sum(r["missing"] for r in runs)),
        "corrupt_pages": int(sum(r["corrupt_pages"] for r in runs)),
    }  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    rows = [f"{'path':<20} {'MB/s':>9} {'x local':>8} {'first layer':>12} {'missing':>8} {'corrupt':>8}"]
    local = report["local_bytes_per_s"]
    for path in PATHS:
        r = report[path]
        first = f"{r['time_to_first_layer_s'] * 1e3:.2f}ms"
        rows.append(f"{path:<20} {r['bytes_per_s'] / 1e6:>9.1f} {r['bytes_per_s'] / local:>8.2f} {first:>12} "
                    f"{r['missing_pages']:>8} {r['corrupt_pages']:>8}")  # fmt: skip
    k = report["peer_killed"]
    rows.append(f"A killed mid-restore: {k['missing_pages']} pages missed, {k['arrived_pages']} arrived, "
                f"{k['wrong_pages']} wrong; answered {k['answered_after_kill_s'] * 1e3:.0f} ms after the kill "
                f"(timeout {k['timeout_s']:.0f} s)")  # fmt: skip
    c = report["config"]
    rows.append(f"{c['pages']} pages x {c['layers']} layers x {c['page_bytes']} B per set, median of {c['repeats']}; "
                f"{report['transport']}")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(worker.main(measure))
