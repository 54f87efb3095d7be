"""The inference-server emulator served on a loopback port from a background thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class Server:
    """The emulator app served on a loopback port from a background thread."""

    def __init__(self, cfg: Any) -> None:
        from flatcake.loadgen.emulator.server import make_app

        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(make_app(cfg))
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
