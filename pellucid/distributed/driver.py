"""Rank 0 of a tensor-parallel engine: it starts (or joins) the other ranks, sends them every step, and
watches them.

Rank 0 lives in the engine-core process: its runner (`DriverRunner`) is the engine's runner, so the
scheduler, the request features and the one read-back of each step stay where they are at one rank. The
other ranks run `pellucid.distributed.worker`:

- `distributed_executor_backend="mp"`: rank 0 starts one worker process per other rank on this machine
  (a fresh interpreter whose stdin is a pipe from the engine process: it exits when the engine does,
  whatever ended it) and the ranks meet through a file store in a private directory;
- `"ray"`: rank 0 places one Ray actor per other rank on the nodes of a Ray cluster (ray_workers.py);
  the ranks meet over TCP;
- `"env"`: a launcher (torchrun) started every rank with torch.distributed's env:// variables, on any
  number of machines; rank 0's process is the engine's, the others became workers when their frontend
  made its engine (core_client.make_client).

Steps go from rank 0 to each worker over a ZMQ socket (pickled StepMessages, step_sync.py); the workers
report start-up and failures back over another. The model's collectives run on torch.distributed.

Faults: a worker that fails or dies makes the engine unusable (the ranks would be out of step). The
watchdog thread notices (the worker's own report, or its exit status) and calls the fatal handler, which
the engine-core process sets to report the error to its frontend and exit; a step on rank 0 that raises
while the workers run it raises TensorParallelFailure, which no per-step handler catches.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import zmq

from pellucid.child_process import describe_exit, start_child
from pellucid.config import EngineConfig
from pellucid.distributed.environment import rank_environment
from pellucid.distributed.parallel_state import TensorParallel, TensorParallelStartupError, init_tensor_parallel
from pellucid.distributed.step_sync import StepEncoder
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.logger import get_logger
from pellucid.runner.model_runner import LaunchedStep, ModelRunner
from pellucid.runner.output import ModelRunnerOutput
from pellucid.runner.rank import RankSetup, build_rank

logger = get_logger(__name__)

_POLL_MS = 100
STARTUP_TIMEOUT_S = float(os.environ.get("PELLUCID_TP_STARTUP_TIMEOUT", "600"))


class TensorParallelFailure(BaseException):
    """The tensor-parallel ranks can no longer run steps together (a worker died, or a step failed on one
    rank while the others ran it). A BaseException: the per-step error handling, which fails a step's
    requests and serves on, must not catch it; the engine process reports it and exits."""


@dataclass
class WorkerSettings:
    """What a worker process needs to start, pickled to its stdin (mp) or found by itself (env)."""

    config: EngineConfig
    rank: int
    size: int
    device: str
    init_method: str
    step_address: str            # rank 0 -> this worker
    reply_address: str           # workers -> rank 0
    log_level: int
    torch_threads: int


@dataclass
class Stop:
    """Rank 0's last message: the engine is shutting down."""


def executor_backend(config: EngineConfig) -> str:
    return config.parallel.distributed_executor_backend or ("env" if "WORLD_SIZE" in os.environ else "mp")


def rank_device(device: torch.device, local_rank: int, size: int) -> torch.device:
    """A rank's device: GPU `local_rank` of this machine (CUDA), or the CPU."""
    if device.type == "cpu":
        return device
    if device.type != "cuda" or device.index not in (None, 0):
        raise ValueError(f"with tensor_parallel_size > 1 the device must be auto, cuda or cpu (rank r uses GPU r of "
                         f"its machine, CUDA_VISIBLE_DEVICES chooses which), got {device}")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"tensor-parallel rank on local GPU {local_rank}, but this machine shows {count} GPU(s) "
                         f"(tensor_parallel_size={size}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return torch.device("cuda", local_rank)


class LocalWorker:
    """A worker process this engine process started (mp)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def exit_reason(self) -> str | None:
        """None while it runs; else how it ended ('was killed by SIGKILL')."""
        code = self.proc.poll()
        return None if code is None else describe_exit(code)

    def stop(self, timeout: float) -> None:
        """After Stop: wait for it to exit (killing it after `timeout`), and close its stdin."""
        try:
            self.proc.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


class WorkerGroup:
    """Ranks 1..N-1 seen from rank 0: their start, the step channel, the watchdog, the shutdown."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.size = config.parallel.tensor_parallel_size
        self.backend = executor_backend(config)
        self.dead_reason: str | None = None
        # Called from the watchdog thread with the reason once the workers cannot go on (set_fatal_handler, by
        # the process hosting the engine core); until then the reason is raised by the next step.
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._lock = threading.Lock()
        self._closing = False
        self._workers: dict[int, Any] = {}      # rank -> LocalWorker or ray_workers.RayWorker
        self._ray: Any = None                     # ray_workers.RayRanks, with the "ray" backend
        self.tp: TensorParallel | None = None
        self._dir: str | None = None
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._steps: list[zmq.Socket] = []
        self._watchdog: threading.Thread | None = None
        try:
            if self.backend == "mp":
                self._start_local_workers(config, device)
            elif self.backend == "ray":
                self._start_ray_workers(config, device)
            else:
                self._join_launched_ranks(config, device)
        except BaseException:
            self.shutdown(timeout=5.0)
            raise
        self._watchdog = threading.Thread(target=self._watch, name="pellucid-tp-watchdog", daemon=True)
        self._watchdog.start()

    # ---- start-up -------------------------------------------------------------------------------------
    def _start_local_workers(self, config: EngineConfig, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size={self.size} needs {self.size} GPUs, this machine shows "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')})")
        self.device = rank_device(device, 0, self.size)
        self._dir = tempfile.mkdtemp(prefix="pellucid-tp-")    # private (0700): sockets and the rendezvous file
        reply_address = f"ipc://{self._dir}/replies"
        self._replies.bind(reply_address)

        def step_address(sock: zmq.Socket, rank: int) -> str:
            address = f"ipc://{self._dir}/steps-{rank}"
            sock.bind(address)
            return address
        # CPU ranks share the machine's cores; a GPU rank needs few CPU threads.
        self._start_workers(config, device, f"file://{self._dir}/rendezvous", reply_address, step_address,
                            lambda rank: str(rank_device(device, rank, self.size)),
                            max(1, torch.get_num_threads() // self.size),
                            lambda settings: LocalWorker(start_child("pellucid.distributed.worker", settings)))

    def _start_ray_workers(self, config: EngineConfig, device: torch.device) -> None:
        from pellucid.distributed.ray_workers import RayRanks, free_tcp_port
        self._ray = RayRanks(self.size, device, STARTUP_TIMEOUT_S)
        self.device = self._ray.rank0_device
        host = self._ray.node_ip
        # Each actor sees only its own GPU.
        self._start_workers(config, device, f"tcp://{host}:{free_tcp_port()}", _bind_tcp(self._replies, host),
                            lambda sock, _rank: _bind_tcp(sock, host),
                            lambda _rank: "cuda:0" if device.type == "cuda" else "cpu",
                            max(1, torch.get_num_threads() // self.size) if device.type == "cpu" else 1,
                            self._ray.start_worker)

    def _start_workers(self, config: EngineConfig, device: torch.device, init_method: str, reply_address: str,
                       step_address: Callable[[zmq.Socket, int], str], worker_device: Callable[[int], str],
                       threads: int, start_worker: Callable[[WorkerSettings], Any]) -> None:
        """Ranks 1..N-1, each with its step socket (`step_address` binds it and says where the worker connects)
        and started by `start_worker`; once all are up, the rendezvous as rank 0."""
        for rank in range(1, self.size):
            sock = self._context.socket(zmq.PUSH)
            self._steps.append(sock)
            settings = WorkerSettings(config, rank, self.size, worker_device(rank), init_method,
                                      step_address(sock, rank), reply_address, get_logger().getEffectiveLevel(),
                                      threads)
            self._workers[rank] = start_worker(settings)
        self._wait_started()
        if device.type == "cpu":
            torch.set_num_threads(threads)
        self.tp = init_tensor_parallel(0, self.size, self.device, init_method, timeout_s=STARTUP_TIMEOUT_S,
                                       all_reduce=config.parallel.all_reduce)

    def _wait_started(self) -> None:
        """Until every worker reports it is up (before the rendezvous, in which rank 0 could not see a worker
        that never comes): a clear error for one that exits or fails first."""
        waiting = set(self._workers)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            if self._replies.poll(_POLL_MS):
                kind, rank, text = pickle.loads(self._replies.recv())
                if kind == "error":
                    raise TensorParallelStartupError(f"tensor-parallel rank {rank} could not start: {text}")
                waiting.discard(rank)
                continue
            for rank in sorted(waiting):
                reason = self._workers[rank].exit_reason()
                if reason is not None:
                    raise TensorParallelStartupError(f"tensor-parallel worker rank {rank} {reason} "
                                                     "before it started (its error is printed above)")
            if time.monotonic() > deadline:
                raise TensorParallelStartupError(f"tensor-parallel ranks {sorted(waiting)} did not start within "
                                                 f"{STARTUP_TIMEOUT_S:.0f} s")

    def _join_launched_ranks(self, config: EngineConfig, device: torch.device) -> None:
        """torchrun started every rank: join as rank 0 (env://), then tell the others where the channels are."""
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        if world != self.size:
            raise ValueError(f"tensor_parallel_size={self.size}, but the launcher started {world} ranks (WORLD_SIZE)")
        if rank != 0:
            raise RuntimeError(f"this process is rank {rank}: only rank 0 runs the engine core")
        self.device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")), self.size)
        self.tp = init_tensor_parallel(0, self.size, self.device, "env://", timeout_s=STARTUP_TIMEOUT_S,
                                       all_reduce=config.parallel.all_reduce)
        host = os.environ.get("PELLUCID_TP_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        addresses = {"reply": _bind_tcp(self._replies, host), "steps": {}, "environment": rank_environment()}
        for rank in range(1, self.size):
            sock = self._context.socket(zmq.PUSH)
            self._steps.append(sock)
            addresses["steps"][rank] = _bind_tcp(sock, host)
        dist.broadcast_object_list([addresses], src=0, group=self.tp.cpu_group)

    # ---- steps ----------------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._steps:
            while True:
                if self.dead_reason is not None:
                    raise TensorParallelFailure(self.dead_reason)
                try:
                    sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:       # no worker connected to it (any more): wait, watching for its death
                    sock.poll(_POLL_MS, zmq.POLLOUT)

    def failure(self, exc: BaseException, wait_s: float = 2.0) -> TensorParallelFailure:
        """The error to raise for `exc` from a step on rank 0 while the workers ran it: a worker's death
        or failure if the watchdog learns of one soon (the usual cause), else exc itself."""
        deadline = time.monotonic() + wait_s
        while self.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.dead_reason is not None:
            return TensorParallelFailure(self.dead_reason)
        return TensorParallelFailure(f"a step failed on tensor-parallel rank 0 while the other ranks ran it; the "
                                     f"ranks are out of step, so the engine stops: {type(exc).__name__}: {exc}")

    # ---- watchdog -------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            try:
                ready = self._replies.poll(_POLL_MS)
                message = pickle.loads(self._replies.recv()) if ready else None
            except zmq.ZMQError:
                return
            if message is not None and message[0] == "error":
                self._fail(f"tensor-parallel rank {message[1]} failed: {message[2]}")
            for rank, worker in self._workers.items():
                reason = worker.exit_reason()
                if reason is not None and not self._closing:
                    self._fail(f"tensor-parallel worker rank {rank} {reason}")
            if self.dead_reason is not None:
                return

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        """`handler(reason)` from the watchdog once the workers cannot go on; at once if that already happened."""
        with self._lock:
            self.on_fatal = handler
            reason = self.dead_reason
        if reason is not None:
            handler(reason)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is not None or self._closing:
                return
            self.dead_reason = reason
            on_fatal = self.on_fatal
        logger.error("%s; the engine stops", reason)
        on_fatal(reason)
        if self.tp is not None:
            self.tp.abort()      # a step stuck in a collective with the dead rank raises now (start-up)

    # ---- shutdown -------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for the ones this process started (terminating stragglers), close
        the channels."""
        if self._closing:
            return
        self._closing = True
        if self.dead_reason is None:
            for sock in self._steps:
                try:
                    sock.send(pickle.dumps(Stop()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        # The watchdog sees _closing within a poll; it must be gone before the workers (and Ray) are.
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2.0)
        deadline = time.monotonic() + (timeout if self.dead_reason is None else 1.0)
        for worker in self._workers.values():
            worker.stop(deadline - time.monotonic())
        if self._ray is not None:
            self._ray.shutdown()
        # The process group is left to the process's exit, which follows: tearing NCCL down after graph
        # captures can hang (pytorch issue 115388), and nothing here needs it released first.
        for sock in self._steps:      # delivers the Stop still queued (workers torchrun started are not waited for)
            sock.close(linger=2000 if self.dead_reason is None else 0)
        self._replies.close(linger=0)
        self._context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class DriverRunner(ModelRunner):
    """Rank 0's runner: sends each step to the other ranks, then runs it here like any runner. Only this
    rank reads the results back (ModelRunner.reads_results)."""

    def __init__(self, *args: Any, workers: WorkerGroup, **kwargs: Any) -> None:
        self.workers = workers
        self.encoder = StepEncoder()
        super().__init__(*args, **kwargs)

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        self.workers.send(self.encoder.encode(so, self.trace_possible))
        try:
            return super().launch(so)
        except Exception as exc:
            raise self.workers.failure(exc) from exc

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        try:
            return super().collect(step)
        except Exception as exc:
            raise self.workers.failure(exc) from exc

    def release_request_states(self, request_ids: set[str]) -> None:
        super().release_request_states(request_ids)
        self.encoder.forget(request_ids)

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.workers.set_fatal_handler(handler)

    def shutdown(self) -> None:
        self.workers.shutdown()


def start_driver_rank(config: EngineConfig, device: torch.device) -> RankSetup:
    """Start (or join) the other ranks, then set up rank 0 with them."""
    workers = WorkerGroup(config, device)

    def make_runner(*args: Any) -> DriverRunner:
        return DriverRunner(*args, workers=workers)
    try:
        return build_rank(config, workers.device, make_runner)
    except TensorParallelStartupError:
        workers.shutdown(timeout=5.0)
        raise
    except BaseException as exc:
        reason = workers.failure(exc).args[0] if not isinstance(exc, TensorParallelFailure) else exc.args[0]
        workers.shutdown(timeout=5.0)
        raise TensorParallelStartupError(f"tensor-parallel start-up failed: {reason}") from exc


def _bind_tcp(sock: zmq.Socket, host: str) -> str:
    """Bind `sock` to a free TCP port (on every interface unless `host` is the loopback); the address other
    machines connect to."""
    sock.bind(f"tcp://{'127.0.0.1' if host in ('127.0.0.1', 'localhost') else '*'}:0")
    port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"
