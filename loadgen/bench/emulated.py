"""``flatcake emulate`` started for one benchmark point (``bench e2e``, and ``bench serve``'s emulated
systems): a fresh node agent for the FlatCake modes (the emulator is its client), then the emulator on a
free loopback port, both stopped when the block ends, their logs in the point's folder."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.storage import engine_config
from flatcake.net import free_port
from flatcake.node_agent import AgentConfig, spawn

FLATCAKE = str(Path(sys.executable).parent / "flatcake")
FLATCAKES = ("flatcake", "flatcake-native")  # the modes with a node agent underneath


def wait_for(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path,
             timeout: float = 60) -> None:  # fmt: skip
    """Until ``check()``; a RuntimeError naming ``log`` (and its last lines) if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout:.0f}s; see {log}")
        time.sleep(0.1)


def tail(log: Path, lines: int = 5) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def save_agent_metrics(agent_log: Path, out: Path) -> bool:
    """The node agent's /metrics (its port is the one its log names: it binds port 0) into ``out``."""
    found = re.search(r"metrics on port (\d+)", agent_log.read_text(errors="replace"))
    if found is None:
        return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=10) as r:
            out.write_bytes(r.read())
    except OSError:
        return False
    return True


def command(emu: EmulatorConfig, port: int, data: Path) -> list[str]:
    """``flatcake emulate``'s command line for ``emu``: a model preset's geometry and GPU costs, or (no
    preset) the geometry and rates as given."""
    args = [FLATCAKE, "emulate", "--mode", emu.mode, "--port", str(port), "--data-dir", str(data),
            "--prefetch-policy", emu.prefetch_policy, "--l3", emu.l3]  # fmt: skip
    if emu.model:
        args += ["--model", emu.model, "--gpu", emu.gpu]
    else:
        args += ["--layers", str(emu.layers), "--page-tokens", str(emu.page_tokens),
                 "--bytes-per-token-layer", str(emu.bytes_per_token_layer),
                 "--prefill-tokens-per-s", repr(emu.prefill_tokens_per_s),
                 "--decode-tokens-per-s", repr(emu.decode_tokens_per_s)]  # fmt: skip
    if not emu.drop_page_cache:
        args.append("--keep-page-cache")
    for name in ("hbm_bytes", "dram_bytes", "ssd_bytes", "scope_file_bytes"):
        args += [f"--{name.replace('_', '-')}", str(getattr(emu, name))]
    if emu.scheduler:
        args += ["--scheduler", emu.scheduler]
    if emu.mode in FLATCAKES:
        args += ["--placement", emu.placement]
    if emu.mode == "flatcake":
        args += ["--storage-dram-share", repr(emu.storage_dram_share)]
    if emu.agent_socket:
        args += ["--agent-socket", emu.agent_socket]
    return args


@dataclass(frozen=True)
class Running:
    """A started emulator: its URL and processes (the agent's where one runs)."""

    url: str
    emulator: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes] | None

    def save_metrics(self, run_dir: Path) -> None:
        """The emulator's /metrics into ``emulator.prom``, the agent's (placement, reclaim, restores by
        medium) into ``agent.prom``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            (run_dir / "emulator.prom").write_bytes(r.read())
        if self.agent is not None:
            save_agent_metrics(run_dir / "agent.log", run_dir / "agent.prom")


@contextlib.contextmanager
def running(emu: EmulatorConfig, data: Path, run_dir: Path, use_agent: bool = True) -> Iterator[Running]:
    """The emulator for ``emu`` on pools in ``data`` (a short path: the agent's socket lives there, and a
    Unix socket's path has at most 107 bytes), logs in ``run_dir``; stopped when the block ends."""
    agent = emulator = None
    logs: list[IO[bytes]] = []
    try:
        if emu.mode in FLATCAKES and use_agent:
            sock = str(data / "agent.sock")
            agent_cfg = AgentConfig(socket=sock, metrics_host="127.0.0.1", metrics_port=0)
            engine = dataclasses.replace(engine_config(emu, data / "flatcake"), agent=agent_cfg)
            logs.append(open(run_dir / "agent.log", "wb"))  # noqa: SIM115 - closed below
            agent = spawn(engine, data, logs[-1])
            emu = dataclasses.replace(emu, agent_socket=sock)
        port = free_port()
        logs.append(open(run_dir / "emulator.log", "wb"))  # noqa: SIM115 - closed below
        emulator = subprocess.Popen(command(emu, port, data), stdout=logs[-1], stderr=subprocess.STDOUT, cwd=data)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(url + "/healthz"), emulator, "the emulator", run_dir / "emulator.log")
        yield Running(url, emulator, agent)
    finally:
        stop(emulator)
        stop(agent)
        for f in logs:
            f.close()
