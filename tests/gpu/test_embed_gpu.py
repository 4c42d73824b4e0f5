"""Embeddings on the GPU against transformers on the CPU: float32 within 1e-4, bf16 with CUDA graphs and
async scheduling by cosine; a dense and a mixture-of-experts model, and an engine without an LM head. Tiny random models; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(model_dir: str, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    return [torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(dim=0), dim=0) for h in hidden]


@pytest.mark.parametrize("arch,head,pooling", [("qwen3", "dense", "last"), ("qwen3-moe", "dense", "last"),
                                               ("qwen3", "none", "last"), ("qwen3", "dense", "mean")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_embeddings_equal_transformers(tiny_model_factory, arch, head, pooling, dtype):
    from pellucid import LLM

    model_dir = tiny_model_factory(arch, num_hidden_layers=2)
    prompts = random_prompts(3, [5, 60, 17, 33, 2, 90, 41, 8])
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=512, max_num_batched_tokens=64,
              head=head, pooler_config={"pooling_type": pooling})
    assert llm.engine.async_scheduling
    got = [torch.tensor(out.outputs.embedding) for out in llm.embed(prompts, use_tqdm=False)]
    for actual, expected in zip(got, _reference(model_dir, prompts, pooling)):
        if dtype == "float32":
            assert (actual - expected).abs().max().item() <= 1e-4
        else:
            assert torch.dot(actual, expected).item() >= 0.995
    llm.shutdown()
