"""AsyncLLM: the engine for asyncio code, with the engine core in its own process by default.

AsyncLLM is a frontend: `add_request` tokenizes and checks a request on the caller's event loop (a bad
one raises ValueError before anything reaches the engine), sends it to the engine core, and returns a
stream. One output-handler task per event loop takes the engine's reports, does the per-token work
(detokenization, stop strings, logprobs text) and feeds each request's stream. The engine core runs
in its own process (engine_process=True, the default here), or in a thread of this process
(engine_process=False: one interpreter, simpler to debug, but the engine's steps compete with the
event loop for the GIL).

AsyncLLM serves one event loop at a time; a later `asyncio.run` may use it again.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any, Callable

import pellucid
from pellucid.config import EngineConfig
from pellucid.engine.core_client import EngineCoreClient, EngineDeadError, start_engine
from pellucid.engine.core_launch import EngineLaunch
from pellucid.engine.engine_core import EngineCore, EngineInfo
from pellucid.engine.input_processor import InputProcessor, send
from pellucid.engine.messages import EngineCoreOutputs, EngineStats
from pellucid.engine.output_processor import OutputProcessor
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.sampling_params import SamplingParams

logger = get_logger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError", "RequestStream"]


class RequestFailedError(RuntimeError):
    """A request ended with an error inside the engine (the engine keeps serving the others)."""

    def __init__(self, request_id: str, message: str, bad_request: bool = False) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.message = message
        self.bad_request = bad_request      # the request's own parameters made it fail (a client error)


class RequestStream:
    """Outputs of one request, read on the event loop that added it.

    Iterating yields outputs until the finished one; a failed request raises `RequestFailedError`.
    Cancelling the reader, or calling `cancel()` before the request finished, aborts the request through
    its owner (AsyncLLM, or AsyncOmni in every stage). With `skip_to_newest` (AsyncLLM's cumulative
    outputs) a slow reader gets only the newest output; without it (AsyncOmni's, each carrying audio of
    its own) every output.
    """

    def __init__(self, request_id: str, owner: Any, skip_to_newest: bool = True) -> None:
        self.request_id = request_id
        self._owner = owner            # anything with abort(request_id)
        self._skip_to_newest = skip_to_newest
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    @property
    def finished(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        # Cumulative outputs: a slow reader may skip straight to the newest one.
        while (self._skip_to_newest and not isinstance(item, BaseException) and not item.finished
               and not self._queue.empty()):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item


class AsyncLLM:
    """`async for out in llm.generate(prompt, params)`: many concurrent requests, one scheduler.

    `AsyncLLM(model=DIR, **engine_kwargs)` takes the same arguments as `LLM`; no model (or "default")
    means the embedded default model.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is None or model == "default":
            from pellucid.default_model import ensure_default_model
            model = ensure_default_model()
        self._start(EngineConfig.from_kwargs(model, **engine_kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, launch: EngineLaunch | None = None) -> "AsyncLLM":
        """`launch`: the engine process `core_launch.launch_ahead(config, asynchronous=True)` started before
        this frontend imported the rest (`pellucid serve` does)."""
        llm = cls.__new__(cls)
        llm._start(config, launch)
        return llm

    def _start(self, config: EngineConfig, launch: EngineLaunch | None = None) -> None:
        self.config = config
        self._client: EngineCoreClient
        self._client, self.tokenizer = start_engine(config, asynchronous=True, launch=launch)
        self.info: EngineInfo = self._client.info
        self.max_model_len: int = self.info.max_model_len
        self.model_name: str = self.info.model_name
        self._inputs = InputProcessor(self.tokenizer, self.info)
        self._outputs = OutputProcessor(self.tokenizer, self.info.eos_token_ids)
        self._streams: dict[str, RequestStream] = {}
        self._handler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._stopping = False
        self._dead: str | None = None
        self._on_dead: list[Callable[[str], None]] = []

    # ---- public API ----

    def engine_info(self) -> dict[str, Any]:
        """Facts about the loaded engine for the startup banner (fixed after construction)."""
        info = self.info
        return {"version": pellucid.__version__, "dtype": info.dtype, "device": info.device,
                "num_blocks": info.num_blocks, "block_size": info.block_size, "features": info.features(),
                "engine_pid": info.pid}

    @property
    def engine(self) -> EngineCore:
        """The EngineCore object, when it runs in this process (engine_process=False)."""
        return self._client.core

    @property
    def is_running(self) -> bool:
        return not self._stopping and self._dead is None and self._client.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone, once it is."""
        return self._dead or self._client.dead_reason

    def on_engine_dead(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` on the event loop once the engine dies (not on a requested shutdown)."""
        self._on_dead.append(callback)

    def get_stats(self) -> EngineStats:
        """The engine's stats as of its last report."""
        return self._client.latest_stats or EngineStats(num_total_blocks=self.info.num_blocks)

    async def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: str | None = None, extras: dict[str, Any] | None = None) -> RequestStream:
        """Check and queue a request; raises ValueError (bad input) before anything is sent."""
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        processed = self._inputs.process(request_id, prompt, sampling_params, extras, stream=True)
        self._ensure_handler()
        stream = RequestStream(request_id, self)
        self._outputs.add(request_id, processed.prompt, processed.prompt_token_ids, processed.params,
                          processed.child_ids, stream=True, feature_keys=processed.feature_keys)
        self._streams[request_id] = stream
        try:
            send(self._client, processed)
        except BaseException:
            self._streams.pop(request_id, None)
            self._outputs.forget(request_id)
            raise
        return stream

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None,
                       extras: dict[str, Any] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as they arrive; leaving early (break, cancel, disconnect) aborts."""
        stream = await self.add_request(prompt, sampling_params, request_id, extras)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Abort a request; from the event loop, or from any thread while a loop serves this engine."""
        self._on_loop(self._abort, request_id)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run one of the engine core's utilities (EngineCore.utility): "reset_prefix_cache", or a request
        feature's "<key>.<name>"."""
        self._check_alive()
        return await self._client.call_utility_async(method, *args)

    def call_utility_blocking(self, method: str, *args: Any) -> Any:
        """call_utility for a thread other than the event loop's (it waits for the engine's answer)."""
        self._check_alive()
        return self._client.call_utility(method, *args)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: requests in flight are aborted and their readers get EngineDeadError."""
        if self._stopping:
            return
        self._stopping = True
        self._on_loop(self._fail_all, "the engine was shut down")
        self._client.shutdown(timeout)

    # ---- internals ----

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` where the frontend's state lives: on the serving event loop's thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and threading.get_ident() != self._loop_thread_id:
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _check_alive(self) -> None:
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(f"the engine core is not running: {reason}")

    def _abort(self, request_id: str) -> None:
        children = self._outputs.child_ids(request_id)
        if not children:
            return
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            # Nobody reads it any more: forget it now; the engine's final report for it is dropped.
            self._streams.pop(request_id, None)
            self._outputs.forget(request_id)
        if self.is_running:
            self._client.finish_requests(children)

    def _ensure_handler(self) -> None:
        """One output-handler task on the running loop (a new loop, e.g. a later asyncio.run, gets its own)."""
        loop = asyncio.get_running_loop()
        if self._handler is not None and self._loop is loop and not self._handler.done():
            return
        self._loop = loop
        self._loop_thread_id = threading.get_ident()
        self._handler = loop.create_task(self._handle_outputs(), name="pellucid-output-handler")

    async def _handle_outputs(self) -> None:
        client = self._client
        try:
            while True:
                outputs = await client.get_outputs_async()
                if outputs.engine_error is not None:
                    self._engine_died(outputs.engine_error)
                    return
                self._deliver(outputs)
                # Not kept while waiting for the next report: the final outputs must be the only owners
                # of what they carry (saves).
                del outputs
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled, or its loop is gone (a finished asyncio.run closes the task when it is collected,
            # maybe while a later loop's handler serves): not a failure of the requests in flight.
            raise
        except BaseException as exc:  # a frontend bug must not leave readers hanging
            logger.exception("the output handler crashed")
            self._fail_all(f"the output handler crashed: {exc!r}")

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        if not outputs.outputs:
            return
        results, stops = self._outputs.process(outputs.outputs)
        if stops:
            self._client.finish_requests([s.child_id for s in stops], "stop", [s.num_output_tokens for s in stops])
        streams = self._streams
        for output in results:
            stream = streams.get(output.request_id)
            if stream is None:
                continue            # aborted by its reader; nobody listens
            if output.finished:
                del streams[output.request_id]
            if output.error is not None:
                stream.put(RequestFailedError(output.request_id, output.error, output.bad_request))
            else:
                stream.put(output)

    def _engine_died(self, reason: str) -> None:
        if self._stopping:
            return
        self._dead = reason
        self._fail_all(f"the engine core died: {reason}")
        for callback in self._on_dead:
            try:
                callback(reason)
            except Exception:
                logger.exception("an engine-death callback failed")

    def _fail_all(self, reason: str) -> None:
        """End every request in flight: its reader gets EngineDeadError."""
        streams, self._streams = self._streams, {}
        self._outputs.fail_all(reason)
        for stream in streams.values():
            stream.put(EngineDeadError(reason))
