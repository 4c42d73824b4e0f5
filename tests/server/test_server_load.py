"""Many concurrent streaming clients, and clients that go away mid-request."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pellucid.sampling_params import SamplingParams
from server_harness import MODEL_NAME, random_prompts, wait_until
from tests.step_faults import slowed_steps


def engine_idle(server) -> bool:
    return (server.metric("pellucid:num_requests_running") == 0
            and server.metric("pellucid:num_requests_waiting") == 0
            and server.metric("pellucid:kv_cache_used_blocks") == 0)


def test_64_concurrent_streams_complete_batched_and_free_their_blocks(server, reference_llm):
    prompts = random_prompts(42, 64)
    max_tokens = 16
    refs = reference_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                  use_tqdm=False)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str):
            stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, finish = [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    text.append(choice.text)
                    finish = choice.finish_reason or finish
            return "".join(text), finish

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    # Batching from the engine's own counters (a /metrics poller beside 64 streams on a busy 2-core machine
    # can miss the running peak): requests served one at a time would make about one token per step.
    steps0, tokens0 = server.metric("pellucid:engine_steps"), server.metric("pellucid:generation_tokens_total")
    results = asyncio.run(run())
    assert [text for text, _ in results] == [r.outputs[0].text for r in refs]
    assert all(finish == "length" for _, finish in results)
    # The engine's statistics reach the frontend with its outputs: wait for the last step's.
    wait_until(lambda: server.metric("pellucid:generation_tokens_total") - tokens0 == 64 * max_tokens)
    steps = server.metric("pellucid:engine_steps") - steps0
    assert 64 * max_tokens / steps > 4, steps
    wait_until(lambda: engine_idle(server))


def test_disconnect_mid_stream_aborts_within_one_step_and_frees_blocks(threaded_server):
    server = threaded_server
    llm = server.llm
    generated_before = server.metric("pellucid:generation_tokens_total")
    aborted_before = llm.get_stats().num_aborted
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks = 0
    with slowed_steps(llm, 0.01), httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks == 3:
                    break
        # Leaving the block closed the connection mid-stream.
        wait_until(lambda: llm.get_stats().num_aborted == aborted_before + 1)
    wait_until(lambda: engine_idle(server))
    generated = server.metric("pellucid:generation_tokens_total") - generated_before
    assert 3 <= generated < 200


def test_disconnect_during_non_streamed_request_aborts(threaded_server):
    server = threaded_server
    llm = server.llm
    generated_before = server.metric("pellucid:generation_tokens_total")
    aborted_before = llm.get_stats().num_aborted
    n, max_tokens = 8, 240
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "n": n, "temperature": 1.0,
            "ignore_eos": True}
    with slowed_steps(llm, 0.01):      # 240 steps take >= 2.4 s: the client gives up long before
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        wait_until(lambda: llm.get_stats().num_aborted == aborted_before + n)
    wait_until(lambda: engine_idle(server))
    generated = server.metric("pellucid:generation_tokens_total") - generated_before
    assert generated < n * max_tokens
