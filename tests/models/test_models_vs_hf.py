"""Pellucid's models against transformers' own implementation of the same random checkpoint."""
from __future__ import annotations

import pytest
import torch

from pellucid.models.loader import load_model
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import (PagedModelRunner, hf_logits, load_hf_model, random_token_prompts,
                                  relative_error)

ARCHS = ["llama", "llama-tied", "llama-bias", "llama-rope-scaling", "llama-yarn", "llama-linear-rope",
         "qwen2", "qwen3", "qwen3-untied", "mistral"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, str(tmp_path_factory.mktemp(arch)), seed=len(cache))
        return cache[arch]
    return get  # type: ignore[return-value]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_matches_hf(checkpoints, arch: str, block_size: int) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    for seed in range(2):
        prompts = random_token_prompts(seed, [7, 33, 1, 20 + 17 * seed])
        runner = PagedModelRunner(model, block_size, seed=seed)
        batch_logits = runner.step(list(enumerate(prompts)), num_padded_tokens=sum(map(len, prompts)) + 3)
        for prompt, logits in zip(prompts, batch_logits):
            assert relative_error(logits, hf_logits(hf_model, prompt)) <= TOLERANCE


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama-yarn"])
def test_chunked_prefill_and_decode_match_one_shot(checkpoints, arch: str, block_size: int) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    for seed in range(2):
        prompt = random_token_prompts(100 + seed, [45])[0]
        expected = hf_logits(hf_model, prompt)
        runner = PagedModelRunner(model, block_size, seed=seed)
        one_shot = runner.step([("one-shot", prompt)])[0]
        split = 19 + seed * 8
        chunked = torch.cat([runner.step([("chunked", prompt[:split])])[0],
                             runner.step([("chunked", prompt[split:])])[0]])
        decoded = torch.cat([runner.step([("decode", [token])])[0] for token in prompt])
        for logits in (one_shot, chunked, decoded):
            assert relative_error(logits, expected) <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_of_decode_chunk_and_fresh_prefill(checkpoints, arch: str) -> None:
    """One step holding a decode, a chunk on top of a cached prefix, and a prompt from zero."""
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    for seed in range(2):
        decode_prompt, chunk_prompt, fresh_prompt = random_token_prompts(200 + seed, [21, 40, 13])
        runner = PagedModelRunner(model, 16, seed=seed)
        runner.step([("decode", decode_prompt[:-1]), ("chunk", chunk_prompt[:17])])
        decode_logits, chunk_logits, fresh_logits = runner.step(
            [("decode", decode_prompt[-1:]), ("chunk", chunk_prompt[17:]), ("fresh", fresh_prompt)])
        assert relative_error(decode_logits, hf_logits(hf_model, decode_prompt)[-1:]) <= TOLERANCE
        assert relative_error(chunk_logits, hf_logits(hf_model, chunk_prompt)[17:]) <= TOLERANCE
        assert relative_error(fresh_logits, hf_logits(hf_model, fresh_prompt)) <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_layer_outputs_are_hf_hidden_states(checkpoints, arch: str) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    prompt = random_token_prompts(7, [26])[0]
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, out.clone()))
             for i, layer in enumerate(model.model.layers)]
    try:
        PagedModelRunner(model, 16).step([("r", prompt)])
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        hf_hidden = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    # The last entry of HF's tuple is after the final norm; compare the layers HF reports raw.
    for i in range(len(model.model.layers) - 1):
        assert relative_error(captured[i], hf_hidden[i + 1][0]) <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_greedy_generation_matches_hf(checkpoints, arch: str) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    for seed in range(2):
        prompt = random_token_prompts(300 + seed, [9])[0]
        with torch.no_grad():
            # No EOS: min_new_tokens would otherwise mask it out of transformers' argmax, and not of ours.
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                         min_new_tokens=12, eos_token_id=None,
                                         pad_token_id=0)[0, len(prompt):].tolist()
        runner = PagedModelRunner(model, 16, seed=seed)
        logits = runner.step([("r", prompt)])[0]
        generated: list[int] = []
        for _ in range(12):
            generated.append(int(logits[-1].argmax()))
            logits = runner.step([("r", generated[-1:])])[0]
        assert generated == expected


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path) -> None:
    model_dir = build_tiny_model("mistral", str(tmp_path), sliding_window=64)
    with pytest.raises(NotImplementedError, match="sliding_window=64"):
        load_model(model_dir, torch.float32, "cpu")
    model, _ = load_model(model_dir, torch.float32, "cpu", max_model_len=64)
    assert model.num_attention_layers == 2


def test_model_exposes_hf_module_paths_and_cache_shape(checkpoints) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints("qwen3")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_names = {name for name, _ in AutoModelForCausalLM.from_pretrained(model_dir).named_modules()}
    ours = {name for name, _ in model.named_modules()}
    for name in ("model.embed_tokens", "model.layers.1.self_attn.q_norm", "model.layers.0.self_attn.o_proj",
                 "model.layers.1.mlp.down_proj", "model.layers.0.post_attention_layernorm", "model.norm", "lm_head"):
        assert name in ours and name in hf_names
    assert {n for n in hf_names if n.startswith("model.layers.")} <= ours
    assert (model.num_attention_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_model_matches_hf(checkpoints, arch: str) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cuda")
    hf_model = load_hf_model(model_dir)
    prompts = random_token_prompts(400, [11, 40, 3])
    runner = PagedModelRunner(model, 16)
    first = runner.step([(i, p[:-1]) for i, p in enumerate(prompts)])
    last = runner.step([(i, p[-1:]) for i, p in enumerate(prompts)])
    for prompt, a, b in zip(prompts, first, last):
        assert relative_error(torch.cat([a, b]).cpu(), hf_logits(hf_model, prompt)) <= TOLERANCE
