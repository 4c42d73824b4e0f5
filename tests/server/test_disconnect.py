"""until_disconnect: the request's work ends with the client, and with the handler that awaits it."""

import asyncio

import pytest

from pellucid.server.disconnect import ClientDisconnected, until_disconnect


class FakeClient:
    """Stands in for a Starlette Request: `receive()` returns HTTP messages until the client leaves."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}


class Work:
    """A request's work that records how it ended."""

    def __init__(self, seconds: float, result: object = None, error: Exception | None = None) -> None:
        self.seconds, self.result, self.error = seconds, result, error
        self.cancelled = False

    async def run(self) -> object:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error
        return self.result


def test_finished_work_returns_its_result():
    async def main():
        work = Work(0.01, result={"id": 7})
        assert await until_disconnect(FakeClient(), work.run()) == {"id": 7}
        assert not work.cancelled
    asyncio.run(main())


def test_failing_work_raises_its_own_error():
    async def main():
        with pytest.raises(ValueError, match="bad request"):
            await until_disconnect(FakeClient(), Work(0.01, error=ValueError("bad request")).run())
    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_work():
    async def main():
        client, work = FakeClient(), Work(60.0)
        asyncio.get_running_loop().call_later(0.02, client.left.set)
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(until_disconnect(client, work.run()), 5.0)
        assert work.cancelled
    asyncio.run(main())


def test_cancelling_the_handler_cancels_the_work():
    async def main():
        work = Work(60.0)
        handler = asyncio.ensure_future(until_disconnect(FakeClient(), work.run()))
        await asyncio.sleep(0.02)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0)   # the work's task runs its cancellation
        assert work.cancelled
        assert not [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    asyncio.run(main())
