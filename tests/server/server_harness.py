"""Test harness: a real server on 127.0.0.1 (uvicorn in a background thread) and shared helpers."""
from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from pellucid.engine.async_llm import AsyncLLM
from pellucid.server.app import build_app

ENGINE_KWARGS = dict(device="cpu", num_kv_blocks=512, max_model_len=256)
MODEL_NAME = "tiny-qwen3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    llm: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread

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


def start_server(llm: AsyncLLM, api_key: str | None = None) -> RunningServer:
    port = free_port()
    app = build_app(llm, MODEL_NAME, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", llm, server, thread)


def random_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "hello", "world", "quick", "brown", "fox", "jumps", "over"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(count)]


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


@contextlib.contextmanager
def slowed_steps(llm: AsyncLLM, seconds: float):
    """Make every engine step take at least `seconds`, so a request is reliably still running later."""
    core = llm._core
    real_step = core.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    core.step = slow_step
    try:
        yield
    finally:
        del core.step
