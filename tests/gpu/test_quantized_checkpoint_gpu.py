"""Quantized checkpoints on the GPU: weights dequantize on the device the model is built on, to the same
values as on the CPU, and the engine serves them."""
from __future__ import annotations

import pytest
import torch

from pellucid import LLM, SamplingParams
from pellucid.models.loader import load_model
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import random_token_prompts
from tests.models.test_quantized_checkpoint import quantize_compressed_tensors, quantize_to_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_device_dequantization_equals_the_cpu(tmp_path, fmt) -> None:
    full = build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=5)
    if fmt == "fp8":
        model_dir = quantize_to_fp8(full, str(tmp_path / "q"), (16, 16), seed=1)
    else:
        model_dir = quantize_compressed_tensors(full, str(tmp_path / "q"), str(tmp_path / "ref"), "float", "block",
                                                block=(24, 40), scale_dtype=torch.bfloat16)
    cpu, _ = load_model(model_dir, torch.float32, "cpu")
    gpu, _ = load_model(model_dir, torch.float32, "cuda")
    cpu_params = dict(cpu.named_parameters())
    for name, param in gpu.named_parameters():
        assert torch.equal(param.cpu(), cpu_params[name]), name
    prompts = [{"prompt_token_ids": p} for p in random_token_prompts(3, [17, 40])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    on_cpu = LLM(model_dir, dtype="float32", device="cpu", max_model_len=96, num_kv_blocks=24)
    on_gpu = LLM(model_dir, dtype="float32", max_model_len=96, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in on_cpu.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in on_gpu.generate(prompts, params, use_tqdm=False)] == expected
    bf16 = LLM(model_dir, dtype="bfloat16", max_model_len=96)
    assert all(len(o.outputs[0].token_ids) == 8 for o in bf16.generate(prompts, params, use_tqdm=False))
