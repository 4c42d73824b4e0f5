"""Starting the engine-core process, apart from the client that talks to it (core_proc.MPClient).

Nothing here imports torch, so a frontend can start its engine process first and import the rest while the
engine imports torch and loads its model: `pellucid serve` launches it right after parsing its flags (see
`launch_ahead`), and the client takes the launch over once the frontend is ready to talk to it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import zmq

from pellucid.child_process import send_settings, spawn_child
from pellucid.config import EngineConfig
from pellucid.logger import get_logger

logger = get_logger(__name__)


@dataclass
class StartupSettings:
    config: EngineConfig
    input_address: str         # frontend -> engine
    output_address: str        # engine -> frontend
    log_level: int
    # The frontend's torch thread count, so that CPU kernels sum in the same order in both processes; None when
    # the frontend has not imported torch (yet): the engine keeps torch's default, which the frontend gets too.
    torch_threads: int | None


def has_engine_process(config: EngineConfig, asynchronous: bool) -> bool:
    """Whether a frontend's engine core runs in a process of its own (make_client's choice): by default for
    asyncio frontends, never for synchronous ones, always with tensor parallelism (rank 0 of the group)."""
    if config.parallel.tensor_parallel_size > 1:
        return True
    return config.runner.engine_process is True or (config.runner.engine_process is None and asynchronous)


class EngineLaunch:
    """An engine-core process started for `config`, and the two sockets it connects to, bound. MPClient takes the
    launch over to talk to it; until then `abandon()` stops it.

    A launch made with hold=True has its process import its modules (torch, the engine's) and then wait for its
    settings, which `release()` sends (MPClient does, at the latest): a pipeline starts all its stages' processes
    at once, so their imports overlap, and releases them one after another where a stage sizes its KV cache from
    the GPU memory the stages before it left (all at once where none does)."""

    def __init__(self, config: EngineConfig, hold: bool = False) -> None:
        self.config = config
        self.taken_over = False     # by a client, which stops and closes it from then on
        self.dir = tempfile.mkdtemp(prefix="pellucid-engine-")     # private (0700): the sockets live here
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.bind(f"ipc://{self.dir}/input")
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(f"ipc://{self.dir}/output")
        self.proc = spawn_child("pellucid.engine.core_proc")
        self._released = False
        if not hold:
            self.release()

    def release(self) -> None:
        """Send the process its settings: it builds its engine core from then on (idempotent)."""
        if self._released:
            return
        self._released = True
        torch = sys.modules.get("torch")
        send_settings(self.proc, StartupSettings(self.config, f"ipc://{self.dir}/input", f"ipc://{self.dir}/output",
                                                 get_logger().getEffectiveLevel(),
                                                 torch.get_num_threads() if torch else None))

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to exit (terminate it, then kill it, after that)."""
        proc = self.proc
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop within %.0f s; terminating it", timeout)
            proc.terminate()
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()

    def close(self) -> None:
        """Close the sockets and remove their directory (after the process is gone)."""
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    def abandon(self) -> None:
        """Stop a launch no client took over: the process exits as soon as its stdin, this end of the pipe,
        closes, whether it still waits for its settings, is loading, or waits for a client. A launch a client
        took over is the client's to stop: then this does nothing."""
        if self.taken_over:
            return
        self.proc.stdin.close()
        self.stop(timeout=10.0)
        self.close()


def launch_ahead(config: EngineConfig, asynchronous: bool, hold: bool = False) -> EngineLaunch | None:
    """The engine process `make_client(config, asynchronous)` would start, started now (held: see EngineLaunch),
    or None where the core will run in this process (or where a launcher started this process as a
    tensor-parallel rank other than 0, which serves rank 0's engine instead of starting one)."""
    if not has_engine_process(config, asynchronous) or os.environ.get("RANK", "0") != "0":
        return None
    return EngineLaunch(config, hold=hold)
