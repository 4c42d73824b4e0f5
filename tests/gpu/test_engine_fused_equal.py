"""Kernels that take over another kernel's work (the rotary kernels storing K/V in the cache, rotary and
SiLU-and-mul as GEMM epilogues, the multi-program argmax, q/k norm + rotary inside decode attention): engines
give the same greedy tokens with and without."""
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


# (kernel, architecture, kernels off in both runs so that this one is what runs, module and function it calls)
EPILOGUE_CASES = [
    ("skinny_qkv_rotary", "llama", (), "pellucid.kernels.skinny_paired", "qkv_rotary_linear"),
    ("skinny_gate_up_silu", "qwen3", ("skinny_silu_down",), "pellucid.kernels.skinny_paired", "gate_up_silu_linear"),
    ("argmax", "llama", (), "pellucid.kernels.argmax", "argmax_rows"),
    ("attention_qk_norm_rotary", "qwen3", (), "pellucid.attention.triton_backend",
     "TritonAttentionBackend.forward_qk_norm_rotary"),
    ("add_rms_norm_top_k", "qwen3-moe", (), "pellucid.kernels.add_rms_norm", "add_top_k_rms_norm"),
]


@pytest.mark.parametrize("kernel,arch,off,module,function", EPILOGUE_CASES)
def test_engine_greedy_equal_with_and_without(tiny_model_factory, monkeypatch, kernel, arch, off, module, function):
    """Engines give the same greedy tokens (float32, chunked prefill and decode steps, CUDA graphs) with
    rotary in the q/k/v GEMM, SiLU-and-mul in the gate/up GEMM, the multi-program argmax, q/k norm + rotary
    in decode attention or a mixture of experts' top-k sum in the next add + RMSNorm as without, and
    with it the kernel does run. float32: an epilogue may change the GEMM's summation order (last-bit
    differences), which in bf16 would flip the tiny random model's many near-ties."""
    import importlib

    from tests.gpu.test_gpu_engine import _generate, _prompts
    target = importlib.import_module(module)
    *owners, name = function.split(".")       # a function of the module, or a method of one of its classes
    for owner in owners:
        target = getattr(target, owner)
    original = getattr(target, name)
    calls = []
    monkeypatch.setattr(target, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    model_dir = tiny_model_factory(arch, seed=5, num_hidden_layers=3)
    runs = {}
    for fused in (False, True):
        kernels = [k for k in DEFAULT_KERNELS if k not in off and (fused or k != kernel)]
        monkeypatch.setenv("PELLUCID_FUSED_KERNELS", ",".join(kernels))
        calls.clear()
        single, _ = _generate(model_dir, _prompts(5, 1), [40], device="cuda", dtype="float32")
        batch, _ = _generate(model_dir, _prompts(6, 5), [24] * 5, device="cuda", dtype="float32")
        runs[fused] = (single, batch)
        assert bool(calls) == fused, (kernel, fused, len(calls))
    assert runs[True] == runs[False]
