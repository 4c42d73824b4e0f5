"""How a frontend talks to the engine core, wherever the core runs: one interface, three homes.

- `InprocClient`: the core in the caller's own thread; `get_outputs()` runs a step. LLM's default (nothing
  to hand over, nothing to copy) and the one to debug with.
- `ThreadedClient`: the core in a background thread of the caller's process (AsyncLLM with
  engine_process=False, pipeline stages in one process): simple to debug, but the engine shares the GIL
  with the frontend. On CUDA the thread queues its work on a stream of its own, so several engines of
  one process (a pipeline's stages) run their kernels side by side instead of in one queue.
- `MPClient`: the core in its own process (core_proc.py), reached over ZMQ: the default of AsyncLLM and
  `pellucid serve`, and selectable for LLM. The frontend's per-token work and the engine's steps run
  on different interpreters.

The last two deliver outputs through a mailbox that a sync frontend blocks on and an asyncio frontend
awaits. An engine that dies is reported once, as an EngineCoreOutputs with `engine_error` set; every
later call raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from pellucid.config import EngineConfig
from pellucid.engine.core_launch import EngineLaunch, has_engine_process
from pellucid.engine.core_loop import EngineCoreLoop
from pellucid.engine.engine_core import EngineCore, EngineInfo, build_core
from pellucid.engine.messages import (EngineCoreOutputs, EngineCoreRequest, EngineStats, FinishRequests, Shutdown,
                                      UtilityCall, UtilityResult)
from pellucid.logger import get_logger
from pellucid.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = get_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (shut down, or it died); no request can be served."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message carries its original error."""


class EngineCoreClient(ABC):
    """What every frontend needs of the engine core."""

    info: EngineInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a checked request. An in-process core raises ValueError at once for a request it refuses;
        a core elsewhere reports it as a failed output instead."""

    @abstractmethod
    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        num_output_tokens: list[int] | None = None) -> None:
        """End requests in the engine (see messages.FinishRequests)."""

    @abstractmethod
    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next report of the engine (an empty one when it has nothing to do or `timeout` passed)."""

    async def get_outputs_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} serves synchronous frontends only")

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run one of EngineCore.UTILITIES in the engine and return its result."""

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._start_utility(method, args))

    def start_utility(self, method: str, *args: Any) -> "Future[Any]":
        """Send a utility call without waiting for it: its result (or error) arrives in the Future. A core
        stepped by its caller runs it at once."""
        future: Future[Any] = Future()
        try:
            future.set_result(self.call_utility(method, *args))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _start_utility(self, method: str, args: tuple[Any, ...]) -> "Future[Any]":
        raise NotImplementedError(f"{type(self).__name__} serves synchronous frontends only")

    @abstractmethod
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: requests in flight are aborted. Idempotent."""

    def wait_ready(self) -> EngineInfo:
        """Block until the engine can take requests and return its info (EngineStartupError if it could
        not start). A core built in this process is ready once its client exists."""
        return self.info

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone (None while it runs)."""
        return None

    def is_idle(self) -> bool:
        """True when the engine is known to hold no work (only a core stepped by its caller can say)."""
        return False

    def holds_work(self) -> bool:
        """True while a core stepped by its caller still holds requests or a launched step: its caller must
        keep stepping it. A core that runs by itself finishes its own work: False."""
        return False

    @property
    def core(self) -> EngineCore:
        """The EngineCore object, where it lives in this process (tests, debugging)."""
        raise RuntimeError(f"the engine core runs in another process ({type(self).__name__}); "
                           "start it with engine_process=False to reach its objects")


def make_client(config: EngineConfig, asynchronous: bool, wait: bool = True,
                launch: EngineLaunch | None = None) -> EngineCoreClient:
    """The client a frontend gets: `config.runner.engine_process` (None: a process for asyncio frontends,
    in-process for synchronous ones). With wait=False an engine process may still be starting: call
    `wait_ready()` before anything else. `launch` is the engine process `core_launch.launch_ahead(config,
    asynchronous)` started already; the client takes it over (or stops it, if the client cannot be made)."""
    try:
        return _make_client(config, asynchronous, wait, launch)
    except BaseException:
        if launch is not None:
            launch.abandon()
        raise


def _make_client(config: EngineConfig, asynchronous: bool, wait: bool, launch: EngineLaunch | None) -> EngineCoreClient:
    in_process = not has_engine_process(config, asynchronous)
    if launch is not None and (in_process or launch.config is not config):
        raise ValueError("the engine process launched ahead does not serve this client: it was started for another "
                         "configuration, or this configuration's core runs in this process")
    if config.parallel.tensor_parallel_size > 1:
        config.parallel.validate()
        from pellucid.distributed.driver import executor_backend
        if executor_backend(config) == "env" and int(os.environ.get("RANK", "0")) != 0:
            # torchrun started this process as another rank: it serves rank 0's engine and exits with it.
            from pellucid.distributed.worker import serve_launched_rank
            serve_launched_rank(config)
        if config.runner.engine_process is False:
            raise ValueError("with tensor_parallel_size > 1 the engine core runs in its own process (rank 0 of the "
                             "tensor-parallel group); engine_process=False is not supported")
    if not in_process:
        from pellucid.engine.core_proc import MPClient
        client = MPClient(launch or EngineLaunch(config))
        if wait:
            client.wait_ready()
        return client
    return ThreadedClient(config) if asynchronous else InprocClient(config)


def start_engine(config: EngineConfig, asynchronous: bool,
                 launch: EngineLaunch | None = None) -> tuple[EngineCoreClient, PreTrainedTokenizerBase]:
    """A frontend's ready client and its tokenizer. The tokenizer loads (and transformers imports: seconds
    on some machines) while an engine process starts; `launch` as make_client's."""
    client = make_client(config, asynchronous, wait=False, launch=launch)
    try:
        try:
            tokenizer = load_tokenizer(config.model.tokenizer_dir)
        except Exception:
            client.wait_ready()     # an engine that cannot start says so before the tokenizer does
            raise
        client.wait_ready()
    except BaseException:           # Ctrl-C included: an engine still starting stops at once
        client.shutdown(timeout=5.0)
        raise
    return client, tokenizer


class InprocClient(EngineCoreClient):
    """The core in the caller's thread: each get_outputs() is one engine step."""

    def __init__(self, config: EngineConfig) -> None:
        self._core = build_core(config)
        self.info = self._core.info()

    @property
    def core(self) -> EngineCore:
        return self._core

    def add_request(self, request: EngineCoreRequest) -> None:
        self._core.add_request(request)

    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        num_output_tokens: list[int] | None = None) -> None:
        self._core.finish_requests(request_ids, reason, num_output_tokens)

    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs:
        core = self._core
        if not core.has_unfinished_requests():
            if not core.has_deferred_outputs():
                return EngineCoreOutputs()
            core.wait_deferred(timeout)     # only finished work off the step loop is left: wait for it
        return core.step()

    def is_idle(self) -> bool:
        return not self.holds_work()

    def holds_work(self) -> bool:
        return self._core.has_unfinished_requests() or self._core.has_deferred_outputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._core.utility(method)(*args)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._core.abort_all()


class OutputMailbox:
    """Engine reports handed from the thread that receives them to the frontend: a synchronous frontend
    blocks in get(); an asyncio frontend awaits get_async() on whichever event loop runs it now.

    A report comes in a one-item list that put() empties, and the sending thread holds it nowhere else:
    once the frontend has taken a report, that thread (however late it runs on) keeps no reference to it,
    so the frontend's final outputs are the only owners of what they carry (saves die with them)."""

    def __init__(self) -> None:
        self._items: deque[EngineCoreOutputs] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def put(self, report: list[EngineCoreOutputs]) -> None:
        with self._cond:
            self._items.append(report.pop())
            self._cond.notify()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass        # that loop is closed; the next get_async() binds the new one

    def get(self, timeout: float | None = None) -> EngineCoreOutputs:
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                return EngineCoreOutputs()
            return self._items.popleft()

    async def get_async(self) -> EngineCoreOutputs:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._loop is not loop or self._event is None:
                    self._loop, self._event = loop, asyncio.Event()
                event = self._event
                event.clear()
            await event.wait()


class BackgroundClient(EngineCoreClient):
    """A core that runs by itself (thread or process): inputs are sent, reports arrive in a mailbox."""

    def __init__(self) -> None:
        self._mailbox = OutputMailbox()
        # The newest stats the engine sent, kept by the receiving thread: readable whether or not a
        # frontend is taking outputs right now.
        self.latest_stats: EngineStats | None = None
        self._utility_ids = itertools.count(1)
        self._utilities: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closing = False

    @abstractmethod
    def _send(self, message: Any) -> None:
        """Hand one input to the engine."""

    # ---- inputs ----
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._send(request)

    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        num_output_tokens: list[int] | None = None) -> None:
        if self._dead is None and not self._closing and request_ids:
            self._send(FinishRequests(list(request_ids), reason, num_output_tokens))

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._start_utility(method, args).result()

    def start_utility(self, method: str, *args: Any) -> "Future[Any]":
        return self._start_utility(method, args)

    def _start_utility(self, method: str, args: tuple[Any, ...]) -> "Future[Any]":
        self._check_alive()
        future: Future[Any] = Future()
        call_id = next(self._utility_ids)
        with self._lock:
            self._utilities[call_id] = future
        self._send(UtilityCall(call_id, method, list(args)))
        return future

    # ---- outputs ----
    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self._mailbox.get(timeout)

    async def get_outputs_async(self) -> EngineCoreOutputs:
        return await self._mailbox.get_async()

    def _receive(self, report: list[EngineCoreOutputs]) -> None:
        """A report from the engine (any thread), in a one-item list that this empties: utility results
        resolve their calls, the rest is mailed."""
        outputs = report[0]
        if outputs.stats is not None:
            self.latest_stats = outputs.stats
        if outputs.utility_results:
            for result in outputs.utility_results:
                self._resolve(result)
            outputs.utility_results = None
        error = outputs.engine_error
        del outputs         # the mailbox takes the only reference this thread has
        if error is not None:
            report.clear()
            self._declare_dead(error)
            return
        self._mailbox.put(report)

    def _resolve(self, result: UtilityResult) -> None:
        with self._lock:
            future = self._utilities.pop(result.call_id, None)
        if future is None:
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    def _declare_dead(self, reason: str) -> None:
        """The engine is gone: say so once, to the mailbox and to every utility call waiting."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            waiting, self._utilities = self._utilities, {}
        if not self._closing:
            logger.error("the engine core died: %s", reason)
        for future in waiting.values():
            future.set_exception(EngineDeadError(f"the engine core died: {reason}"))
        self._mailbox.put([EngineCoreOutputs(engine_error=reason)])

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is not running: {self._dead}")
        if self._closing:
            raise EngineDeadError("the engine is shutting down")


class ThreadedClient(BackgroundClient):
    """The core in a background thread of this process: no copies, one GIL."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        if config.scheduler.async_scheduling is None:
            # Stepping ahead keeps the engine thread busy on the host for the whole step, so it seldom
            # releases the GIL that the frontend's thread needs to stream tokens out. Measured through the
            # server on an H100 (Qwen3-0.6B shape, 300 streamed requests at once): serial steps gave 5,783
            # output tok/s, stepping ahead 4,429. Asking for async_scheduling=True still turns it on.
            config.scheduler.async_scheduling = False
        self._core = build_core(config)
        self.info = self._core.info()
        self.latest_stats = self._core.stats()
        self._inputs: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pellucid-engine-core", daemon=True)
        self._thread.start()

    @property
    def core(self) -> EngineCore:
        return self._core

    def _send(self, message: Any) -> None:
        self._inputs.put(message)

    def _run(self) -> None:
        try:
            with self._own_stream():
                EngineCoreLoop(self._core, self._inputs, self._receive).run()
        except BaseException as exc:  # an engine-loop bug must not leave readers hanging
            logger.exception("the engine loop crashed")
            self._declare_dead(f"the engine loop crashed: {type(exc).__name__}: {exc}")
            return
        self._declare_dead("the engine was shut down")

    def _own_stream(self) -> contextlib.AbstractContextManager:
        """This thread's current CUDA stream: a new one on a CUDA engine. The runner queues everything on the
        current stream and synchronizes on events, so its steps stay ordered; what another engine of this
        process queues no longer waits behind them. (Chunks between pipeline stages go through host memory,
        so no device tensor is shared between the streams.)"""
        device = self._core.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.synchronize(device)      # the core's start-up work, queued on the builder's stream, is done
        return torch.cuda.stream(torch.cuda.Stream(device))

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._inputs.put(Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine loop did not stop within %.0f s", timeout)
