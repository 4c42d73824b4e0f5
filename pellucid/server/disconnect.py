"""A client that leaves mid-request: its work is cancelled, which aborts its requests in the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import Request


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
