"""Serving a server process until SIGTERM, and draining it before it stops listening.

uvicorn alone stops listening at the first SIGTERM (new clients get "connection refused") and after its graceful
limit cancels what still runs (those clients get a bare 500). :class:`DrainingServer` puts the drain first: the
first SIGTERM / SIGINT starts the app's :class:`~serving.guard.Drain` (new requests get 503 with ``Retry-After``,
``/health`` says draining, so a coordinator or load balancer moves traffic away) while the listener stays open;
when nothing runs any more or the grace is over, what still runs is ended with a clear error and uvicorn exits.
A second signal exits at once.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import uvicorn

from serving.guard import Drain


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown begins with the app's drain.

    Args:
        config: uvicorn's config.
        drain: The app's drain (shared with its :class:`~serving.guard.Guard`).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain. Second: exit now."""
        if self.drain.draining:
            self.should_exit = self.force_exit = True
        else:
            self.drain.begin()

    def begin_drain(self) -> None:
        """What SIGTERM does (for callers without signals: tests, threads)."""
        self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick, plus: once the drain is done, end what still runs and exit."""
        if self.drain.draining and not self.should_exit and self.drain.done():
            await self.drain.finish()
            self.should_exit = True
        return await super().on_tick(counter)


def serve_forever(app: Any, drain: Drain, host: str, port: int) -> None:
    """Serve ``app`` until SIGTERM / SIGINT, draining first (see the module docstring)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=max(int(drain.grace_s), 1) + 5)
    DrainingServer(config, drain).run()  # uvicorn routes SIGTERM / SIGINT to handle_exit
