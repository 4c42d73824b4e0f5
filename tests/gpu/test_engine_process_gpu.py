"""The engine core in its own process on the GPU gives what the in-process engine gives: float32 greedy
tokens, seeded samples, and traced saves; the frontend process never touches CUDA. Skipped without CUDA."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KWARGS = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=1024)


def _prompts(seed: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_process_on_the_gpu_equals_in_process(tiny_model_factory, seed):
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams
    from pellucid.tracing import Save, TracePlan

    model_dir = tiny_model_factory("qwen3", seed=seed, num_hidden_layers=3)
    prompts = _prompts(seed, 8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12 + i, ignore_eos=True)
              for i in range(len(prompts))]
    extras = [{"trace": TracePlan([Save(site="model.layers.1", name="h")])} if i % 3 == 0 else None
              for i in range(len(prompts))]
    results = []
    for engine_process in (False, True):
        llm = LLM(model_dir, engine_process=engine_process, **KWARGS)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False, extras=extras))
        finally:
            llm.shutdown()
    inproc, mp = results
    assert [o.outputs[0].token_ids for o in mp] == [o.outputs[0].token_ids for o in inproc]
    for a, b in zip(inproc, mp):
        if a.extras:
            torch.testing.assert_close(b.extras["saves"]["h"], a.extras["saves"]["h"].cpu(), rtol=1e-5, atol=1e-5)


def test_the_frontend_process_never_initializes_cuda(tiny_model_factory):
    """Only the engine process holds a CUDA context: an AsyncLLM frontend streams without touching the GPU."""
    model_dir = tiny_model_factory("qwen3", num_hidden_layers=2)
    script = f"""
import asyncio, torch
from pellucid.engine.async_llm import AsyncLLM
from pellucid.sampling_params import SamplingParams
llm = AsyncLLM({model_dir!r}, device="cuda", dtype="bfloat16", max_model_len=256, num_kv_blocks=256)
async def main():
    async for out in llm.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)):
        pass
    return out
out = asyncio.run(main())
assert len(out.outputs[0].token_ids) == 8
print("INITIALIZED", torch.cuda.is_initialized())
llm.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "INITIALIZED False" in done.stdout
