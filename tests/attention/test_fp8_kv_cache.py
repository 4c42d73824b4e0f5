"""An FP8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2): the engine equals transformers whose attention sees its keys
and values rounded to the same 8-bit type (an attention function registered through transformers' own
AttentionInterface), under chunked prefill, prefix hits and mixed batches; the cache holds 4x a float32 one's
tokens in the same bytes; the Triton kernels (under the interpreter here, compiled in tests/gpu) store the torch
backend's bytes and attend as it does."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, dequantize_kv, quantize_kv, resolve_kv_cache_dtype
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from tests.gpu.check_support import interpreted_checks, interpreter_runs_loaded_loop_bounds
from tests.reference import random_prompts

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def test_quantize_rounds_to_nearest_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.06, 1.07, -3.3, 447.0, 500.0, -1e6, 1e-9])
    e4m3 = quantize_kv(x, torch.float8_e4m3fn).float()
    # e4m3 has 3 mantissa bits: 1.0625 is the midpoint of 1.0 and 1.125; 1.06 rounds down, 1.07 up.
    assert e4m3.tolist()[:5] == [0.0, 1.0, 1.0, 1.125, -3.25]
    assert e4m3[5] == 448.0 and e4m3[6] == 448.0 and e4m3[7] == -448.0 and e4m3[8] == 0.0
    assert quantize_kv(torch.tensor([1e6]), torch.float8_e5m2).float().item() == 57344.0
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_scaled_quantization_picks_the_nearest_fp8_value_of_the_scaled_input():
    """quantize_kv(x, fp8, s) * s against a brute-force search of every finite FP8 value for x / s's nearest."""
    x = torch.randn(4000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    for dtype in FP8.values():
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().double()
        grid = codes[torch.isfinite(codes)]
        for scale in (1.0, 0.37, 2.9, 0.0071):
            target = (x / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
            nearest = grid[(target[:, None] - grid[None, :]).abs().argmin(1)]
            got = quantize_kv(x.float(), dtype, scale).double()
            assert torch.equal(got, nearest), (dtype, scale)
            assert torch.allclose(dequantize_kv(quantize_kv(x.float(), dtype, scale), scale).double(), nearest * scale)


def hf_with_rounded_kv(model_dir: str, kv_dtype: torch.dtype, scales: dict[int, KvScales] | None = None):
    """transformers' model of the checkpoint (float32) whose attention gets every key and value rounded to
    kv_dtype first, as the engine's cache stores them: in layer i divided by scales[i] (KvScales), rounded, and
    multiplied back (scale 1.0 where `scales` has no entry)."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    eager = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").eager_attention_forward
    scales = scales or {}
    name = f"pellucid_rounded_kv_{str(kv_dtype).removeprefix('torch.')}_{id(scales)}"

    def attention(module, query, key, value, *args, **kwargs):
        layer = scales.get(module.layer_idx, UNIT_KV_SCALES)
        key = dequantize_kv(quantize_kv(key, kv_dtype, layer.k), layer.k).to(key.dtype)
        value = dequantize_kv(quantize_kv(value, kv_dtype, layer.v), layer.v).to(value.dtype)
        return eager(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)       # the eager function's causal mask
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name).eval()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_equals_transformers_on_rounded_keys_and_values(tiny_model_factory, arch: str, kv: str):
    """Greedy tokens equal, and every prompt and output position's logprob within 2e-3 of the rounded
    reference: prompts chunked (32-token budget), two sharing a 40-token prefix (a prefix hit), all in one batch.
    The unrounded model is further off, so the cache does round."""
    model_dir = tiny_model_factory(arch)
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype=kv, num_kv_blocks=96, max_model_len=256,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    shared = random_prompts(7, [40])[0]
    prompts = random_prompts(11, [5, 57, 23]) + [shared + p for p in random_prompts(12, [9, 14])]
    scored = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    # (prompt logprobs need the whole prompt computed, so the prefix-hit requests ask for the outputs' alone)
    params = [scored] * 3 + [SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)] * 2
    llm.generate(prompts[-1:], params[-1], use_tqdm=False)       # caches the shared prefix for the hits below
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[3].num_cached_tokens >= 32 and outputs[4].num_cached_tokens >= 32
    rounded = hf_with_rounded_kv(model_dir, FP8[kv])
    plain = hf_with_rounded_kv(model_dir, torch.float32)
    worst = worst_plain = 0.0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        sequence = prompt + completion.token_ids
        ref = hf_logprobs(rounded, sequence)
        unrounded = hf_logprobs(plain, sequence)
        assert completion.token_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()
        engine = [(pos, tid, position[tid].logprob)
                  for pos, (tid, position) in enumerate(zip(prompt, output.prompt_logprobs or []))
                  if position is not None]
        engine += [(len(prompt) + i, tid, position[tid].logprob)
                   for i, (tid, position) in enumerate(zip(completion.token_ids, completion.logprobs))]
        for pos, tid, logprob in engine:
            worst = max(worst, abs(logprob - ref[pos - 1, tid].item()))
            worst_plain = max(worst_plain, abs(logprob - unrounded[pos - 1, tid].item()))
    assert worst < 2e-3, worst
    assert worst_plain > 10 * max(worst, 1e-4), (worst, worst_plain)


def test_an_fp8_cache_holds_four_times_a_float32_caches_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    engines = {kv: LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype=kv, max_model_len=256,
                       cpu_kv_cache_bytes=1 << 22).engine for kv in ("auto", "fp8")}
    assert engines["fp8"].runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert engines["fp8"].runner.kv_bytes_per_block() * 4 == engines["auto"].runner.kv_bytes_per_block()
    assert engines["fp8"].num_blocks == 4 * engines["auto"].num_blocks


def test_an_unknown_kv_cache_dtype_is_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(tiny_model_factory("qwen3"), device="cpu", kv_cache_dtype="int4")


# ---- the Triton kernels on an FP8 cache, under the interpreter ------------------------------------------------

def run_kernel_checks(device: str, half: torch.dtype = torch.bfloat16) -> None:
    """write_kv stores the torch backend's bytes (with and without calibrated scales), and both Triton paths
    (decode splits, the unified kernel of a mixed batch) attend over the FP8 cache as the torch backend does.
    `half`: the 16-bit model dtype (the interpreter computes no bfloat16)."""
    from pellucid.attention.torch_ref import TorchReferenceBackend
    from pellucid.attention.triton_backend import TritonAttentionBackend
    from tests.attention.test_triton_backend import make_case

    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # The second batch's layer has calibrated scales (not powers of two, so they move the rounding).
        for seed, q_lens, computed, scales in ((0, [1, 1, 1], [40, 7, 130], UNIT_KV_SCALES),
                                               (1, [1, 37, 1, 9], [70, 0, 3, 35], KvScales(0.37, 2.9))):
            for dtype in (torch.float32, half):
                case = make_case(seed, q_lens, computed, 16, 8, 2, 64, dtype, device)
                outputs, caches = [], []
                for backend_cls in (TorchReferenceBackend, TritonAttentionBackend):
                    backend = backend_cls(8, 2, 64, dtype, torch.device(device), kv_cache_dtype=kv_dtype)
                    if backend_cls is TritonAttentionBackend:      # several splits of several tiles each
                        backend.decode_block_n_small_batch = backend.decode_block_n_large_batch = 16
                        backend.decode_min_tokens_per_split = 32
                    # Keys past the largest FP8 value too: the stores saturate alike.
                    cache = (case.kv_cache.float() * 40).to(kv_dtype)
                    backend.write_kv(case.key * 400, case.value, cache, case.common.slot_mapping, scales)
                    outputs.append(backend.forward(case.query, cache, backend.build_metadata(case.common), case.scale,
                                                   scales))
                    caches.append(cache)
                assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8)), (kv_dtype, seed, dtype)
                rows = int(case.common.query_start_loc_cpu[case.common.num_reqs])
                expected, got = outputs[0][:rows].double(), outputs[1][:rows].double()
                err = ((got - expected).norm() / expected.norm()).item()
                assert err < (1e-5 if dtype == torch.float32 else 2e-2), (kv_dtype, seed, dtype, err)
    print("fp8 kv checks passed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels (tests/gpu)")
def test_triton_kernels_on_an_fp8_cache_under_the_interpreter():
    pytest.importorskip("triton")
    interpreted_checks(__file__, "fp8 kv checks passed")


if __name__ == "__main__" and "--interpret" in sys.argv:
    torch.set_num_threads(1)
    if interpreter_runs_loaded_loop_bounds():
        run_kernel_checks("cpu", half=torch.float16)
