"""`pellucid serve` and its engine-core process live and die together: an engine that dies fails the
requests in flight and takes the server down with a non-zero exit; a server killed with SIGKILL leaves
no engine behind; a start-up failure shows its original error."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx

from pellucid.bench.serve import child_pids
from server_harness import alive, free_port, start_serve_process, wait_healthy

SERVE = [sys.executable, "-m", "pellucid"]


def wait_for(predicate, timeout: float) -> float:
    """Seconds until predicate() held; AssertionError after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)
    return time.monotonic() - start


def start(model_dir: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve_process(SERVE, model_dir, port)
    wait_healthy(proc, url, timeout=180, interval=0.1)
    engines = child_pids(proc.pid)
    assert len(engines) == 1, engines
    return proc, url, engines[0]


def stream_in_background(url: str, max_tokens: int = 5000) -> tuple[threading.Thread, dict]:
    result: dict = {"lines": []}

    def run() -> None:
        body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:        # events are separated by empty lines
                        result["lines"].append(line)
        except httpx.HTTPError as exc:
            result["error"] = exc
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: len(result["lines"]) >= 2 or "ended" in result, timeout=60)
    return thread, result


def test_engine_death_fails_in_flight_requests_and_stops_the_server(server_model_dir):
    proc, url, engine = start(server_model_dir)
    try:
        thread, result = stream_in_background(url)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        thread.join(30)
        assert "ended" in result and result["ended"] - killed < 5.0      # failed at once, not after a timeout
        events = [json.loads(line[6:]) for line in result["lines"] if line.startswith("data: {")]
        error = events[-1]["error"]
        assert "engine" in error["message"] and "SIGKILL" in error["message"], error
        assert result["lines"][-1] == "data: [DONE]"
        # The server stops taking requests and exits non-zero.
        proc.wait(timeout=60)
        assert proc.returncode != 0
        output = proc.stdout.read()
        assert "engine core died" in output and "SIGKILL" in output, output
        try:
            health = httpx.get(f"{url}/health", timeout=2).status_code
        except httpx.HTTPError:
            health = None
        assert health != 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_is_503_and_new_requests_fail_clearly_once_the_engine_is_gone(server_model_dir):
    # A long graceful-shutdown window keeps the server up after the engine died, long enough to ask it.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve_process(SERVE, server_model_dir, port, "--graceful-shutdown-timeout", "30")
    try:
        wait_healthy(proc, url, timeout=180, interval=0.1)
        thread, result = stream_in_background(url)      # holds the server open while it shuts down
        os.kill(child_pids(proc.pid)[0], signal.SIGKILL)
        thread.join(30)
        statuses = []
        try:
            statuses.append(httpx.get(f"{url}/health", timeout=5).status_code)
            response = httpx.post(f"{url}/v1/completions", timeout=5,
                                  json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
            statuses.append(response.status_code)
            assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        except httpx.HTTPError:
            pass            # the server had already closed its socket: also no 200, and no hang
        assert 200 not in statuses
        proc.wait(timeout=60)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_of_the_server_leaves_no_engine_process(server_model_dir):
    proc, url, engine = start(server_model_dir)
    try:
        stream_in_background(url)
        proc.kill()
        proc.wait(timeout=30)
        gone_after = wait_for(lambda: not alive(engine), timeout=15)
        assert gone_after < 15
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


def test_sigterm_exits_zero_and_leaves_no_children(server_model_dir):
    proc, url, engine = start(server_model_dir)
    try:
        thread, result = stream_in_background(url, max_tokens=40)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        thread.join(30)
        output = proc.stdout.read()
        assert proc.returncode == 0, output
        assert result["lines"][-1] == "data: [DONE]"       # the request in flight was drained, not cut off
        assert not alive(engine)
        # A clean stop says nothing alarming: nanobind (triton's bindings) lists objects it sees leaked at
        # exit, which the start-up heap's gc.freeze would cause if serve did not thaw it first.
        assert "leaked" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_startup_failure_shows_the_original_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"],
                                                      "model_type": "llama", "vocab_size": 32}))
    proc = start_serve_process(SERVE, str(tmp_path), free_port())
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "NoSuchForCausalLM" in output and "could not start" in output, output


def test_a_bad_pooler_config_stops_serve_before_the_engine_starts(tmp_path):
    proc = start_serve_process(SERVE, str(tmp_path), free_port(), "--pooler-config", '{"pooling_type": "max"}')
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2
    assert "--pooler-config" in output and "pooling_type must be one of" in output, output
