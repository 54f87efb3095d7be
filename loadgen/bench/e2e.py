"""``flatcake bench e2e``: the main job. Emulators on loopback, a trace replayed through Locust at
several rates for FlatCake, tiered and DRAM-only storage, then the report.

Each (system, QPS) point starts cold: a fresh emulator (and, for FlatCake, a fresh node agent that
the emulator uses as its client) on fresh pools, so points do not warm each other.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatcake.loadgen.emulator.server import EmulatorConfig, engine_config, page_keys
from flatcake.loadgen.replay.requests import prompt_tokens
from flatcake.loadgen.replay.run import LoadgenConfig
from flatcake.loadgen.replay.run import run as run_locust
from flatcake.loadgen.report import build as R
from flatcake.loadgen.traces import stats as trace_stats
from flatcake.loadgen.traces.formats import BUNDLED_TRACE, read_trace
from flatcake.node_agent import AgentConfig, spawn

BUNDLED = BUNDLED_TRACE
FLATCAKE = str(Path(sys.executable).parent / "flatcake")


@dataclass(frozen=True)
class E2EConfig:
    trace: str = str(BUNDLED)
    requests: int = 50
    qps: tuple[float, ...] = (2.0, 4.0, 8.0)
    systems: tuple[str, ...] = ("flatcake", "tiered", "dram")
    max_output: int = 16
    use_agent: bool = True
    # The modelled GPU and memory sizes (see loadgen/emulator.py); sized so that the middle rate is
    # near the GPU's limit and the highest is past it, where queues (and tiered staging) fill.
    emulator: EmulatorConfig = field(
        default_factory=lambda: EmulatorConfig(hbm_bytes=2 << 20, dram_bytes=4 << 20, ssd_bytes=1536 << 20,
                                               staging_tokens=40_000, prefill_tokens_per_s=5_000.0)
    )  # fmt: skip


QUICK = E2EConfig(requests=24, qps=(2.0, 8.0))


def page_ideal(trace: str, limit: int, page_tokens: int) -> float:
    """Delivered hit rate of an infinite cache of full pages: what an engine with pages can reach."""
    seen: set[str] = set()
    hit = total = 0
    for r in read_trace(trace, limit):
        tokens = prompt_tokens(r)
        keys = page_keys(tokens, page_tokens)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += n * page_tokens
        total += len(tokens)
        seen.update(keys)
    return hit / total if total else 0.0


def run_meta(trace: str, requests: int | None, page_tokens: int, qps: tuple[float, ...], systems: tuple[str, ...],
             context: str, description: str = "") -> dict[str, Any]:  # fmt: skip
    """What the report needs besides the records: the trace slice, its ideal hit rates, where it ran."""
    stats = trace_stats.compute(read_trace(trace, requests), progress=False)
    return {
        "trace": trace, "requests": stats["requests"], "qps": list(qps), "systems": list(systems),
        "ideal_hit_rate_tokens": stats["ideal_hit_rate_tokens"],
        "ideal_hit_rate_pages": page_ideal(trace, requests or stats["requests"], page_tokens),
        "context": context, "description": description,
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout:.0f}s")
        time.sleep(0.1)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_point(cfg: E2EConfig, system: str, qps: float, out: Path, work: Path) -> None:
    """One cold run of one system at one rate; its records land in ``out/<system>/qps-<q>/``."""
    run_dir = out / system / f"qps-{qps:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    data = work / f"{system}-{qps:g}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    emu = dataclasses.replace(cfg.emulator, mode=system, data_dir=str(data))
    agent = emulator = None
    logs = []
    try:
        if system == "flatcake" and cfg.use_agent:
            sock = str(data / "agent.sock")
            agent_cfg = AgentConfig(socket=sock, metrics_host="127.0.0.1", metrics_port=0)
            engine = dataclasses.replace(engine_config(emu, data / "flatcake"), agent=agent_cfg)
            logs.append(open(run_dir / "agent.log", "wb"))  # noqa: SIM115 - closed below
            agent = spawn(engine, data, logs[-1])
            emu = dataclasses.replace(emu, agent_socket=sock)
        port = _free_port()
        args = [FLATCAKE, "emulate", "--mode", system, "--port", str(port), "--data-dir", str(data)]
        for name in ("hbm_bytes", "dram_bytes", "ssd_bytes", "staging_tokens", "prefill_tokens_per_s",
                     "decode_tokens_per_s", "layers", "bytes_per_token_layer"):  # fmt: skip
            args += [f"--{name.replace('_', '-')}", str(getattr(emu, name))]
        if emu.agent_socket:
            args += ["--agent-socket", emu.agent_socket]
        logs.append(open(run_dir / "emulator.log", "wb"))  # noqa: SIM115 - closed below
        emulator = subprocess.Popen(args, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=data)
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _http_ok(url + "/healthz"), emulator, "the emulator")
        rc = run_locust(LoadgenConfig(host=url, trace=cfg.trace, qps=qps, system=system,
                                      results=str(run_dir / "results.jsonl"), csv_prefix=str(run_dir / "locust"),
                                      limit=cfg.requests, max_output=cfg.max_output))  # fmt: skip
        if rc not in (0, 1):  # 1: Locust saw failed requests, which the records show
            raise RuntimeError(f"locust exited with {rc}")
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            (run_dir / "emulator.prom").write_bytes(r.read())
    finally:
        _stop(emulator)
        _stop(agent)
        for f in logs:
            f.close()
        shutil.rmtree(data, ignore_errors=True)


def run(cfg: E2EConfig, out: str | Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    out = Path(out).resolve()  # the processes it starts run in their own directories
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    meta = run_meta(
        cfg.trace, cfg.requests, cfg.emulator.page_tokens, cfg.qps, cfg.systems,
        context="local emulators on loopback (flatcake emulate)",
        description="Each point starts cold. Hits are delivered hits: KV in HBM before prefill starts.",
    )  # fmt: skip
    meta["emulator"] = dataclasses.asdict(cfg.emulator)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    points = [(s, q) for s in cfg.systems for q in cfg.qps]
    started = time.monotonic()
    for i, (system, qps) in enumerate(points, 1):
        log(f"[{i}/{len(points)}] {system} at {qps:g} QPS, {cfg.requests} requests "
            f"({time.monotonic() - started:.0f}s elapsed)")  # fmt: skip
        run_point(cfg, system, qps, out, work)
    shutil.rmtree(work, ignore_errors=True)
    return R.write(out)
