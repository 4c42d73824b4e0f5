"""The flags of `pellucid bench` and its subcommands, apart from the benchmarks themselves: building the CLI's
parser (`pellucid --help`) imports no torch."""
from __future__ import annotations

import argparse
import os
import tempfile

from pellucid.bench.models import NAMED_CONFIGS
from pellucid.config import KV_CACHE_DTYPES

# `bench serve` variants: the extra `pellucid serve` flags of each.
SERVER_VARIANTS = {"process": [], "thread": ["--no-engine-process"]}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="Qwen3-0.6B",
                        help=f"a named random-weight shape ({', '.join(NAMED_CONFIGS)}) or a model directory")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"),
                        help="where named shapes are written (reused across runs)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch the next step before this one is read back (default: on for CUDA)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the KV cache's element type (the floors count its bytes)")
    parser.add_argument("--seed", type=int, default=0)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=0, help="also time one prompt of this many tokens")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-requests", type=int, default=64, help="0 skips the transformers reference")
    parser.add_argument("--hf-scale", type=float, default=0.25)


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="Qwen3-0.6B", help="a named random-weight shape or a model directory")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "pellucid-bench-models"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--num-requests", type=int, default=1000, help="requests of the all-at-once load")
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--rates", default="inf,10,20,40",
                        help="comma-separated loads: inf (all at once) or requests per second (Poisson arrivals)")
    parser.add_argument("--rate-requests", type=int, default=300, help="requests of each fixed-rate load")
    parser.add_argument("--variants", default="process,thread", help=f"server variants: {', '.join(SERVER_VARIANTS)}")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline engine's reference row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra `pellucid serve` flags, e.g. '--max-num-seqs 128'")
