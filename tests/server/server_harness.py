"""Test harness: a real server on 127.0.0.1 (uvicorn in a background thread) and shared helpers."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any
from dataclasses import dataclass

import httpx
import uvicorn

from pellucid.engine.async_llm import AsyncLLM
from pellucid.server.app import build_app

ENGINE_KWARGS = dict(device="cpu", num_kv_blocks=512, max_model_len=512)   # the tiny model's positions
MODEL_NAME = "tiny-qwen3"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PELLUCID_CLI = [sys.executable, "-m", "pellucid.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    llm: AsyncLLM

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metric(self, name: str) -> float:
        return parse_metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def parse_metric(text: str, name: str) -> float:
    """Value of one pellucid metric (single series) in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def run_app_in_thread(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Serve an ASGI app from a thread of this process: (its URL, the server, the thread) once it listens.
    Stop it with `server.should_exit = True` and a join of the thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def start_server(llm: AsyncLLM, api_key: str | None = None) -> RunningServer:
    """The app as `pellucid serve --enable-auto-tool-choice --tool-call-parser hermes` builds it."""
    app = build_app(llm, MODEL_NAME, api_key=api_key, tool_call_parser="hermes", enable_auto_tool_choice=True)
    return RunningServer(*run_app_in_thread(app), llm=llm)


def random_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "hello", "world", "quick", "brown", "fox", "jumps", "over"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(count)]


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cmdline(pid: int) -> str:
    """A process's command line, spaces between the arguments ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def wait_gone(pids: list[int], timeout: float) -> None:
    """Until none of `pids` runs; the assertion names the ones still alive."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, \
            f"processes still alive: {[f'{p}: {cmdline(p)[:120]}' for p in pids if alive(p)]}"
        time.sleep(0.05)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def start_serve_process(launcher: list[str], model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    """`pellucid serve` in a child process on the CPU with small limits, the model served as "tiny".
    `launcher` is the command line up to the `serve` subcommand; output (stdout and stderr) is piped."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [*launcher, "serve", model_dir, "--port", str(port), "--device", "cpu", "--num-kv-blocks", "128",
           "--max-model-len", "256", "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, interval: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise AssertionError("server did not become healthy")
