"""Client CPU per streamed token of the load generator (aiohttp, `pellucid.bench.serve_load`) against an
httpx client of the same shape, on a stand-in SSE server (no engine: a token every `--gap-ms` per stream).

    python benchmarks/sse_client_bench.py [--streams 300] [--gap-ms 5]

Why: `pellucid bench serve` measures a server with one client process; a client that spends more CPU per
token than the server caps the figure and delivers tokens in bursts (near-zero inter-token gaps). The
stand-in server runs in its own process; the table gives each client's CPU time per token, its share of a
core, the output rate and the ITL p50 (the stand-in's gap when the client keeps up).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pellucid.bench.common import print_table  # noqa: E402
from pellucid.bench.serve_load import (LoadRequest, RequestResult, drive, make_requests, percentile,  # noqa: E402
                                       summarize)
from tests.server.server_harness import free_port  # noqa: E402

STAND_IN = """
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

GAP = float(sys.argv[2]) / 1000

async def completions(request):
    n = (await request.json())["max_tokens"]
    async def events():
        for _ in range(n):
            await asyncio.sleep(GAP)
            yield "data: " + json.dumps({"object": "text_completion", "choices": [
                {"index": 0, "text": " tok", "finish_reason": None}]}) + "\\n\\n"
        yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")

async def models(request):
    return JSONResponse({"data": [{"id": "stand-in"}]})

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
uvicorn.run(app, port=int(sys.argv[1]), log_level="warning")
"""


async def drive_httpx(base: str, requests: list[LoadRequest]) -> tuple[list[RequestResult], float]:
    """The same requests all at once through httpx, read line by line as serve_load reads them."""
    import httpx

    async def one(client: httpx.AsyncClient, request: LoadRequest) -> RequestResult:
        result = RequestResult(ok=False, prompt_tokens=len(request.prompt))
        body = {"model": "stand-in", "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    result.observe(json.loads(line[len("data: "):]))
        return result.finish()

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, r) for r in requests))
        return list(results), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port), str(args.gap_ms)])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                asyncio.run(drive(base, make_requests(1, (4, 4), (2, 2), (10, 100), 0), float("inf")))
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the stand-in SSE server did not start") from None
                time.sleep(0.2)
        requests = make_requests(args.streams, (32, 1024), (16, 512), (10, 1000), args.seed)
        rows = []
        for name, run in (("aiohttp (pellucid bench serve)", lambda: drive(base, requests, float("inf"))),
                          ("httpx", lambda: drive_httpx(base, requests))):
            cpu = time.process_time()
            results, duration = asyncio.run(run())
            cpu = time.process_time() - cpu
            s = summarize(results, duration)
            itls = [gap * 1000 for r in results for gap in r.itls]
            rows.append([name, f"{cpu / max(s.output_tokens, 1) * 1e6:.1f}", f"{cpu / duration:.2f}",
                         f"{s.output_tok_s:,.0f}", f"{percentile(itls, 50):.2f}", str(s.num_failed)])
    finally:
        server.terminate()
        server.wait()
    print(f"\n{args.streams} streams at once, a token every {args.gap_ms:g} ms per stream (stand-in server)")
    print_table(["client", "client CPU us/token", "client cores", "output tok/s", "ITL p50 ms", "failed"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
