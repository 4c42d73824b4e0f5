"""The engine core in its own process, and the client that talks to it over ZMQ (core_launch.py starts it).

The process is a fresh interpreter (`python -m pellucid.engine.core_proc`), not a fork or a
multiprocessing spawn: it never re-imports the frontend's main module and starts the same way under a
script, a notebook or the server. Its stdin is a pipe from the frontend: the start-up settings come
first, and end-of-file afterwards means the frontend is gone, whatever killed it (SIGKILL included),
so the engine exits at once and never outlives it.

Two ZMQ sockets on private ipc paths carry the traffic: frontend -> engine (requests, aborts, utility
calls) and engine -> frontend (step outputs, utility results). In the engine process one thread reads
and decodes the inputs, one encodes and sends the outputs, and the main thread runs the busy loop
(core_loop.py), so sockets and serialization overlap the steps. Messages are msgpack with tensors as
side frames (serial.py).
"""
from __future__ import annotations

import atexit
import gc
import pickle
import queue
import signal
import sys
import threading
import traceback
import weakref
from typing import Any

import msgspec
import torch
import zmq

from pellucid.engine.core_client import BackgroundClient, EngineStartupError
from pellucid.engine.core_launch import EngineLaunch, StartupSettings
from pellucid.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineInput, EngineStats, Shutdown
from pellucid.engine.serial import MessageDecoder, MessageEncoder
from pellucid.logger import get_logger
from pellucid.child_process import describe_exit, exit_now, exit_when_parent_is_gone, read_settings

logger = get_logger(__name__)

_POLL_MS = 200


class _Startup(msgspec.Struct):
    """The engine's first message: its info (a pickled EngineInfo), or why it could not start."""

    info: bytes = b""
    stats: EngineStats | None = None
    error: str | None = None


# ---- the engine process ---------------------------------------------------------------------------
def main() -> None:
    settings: StartupSettings | None = read_settings(sys.stdin.buffer)
    if settings is None:
        return      # the frontend gave this launch up before sending its settings (core_launch.EngineLaunch)
    get_logger().setLevel(settings.log_level)
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    _exit_when_frontend_is_gone(sys.stdin.buffer)
    # Ctrl-C in a terminal reaches the whole process group: the frontend decides what happens then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(settings.output_address)
    inputs = context.socket(zmq.PULL)
    inputs.connect(settings.input_address)
    encoder = MessageEncoder()
    try:
        from pellucid.engine.engine_core import build_core
        core = build_core(settings.config)
        info = core.info(probe_sites=True)
    except BaseException as exc:
        logger.error("the engine core could not start:\n%s", traceback.format_exc())
        outputs.send_multipart(encoder.encode(_Startup(error=f"{type(exc).__name__}: {exc}")))
        _exit(context, [inputs, outputs], 1)
    outputs.send_multipart(encoder.encode(_Startup(info=pickle.dumps(info), stats=core.stats())), copy=False)
    freeze_startup_heap()
    code = _serve(core, inputs, outputs, stop, context)
    core.shutdown()
    _exit(context, [inputs, outputs], code)


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (model, tokenizer tables, caches) out of the cyclic garbage
    collector's view: a serving process allocates many short-lived objects per step, and each full
    collection would otherwise walk that whole heap again."""
    gc.collect()
    gc.freeze()


def thaw_startup_heap() -> None:
    """Undo freeze_startup_heap before a normal interpreter exit: frozen objects are never finalized, and
    extension modules built on nanobind (triton's) then report each of theirs as leaked on stderr."""
    gc.unfreeze()


def _exit(context: zmq.Context, sockets: list[zmq.Socket], code: int) -> None:
    """Deliver what is still queued for the frontend, then leave at once."""
    exit_now(context, sockets, code, linger_ms=5000)


def _serve(core: Any, inputs: zmq.Socket, outputs: zmq.Socket, stop: threading.Event, context: zmq.Context) -> int:
    from pellucid.engine.core_loop import EngineCoreLoop

    input_queue: queue.Queue[Any] = queue.Queue()
    output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()

    def read_inputs() -> None:
        decoder = MessageDecoder(EngineInput)
        while not stop.is_set():
            try:
                if not inputs.poll(_POLL_MS):
                    continue
                frames = inputs.recv_multipart(copy=False)
            except zmq.ZMQError:
                return          # closed by die(): the process is exiting
            try:
                message = decoder.decode(frames)
                if isinstance(message, EngineCoreRequest):
                    message = message.with_unpickled_extras()
                input_queue.put(message)
            except Exception:
                logger.exception("could not decode a message from the frontend; dropped")
        input_queue.put(Shutdown())     # SIGTERM: leave like a requested shutdown

    def send_outputs() -> None:
        encoder = MessageEncoder()
        while (item := output_queue.get()) is not None:
            outputs.send_multipart(encoder.encode(item), copy=False)

    reader = threading.Thread(target=read_inputs, name="pellucid-engine-inputs", daemon=True)
    sender = threading.Thread(target=send_outputs, name="pellucid-engine-outputs", daemon=True)
    reader.start()
    sender.start()

    def die(reason: str) -> None:
        """The engine cannot go on (a tensor-parallel worker died; called from its watchdog thread, while
        the loop may be stuck in a collective): the frontend learns why, then this process ends (and with
        it, through their stdin, the other workers)."""
        output_queue.put(EngineCoreOutputs(engine_error=reason))
        output_queue.put(None)
        sender.join(timeout=10.0)
        _exit(context, [inputs, outputs], 1)
    core.set_fatal_handler(die)
    code = 0
    try:
        EngineCoreLoop(core, input_queue, lambda report: output_queue.put(report.pop())).run()
    except BaseException as exc:
        logger.error("the engine loop crashed:\n%s", traceback.format_exc())
        output_queue.put(EngineCoreOutputs(engine_error=f"the engine loop crashed: {type(exc).__name__}: {exc}"))
        code = 1
    stop.set()
    output_queue.put(None)
    sender.join()
    reader.join()
    return code


def _exit_when_frontend_is_gone(pipe: Any) -> None:
    """End this process as soon as its stdin (a pipe held only by the frontend) reaches end-of-file."""
    exit_when_parent_is_gone(pipe, lambda: logger.error("the frontend process is gone; the engine core exits"))


# ---- the frontend's side ----------------------------------------------------------------------------
class MPClient(BackgroundClient):
    """Talks to an engine-core process that `launch` started; any thread may send, one thread receives.

    The constructor returns at once, the process still starting; `wait_ready()` waits for its start-up to
    finish, so the frontend can do its own (load a tokenizer) meanwhile."""

    def __init__(self, launch: EngineLaunch) -> None:
        super().__init__()
        launch.taken_over = True
        launch.release()
        self._launch = launch
        self._proc = launch.proc
        self._input = launch.input
        self._output = launch.output
        self._encoder = MessageEncoder()
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None      # started once the engine is ready
        _LIVE_CLIENTS.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self) -> Any:
        if self._receiver is not None:
            return self.info
        if self._closing:
            raise EngineStartupError("the engine was shut down before it was ready")
        try:
            self.info = self._read_startup()
        except BaseException as exc:
            self._closing = True
            _LIVE_CLIENTS.discard(self)
            if not isinstance(exc, EngineStartupError):
                self._proc.stdin.close()    # cut short (Ctrl-C): the end of its pipe stops it at once
            # (an engine that failed has said why and exits by itself)
            self._launch.stop(timeout=5.0)
            self._launch.close()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="pellucid-engine-client", daemon=True)
        self._receiver.start()
        return self.info

    def _read_startup(self) -> Any:
        decoder = MessageDecoder(_Startup)
        while not self._output.poll(_POLL_MS):
            code = self._proc.poll()
            if code is not None:
                raise EngineStartupError(f"the engine process exited with code {code} before it was ready "
                                         "(its error is printed above)")
        startup = decoder.decode(self._output.recv_multipart(copy=False))
        if startup.error is not None:
            raise EngineStartupError(f"the engine core could not start: {startup.error}")
        self.latest_stats = startup.stats
        return pickle.loads(startup.info)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        try:
            request = request.with_pickled_extras()
        except Exception as exc:
            raise ValueError(f"request {request.request_id!r}: its extras cannot be sent to the engine process "
                             f"({type(exc).__name__}: {exc}); a Python function in a trace op must be a module-level "
                             "function, or run the engine in this process (engine_process=False)") from exc
        self._send(request)

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._input.send_multipart(self._encoder.encode(message), copy=False)

    def _receive_loop(self) -> None:
        """Receive and deliver the engine's reports until it is gone; a process that exits unasked is
        declared dead once everything it sent before has been delivered (its own last words included)."""
        decoder = MessageDecoder(EngineCoreOutputs)
        exited = False
        while self._dead is None:
            try:
                if not self._output.poll(0 if exited else _POLL_MS):
                    if exited:
                        break
                    exited = self._proc.poll() is not None
                    continue
                frames = self._output.recv_multipart(copy=False)
            except zmq.ZMQError:
                return          # the socket was closed by shutdown()
            try:
                report = [decoder.decode(frames)]
            except Exception as exc:
                logger.exception("could not decode a message from the engine")
                self._declare_dead(f"undecodable message from the engine: {exc!r}")
                return
            del frames
            self._receive(report)   # empties `report`: the frontend's outputs own what they carry
        if exited and not self._closing:
            self._declare_dead(_exit_description(self._proc.returncode))

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closing:
            return
        self._closing = True
        _LIVE_CLIENTS.discard(self)
        if self._receiver is None:
            # Not ready (still starting, or failed to): it reads no inputs yet, but it exits as soon as its
            # stdin, the frontend's pipe, closes.
            self._proc.stdin.close()
        elif self._dead is None and self._proc.poll() is None:
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
        self._launch.stop(timeout)
        if self._receiver is not None:
            self._receiver.join(timeout=5.0)
        self._declare_dead("the engine was shut down")
        self._launch.close()


def _exit_description(code: int) -> str:
    return f"the engine process {describe_exit(code)}"


# Engine processes still running when this interpreter exits are shut down (the pipe would end them too,
# but a clean shutdown lets them abort their requests and release the GPU in order).
_LIVE_CLIENTS: "weakref.WeakSet[MPClient]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:
    for client in list(_LIVE_CLIENTS):
        try:
            client.shutdown(timeout=10.0)
        except Exception:
            pass


if __name__ == "__main__":
    main()
