"""Mixture-of-experts models through the engine on the CPU against transformers: mixed batches, forced chunked
prefill, prefix-cache hits and preemption give transformers' greedy tokens; extraction and FlashHead work."""
from __future__ import annotations

import pytest
import torch

from pellucid import LLM, SamplingParams
from tests.reference import hf_forward, random_prompts, relative_error

ARCHS = ["qwen3-moe", "qwen2-moe", "mixtral"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_models(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        return cache[arch]
    return get


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_prefix_hits_and_preemption_give_hf_greedy_tokens(tiny_model_factory, hf_models, arch):
    hf = hf_models(arch)
    seed = ARCHS.index(arch)
    prefix = random_prompts(seed, [24])[0]
    prompts = [prefix + tail for tail in random_prompts(seed + 10, [5, 11, 3])] + random_prompts(seed + 20, [19, 2, 27])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [_hf_greedy(hf, p, 12) for p in prompts]
    # A pool and a token budget this small split prompts over steps, mix prefills with decodes and preempt.
    llm = LLM(tiny_model_factory(arch), dtype="float32", device="cpu", num_kv_blocks=24, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    # Prefix hits: once the first prompt ran, the others find the shared prefix in the cache.
    roomy = LLM(tiny_model_factory(arch), dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
                max_num_batched_tokens=16)
    first = roomy.generate(prompts[:1], params, use_tqdm=False)
    again = roomy.generate(prompts[1:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + again] == expected[:3]
    assert all(o.num_cached_tokens >= 20 for o in again)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_extraction_of_a_moe_model_equals_hf_hidden_states(tiny_model_factory, hf_models, tmp_path, arch):
    from pellucid.extraction import HiddenStatesDataset

    hf = hf_models(arch)
    llm = LLM(tiny_model_factory(arch), dtype="float32", device="cpu", num_kv_blocks=128,
              max_num_batched_tokens=16)
    prompts = random_prompts(40 + ARCHS.index(arch), [30, 9, 17])
    llm.extract_hidden_states(prompts, layers=[0, 1], output_dir=str(tmp_path), progress=False)
    for item in HiddenStatesDataset(str(tmp_path)):
        ref = hf_forward(hf, prompts[int(item["id"])])
        expected = torch.stack([ref["layers"][0], ref["layers"][1]], dim=1)
        assert relative_error(item["hidden_states"], expected) <= TOLERANCE


def test_flashhead_on_a_moe_model_with_all_probes_equals_the_dense_head(tiny_model_factory):
    from pellucid.cli import main as cli_main

    model_dir = tiny_model_factory("qwen3-moe", seed=5)
    assert cli_main(["flashhead", "build", model_dir, "--iterations", "3", "--device", "cpu"]) == 0
    engine = dict(device="cpu", num_kv_blocks=128, max_model_len=128)
    dense = LLM(model_dir, **engine)
    flash = LLM(model_dir, head="flashhead", head_options={"probes": 32}, **engine)
    assert flash.engine.runner.head.describe()["name"] == "flashhead"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(3, [6, 14, 3])
    assert ([o.outputs[0].token_ids for o in flash.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)])
