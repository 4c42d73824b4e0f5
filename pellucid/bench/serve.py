"""`pellucid bench serve`: the offline engine and `pellucid serve` on the same requests, in one run.

The offline engine (`LLM.generate`, in a child process) runs the whole request set once; then each
server variant (`process`: the engine core in its own process, the default; `thread`: the engine core
in a thread of the API server's process, the design before) is started as `pellucid serve` and driven
with the same requests, all at once and at fixed Poisson rates. Every row is printed beside the offline
figure (the ratio), with TTFT / ITL percentiles, the engine's mean step time and tokens per step while
the load ran (its busy time, from /metrics), and the CPU time each process spent per output token:
the API server's (the frontend: HTTP, tokenization, detokenization, SSE) and the engine core's. "API server
cores" is the API server's CPU time over the load's duration: near 1.0, one API server process is the
bottleneck and several (vLLM's --api-server-count) would pay off. "client cores" is the same for the load
generator (aiohttp, in this process): near 1.0, the client and not the server limits the row.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from pellucid.bench.args import SERVER_VARIANTS
from pellucid.bench.common import print_table
from pellucid.bench.models import resolve_model
from pellucid.bench.serve_load import LoadRequest, drive, make_requests, summarize


def run_serve_bench(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model, args.model_cache)
    vocab = _vocab_size(model_dir)
    requests = make_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), (10, vocab - 10),
                             args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    headers = ["system", "load", "requests", "output tok/s", "vs offline", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
               "engine step ms", "tokens/step", "API server CPU us/tok", "API server cores", "engine CPU us/tok",
               "client cores", "failed"]
    rows = []
    offline = None
    if not args.no_offline:
        offline = _run_offline(model_dir, args, requests)
        rows.append(["LLM.generate", "all at once", str(len(requests)), f"{offline:,.0f}", "1.00x"] + ["-"] * 9)
        print_table(headers, rows)
    for variant in args.variants.split(","):
        with _Server(model_dir, args, SERVER_VARIANTS[variant]) as server:
            asyncio.run(drive(server.url, requests[:8], float("inf")))      # warm-up: compilation, graphs
            for rate in rates:
                load = requests if rate == float("inf") else requests[:args.rate_requests]
                rows.append(server.measure(variant, load, rate, args.seed, offline))
                print_table(headers, rows[-1:])
    print(f"\n{args.model}, {args.dtype}; prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} (greedy, ignore_eos), streamed; engine step = busy time / "
          "steps while the load ran")
    print_table(headers, rows)


def _vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


_OFFLINE = """
import json, sys, time
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], dtype=spec["dtype"], **spec["engine"])
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in spec["max_tokens"]]
llm.generate(spec["prompts"][:8], params[:8], use_tqdm=False)       # warm-up: compilation, graphs
start = time.perf_counter()
outs = llm.generate(spec["prompts"], params, use_tqdm=False)
elapsed = time.perf_counter() - start
print("RESULT " + json.dumps({"elapsed": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def _run_offline(model_dir: str, args: argparse.Namespace, requests: list[LoadRequest]) -> float:
    """Output tok/s of LLM.generate on the requests, in a child process (its GPU memory is gone after)."""
    engine = _engine_kwargs(args.server_args)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model_dir, "dtype": args.dtype, "engine": engine,
                   "prompts": [r.prompt for r in requests], "max_tokens": [r.max_tokens for r in requests]}, f)
    try:
        done = subprocess.run([sys.executable, "-c", _OFFLINE, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"the offline run failed:\n{done.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    return result["tokens"] / result["elapsed"]


def _engine_kwargs(server_args: str) -> dict:
    """The engine flags among the server flags, as LLM keyword arguments (the offline run gets the same)."""
    from pellucid.engine.arg_utils import add_engine_args, engine_kwargs_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    known, _ = parser.parse_known_args(server_args.split())
    kwargs = engine_kwargs_from_args(known)
    defaults = engine_kwargs_from_args(parser.parse_args([]))
    return {k: v for k, v in kwargs.items() if v != defaults[k] and k not in ("dtype", "engine_process")}


class _Server:
    """`pellucid serve` in a child process, and the measurements of one load against it."""

    def __init__(self, model_dir: str, args: argparse.Namespace, variant_flags: list[str]) -> None:
        self.url = f"http://127.0.0.1:{args.port}"
        self.cmd = [sys.executable, "-m", "pellucid", "serve", model_dir, "--port", str(args.port), "--dtype",
                    args.dtype, "--log-stats-interval", "0", "--uvicorn-log-level", "warning", *variant_flags,
                    *args.server_args.split()]
        self.timeout = args.startup_timeout

    def __enter__(self) -> "_Server":
        self.proc = subprocess.Popen(self.cmd)
        _wait_ready(self.url, self.proc, self.timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def measure(self, variant: str, load: list[LoadRequest], rate: float, seed: int, offline: float | None) -> list[str]:
        before_metrics, before_cpu = self._metrics(), self._cpu_seconds()
        client_cpu = time.process_time()
        results, duration = asyncio.run(drive(self.url, load, rate, seed=seed))
        client_cpu = time.process_time() - client_cpu
        after_metrics, after_cpu = self._metrics(), self._cpu_seconds()
        s = summarize(results, duration)
        steps = after_metrics["pellucid:engine_steps"] - before_metrics["pellucid:engine_steps"]
        busy = after_metrics["pellucid:engine_step_seconds"] - before_metrics["pellucid:engine_step_seconds"]
        tokens = s.output_tokens
        per_token = [f"{(after - before) / max(tokens, 1) * 1e6:.1f}" for before, after in zip(before_cpu, after_cpu)]
        for error in s.errors:
            print(f"error ({variant}, rate {rate:g}): {error}", file=sys.stderr)
        return [f"serve ({variant})", "all at once" if rate == float("inf") else f"{rate:g} req/s", str(len(load)),
                f"{s.output_tok_s:,.0f}", f"{s.output_tok_s / offline:.2f}x" if offline else "-",
                f"{s.ttft_ms[0]:.1f} / {s.ttft_ms[1]:.1f}", f"{s.itl_ms[0]:.2f} / {s.itl_ms[1]:.2f}",
                f"{busy / steps * 1e3:.2f}" if steps else "-", f"{tokens / steps:.1f}" if steps else "-",
                per_token[0], f"{(after_cpu[0] - before_cpu[0]) / duration:.2f}",
                per_token[1] if len(per_token) > 1 else "-", f"{client_cpu / duration:.2f}", str(s.num_failed)]

    def _metrics(self) -> dict[str, float]:
        values = {}
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith("pellucid:") and "{" in line:
                values[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        return values

    def _cpu_seconds(self) -> list[float]:
        """CPU time (user + system) of the server process, then of its engine process if it has one."""
        pids = [self.proc.pid] + child_pids(self.proc.pid)
        return [_cpu_time(pid) for pid in pids]


def child_pids(pid: int) -> list[int]:
    """The children of a process (Linux: /proc/<pid>/task/<tid>/children)."""
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children += [int(c) for c in f.read().split()]
    return children


def _cpu_time(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:        # connection refused while it starts; urllib's errors are OSErrors
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server at {url} was not ready after {timeout:.0f} s")

