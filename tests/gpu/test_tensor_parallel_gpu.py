"""Tensor parallelism on GPUs (NCCL): TP=2 with CUDA graphs (the collectives captured in them), async
scheduling and the fused kernels gives what TP=1 gives in float32, traced and untraced, with the dense head
and a sharded FlashHead; asking for more ranks than GPUs is a clear start-up error. Skipped without 2 GPUs."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")

KWARGS = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=512)


def _prompts(seed: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


@pytest.mark.parametrize("head", ["dense", "flashhead"])
def test_tp2_on_gpus_equals_tp1(tiny_model_factory, head):
    from pellucid.cli import main as cli_main
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams
    from pellucid.tracing import Add, Save, TracePlan

    model_dir = tiny_model_factory("qwen3", seed=4, num_hidden_layers=3)
    head_kwargs = {}
    if head == "flashhead":
        if not os.path.exists(os.path.join(model_dir, "flashhead")):
            assert cli_main(["flashhead", "build", model_dir, "--iterations", "3", "--device", "cpu"]) == 0
        head_kwargs = dict(head="flashhead", head_options={"probes": 4})
    prompts = _prompts(3, 10)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=16 + i, ignore_eos=True)
              for i in range(len(prompts))]
    # Taps at a sharded site (q_proj.output: gathered inside the graph variant) and a whole one.
    taps = TracePlan([Save(site="model.layers.1.self_attn.q_proj", name="q"), Save(site="model.layers.2", name="h"),
                      Add(site="model.layers.0.mlp.act_fn", value=torch.full((128,), 0.05))])
    extras = [{"trace": taps} if i % 4 == 0 else None for i in range(len(prompts))]
    results = []
    for tp in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=tp, engine_process=True, **KWARGS, **head_kwargs)
        try:
            assert llm.info.cuda_graphs
            results.append(llm.generate(prompts, params, use_tqdm=False, extras=extras))
        finally:
            llm.shutdown()
    tp1, tp2 = results
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]
    for a, b in zip(tp1, tp2):
        if a.extras:
            for name in ("q", "h"):
                torch.testing.assert_close(b.extras["saves"][name].cpu(), a.extras["saves"][name].cpu(),
                                           rtol=1e-4, atol=1e-4)


def test_more_ranks_than_gpus_is_a_startup_error(tiny_model_factory):
    from pellucid.engine.core_client import EngineStartupError
    from pellucid.llm import LLM
    count = torch.cuda.device_count()
    with pytest.raises(EngineStartupError, match=f"needs {count + 1} GPUs"):
        LLM(tiny_model_factory("qwen3", num_hidden_layers=2), tensor_parallel_size=count + 1, **KWARGS)
