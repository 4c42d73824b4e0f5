"""`pellucid bench serve`: start `pellucid serve` on a model in a subprocess, run the HTTP load
generator (benchmarks/serve_bench.py) against it, stop the server."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

from pellucid.bench.models import resolve_model

_LOAD_GENERATOR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_bench.py")


# The server's own parser, independent of which subcommands pellucid/cli.py registers.
_SERVER_MAIN = ("import argparse, sys\n"
                "from pellucid.server.serve import add_serve_parser\n"
                "parser = argparse.ArgumentParser()\n"
                "add_serve_parser(parser.add_subparsers(dest='command', required=True))\n"
                "args = parser.parse_args(sys.argv[1:])\n"
                "raise SystemExit(args.func(args) or 0)\n")


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="Qwen3-0.6B")
    parser.add_argument("--model-cache", default="/tmp/pellucid-bench-models")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("load_args", nargs=argparse.REMAINDER,
                        help="arguments after -- go to benchmarks/serve_bench.py (e.g. --num-requests 200)")


def _load_generator_main():
    path = os.path.abspath(_LOAD_GENERATOR)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the load generator {path} is missing (it ships in the source tree only)")
    spec = importlib.util.spec_from_file_location("pellucid_serve_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module.main


def _wait_ready(url: str, server: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server at {url} was not ready after {timeout:.0f} s")


def run_serve_bench(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model, args.model_cache)
    main = _load_generator_main()
    server_cmd = [sys.executable, "-c", _SERVER_MAIN, "serve", model_dir, "--port", str(args.port),
                  "--dtype", "bfloat16"]
    server = subprocess.Popen(server_cmd)
    url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_ready(url, server, args.startup_timeout)
        load_args = [a for a in args.load_args if a != "--"]
        saved = sys.argv
        sys.argv = ["serve_bench.py", "--base-url", url, *load_args]
        try:
            main()
        finally:
            sys.argv = saved
    finally:
        server.terminate()
        server.wait(timeout=60)
