"""The emulator orders requests as its node agent's ``scheduler.policy`` says, unless one is chosen."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from flatcake.cli import build_parser
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import Emulator, scheduler_policy
from flatcake.node_agent import SchedulerConfig
from tests.support.agents import AgentThread

pytestmark = pytest.mark.integration


def _policy(tmp_path: Path, socket: str | None, scheduler: str | None = None) -> str:
    cfg = EmulatorConfig(mode="flatcake", data_dir=str(tmp_path / "emulator"), agent_socket=socket,
                         page_tokens=64, bytes_per_token_layer=64,  # the agent's 4 KiB pages of 4 layers
                         dram_bytes=4 << 20, ssd_bytes=32 << 20, scope_file_bytes=4 << 20,
                         scheduler=scheduler)  # fmt: skip
    emulator = Emulator(cfg)
    try:
        return emulator.sched.policy
    finally:
        asyncio.run(emulator.stop())


def test_the_agents_policy_is_used_unless_one_is_chosen(
    agent_thread: Callable[..., AgentThread], tmp_path: Path
) -> None:
    agent = agent_thread(scheduler=SchedulerConfig(policy="fcfs"))
    assert _policy(tmp_path, agent.socket) == "fcfs"  # handed over at registration
    assert _policy(tmp_path, agent.socket, "mas") == "mas"  # an explicit choice wins
    assert _policy(tmp_path, None) == "mas"  # an in-process engine: no agent to ask


def test_the_choice_is_checked_and_left_open_by_default() -> None:
    assert build_parser().parse_args(["emulate"]).scheduler is None  # so the agent's policy applies
    assert build_parser().parse_args(["emulate", "--scheduler", "fcfs"]).scheduler == "fcfs"
    with pytest.raises(ValueError, match="scheduler: 'lifo' must be one of mas, fcfs"):
        EmulatorConfig(scheduler="lifo")
    assert scheduler_policy(EmulatorConfig(mode="tiered", scheduler="mas"), None) == "fcfs"  # as SGLang schedules
