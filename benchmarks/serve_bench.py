"""Load generator for an OpenAI-compatible server (Pellucid's, or any other).

Streams /v1/completions requests with random token-id prompts and random output lengths, arriving
as a Poisson process or at a fixed rate, and prints request throughput, output tokens/s, time to
first token and inter-token latency (p50 / p99).

    pellucid serve default --port 8000 &
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None      # None: no chunk with a choice arrived
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      api_key: str | None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                # Every chunk with a choice carries one step's token, even when its text is empty (bytes
                # of an unfinished UTF-8 character, or ids the tokenizer cannot spell): time them all.
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


async def run(args: argparse.Namespace) -> list[RequestResult]:
    rng = random.Random(args.seed)
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(max_connections=None)) as client:
        model = args.model
        if model is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = (await client.get(f"{base}/v1/models", headers=headers)).json()["data"][0]["id"]
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: list[int], max_tokens: int) -> RequestResult:
            if limit is None:
                return await one_request(client, f"{base}/v1/completions", model, prompt, max_tokens, args.api_key)
            async with limit:
                return await one_request(client, f"{base}/v1/completions", model, prompt, max_tokens, args.api_key)

        tasks = []
        for _ in range(args.num_requests):
            prompt_len = rng.randint(args.input_len_min, args.input_len_max)
            prompt = [rng.randrange(args.token_id_min, args.token_id_max) for _ in range(prompt_len)]
            tasks.append(asyncio.ensure_future(limited(prompt, rng.randint(args.output_len_min, args.output_len_max))))
            if args.request_rate != float("inf"):
                gap = rng.expovariate(args.request_rate) if args.arrivals == "poisson" else 1.0 / args.request_rate
                await asyncio.sleep(gap)
        return await asyncio.gather(*tasks)


def report(args: argparse.Namespace, results: list[RequestResult], duration: float) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [gap * 1000 for r in ok for gap in r.itls]
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s {args.arrivals}"
    rows = [
        ("workload", f"{args.num_requests} reqs, rate {rate}, in {args.input_len_min}-{args.input_len_max}, "
                     f"out {args.output_len_min}-{args.output_len_max} tokens"),
        ("successful / failed requests", f"{len(ok)} / {len(failed)}"),
        ("duration (s)", f"{duration:.2f}"),
        ("request throughput (req/s)", f"{len(ok) / duration:.2f}"),
        ("output throughput (tok/s)", f"{output_tokens / duration:.1f}"),
        ("total throughput (tok/s)", f"{(output_tokens + sum(r.prompt_tokens for r in ok)) / duration:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{percentile(ttfts, 50):.1f} / {percentile(ttfts, 99):.1f}"),
        ("ITL p50 / p99 (ms)", f"{percentile(itls, 50):.2f} / {percentile(itls, 99):.2f}"),
        ("mean E2E latency (ms)", f"{statistics.fmean(r.latency for r in ok) * 1000:.1f}" if ok else "nan"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'metric'.ljust(width)} | value")
    print(f"{'-' * width}-|-{'-' * 40}")
    for name, value in rows:
        print(f"{name.ljust(width)} | {value}")
    for r in failed[:5]:
        print(f"error: {r.error}")


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
    start = time.perf_counter()
    results = asyncio.run(run(args))
    report(args, results, time.perf_counter() - start)


if __name__ == "__main__":
    main()
