"""The rotary kernels storing K/V in the cache (pellucid.attention.fused_kv_store) instead of a KV-write
launch: engines give the same greedy tokens with and without it."""
from __future__ import annotations

import pytest
import torch

from pellucid.kernels import DEFAULT_KERNELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_equal_with_and_without_fused_kv_store(tiny_model_factory, monkeypatch, arch):
    """bf16: mixed prefill (chunked, several prompts) and decode steps, eager and CUDA graphs."""
    from tests.gpu.test_gpu_engine import _generate, _prompts
    model_dir = tiny_model_factory(arch, seed=4, num_hidden_layers=3)
    runs = {}
    for fused in (False, True):
        kernels = [k for k in DEFAULT_KERNELS if fused or k != "rotary_kv_store"]
        monkeypatch.setenv("PELLUCID_FUSED_KERNELS", ",".join(kernels))
        single, _ = _generate(model_dir, _prompts(5, 1), [40], device="cuda", dtype="bfloat16")
        batch, llm = _generate(model_dir, _prompts(6, 5), [24] * 5, device="cuda", dtype="bfloat16")
        assert llm.engine.runner.cuda_graphs is not None
        runs[fused] = (single, batch)
    assert runs[True] == runs[False]
