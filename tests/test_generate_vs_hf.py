"""End-to-end: Pellucid's greedy generations and logprobs equal transformers' on tiny random models."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pellucid import LLM, SamplingParams
from tests.conftest import ARCHS


def _random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    vocab = llm.engine.runner.head.vocab_size
    prompts = _random_prompts(vocab, [5, 17, 33, 50], seed=hash(arch) % 1000)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == _hf_greedy(model_dir, prompts, 32)


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu")
    vocab = llm.engine.runner.head.vocab_size
    prompt = _random_prompts(vocab, [21], seed=7)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), dim=-1)
    # prompt logprobs: position p scores prompt token p
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        tok = prompt[p]
        assert abs(entry[tok].logprob - ref[p - 1, tok].item()) < 1e-4
        assert entry[tok].rank == int((ref[p - 1] > ref[p - 1, tok]).sum().item()) + 1
        top = torch.topk(ref[p - 1], 2).indices.tolist()
        assert set(top) <= set(entry)
    for j, tok in enumerate(out.outputs[0].token_ids):
        row = ref[len(prompt) - 1 + j]
        entry = out.outputs[0].logprobs[j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == 1            # greedy picks the top token
        assert set(torch.topk(row, 3).indices.tolist()) <= set(entry)
