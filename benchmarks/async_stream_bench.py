"""Streamed generation through AsyncLLM with the engine core in a thread of this process and in its own
process, against LLM.generate on the same requests (no HTTP: the engine-client path alone).

    python benchmarks/async_stream_bench.py --model DIR --device cpu --num-requests 128 --output-len 64
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

from pellucid.bench.common import print_table
from pellucid.engine.async_llm import AsyncLLM
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams


async def _stream_all(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> float:
    async def one(prompt: list[int]) -> None:
        async for _ in llm.generate(prompt, params):
            pass
    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[8, 32])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = dict(device=args.device, dtype=args.dtype, max_model_len=args.prompt_len[1] + args.output_len + 8)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens = args.num_requests * args.output_len

    llm = LLM(args.model, **engine)
    llm.generate(prompts[:4], params, use_tqdm=False)         # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    offline = tokens / (time.perf_counter() - start)
    llm.shutdown()
    rows = [["LLM.generate (final outputs only)", f"{offline:,.0f}", "1.00x"]]
    for engine_process in (False, True):
        async_llm = AsyncLLM(args.model, engine_process=engine_process, **engine)
        try:
            asyncio.run(_stream_all(async_llm, prompts[:4], params))
            rate = tokens / asyncio.run(_stream_all(async_llm, prompts, params))
        finally:
            async_llm.shutdown()
        home = "its own process" if engine_process else "a thread of this process"
        rows.append([f"AsyncLLM streamed, engine core in {home}", f"{rate:,.0f}", f"{rate / offline:.2f}x"])
    print(f"\n{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.output_len} greedy tokens each")
    print_table(["system", "output tok/s", "vs LLM.generate"], rows)


if __name__ == "__main__":
    main()
