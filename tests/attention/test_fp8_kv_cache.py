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

from pellucid.attention.kv_dtype import quantize_kv, resolve_kv_cache_dtype
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from tests.gpu.check_support import interpreted_checks, interpreter_runs_loaded_loop_bounds
from tests.log_records import pellucid_log_records
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


def _hf_with_rounded_kv(model_dir: str, kv_dtype: torch.dtype):
    """transformers' model of the checkpoint (float32) whose attention gets every key and value rounded to
    kv_dtype first, as the engine's cache stores them."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    eager = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").eager_attention_forward
    name = f"pellucid_rounded_kv_{str(kv_dtype).removeprefix('torch.')}"

    def attention(module, query, key, value, *args, **kwargs):
        return eager(module, query, quantize_kv(key, kv_dtype).to(key.dtype),
                     quantize_kv(value, kv_dtype).to(value.dtype), *args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)       # the eager function's causal mask
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name).eval()


def _hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
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
    rounded = _hf_with_rounded_kv(model_dir, FP8[kv])
    plain = _hf_with_rounded_kv(model_dir, torch.float32)
    worst = worst_plain = 0.0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        sequence = prompt + completion.token_ids
        ref = _hf_logprobs(rounded, sequence)
        unrounded = _hf_logprobs(plain, sequence)
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
    """write_kv stores the torch backend's bytes, and both Triton paths (decode splits, the unified kernel of a
    mixed batch) attend over the FP8 cache as the torch backend does. `half`: the 16-bit model dtype (the
    interpreter computes no bfloat16)."""
    from pellucid.attention.torch_ref import TorchReferenceBackend
    from pellucid.attention.triton_backend import TritonAttentionBackend
    from tests.attention.test_triton_backend import make_case

    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for seed, q_lens, computed in ((0, [1, 1, 1], [40, 7, 130]), (1, [1, 37, 1, 9], [70, 0, 3, 35])):
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
                    backend.write_kv(case.key * 400, case.value, cache, case.common.slot_mapping)
                    outputs.append(backend.forward(case.query, cache, backend.build_metadata(case.common), case.scale))
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


def test_calibrated_kv_scales_of_a_checkpoint_are_said_to_be_unused(tiny_model_factory, monkeypatch):
    """A checkpoint calibrated for an FP8 cache (compressed-tensors' kv_cache_scheme) carries k/v scales this cache
    does not apply: the engine says so rather than ignoring them quietly."""
    import pellucid.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "read_quantization_config",
                        lambda _dir: {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}})
    with pellucid_log_records() as records:
        for kv in ("auto", "fp8"):
            LLM(tiny_model_factory("qwen3"), device="cpu", kv_cache_dtype=kv, num_kv_blocks=8, max_model_len=64)
    warned = [r.getMessage() for r in records if "kv_cache_scheme" in r.getMessage()]
    assert len(warned) == 1 and "float8_e4m3fn" in warned[0]


if __name__ == "__main__" and "--interpret" in sys.argv:
    torch.set_num_threads(1)
    if interpreter_runs_loaded_loop_bounds():
        run_kernel_checks("cpu", half=torch.float16)
