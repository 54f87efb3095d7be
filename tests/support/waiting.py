"""Waiting for progress, never for a fixed time: CI machines are loaded and slow, so a test polls for
the evidence it needs (a counter, a published key, a log record) under a generous deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.05


def wait_until(check: Callable[[], T], *, what: str, timeout: float = 120.0, poll: float = POLL_S) -> T:
    """Call ``check`` until it returns something truthy, and return that; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(poll)


async def async_wait_until(
    check: Callable[[], Awaitable[T]], *, what: str, timeout: float = 120.0, poll: float = POLL_S
) -> T:
    """``wait_until`` for tests whose servers run on the test's own event loop (kmock)."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        await asyncio.sleep(poll)
