"""The server with its engine core in another process (the default): concurrent streams with clients
leaving, and bad input refused before anything reaches the engine."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random

import httpx
import pytest

from pellucid.sampling_params import SamplingParams
from server_harness import MODEL_NAME, random_prompts, wait_until


def _engine_idle(server) -> bool:
    stats = server.llm.get_stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_64_streams_with_random_disconnects(server, reference_llm, seed):
    assert server.llm.info.pid != os.getpid()      # the engine core runs in its own process
    rng = random.Random(seed)
    prompts = random_prompts(100 + seed, 64)
    leave_after = {i: rng.randint(1, 5) for i in rng.sample(range(64), 20)}     # chunks read before leaving
    # The clients that leave asked for far more tokens than they read: the engine is still generating for
    # them when they go.
    max_tokens = [200 if i in leave_after else rng.randint(8, 48) for i in range(len(prompts))]
    refs = reference_llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                            for m in max_tokens], use_tqdm=False)
    aborted_before = server.llm.get_stats().num_aborted

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, str | None, int]:
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "stream": True, "ignore_eos": True}
        text, finish, chunks = [], None, 0
        async with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                if i in leave_after and chunks >= leave_after[i]:
                    break       # leaving the block closes the connection mid-stream
        return "".join(text), finish, chunks

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    # The server and this client share the test process, which holds what the whole suite left on its heap.
    # Its full garbage collections stall the frontend long enough for the engine process to finish requests
    # before their clients' disconnects reach it: four full CI runs failed this test so (alone it never did),
    # and with the heap frozen, so that collections no longer scan it, a full run passed.
    gc.collect()
    gc.freeze()
    try:
        results = asyncio.run(run())
    finally:
        gc.unfreeze()
    for i, (text, finish, _) in enumerate(results):
        if i not in leave_after:
            assert (text, finish) == (refs[i].outputs[0].text, "length"), i
    # Every request whose client left before its end was aborted, and nothing leaks. (A tiny random model
    # samples many byte tokens that spell no text alone, so a request may reach its end within the chunks a
    # client reads before leaving: that one finished, and was not aborted.)
    left = [i for i in leave_after if results[i][1] is None]
    assert all(results[i][2] == leave_after[i] for i in left) and len(left) >= len(leave_after) // 2
    wait_until(lambda: _engine_idle(server), timeout=30)
    assert server.llm.get_stats().num_aborted - aborted_before == len(left)
    assert server.metric("pellucid:kv_cache_used_blocks") == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[10**7]], "max_tokens": 2}, "prompt"),
    ({"prompt": "hi " * 400, "max_tokens": 2}, "prompt"),
    ({"prompt": "hi", "max_tokens": 2, "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 2, "interventions": [{"op": "save", "site": "model.layrs.0"}]}, "interventions"),
    ({"prompt": "hi", "max_tokens": 2, "n": 2, "interventions": [{"op": "save", "site": "model.norm"}]},
     "interventions"),
])
def test_bad_input_is_a_400_before_anything_reaches_the_engine(server, body, param):
    before = server.llm.get_stats()
    response = httpx.post(f"{server.base_url}/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    good = httpx.post(f"{server.base_url}/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
    assert good.status_code == 200
    wait_until(lambda: server.llm.get_stats().num_requests_added > before.num_requests_added)
    after = server.llm.get_stats()
    assert after.num_requests_added == before.num_requests_added + 1      # only the good one arrived
    assert after.num_requests_refused == before.num_requests_refused


def test_metrics_carry_the_engine_processes_counters(server):
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 5, "ignore_eos": True}
    before = server.metric("pellucid:generation_tokens_total")
    assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: server.metric("pellucid:generation_tokens_total") >= before + 5)
    assert server.metric("pellucid:kv_cache_total_blocks") == server.llm.info.num_blocks
