"""How long `pellucid serve` takes to come up: seconds from launch to the first 200 on /health, for this tree
and for a reference copy of the project (an older checkout, its `pellucid/` package under --reference),
started alternately on the same machine; the table gives each run, the medians and their ratio.

    git worktree add /tmp/ref-tree <older commit>
    python benchmarks/serve_startup.py --reference /tmp/ref-tree --device cuda --runs 3

--timeline instead prints one start-up of this tree line by line, each line stamped with seconds since
launch, with every top-level import of either process that took more than --slow-import seconds
(PYTHONPROFILEIMPORTTIME): where the time goes.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from pellucid.bench.common import print_table
from pellucid.tiny_models import build_tiny_model

THIS_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tree: str, model: str, device: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    # Run from the tree itself: `python -m` puts the working directory first on sys.path.
    env = dict(env, PYTHONPATH=tree + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "pellucid.cli", "serve", model, "--port", str(port), "--device",
                             device, "--num-kv-blocks", "256", "--max-model-len", "256", "--log-stats-interval", "0"],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen, port: int, output: list[tuple[float, str]], t0: float) -> float:
    while True:
        if proc.poll() is not None:
            time.sleep(0.5)     # the reader thread takes the last lines
            raise RuntimeError("serve exited before it was healthy:\n" + "\n".join(l for _, l in output[-40:]))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)


def start_once(tree: str, model: str, device: str, env: dict[str, str]) -> tuple[float, list[tuple[float, str]]]:
    """(seconds to healthy, [(seconds since launch, output line)])"""
    port = free_port()
    output: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = launch(tree, model, device, port, env)
    reader = threading.Thread(target=lambda: output.extend((time.monotonic() - t0, line.rstrip()) for line in proc.stdout),
                              daemon=True)
    reader.start()
    try:
        elapsed = wait_healthy(proc, port, output, t0)
    finally:
        proc.terminate()
        proc.wait(60)
        reader.join(10)
    return elapsed, output


def timeline(model: str, device: str, slow_import: float) -> None:
    elapsed, output = start_once(THIS_TREE, model, device, dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
    print(f"healthy after {elapsed:.2f} s")
    for stamp, line in output:
        if line.startswith("import time:"):
            fields = line.split("|")
            top_level = len(fields) == 3 and not fields[2].startswith("  ")
            if top_level and fields[1].strip().isdigit() and int(fields[1]) / 1e6 > slow_import:
                print(f"{stamp:7.2f}  import {fields[2].strip()} ({int(fields[1]) / 1e6:.2f} s)")
        elif stamp <= elapsed + 0.1:
            print(f"{stamp:7.2f}  {line[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="a checkout of the project to compare with (required unless --timeline)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--slow-import", type=float, default=0.3)
    args = parser.parse_args()
    model = build_tiny_model("qwen3", "/tmp/pellucid-startup-model", seed=5)
    if args.timeline:
        timeline(model, args.device, args.slow_import)
        return
    if args.reference is None:
        parser.error("--reference is required (or --timeline)")
    trees = {"this tree": THIS_TREE, "reference": os.path.abspath(args.reference)}
    # A first start-up fills the file cache and, on CUDA, Triton's kernel cache, for both trees' kernels alike.
    start_once(THIS_TREE, model, args.device, dict(os.environ))
    runs: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(start_once(tree, model, args.device, dict(os.environ))[0])
    medians = {name: statistics.median(times) for name, times in runs.items()}
    rows = [[args.device, name, ", ".join(f"{t:.2f}" for t in sorted(runs[name])), f"{medians[name]:.2f}"]
            for name in trees]
    rows.append([args.device, "this tree / reference", "", f"{medians['this tree'] / medians['reference']:.2f}x"])
    print_table(["device", "tree", "runs (s to /health)", "median s"], rows)


if __name__ == "__main__":
    main()
