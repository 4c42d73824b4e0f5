"""No device-to-host sync in the engine step loop except the runner's marked readback of sampled ids.

Runs many engine steps (prefill, mixed, CUDA-graph decode, and eager decode past the largest graph)
with varied sampling parameters under torch.cuda.set_sync_debug_mode("error"): any other sync raises.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _params(i: int):
    from pellucid.sampling_params import SamplingParams
    from pellucid.structured import StructuredOutputsParams

    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=i),
        dict(temperature=1.0, top_k=20, min_p=0.05),
        dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
        dict(temperature=0.0, min_tokens=4, logprobs=3),
        dict(temperature=0.9, seed=i, logit_bias={7: 3.0, 11: -2.0}, allowed_token_ids=list(range(5, 300))),
        dict(temperature=0.8, seed=i, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,40}( [0-9]{1,9})*")),
    ]
    return SamplingParams(max_tokens=12 + i % 7, ignore_eos=True, **kinds[i % len(kinds)])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_steps_do_not_sync(tiny_model_factory, enforce_eager, arch):
    from pellucid.llm import LLM

    # qwen3-moe: the fused MoE routing, token layout and grouped GEMMs, whose sizes depend on the batch only.
    model_dir = tiny_model_factory(arch, num_hidden_layers=2)
    # Graph sizes up to 4 only: larger decode batches take the eager path, which must not sync either.
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=12,
              num_kv_blocks=1024, cuda_graph_sizes=[1, 2, 4], enforce_eager=enforce_eager)
    core = llm.engine
    g = torch.Generator().manual_seed(0)

    def add(i: int) -> None:
        prompt = torch.randint(5, 500, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
        llm.add_request(f"r{i}", prompt, _params(i))

    add(0)
    llm.step()   # first step outside the check: kernel compilation and allocator warm-up
    steps, finished = 0, set()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 14):      # arrivals while others decode: mixed prefill + decode steps
            add(i)
            for out in llm.step():
                finished |= {out.request_id} if out.finished else set()
            steps += 1
        while llm.has_unfinished_requests():
            for out in llm.step():
                finished |= {out.request_id} if out.finished else set()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert finished == {f"r{i}" for i in range(14)}
    assert steps > 20
    if not enforce_eager:
        assert core.runner.cuda_graphs.num_replays > 0
