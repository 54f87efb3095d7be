"""kill -9 of the agent under load, several times over, with the campaign's audit after each restart."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.node_agent.service.test_agent_processes import client, read_log, start_agent, stop_agent
from tests.support.engines import small_config
from tests.support.faults import audit
from tests.support.kv_client import page_bytes_for
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults


def test_repeated_kill_9_under_load_loses_and_corrupts_nothing(tmp_path: Path) -> None:
    config = small_config(tmp_path / "node", files=1024, file_bytes=10 * 4 * 4096, dram_bytes=4096 * 4 * 4096)
    published: set[str] = set()
    for cycle in range(3):
        agent = start_agent(config, tmp_path)
        if published:  # what earlier cycles acknowledged survived this kill and restart
            lost, wrong = audit(config, sorted(published), lambda k: page_bytes_for(k, 4, 4096), what=f"cycle {cycle}")
            assert (lost, wrong) == (0, 0)
        logs = [tmp_path / f"c{cycle}-w{i}.log" for i in range(2)]
        writers = [client(config, log, 600, 100 * cycle + i) for i, log in enumerate(logs)]
        wait_until(lambda logs=logs: sum(len(read_log(x)[1]) for x in logs) >= 30, what="writers to publish")
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert [w.wait(30) for w in writers] == [3, 3]
        for log in logs:
            published |= read_log(log)[1]
    agent = start_agent(config, tmp_path)
    try:
        lost, wrong = audit(config, sorted(published), lambda k: page_bytes_for(k, 4, 4096), what="after 3 kills")
        assert (lost, wrong) == (0, 0)
    finally:
        stop_agent(agent)
