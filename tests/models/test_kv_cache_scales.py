"""A checkpoint's calibrated KV-cache scales (pellucid.models.kv_cache_scales): an FP8 cache stores each layer's keys
divided by its k_scale and values by its v_scale, and attends over them multiplied back. The engine equals
transformers whose attention sees keys and values rounded the same way, for each naming the checkpoints use; a cache
in the model's dtype ignores the scales; per-head scales and integer KV schemes are refused by name."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pellucid.attention.kv_dtype import KvScales
from pellucid.llm import LLM
from pellucid.sampling_params import SamplingParams
from tests.attention.test_fp8_kv_cache import hf_logprobs, hf_with_rounded_kv
from tests.log_records import pellucid_log_records
from tests.reference import random_prompts

SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _layer_scales(num_layers: int, seed: int) -> dict[int, KvScales]:
    """Scales small enough that some keys and values saturate, and not powers of two, so they move the rounding."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda: float(torch.empty(()).uniform_(0.004, 0.02, generator=gen))  # noqa: E731
    return {i: KvScales(draw(), draw()) for i in range(num_layers)}


def _with_scales(src: str, dst: str, scales: dict[int, KvScales], naming: str, scheme: dict | None = SCHEME,
                 shape: tuple[int, ...] = (1,)) -> str:
    """A copy of the checkpoint at `src` with `scales` stored as `naming` names them, and a compressed-tensors
    quantization_config declaring `scheme` (its weights stay full precision)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for i, s in scales.items():
        attn = f"model.layers.{i}.self_attn"
        names = {"k_scale": {f"{attn}.k_scale": s.k, f"{attn}.v_scale": s.v},
                 "output_scale": {f"{attn}.k_proj.output_scale": s.k, f"{attn}.v_proj.output_scale": s.v},
                 "kv_scale": {f"{attn}.kv_scale": s.k}}[naming]
        tensors.update({name: torch.full(shape, value) for name, value in names.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if scheme is not None:
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "kv_cache_scheme": scheme}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _num_layers(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def _worst_logprob_gaps(llm: LLM, refs: list) -> list[float]:
    """Greedy outputs of a chunked, prefix-sharing batch; for each reference model, the largest gap between the
    engine's logprob and the reference's over every output position (greedy tokens must equal the first's)."""
    shared = random_prompts(7, [40])[0]
    prompts = random_prompts(11, [5, 57]) + [shared + p for p in random_prompts(12, [9, 14])]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    llm.generate(prompts[-1:], params, use_tqdm=False)       # the shared prefix is then a cache hit
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[3].num_cached_tokens >= 32
    worst = [0.0] * len(refs)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        sequence = prompt + completion.token_ids
        for r, ref in enumerate(refs):
            logprobs = hf_logprobs(ref, sequence)
            if r == 0:
                assert completion.token_ids == logprobs[len(prompt) - 1:-1].argmax(-1).tolist()
            for i, (tid, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
                worst[r] = max(worst[r], abs(position[tid].logprob - logprobs[len(prompt) + i - 1, tid].item()))
    return worst


@pytest.mark.parametrize("arch,naming", [("qwen3", "k_scale"), ("llama", "k_scale"), ("qwen3", "output_scale"),
                                         ("qwen3", "kv_scale")])
def test_an_fp8_cache_applies_the_checkpoints_scales(tiny_model_factory, tmp_path, arch: str, naming: str):
    """Within 2e-3 of transformers on keys and values rounded with the scales (greedy tokens equal), and far from
    it when rounded unscaled: the scales are applied, in every layer, under chunked prefill and a prefix hit."""
    src = tiny_model_factory(arch)
    scales = _layer_scales(_num_layers(src), seed=3)
    if naming == "kv_scale":        # one scale for both
        scales = {i: KvScales(s.k, s.k) for i, s in scales.items()}
    model_dir = _with_scales(src, str(tmp_path / "scaled"), scales, naming)
    with pellucid_log_records() as records:
        llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=96, max_model_len=256,
                  max_num_batched_tokens=32, enable_prefix_caching=True)
    applied = [r.getMessage() for r in records if "applies the checkpoint's calibrated scales" in r.getMessage()]
    assert applied and f"in {len(scales)} of {len(scales)} attention layers" in applied[0]
    scaled_ref = hf_with_rounded_kv(src, torch.float8_e4m3fn, scales)
    unscaled_ref = hf_with_rounded_kv(src, torch.float8_e4m3fn)
    worst, worst_unscaled = _worst_logprob_gaps(llm, [scaled_ref, unscaled_ref])
    assert worst < 2e-3, worst
    assert worst_unscaled > 10 * max(worst, 1e-4), (worst, worst_unscaled)


def test_a_cache_in_the_models_dtype_ignores_the_scales(tiny_model_factory, tmp_path):
    """The same logprobs as the checkpoint without scales, bit for bit; the engine says the scales are unused."""
    src = tiny_model_factory("qwen3")
    model_dir = _with_scales(src, str(tmp_path / "scaled"), _layer_scales(_num_layers(src), seed=4), "k_scale")
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    prompts = random_prompts(5, [12, 30])
    results = []
    with pellucid_log_records() as records:
        for d in (model_dir, src):
            outputs = LLM(d, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128).generate(
                prompts, params, use_tqdm=False)
            results.append([[(t, p[t].logprob) for t, p in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                            for o in outputs])
    assert results[0] == results[1]
    assert any("needs no scales" in r.getMessage() for r in records)


def test_per_head_scales_are_refused(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen3")
    model_dir = _with_scales(src, str(tmp_path / "heads"), {0: KvScales(0.01, 0.02)}, "k_scale", shape=(2,))
    with pytest.raises(NotImplementedError, match="holds 2 KV-cache scales"):
        LLM(model_dir, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=64)


def test_a_non_positive_scale_is_refused(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen3")
    model_dir = _with_scales(src, str(tmp_path / "zero"), {1: KvScales(0.01, 0.02)}, "k_scale")
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.zeros(1)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.attn: a KV-cache scale must be positive"):
        LLM(model_dir, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=64)


def test_a_declared_scheme_without_scales_is_said(tiny_model_factory, tmp_path):
    """kv_cache_scheme but no scale tensors: the FP8 cache stores unscaled, and says so; an integer scheme cannot
    be applied by an FP8 cache and is refused."""
    src = tiny_model_factory("qwen3")
    declared = _with_scales(src, str(tmp_path / "declared"), {}, "k_scale")
    with pellucid_log_records() as records:
        LLM(declared, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=64)
    assert any("holds no KV-cache scales" in r.getMessage() for r in records)
    integer = _with_scales(src, str(tmp_path / "int8"), {0: KvScales(0.01, 0.02)}, "k_scale",
                           scheme=dict(SCHEME, type="int"))
    with pytest.raises(ValueError, match="8-bit int KV cache"):
        LLM(integer, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=64)
    LLM(integer, device="cpu", num_kv_blocks=8, max_model_len=64)      # a model-dtype cache needs none
