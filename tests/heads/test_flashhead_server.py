"""FlashHead under `pellucid serve` (a real server process): the startup log names the head, /v1/models
names it, /metrics exports its info gauge and its fast-path row counter grows with completions; a
missing asset stops the server at startup with the command that builds one."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pellucid.cli import main as cli_main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pellucid.cli", "serve", model_dir, "--port", str(port), "--device", "cpu",
           "--num-kv-blocks", "128", "--max-model-len", "256", "--served-model-name", "tiny",
           "--log-stats-interval", "0", "--uvicorn-log-level", "warning", *extra]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def metric_value(text: str, metric: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{metric} {labels} not in /metrics")


@pytest.fixture(scope="module")
def flash_model_dir(tiny_model_factory) -> str:
    model_dir = tiny_model_factory("qwen3", seed=31)
    assert cli_main(["flashhead", "build", model_dir, "--iterations", "3", "--device", "cpu"]) == 0
    return model_dir


def test_flashhead_is_active_under_pellucid_serve(flash_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(flash_model_dir, port, "--head", "flashhead", "--head-options", '{"probes": 8}')
    try:
        wait_healthy(proc, url)
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        described = card["pellucid"]["lm_head"]
        assert described["name"] == "flashhead" and described["probes"] == 8 and described["clusters"] == 32

        before = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(before, "pellucid:lm_head_info", name="flashhead", clusters="32", probes="8") == 1
        fast_before = metric_value(before, "pellucid:lm_head_rows_total", path="fast")
        for prompt in ("hello world", "the quick brown fox", "one two three"):
            reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        after = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(after, "pellucid:lm_head_rows_total", path="fast") - fast_before >= 3 * 6
        # logprobs need exact logits: served by the dense fallback, and counted there
        dense_before = metric_value(after, "pellucid:lm_head_rows_total", path="dense")
        reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2})
        assert reply.status_code == 200, reply.text
        final = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(final, "pellucid:lm_head_rows_total", path="dense") - dense_before >= 4
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert "LM head active" in output and "'name': 'flashhead'" in output, output[-3000:]


def test_serve_refuses_flashhead_without_an_asset(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", seed=32)
    proc = serve(model_dir, free_port(), "--head", "flashhead")
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "FlashHead asset not found" in output and "pellucid flashhead build" in output, output[-3000:]
