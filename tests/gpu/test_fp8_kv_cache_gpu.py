"""An FP8 KV cache on the GPU: the compiled Triton kernels store the torch backend's bytes and attend as it does
(tests/attention/test_fp8_kv_cache.py runs the same checks under the interpreter on the CPU), and the engine on
the triton backend with CUDA graphs (chunked prefill, a prefix hit, mixed batches) gives the torch backend's
greedy tokens and log-probabilities in float32, with and without a checkpoint's calibrated KV-cache scales."""
from __future__ import annotations

import pytest
import torch

from tests.reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fp8_kv_kernels_on_gpu():
    from tests.attention.test_fp8_kv_cache import run_kernel_checks
    run_kernel_checks("cuda")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_triton_engine_equals_the_torch_backend_on_an_fp8_cache(tiny_model_factory, arch: str, kv: str):
    _check_triton_equals_torch(tiny_model_factory(arch), kv)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_triton_engine_applies_a_checkpoints_kv_scales_as_the_torch_backend(tiny_model_factory, tmp_path, arch: str):
    from tests.models.test_kv_cache_scales import _layer_scales, _num_layers, _with_scales

    src = tiny_model_factory(arch)
    _check_triton_equals_torch(_with_scales(src, str(tmp_path / "scaled"), _layer_scales(_num_layers(src), seed=5),
                                            "k_scale"), "fp8")


def _check_triton_equals_torch(model_dir: str, kv: str) -> None:
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams
    from tests.gpu.engine_runs import release

    shared = random_prompts(3, [48])[0]
    prompts = random_prompts(4, [3, 70, 21, 130]) + [shared + p for p in random_prompts(5, [6, 11, 17])]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    runs = {}
    for backend in ("triton", "torch"):
        llm = LLM(model_dir, device="cuda", dtype="float32", kv_cache_dtype=kv, attention_backend=backend,
                  max_model_len=512, num_kv_blocks=256, max_num_batched_tokens=64)
        assert llm.engine.runner.kv_caches[0].dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
        llm.generate([shared + [7]], SamplingParams(max_tokens=1), use_tqdm=False)      # the prefix hit below
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if backend == "triton":
            assert llm.engine.runner.cuda_graphs.num_replays > 0
        assert all(o.num_cached_tokens >= 48 for o in outputs[4:])
        runs[backend] = [(o.outputs[0].token_ids, [{t: e.logprob for t, e in pos.items()} for pos in o.outputs[0].logprobs])
                         for o in outputs]
        release(llm)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs["triton"], runs["torch"]):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) <= 1e-3 for t in got)
