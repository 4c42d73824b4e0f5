"""Async scheduling on the GPU: steps launched ahead of the previous step's readback, their input ids fed
from the device, give the serial engine's greedy tokens (float32, CUDA graphs, a batch that shrinks so the
feed takes both its in-order and its remapped path) and sync only at the marked readbacks."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(seed: int, count: int, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=g).tolist()
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(model_dir: str, prompts: list[list[int]], max_tokens: list[int], async_scheduling: bool):
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    llm = LLM(model_dir, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=1024,
              async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("seed", [0, 1])
def test_stepping_ahead_on_the_gpu_equals_serial(tiny_model_factory, seed, arch):
    model_dir = tiny_model_factory(arch, seed=seed, num_hidden_layers=2)
    prompts = _prompts(seed + 40, 11)
    lengths = [6 + 3 * i for i in range(len(prompts))]
    serial, _ = _generate(model_dir, prompts, lengths, async_scheduling=False)
    ahead, engine = _generate(model_dir, prompts, lengths, async_scheduling=True)
    assert engine.num_steps_ahead > 20
    assert engine.runner.cuda_graphs.num_replays > 0
    assert ahead == serial


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_stepping_ahead_does_not_sync(tiny_model_factory, arch):
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    model_dir = tiny_model_factory(arch, num_hidden_layers=2)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=12,
              num_kv_blocks=1024, cuda_graph_sizes=[1, 2, 4], async_scheduling=True)
    core = llm.engine
    g = torch.Generator().manual_seed(0)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, top_k=20)]

    def add(i: int) -> None:
        prompt = torch.randint(5, 500, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
        llm.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10 + i % 7, ignore_eos=True, **kinds[i % 3]))

    add(0)
    llm.step()   # kernel compilation and allocator warm-up outside the check
    finished: set[str] = set()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 12):
            add(i)
            finished |= {o.request_id for o in llm.step() if o.finished}
        while llm.has_unfinished_requests():
            finished |= {o.request_id for o in llm.step() if o.finished}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert finished == {f"r{i}" for i in range(12)}
    assert core.num_steps_ahead > 20
