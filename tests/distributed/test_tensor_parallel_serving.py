"""AsyncLLM, the OpenAI server, FlashHead, async scheduling and extraction at TP=2 on the CPU (gloo): one
AsyncLLM whose FlashHead is sharded over the ranks and whose steps are launched ahead of their read-back
serves streams and HTTP requests as TP=1 does, and an extraction job on it writes each sample once, equal
to transformers."""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from pellucid import LLM, SamplingParams
from pellucid.engine.async_llm import AsyncLLM
from pellucid.extraction import HiddenStatesDataset, extract_hidden_states_async
from tests.reference import hf_forward, random_prompts, relative_error
from tests.server.server_harness import MODEL_NAME, start_server

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, head="flashhead", head_options={"probes": 4})
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(flashhead_model_factory) -> str:
    return flashhead_model_factory("qwen3", seed=29, num_hidden_layers=2)


@pytest.fixture(scope="module")
def tp2(model_dir):
    # Stepping ahead (the GPU default): every rank feeds the previous step's tokens, rank 0's, on the device.
    engine = AsyncLLM(model_dir, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    yield engine
    engine.shutdown()


async def _final(engine: AsyncLLM, prompt, params: SamplingParams):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last


def test_async_llm_and_server_equal_tp1_with_a_sharded_flashhead(model_dir, tp2):
    """Streams (greedy and seeded, with 4 of 32 clusters probed) and HTTP completions equal TP=1's
    (stepping serially); the TP=2 engine stepped ahead of its read-backs."""
    tp1 = LLM(model_dir, async_scheduling=False, **ENGINE)
    prompts = random_prompts(5, [9, 30, 4, 17], vocab=500)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)]
    for p in params:
        expected = [o.outputs[0].token_ids for o in tp1.generate(prompts, p, use_tqdm=False)]

        async def run() -> list:
            return await asyncio.gather(*(_final(tp2, prompt, p) for prompt in prompts))
        assert [o.outputs[0].token_ids for o in asyncio.run(run())] == expected
    assert tp2.get_stats().num_steps_ahead > 0

    server = start_server(tp2)
    try:
        text = ["the quick brown fox", "hello world"]
        expected = [o.outputs[0].text for o in tp1.generate(text, params[0], use_tqdm=False)]
        for prompt, want in zip(text, expected):
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["text"] == want
        card = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]
        assert card["pellucid"]["lm_head"]["name"] == "flashhead"
        fast = [line for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
                if line.startswith("pellucid:lm_head_rows_total{") and 'path="fast"' in line]
        assert fast and float(fast[0].rsplit(" ", 1)[1]) > 0     # FlashHead's fast path served the rows
    finally:
        server.stop()


def test_extraction_writes_each_sample_once(model_dir, tp2, tmp_path):
    """Rank 0's engine writes the files (no worker does), each sample once, equal to transformers."""
    from transformers import AutoModelForCausalLM
    prompts = random_prompts(9, [21, 6, 40, 13], vocab=500)
    summary = asyncio.run(extract_hidden_states_async(tp2, prompts, layers=[0, 1, -1], output_dir=str(tmp_path),
                                                      max_in_flight=3))
    assert summary.num_samples == len(prompts)
    dataset = HiddenStatesDataset(str(tmp_path))
    assert sorted(item["id"] for item in dataset) == [str(i) for i in range(len(prompts))]
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert files == sorted(entry["file"] for entry in dataset.entries)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for item in dataset:
        prompt = prompts[int(item["id"])]
        assert item["input_ids"].tolist() == prompt
        ref = hf_forward(hf, prompt)
        with torch.no_grad():
            final = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        expected = torch.stack([ref["layers"][0], ref["layers"][1], final], dim=1)
        assert relative_error(item["hidden_states"], expected) <= TOLERANCE
