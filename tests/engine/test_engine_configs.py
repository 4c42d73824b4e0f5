"""Scheduling and caching choices never change greedy outputs; prefix caching saves exactly the shared blocks."""
from __future__ import annotations

import pytest
import torch

from pellucid import LLM, SamplingParams


def _prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


CONFIGS = {
    "baseline": dict(),
    "no-chunked-prefill": dict(enable_chunked_prefill=False),
    "tiny-token-budget": dict(max_num_batched_tokens=24),     # forces chunked prefill mixed with decodes
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "block-size-32": dict(block_size=32),
    "one-seq-at-a-time": dict(max_num_seqs=1),
    "64-seqs": dict(max_num_seqs=64),
    "preemption": dict(num_kv_blocks=9),                      # too small for all requests at once
}


@pytest.fixture(scope="module")
def workload(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    ref_llm = LLM(model_dir, dtype="float32", device="cpu")
    vocab = ref_llm.engine.runner.head.vocab_size
    shared = _prompts(vocab, 1, [40])[0]
    prompts = _prompts(vocab, 2, [7, 61, 30, 90, 12, 45]) + [shared + [5, 6, 7], shared + [8, 9]]
    return model_dir, prompts, _greedy(ref_llm, prompts)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_gives_identical_greedy_outputs(workload, name):
    model_dir, prompts, expected = workload
    llm = LLM(model_dir, dtype="float32", device="cpu", **CONFIGS[name])
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0
    if name == "preemption":
        assert stats.num_preemptions > 0


def test_prefix_cache_computes_only_uncached_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=16)
    vocab = llm.engine.runner.head.vocab_size
    prefix = _prompts(vocab, 3, [48])[0]                     # exactly 3 full blocks
    first, second = prefix + _prompts(vocab, 4, [5])[0], prefix + _prompts(vocab, 5, [9])[0]
    _greedy(llm, [first], 4)
    before = llm.engine.stats().prompt_tokens_total
    out = llm.generate([second], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    assert llm.engine.stats().prompt_tokens_total - before == len(second) - 48
    fresh = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    assert out.outputs[0].token_ids == _greedy(fresh, [second], 4)[0]
