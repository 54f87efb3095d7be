"""Real processes: an agent killed with SIGKILL during a put storm, and eight concurrent clients."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.service.client import AgentConnection, connect
from tests.support.engines import small_config
from tests.support.kv_client import page_bytes_for
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

HELPER = Path(__file__).parents[2] / "support" / "kv_client.py"  # run as a script
FLATCAKE = Path(sys.executable).parent / "flatcake"


def start_agent(config: EngineConfig, where: Path) -> subprocess.Popen[str]:
    path = where / "engine.json"
    path.write_text(json.dumps(config.to_dict()))
    proc = subprocess.Popen([str(FLATCAKE), "agent", "serve", "--config", str(path)], cwd=where,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip

    def answers() -> bool:
        try:
            conn = AgentConnection(config.agent.socket, timeout=5)
            conn.call("register")
            conn.close()
            return True
        except (ConnectionError, OSError):
            if proc.poll() is not None:
                raise AssertionError(f"agent exited: {proc.stderr.read() if proc.stderr else ''}") from None
            return False

    wait_until(answers, what="the agent to answer on its socket")
    return proc


def stop_agent(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return err


def client(config: EngineConfig, log: Path, seconds: float, seed: int, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, str(HELPER), config.agent.socket, str(log), str(seconds), str(seed), *extra]
    return subprocess.Popen(args, stderr=subprocess.PIPE, text=True)


def read_log(log: Path) -> tuple[set[str], set[str]]:
    attempted: set[str] = set()
    published: set[str] = set()
    if not log.exists():
        return attempted, published
    for line in log.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "attempt":
            attempted.update(rest.split())
        elif kind == "published":
            published.update(rest.split())
    return attempted, published


def check_bytes(config: EngineConfig, keys: list[str]) -> None:
    with connect(config.agent.socket) as e:
        assert e.exists(keys) == len(keys)
        for i in range(0, len(keys), 256):
            batch = keys[i : i + 256]
            dest = np.zeros((config.layers, len(batch), config.page_bytes), np.uint8)
            with e.get(batch, dest) as restore:
                assert restore.run() == set()
            for j, key in enumerate(batch):
                assert np.array_equal(dest[:, j], page_bytes_for(key, config.layers, config.page_bytes)), key


def test_kill_9_during_a_put_storm_loses_nothing_published(tmp_path: Path) -> None:
    node = tmp_path / "node"
    # Room for the whole storm (1,024 files of 10 pages; a session is 9 pages), so nothing is reclaimed.
    config = small_config(node, files=1024, file_bytes=10 * 4 * 4096, dram_bytes=4096 * 4 * 4096)
    agent = start_agent(config, tmp_path)
    logs = [tmp_path / f"writer{i}.log" for i in range(2)]
    writers = [client(config, log, 600, seed) for seed, log in enumerate(logs)]

    def storm_under_way() -> bool:
        assert all(w.poll() is None for w in writers), "a writer exited before the kill"
        return sum(len(read_log(log)[1]) for log in logs) >= 60  # both writers well into the storm

    wait_until(storm_under_way, what="the writers to publish 60 pages")
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    assert [w.wait(30) for w in writers] == [3, 3]  # both saw the agent vanish mid-storm
    attempted: set[str] = set()
    published: set[str] = set()
    for log in logs:
        a, p = read_log(log)
        attempted |= a
        published |= p
    assert len(published) >= 30, "the storm was too short to mean anything"
    journal = node / "pool" / "journal.log"
    with open(journal, "ab") as f:  # a torn last record, as a crash mid-append leaves
        f.write(struct.pack("<II", 4096, 0) + b"torn")
    agent = start_agent(config, tmp_path)
    try:
        check_bytes(config, sorted(published))  # every published key, bit-exact
        with connect(config.agent.socket) as e:
            stored = [k for k in sorted(attempted) if e.exists([k])]
            unknown = [k for k in ["never-written", "c0-r999-s0-t0-p0"] if e.exists([k])]
            stats = e.catalog.conn.call("stats")
        assert not unknown
        check_bytes(config, stored)  # keys published just before the kill (reply lost) are whole too
        assert set(stored) >= published
        assert stats["recovered"]["dropped_pages"] == 0 and stats["open_allocations"] == 0
        assert stats["usage"]["ssd"]["reclaimed_scopes"] == stats["usage"]["dram"]["reclaimed_scopes"] == 0
        # Unpublished allocations left no space behind: the SSD space held is exactly the stored pages'.
        ssd = stats["usage"]["ssd"]
        assert ssd["used_bytes"] == ssd["pages"] * config.layers * config.page_bytes
    finally:
        err = stop_agent(agent)
    assert "torn or corrupt tail" in err


def test_eight_clients_concurrently_with_two_killed(tmp_path: Path) -> None:
    node = tmp_path / "node"
    config = small_config(node, files=512, file_bytes=10 * 4 * 4096, dram_bytes=2048 * 4 * 4096)
    agent = start_agent(config, tmp_path)
    try:
        logs = [tmp_path / f"client{i}.log" for i in range(8)]
        # Two clients keep going until killed mid-run; six do eight rounds each and exit.
        procs = [client(config, log, 60, seed, "--pause", "0.1") for seed, log in enumerate(logs[:2])]
        procs += [client(config, log, 600, seed, "--rounds", "8") for seed, log in enumerate(logs[2:], 2)]
        for log in logs[:2]:  # each victim is killed in the middle of its work, not before it began
            wait_until(lambda log=log: read_log(log)[1], what=f"{log.name} to publish")
        for victim in procs[:2]:
            os.kill(victim.pid, signal.SIGKILL)
        codes = [p.wait(60) for p in procs]
        errors = [p.stderr.read() if p.stderr else "" for p in procs]
        assert codes == [-9, -9, 0, 0, 0, 0, 0, 0], errors
        published: set[str] = set()
        verified = 0
        for log in logs:
            published |= read_log(log)[1]
            verified += sum(1 for line in log.read_text().splitlines() if line.startswith("verified"))
        assert verified >= 8 and len(published) > 100
        check_bytes(config, sorted(published))  # zero lost, zero corrupt
        with connect(config.agent.socket) as e:
            stats = e.catalog.conn.call("stats")
        assert stats["open_allocations"] == 0 and stats["leases"] == 0  # the killed clients' too
        assert stats["usage"]["ssd"]["reclaimed_scopes"] == stats["usage"]["dram"]["reclaimed_scopes"] == 0
        ssd = stats["usage"]["ssd"]
        assert ssd["used_bytes"] == ssd["pages"] * config.layers * config.page_bytes  # no orphaned space
    finally:
        stop_agent(agent)


def test_an_agent_that_cannot_start_says_why_through_spawn(tmp_path: Path) -> None:
    """``spawn`` (benchmarks, tests) used to say only "did not start"; now it says how the agent ended and
    shows the end of its log: here a second agent on a pool the first one serves."""
    from flatcake.node_agent.service.main import spawn

    config = small_config(tmp_path / "node")
    first = spawn(config, tmp_path / "node")
    try:
        second = tmp_path / "second"
        second.mkdir()
        other = dataclasses.replace(config, agent=dataclasses.replace(config.agent, socket=str(second / "a.sock")))
        with pytest.raises(RuntimeError, match=r"exited with code [1-9](.|\n)*served by another flatcake agent") as err:
            spawn(other, second)
        assert str(second / "agent.log") in str(err.value)
    finally:
        first.terminate()
        first.wait(30)
