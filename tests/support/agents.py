"""A real node agent serving its socket from a thread of the test process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from flatcake.node_agent import EngineConfig
from flatcake.node_agent.service.server import Agent
from tests.support.waiting import wait_until


class AgentThread:
    """A real agent serving its socket from a thread of the test process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.agent = Agent(config)
        self.port = self.agent.start_http()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self.agent.serve(self._stop),))
        self._thread.start()
        wait_until(lambda: self.agent.ready, what="the agent to become ready")

    @property
    def socket(self) -> str:
        return self.config.agent.socket

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()
        self.agent.close()


def agent_stats(socket_path: str) -> dict[str, Any]:
    """The agent's ``stats`` (a registered connection of its own; the agent refuses unregistered ones)."""
    from flatcake.node_agent.service.client import AgentConnection

    conn = AgentConnection(socket_path)
    try:
        conn.call("register")
        answer: dict[str, Any] = conn.call("stats")
        return answer
    finally:
        conn.close()
