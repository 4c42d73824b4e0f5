"""HTTP load for an OpenAI-compatible server: a seeded set of requests, sent all at once or at a rate,
each streamed and timed (time to first token, gaps between tokens)."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class LoadRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None      # None: no chunk with a choice arrived
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    started: float = field(default_factory=time.perf_counter)
    last_token: float | None = None

    def observe(self, chunk: dict) -> None:
        """One streamed chunk: its usage, and the arrival of a chunk with a choice (TTFT, then the gaps).
        Every chunk with a choice carries new text; a tokenizer that spells every id (the named benchmark
        shapes have one) makes that one chunk per token."""
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):
            now = time.perf_counter()
            if self.last_token is None:
                self.ttft = now - self.started
            else:
                self.itls.append(now - self.last_token)
            self.last_token = now

    def finish(self) -> "RequestResult":
        self.latency = time.perf_counter() - self.started
        self.ok = True
        return self


def make_requests(num: int, input_lens: tuple[int, int], output_lens: tuple[int, int], token_ids: tuple[int, int],
                  seed: int) -> list[LoadRequest]:
    """`num` random token-id prompts and output lengths (uniform over the inclusive ranges)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt = [rng.randrange(*token_ids) for _ in range(rng.randint(*input_lens))]
        requests.append(LoadRequest(prompt, rng.randint(*output_lens)))
    return requests


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(session: aiohttp.ClientSession, url: str, model: str, request: LoadRequest,
                      api_key: str | None) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(ok=False, prompt_tokens=len(request.prompt))
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:        # one SSE line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                result.observe(chunk)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    return result.finish()


async def drive(base_url: str, requests: list[LoadRequest], rate: float, arrivals: str = "poisson",
                model: str | None = None, api_key: str | None = None, max_concurrency: int | None = None,
                seed: int = 0, timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send `requests` (all at once for rate inf, else `rate` per second, Poisson or fixed gaps); returns the
    results and the wall time from the first request to the last response.

    The client is aiohttp: httpx spent ~70 us of client CPU per streamed token against aiohttp's ~30
    (benchmarks/sse_client_bench.py), so one httpx client process capped a fast server and delivered tokens
    in bursts that showed as near-zero inter-token gaps."""
    rng = random.Random(seed)
    base = base_url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)          # no pool limit: every request is its own stream
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        if model is None:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            async with session.get(f"{base}/v1/models", headers=headers) as response:
                model = (await response.json())["data"][0]["id"]
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(request: LoadRequest) -> RequestResult:
            if limit is None:
                return await one_request(session, f"{base}/v1/completions", model, request, api_key)
            async with limit:
                return await one_request(session, f"{base}/v1/completions", model, request, api_key)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(limited(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


@dataclass
class LoadSummary:
    num_ok: int
    num_failed: int
    duration: float
    output_tokens: int
    prompt_tokens: int
    ttft_ms: tuple[float, float]        # p50, p99
    itl_ms: tuple[float, float]
    mean_latency_ms: float
    errors: list[str]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration


def summarize(results: list[RequestResult], duration: float) -> LoadSummary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [gap * 1000 for r in ok for gap in r.itls]
    return LoadSummary(len(ok), len(results) - len(ok), duration, sum(r.output_tokens for r in ok),
                       sum(r.prompt_tokens for r in ok), (percentile(ttfts, 50), percentile(ttfts, 99)),
                       (percentile(itls, 50), percentile(itls, 99)),
                       statistics.fmean(r.latency for r in ok) * 1000 if ok else float("nan"),
                       [r.error for r in results if not r.ok][:5])
