"""A tensor-parallel worker: ranks 1..N-1 of an engine, each holding its shard of the model and KV cache.

It runs the same rank set-up as rank 0 (pellucid/runner/rank.py), then every step rank 0 sends: the step
message becomes a SchedulerOutput over the worker's own copies of the requests (step_sync.py) and goes
through the same ModelRunner.launch. The worker never reads a step's results back (only rank 0 does);
it retires a step once the next one is launched.

Started by rank 0 as `python -m pellucid.distributed.worker` (settings on stdin, whose end-of-file means
the engine is gone: the worker exits at once), in a Ray actor (ray_workers.py), or, under torchrun, in the
process of a frontend whose rank is not 0 (`serve_launched_rank`). Any failure is reported to rank 0 before the worker exits: the engine
cannot go on without it.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import zmq

from pellucid.child_process import exit_now, exit_when_parent_is_gone
from pellucid.config import EngineConfig, resolve_device
from pellucid.distributed.driver import Stop, WorkerSettings, rank_device
from pellucid.distributed.environment import environment_differences, rank_environment
from pellucid.distributed.parallel_state import TensorParallelStartupError, init_tensor_parallel
from pellucid.distributed.step_sync import StepMessage, WorkerRequests
from pellucid.engine.features import get_feature
from pellucid.logger import get_logger
from pellucid.runner.model_runner import LaunchedStep, ModelRunner
from pellucid.runner.rank import build_rank
from pellucid.structured.matcher import matcher_for

logger = get_logger("pellucid.distributed.worker")   # not __main__ when run with -m


class Worker:
    def __init__(self, config: EngineConfig, rank: int, reply: zmq.Socket) -> None:
        self.config = config
        self.rank = rank
        self.reply = reply

    def report(self, kind: str, text: str = "") -> None:
        try:
            self.reply.send(pickle.dumps((kind, self.rank, text)), flags=zmq.NOBLOCK)
        except zmq.Again:       # not connected to rank 0 (yet): the log has it
            pass

    def run(self, device: torch.device, init_method: str, steps: zmq.Socket | None,
            context: zmq.Context) -> None:
        """Join the group, set up this rank, then run steps until rank 0 says stop."""
        parallel = self.config.parallel
        tp = init_tensor_parallel(self.rank, parallel.tensor_parallel_size, device, init_method,
                                  all_reduce=parallel.all_reduce)
        if steps is None:       # launched by torchrun: rank 0 tells where its step channel is
            holder: list[Any] = [None]
            dist.broadcast_object_list(holder, src=0, group=tp.cpu_group)
            self.reply.connect(holder[0]["reply"])
            differences = environment_differences(holder[0]["environment"], rank_environment())
            if differences:
                raise TensorParallelStartupError(
                    f"tensor-parallel rank {self.rank} was started with other PELLUCID_ settings than rank 0 "
                    f"({'; '.join(differences)}): every rank must compute as rank 0 does; start every rank with "
                    "the same environment")
            steps = context.socket(zmq.PULL)
            steps.connect(holder[0]["steps"][self.rank])
        torch.manual_seed(self.config.model.seed)    # as the engine core: every rank draws the same samples
        setup = build_rank(self.config, device)
        runner = setup.runner

        def bind(key: str, value: Any, request: Any) -> Any:
            return get_feature(key).on_rank(value, request, runner)
        def grammar_for(request: Any) -> Any:
            model = self.config.model
            return matcher_for(request.sampling_params, model.tokenizer_dir, runner.head.vocab_size,
                               request.eos_token_ids)
        requests = WorkerRequests(setup.max_model_len, bind, grammar_for)
        logger.info("tensor-parallel rank %d ready (pid %d)", self.rank, os.getpid())
        self._serve(steps, runner, requests)

    def _serve(self, steps: zmq.Socket, runner: ModelRunner, requests: WorkerRequests) -> None:
        previous: LaunchedStep | None = None
        while True:
            message = pickle.loads(steps.recv())
            if isinstance(message, Stop):
                return
            assert isinstance(message, StepMessage)
            so = requests.apply(message)
            if so.is_empty:
                continue
            runner.trace_possible = message.trace_possible
            launched = runner.launch(so)
            if previous is not None:
                runner.retire(previous)
            previous = launched


def serve_worker_rank(settings: WorkerSettings) -> None:
    """Run as worker rank settings.rank, connected to rank 0's channels, until rank 0 says stop. A failure
    is reported to rank 0, then raised. The local worker process and the Ray actor both run this."""
    get_logger().setLevel(settings.log_level)
    torch.set_num_threads(settings.torch_threads)
    context = zmq.Context()
    reply = context.socket(zmq.PUSH)
    reply.connect(settings.reply_address)
    steps = context.socket(zmq.PULL)
    steps.connect(settings.step_address)
    worker = Worker(settings.config, settings.rank, reply)
    try:
        worker.report("started")
        worker.run(torch.device(settings.device), settings.init_method, steps, context)
    except BaseException as exc:
        _report_failure(worker, exc)
        raise
    finally:
        for sock in (reply, steps):      # delivers the last report (up to 2 s)
            sock.close(linger=2000)
        context.term()


def main() -> None:
    """`python -m pellucid.distributed.worker`: a worker rank 0 started on this machine."""
    settings: WorkerSettings = pickle.load(sys.stdin.buffer)
    exit_when_parent_is_gone(sys.stdin.buffer, lambda: logger.debug(
        "tensor-parallel rank %d: the engine process is gone; exiting", settings.rank))
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the process group: the engine decides
    code = 0
    try:
        serve_worker_rank(settings)
    except BaseException:        # reported to rank 0 and logged by serve_worker_rank
        code = 1
    # Leave at once: no interpreter teardown, in which the thread blocked on stdin (or a collective) would
    # make the exit fail.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_launched_rank(config: EngineConfig) -> None:
    """Run this process as worker rank $RANK of an engine whose ranks a launcher started (torchrun), until
    the engine stops; then exit the process (a frontend of rank > 0 never gets an engine of its own)."""
    rank = int(os.environ["RANK"])
    context = zmq.Context()
    reply = context.socket(zmq.PUSH)
    worker = Worker(config, rank, reply)
    code = 0
    try:
        size = config.parallel.tensor_parallel_size
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size}, but the launcher started {world} ranks (WORLD_SIZE)")
        device = rank_device(torch.device(resolve_device(config.runner.device)),
                             int(os.environ.get("LOCAL_RANK", "0")), size)
        logger.info("rank %d of %d: serving as a tensor-parallel worker of rank 0's engine", rank, size)
        worker.run(device, "env://", None, context)
    except BaseException as exc:
        code = 1
        _report_failure(worker, exc)
    _exit(context, [reply], code)


def _report_failure(worker: Worker, exc: BaseException) -> None:
    logger.error("tensor-parallel rank %d failed:\n%s", worker.rank, traceback.format_exc())
    worker.report("error", f"{type(exc).__name__}: {exc}")


def _exit(context: zmq.Context, sockets: list[zmq.Socket], code: int) -> None:
    """Deliver the last report, then leave at once (a collective may still hold a thread)."""
    exit_now(context, sockets, code, linger_ms=2000)


if __name__ == "__main__":
    main()
