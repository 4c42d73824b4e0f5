"""Classification on the GPU against transformers on the CPU: float32 logits within 1e-4, bf16 with CUDA graphs
and async scheduling close; a dense and a mixture-of-experts classifier. Tiny random models; skipped without
CUDA."""
from __future__ import annotations

import pytest
import torch

from pellucid.tiny_models import build_tiny_classifier
from tests.reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_classify_equals_transformers(tmp_path, arch, dtype):
    from transformers import AutoModelForSequenceClassification

    from pellucid import LLM

    model_dir = build_tiny_classifier(arch, str(tmp_path / arch), num_labels=3, seed=2)
    prompts = random_prompts(4, [5, 60, 17, 33, 2, 90, 41, 8])
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=512, max_num_batched_tokens=64)
    assert llm.engine.async_scheduling and llm.info.lm_head["name"] == "none"
    for prompt, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        actual = torch.tensor(out.outputs.logits)
        tolerance = 1e-4 if dtype == "float32" else 0.05 * expected.abs().max().item() + 0.02
        assert (actual - expected).abs().max().item() <= tolerance, (actual, expected)
    llm.shutdown()
