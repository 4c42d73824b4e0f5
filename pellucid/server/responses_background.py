"""Background responses (`"background": true` on `POST /v1/responses`): the response runs in a task of its own, so
the client may drop its connection, poll the stored response (`GET /v1/responses/{id}`), read its events again
from any point (`GET /v1/responses/{id}?stream=true&starting_after=N`), or cancel it
(`POST /v1/responses/{id}/cancel`). Its events are kept in an `EventLog` beside the stored response.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class EventLog:
    """A response's SSE events in order (event i has sequence number i), read by any number of followers."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events with sequence numbers above `after`, then each new one as it comes, until the response ends."""
        index = after + 1
        while True:
            changed = self._changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            await changed.wait()


@dataclass
class BackgroundRun:
    """A background response still running: its task, its events, and what stopping it must end."""
    task: asyncio.Task[Any]
    log: EventLog
    run: Any                                             # the response (responses_route._Run)
    streams: list[Any] = field(default_factory=list)     # its engine requests (pellucid.engine.async_llm.RequestStream)
