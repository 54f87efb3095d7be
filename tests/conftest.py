"""Fixtures shared by the whole suite; helpers live in ``tests/support`` (import them from there)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flatcake.node_agent import Engine
from flatcake.node_agent.datapath.io_backends import IOBackend
from tests.support.agents import AgentThread
from tests.support.engines import small_config


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(backend: IOBackend | None = None, sub: str = "", **kw: Any) -> Engine:
        engine = Engine(small_config(tmp_path / sub if sub else tmp_path, **kw), io=backend)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def agent_thread(tmp_path: Path) -> Iterator[Callable[..., AgentThread]]:
    made: list[AgentThread] = []

    def start(sub: str = "node", **kw: Any) -> AgentThread:
        a = AgentThread(small_config(tmp_path / sub, **kw))
        made.append(a)
        return a

    yield start
    for a in made:
        a.stop()


TIERS = ("unit", "integration", "system", "faults")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test has exactly one tier marker, so `-m unit` and friends select every test once."""
    wrong = [
        f"{item.nodeid}: {tiers or 'none'}"
        for item in items
        if len(tiers := [m.name for m in item.iter_markers() if m.name in TIERS]) != 1
    ]
    if wrong:
        raise pytest.UsageError(
            "tests need exactly one tier marker (unit, integration, system, faults):\n" + "\n".join(wrong)
        )
