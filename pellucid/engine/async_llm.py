"""AsyncLLM: the engine core driven by one background thread, streamed to asyncio consumers.

The engine core is not thread-safe, so only the loop thread touches it. Other threads hand over
adds and aborts through a command list guarded by a condition; the loop drains it before every
step and sleeps on the condition when there is nothing to do. Outputs travel back to each
request's asyncio queue through `loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pellucid
from pellucid.config import EngineConfig
from pellucid.engine.engine_core import EngineCore, EngineStats
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.sampling_params import SamplingParams

logger = get_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or it crashed); no request can be served."""


class RequestFailedError(RuntimeError):
    """A request ended with an error inside the engine (the engine keeps serving the others)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.message = message


class RequestStream:
    """Cumulative outputs of one request, fed by the engine thread, read on the asyncio loop that added it.

    Iterating yields `RequestOutput`s until the finished one; a failed request raises
    `RequestFailedError`. Cancelling the reader, or calling `cancel()` before the request finished,
    aborts the request in the engine.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, async_llm: "AsyncLLM") -> None:
        self.request_id = request_id
        self._loop = loop
        self._async_llm = async_llm
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done = False

    # Engine-thread side.
    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The consumer's event loop is closed: nobody is left to read this request.
            pass

    # Consumer side.
    @property
    def finished(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._done:
            self._done = True
            self._async_llm.abort(self.request_id)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        # Outputs are cumulative: a slow reader may skip straight to the newest one.
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    extras: dict[str, Any] | None
    stream: RequestStream
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str
    step_asked: int         # engine steps run when abort() was called


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
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        if config.scheduler.async_scheduling is None:
            # Stepping ahead keeps the loop thread busy on the host for the whole step, so it seldom
            # releases the GIL that the asyncio thread needs to stream tokens out. Measured through
            # `pellucid serve` on an H100 (Qwen3-0.6B shape, 300 streamed requests at once): serial steps
            # gave 5,783 output tok/s, stepping ahead 4,429. Asking for async_scheduling=True still turns it on.
            config.scheduler.async_scheduling = False
        self._core = EngineCore(config)
        # The HTTP side tokenizes on its own copy: the core's tokenizer belongs to the loop thread.
        self.tokenizer = copy.deepcopy(self._core.tokenizer)
        self.hf_config = self._core.hf_config
        self.max_model_len: int = self._core.max_model_len
        self.model_name: str = self._core.model_name
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._dead: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}      # loop thread only
        self.num_steps = 0
        self.num_step_failures = 0
        self.num_aborted = 0
        self.max_abort_lag_steps = 0   # most engine steps between abort() and its effect
        self._stats = self._core.stats()
        self._thread = threading.Thread(target=self._run, name="pellucid-engine-loop", daemon=True)
        self._thread.start()

    # ---- public API (any thread / the asyncio loop) ----

    def engine_info(self) -> dict[str, Any]:
        """Facts about the loaded engine for the startup banner (fixed after construction)."""
        core, config = self._core, self.config
        cuda_graphs = core.device.type == "cuda" and not config.runner.enforce_eager
        return {
            "version": pellucid.__version__,
            "dtype": str(core.dtype).removeprefix("torch."),
            "device": str(core.device),
            "num_blocks": core.num_blocks,
            "block_size": config.cache.block_size,
            "features": {
                "prefix_caching": config.cache.enable_prefix_caching,
                "chunked_prefill": config.scheduler.enable_chunked_prefill,
                "max_num_seqs": config.scheduler.max_num_seqs,
                "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                "attention_backend": config.runner.attention_backend,
                "cuda_graphs": cuda_graphs,
                "lm_head": core.runner.head.describe(),
            },
        }

    # ---- tracing accessor (begin) ----
    @property
    def model(self) -> Any:
        """The loaded model's module tree, for naming trace sites (`async_trace` checks paths on it).
        The engine thread runs it: read its structure, never call it from another thread."""
        return self._core.model
    # ---- tracing accessor (end) ----

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    def get_stats(self) -> EngineStats:
        """The engine's `EngineStats` as of the last step (snapshotted by the loop thread)."""
        return self._stats

    async def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: str | None = None, extras: dict[str, Any] | None = None) -> RequestStream:
        """Validate and queue a request; raises ValueError (bad input) before returning its stream."""
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self)
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, sampling_params, extras, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
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
        """Abort a request from any thread; applied before the next engine step."""
        with self._cond:
            if self._stopping:
                return
            self._commands.append(_Abort(request_id, self.num_steps))
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: requests in flight are aborted (blocks freed) and their readers get EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine loop did not stop within %.0f s", timeout)

    # ---- internals ----

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # an engine-loop bug must not leave readers hanging
            logger.exception("engine loop crashed")
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine loop crashed: {exc!r}"))

    def _loop_forever(self) -> None:
        core = self._core
        while True:
            busy = core.has_unfinished_requests()
            with self._cond:
                while not busy and not self._commands and not self._stopping:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            if stopping:
                for command in commands:
                    if isinstance(command, _Add):
                        _resolve(command.accepted, EngineDeadError("the engine is shutting down"))
                self._fail_all(EngineDeadError("the engine was shut down"))
                self._stats = core.stats()
                return
            for command in commands:
                self._apply(command)
            if core.has_unfinished_requests():
                self._step()
            else:
                self._stats = core.stats()

    def _apply(self, command: _Add | _Abort) -> None:
        core = self._core
        if isinstance(command, _Abort):
            stream = self._streams.get(command.request_id)
            if stream is not None:
                core.abort_request(command.request_id)
                self.num_aborted += 1
                self.max_abort_lag_steps = max(self.max_abort_lag_steps, self.num_steps - command.step_asked)
                # A reader still listening (abort() called by someone else) gets the core's final
                # output with finish_reason "abort"; a reader that left needs nothing more.
                if stream.finished:
                    del self._streams[command.request_id]
            return
        if command.accepted.cancelled():
            return
        try:
            if command.request_id in self._streams:
                raise ValueError(f"request id {command.request_id!r} is already in flight")
            core.add_request(command.request_id, command.prompt, command.params, command.extras)
        except Exception as exc:
            _resolve(command.accepted, exc)
            return
        self._streams[command.request_id] = command.stream
        _resolve(command.accepted, None)

    def _step(self) -> None:
        try:
            outputs = self._core.step()
        except Exception as exc:
            self.num_step_failures += 1
            logger.exception("engine step failed; failing the requests in flight and serving on")
            self._fail_all(RequestFailedError("(in flight)", f"engine step failed: {exc!r}"), per_request=True)
            return
        self.num_steps += 1
        # Snapshot before delivering, so a reader that saw its final output also sees its blocks freed.
        self._stats = self._core.stats()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue            # aborted by its reader; nobody listens
            if output.finished:
                del self._streams[output.request_id]
            if output.error is not None:
                stream.put(RequestFailedError(output.request_id, output.error))
            else:
                stream.put(output)

    def _fail_all(self, error: BaseException, per_request: bool = False) -> None:
        """End every request in flight: abort it in the core (freeing its blocks) and tell its reader."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self._core.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            if per_request and isinstance(error, RequestFailedError):
                stream.put(RequestFailedError(request_id, error.message))
            else:
                stream.put(error)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Complete an asyncio future from the engine thread (no-op if its reader gave up)."""
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass
