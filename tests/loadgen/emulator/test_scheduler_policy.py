"""Request ordering is a benchmark setting (issue 30 item 7): the emulator orders FlatCake's requests
as ``--scheduler`` says (FC-MAS by default), whatever agent it uses; a real server's requests are
ordered by the server's own scheduler, so the agent's configuration has no such field, and an agent
given a configuration rendered before that still starts."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from flatcake.cli import build_parser
from flatcake.errors import ConfigError
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import Emulator, scheduler_policy
from flatcake.node_agent.config import EngineConfig
from tests.support.agents import AgentThread
from tests.support.engines import small_config

pytestmark = pytest.mark.integration


def _policy(tmp_path: Path, socket: str | None, scheduler: str | None = None) -> str:
    cfg = EmulatorConfig(mode="flatcake-native", data_dir=str(tmp_path / "emulator"), agent_socket=socket,
                         page_tokens=64, bytes_per_token_layer=64,  # the agent's 4 KiB pages of 4 layers
                         dram_bytes=4 << 20, ssd_bytes=32 << 20, scope_file_bytes=4 << 20,
                         scheduler=scheduler)  # fmt: skip
    emulator = Emulator(cfg)
    try:
        return emulator.sched.policy
    finally:
        asyncio.run(emulator.stop())


def test_the_emulators_choice_orders_requests_with_or_without_an_agent(
    agent_thread: Callable[..., AgentThread], tmp_path: Path
) -> None:
    agent = agent_thread()
    assert _policy(tmp_path, agent.socket) == "mas"
    assert _policy(tmp_path, agent.socket, "fcfs") == "fcfs"
    assert _policy(tmp_path, None, "fcfs") == "fcfs"


def test_the_choice_is_checked_and_tiered_modes_schedule_as_sglang() -> None:
    assert build_parser().parse_args(["emulate"]).scheduler is None  # FC-MAS
    assert build_parser().parse_args(["emulate", "--scheduler", "fcfs"]).scheduler == "fcfs"
    with pytest.raises(ValueError, match="scheduler: 'lifo' must be one of mas, fcfs"):
        EmulatorConfig(scheduler="lifo")
    assert scheduler_policy(EmulatorConfig(mode="tiered", scheduler="mas")) == "fcfs"  # as SGLang schedules


def test_a_configuration_rendered_with_the_retired_scheduler_field_still_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = {**small_config(tmp_path).to_dict(), "scheduler": {"policy": "fcfs"}}
    assert "scheduler" not in small_config(tmp_path).to_dict()
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="flatcake.node_agent.config"):
        config = EngineConfig.load(path)
    assert config == EngineConfig.from_dict({k: v for k, v in data.items() if k != "scheduler"})
    assert "scheduler is no longer a configuration field" in caplog.text
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['schedular'\]"):  # other unknown names still fail
        EngineConfig.from_dict({**data, "schedular": {}})
