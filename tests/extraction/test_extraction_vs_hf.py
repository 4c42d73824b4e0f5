"""Extracted hidden states against transformers' own forward, for every architecture, under chunked
prefill, prefix caching with a shared prefix, and preemption."""
from __future__ import annotations

import pytest
import torch

from pellucid import SamplingParams
from pellucid.extraction import HiddenStatesDataset, read_job_info
from tests.extraction.conftest import (EXTRACTION_ARCHS, TOLERANCE, expected_states, num_layers_of, random_prompts,
                                       relative_error)


def _layers(arch: str) -> list[int]:
    last = num_layers_of(arch) - 1
    return [0, 1, last, -1]


def _check_against_hf(arch, out_dir, prompts, hf_reference, layers):
    ds = HiddenStatesDataset(str(out_dir))
    assert sorted(e["id"] for e in ds.entries) == sorted(str(i) for i in range(len(prompts)))
    for item in ds:
        prompt = prompts[int(item["id"])]
        assert item["input_ids"].tolist() == prompt
        assert item["prompt_length"] == len(prompt)
        assert item["hidden_states"].shape == (len(prompt), len(layers), 64)
        assert item["hidden_states"].dtype == torch.float32
        ref = hf_reference(arch, prompt)
        assert relative_error(item["hidden_states"], expected_states(ref, layers)) <= TOLERANCE
        # The HuggingFace convention the layer ids follow: hidden_states[i + 1] (last layer excepted).
        for j, layer in enumerate(layers):
            if 0 <= layer < num_layers_of(arch) - 1:
                assert relative_error(item["hidden_states"][:, j], ref["hidden_states"][layer + 1]) <= TOLERANCE


@pytest.mark.parametrize("arch", EXTRACTION_ARCHS)
def test_chunked_prefill_matches_transformers(make_ext_llm, hf_reference, tmp_path, arch):
    """Prompts longer than the step token budget are split across steps and still give one full sample."""
    llm = make_ext_llm(arch, max_num_batched_tokens=16, max_num_seqs=4)
    seed = EXTRACTION_ARCHS.index(arch)
    prompts = random_prompts(seed, [45, 7, 33, 20])
    layers = _layers(arch)
    summary = llm.extract_hidden_states(prompts, layers=layers, output_dir=str(tmp_path), progress=False)
    assert summary.num_samples == len(prompts) and summary.num_tokens == sum(map(len, prompts))
    assert read_job_info(str(tmp_path))["layers"] == layers
    _check_against_hf(arch, tmp_path, prompts, hf_reference, layers)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_still_get_hidden_states(make_ext_llm, hf_reference, tmp_path, arch):
    """With the prefix of every prompt already cached, extraction still computes (and writes) every position."""
    llm = make_ext_llm(arch, enable_prefix_caching=True, block_size=8)
    seed = 10 + EXTRACTION_ARCHS.index(arch)
    prefix = random_prompts(seed, [32])[0]
    tails = random_prompts(seed + 1, [5, 11, 3])
    prompts = [prefix + tail for tail in tails]
    warm = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)   # fills the prefix cache
    assert warm[2].num_cached_tokens >= 24
    hits_before = llm.engine.stats().prefix_cache_hits
    layers = _layers(arch)
    llm.extract_hidden_states(prompts, layers=layers, output_dir=str(tmp_path), progress=False)
    _check_against_hf(arch, tmp_path, prompts, hf_reference, layers)
    # The cache is still there for ordinary requests.
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens >= 24 and llm.engine.stats().prefix_cache_hits > hits_before


@pytest.mark.parametrize("arch", ["llama", "mistral", "lfm2"])
def test_preemption_matches_transformers(make_ext_llm, hf_reference, tmp_path, monkeypatch, arch):
    """A KV pool too small for the batch: generating requests grow and evict the newest requests, among
    them extraction passes in the middle of their prefill. Recomputed samples stay exact and whole."""
    llm = make_ext_llm(arch, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    scheduler = llm.engine.scheduler
    evicted_traced = []
    original = scheduler._preempt

    def record(request):
        evicted_traced.append(request.extras.get("trace") is not None)
        original(request)
    monkeypatch.setattr(scheduler, "_preempt", record)

    seed = 20 + EXTRACTION_ARCHS.index(arch)
    prompts = random_prompts(seed, [18, 9, 14, 21, 12, 16])
    layers = _layers(arch)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.extract_hidden_states(prompts, layers=layers, output_dir=str(tmp_path), generate=params, progress=False)
    assert any(evicted_traced), "no extraction pass was preempted; the test did not exercise recompute"

    reference = make_ext_llm(arch).generate(prompts, params, use_tqdm=False)
    for item in HiddenStatesDataset(str(tmp_path)):
        index = int(item["id"])
        response = reference[index].outputs[0].token_ids
        sequence = prompts[index] + response
        assert item["input_ids"].tolist() == sequence
        assert item["prompt_length"] == len(prompts[index])
        assert item["loss_mask"].tolist() == [False] * len(prompts[index]) + [True] * len(response)
        ref = hf_reference(arch, sequence)
        assert relative_error(item["hidden_states"], expected_states(ref, layers)) <= TOLERANCE
