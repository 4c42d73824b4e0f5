"""`pellucid bench latency | throughput | serve | floors`: benchmarks that print a table with the
reference (transformers, the GPU's measured floors) beside every figure."""
from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` and its subcommands on the CLI's subparsers (pellucid/cli.py)."""
    from pellucid.bench.args import add_latency_args, add_serve_bench_args, add_throughput_args
    from pellucid.cli import subcommand_help

    parser = subparsers.add_parser("bench", help=subcommand_help("bench"))
    sub = parser.add_subparsers(dest="bench_command", required=True)
    latency = sub.add_parser("latency", help="prefill time and per-token decode time vs the weight-bytes floor")
    add_latency_args(latency)
    latency.set_defaults(func=_run("pellucid.bench.latency", "run_latency"))
    throughput = sub.add_parser("throughput", help="the nano-vllm offline workload vs its memory floor and "
                                                   "transformers")
    add_throughput_args(throughput)
    throughput.set_defaults(func=_run("pellucid.bench.throughput", "run_throughput"))
    serve = sub.add_parser("serve", help="HTTP load against `pellucid serve` (benchmarks/serve_bench.py)")
    add_serve_bench_args(serve)
    serve.set_defaults(func=_run("pellucid.bench.serve", "run_serve_bench"))
    floors = sub.add_parser("floors", help="measure copy bandwidth and bf16 matmul rate")
    floors.set_defaults(func=_print_floors)
    return parser


def _run(module: str, function: str):
    def run(args: argparse.Namespace) -> int:
        import importlib
        getattr(importlib.import_module(module), function)(args)
        return 0
    return run


def _print_floors(args: argparse.Namespace) -> int:
    from pellucid.bench.floors import measure_floors, print_floors
    print_floors(measure_floors())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pellucid.bench ...` until the CLI wires `bench` in."""
    parser = argparse.ArgumentParser(prog="pellucid")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return int(args.func(args) or 0)
