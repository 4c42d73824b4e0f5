"""FlashHead under `pellucid serve` (a real server process): the startup log names the head, /v1/models
names it, /metrics exports its info gauge and its fast-path row counter grows with completions; a
missing asset stops the server at startup with the command that builds one."""
from __future__ import annotations

import signal
import subprocess

import httpx
import pytest

from pellucid.cli import main as cli_main
from tests.server.server_harness import PELLUCID_CLI, free_port, start_serve_process, wait_healthy


def serve(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    return start_serve_process(PELLUCID_CLI, model_dir, port, "--log-stats-interval", "0", *extra)


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
        wait_healthy(proc, url, timeout=180, interval=0.2)
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
