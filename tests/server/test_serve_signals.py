"""`pellucid serve` as a subprocess: startup banner, SIGTERM / SIGINT with a request in flight -> exit 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_harness import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The lead wires add_serve_parser into pellucid/cli.py; this drives the serve command on its own.
SERVE = """
import argparse, sys
from pellucid.server.serve import add_serve_parser
parser = argparse.ArgumentParser(prog="pellucid")
add_serve_parser(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def start_serve(model_dir: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", SERVE, "serve", model_dir, "--port", str(port), "--device", "cpu",
           "--num-kv-blocks", "128", "--max-model-len", "256", "--served-model-name", "tiny",
           "--log-stats-interval", "0.5", "--uvicorn-log-level", "warning"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_a_request_in_flight_exits_zero(server_model_dir, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(server_model_dir, port)
    try:
        wait_healthy(proc, url)
        warmup = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        assert warmup.status_code == 200, warmup.text
        time.sleep(1.2)     # let the stats logger report that activity
        result: dict[str, object] = {}

        def stream_one() -> None:
            body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 60, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            lines = []
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        lines.append(line)
                        if len(lines) == 2:
                            result["started"] = True
            except httpx.HTTPError as exc:
                result["error"] = exc
            result["lines"] = lines

        client = threading.Thread(target=stream_one)
        client.start()
        deadline = time.monotonic() + 60
        while "started" not in result and client.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(sig)
        client.join(60)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    # The request in flight finished (graceful shutdown) rather than being cut off.
    lines = [line for line in result["lines"] if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", output
    assert "KV cache: 128 blocks" in output
    assert "Avg generation throughput" in output
    assert "dtype=float32" in output and "device=cpu" in output
