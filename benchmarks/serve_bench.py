"""Load generator for an OpenAI-compatible server (Pellucid's, or any other).

Streams /v1/completions requests with random token-id prompts and random output lengths, arriving
as a Poisson process or at a fixed rate, and prints request throughput, output tokens/s, time to
first token and inter-token latency (p50 / p99). `pellucid bench serve` runs the same load against a
server it starts, beside the offline engine on the same requests.

    pellucid serve default --port 8000 &
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 20
"""
from __future__ import annotations

import argparse
import asyncio

from pellucid.bench.serve_load import drive, make_requests, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (inf: all at once)")
    parser.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len-min", type=int, default=32)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len-min", type=int, default=16)
    parser.add_argument("--output-len-max", type=int, default=128)
    parser.add_argument("--token-id-min", type=int, default=10, help="prompt token ids are drawn from [min, max)")
    parser.add_argument("--token-id-max", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = make_requests(args.num_requests, (args.input_len_min, args.input_len_max),
                             (args.output_len_min, args.output_len_max), (args.token_id_min, args.token_id_max),
                             args.seed)
    results, duration = asyncio.run(drive(args.base_url, requests, args.request_rate, args.arrivals, args.model,
                                          args.api_key, args.max_concurrency, args.seed, args.timeout))
    s = summarize(results, duration)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s {args.arrivals}"
    rows = [
        ("workload", f"{args.num_requests} reqs, rate {rate}, in {args.input_len_min}-{args.input_len_max}, "
                     f"out {args.output_len_min}-{args.output_len_max} tokens"),
        ("successful / failed requests", f"{s.num_ok} / {s.num_failed}"),
        ("duration (s)", f"{duration:.2f}"),
        ("request throughput (req/s)", f"{s.num_ok / duration:.2f}"),
        ("output throughput (tok/s)", f"{s.output_tok_s:.1f}"),
        ("total throughput (tok/s)", f"{(s.output_tokens + s.prompt_tokens) / duration:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{s.ttft_ms[0]:.1f} / {s.ttft_ms[1]:.1f}"),
        ("ITL p50 / p99 (ms)", f"{s.itl_ms[0]:.2f} / {s.itl_ms[1]:.2f}"),
        ("mean E2E latency (ms)", f"{s.mean_latency_ms:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'metric'.ljust(width)} | value")
    print(f"{'-' * width}-|-{'-' * 40}")
    for name, value in rows:
        print(f"{name.ljust(width)} | {value}")
    for error in s.errors:
        print(f"error: {error}")


if __name__ == "__main__":
    main()
