"""No client can deny the control plane to others (issue 29 item 4): while another process's clients
stall mid-frame, stop reading their replies, flood, send oversized and malformed frames and open
connections until refused, a well-behaved client is never refused or disconnected and each of its
requests is answered within BOUND_S (a third of agent.frame_timeout_s, the delay that a stalled
frame or a full frame budget would otherwise cost it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flatcake.node_agent.service.client import AgentConnection, connect
from tests.node_agent.service.test_agent_processes import start_agent, stop_agent
from tests.support.engines import small_config
from tests.support.kv_client import fill
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

MISBEHAVE = Path(__file__).parents[1] / "support" / "misbehave.py"
MODES = ("stall", "slow", "flood", "oversized", "malformed", "many")
FRAME_TIMEOUT_S = 3.0
BOUND_S = 1.0


def test_misbehaving_clients_cannot_refuse_disconnect_or_delay_a_well_behaved_one(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node", files=64, dram_bytes=256 * 4 * 4096,
                          agent={"max_clients": 256, "max_clients_per_process": 64,
                                 "frame_timeout_s": FRAME_TIMEOUT_S})  # fmt: skip
    agent = start_agent(config, tmp_path)
    keys = [f"good-{i}" for i in range(8)]
    with connect(config.agent.socket) as engine:
        engine.put(keys, fill(keys, config.layers, config.page_bytes))
    progress = tmp_path / "misbehaving.progress"
    bad = subprocess.Popen([sys.executable, str(MISBEHAVE), config.agent.socket, str(progress), ",".join(MODES)],
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:

        def under_way() -> bool:
            assert bad.poll() is None, f"the misbehaving clients exited: {bad.stderr.read() if bad.stderr else ''}"
            lines = progress.read_text().split() if progress.exists() else []
            return all(mode in lines for mode in MODES)

        wait_until(under_way, what="every kind of misbehaviour to be under way")
        latencies: list[float] = []
        stats: dict[str, Any] = {}
        deadline = time.monotonic() + 20 * FRAME_TIMEOUT_S
        # Rounds until the agent has cut the stalled frames off at least once (so the measurement spans
        # what they hold), a new connection each round: admission is part of the promise.
        while len(latencies) < 120 or stats.get("dropped_connections", {}).get("frame_timeout", 0) < 4:
            assert time.monotonic() < deadline, f"the stalled frames were never cut off: {stats}"
            conn = AgentConnection(config.agent.socket)
            try:
                for _ in range(10):
                    started = time.perf_counter()
                    conn.call("register")
                    assert conn.call("exists", keys=keys) == len(keys)
                    lease = conn.call("acquire", keys=keys)
                    conn.call("release", id=lease["id"])
                    latencies.append(time.perf_counter() - started)
                stats = conn.call("stats")
            finally:
                conn.close()
    finally:
        bad.kill()
        bad.wait(10)
        stop_agent(agent)
    worst, median = max(latencies), float(np.median(latencies))
    assert worst < BOUND_S, f"a well-behaved request took {worst:.3f} s (median {median * 1000:.1f} ms)"
    dropped = stats["dropped_connections"]
    # The misbehaviour reached the agent's defences: refused past the per-process cap, cut off when stalled.
    assert dropped.get("busy", 0) >= 1 and dropped.get("frame_timeout", 0) >= 1, dropped
    print(f"well-behaved round trips under six misbehaviours: median {median * 1e3:.1f} ms, worst {worst * 1e3:.1f} ms")
