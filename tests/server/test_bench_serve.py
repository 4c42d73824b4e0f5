"""`pellucid bench serve` end to end on the CPU: it starts a real server on a tiny random model, drives it
with the HTTP load generator, and every request succeeds with the output lengths it asked for."""
from __future__ import annotations

import re
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_runs_the_load_generator_against_a_real_server(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    result = subprocess.run([sys.executable, "-m", "pellucid.bench", "serve", "--model", model_dir,
                             "--port", str(_free_port()), "--", "--num-requests", "6", "--output-len-max", "24"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    counts = re.search(r"successful / failed requests\s*\|\s*(\d+) / (\d+)", result.stdout)
    assert counts is not None, result.stdout
    assert (int(counts.group(1)), int(counts.group(2))) == (6, 0)
    throughput = re.search(r"output throughput \(tok/s\)\s*\|\s*([\d.]+)", result.stdout)
    assert throughput is not None and float(throughput.group(1)) > 0
