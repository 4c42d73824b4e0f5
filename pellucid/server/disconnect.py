"""A client that leaves mid-request: its work is cancelled, which aborts its requests in the engine (a streamed
response's generator is closed when its connection breaks: EventStream)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its requests) if the client disconnects.

    Cancelling the caller cancels `work` too, so a handler stopped by the server (shutdown, a timeout) does not
    leave its requests running."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


class EventStream(StreamingResponse):
    """SSE response that always closes its body generator, so a broken connection aborts the request."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
