"""`pellucid serve` as a subprocess: startup banner, SIGTERM / SIGINT with a request in flight -> exit 0."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_harness import free_port, start_serve_process, wait_healthy

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
    return start_serve_process([sys.executable, "-c", SERVE], model_dir, port, "--log-stats-interval", "0.5")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_a_request_in_flight_exits_zero(server_model_dir, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(server_model_dir, port)
    try:
        wait_healthy(proc, url, timeout=120, interval=0.1)
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
