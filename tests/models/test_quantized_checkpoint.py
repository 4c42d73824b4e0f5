"""Quantized checkpoints the loader dequantizes: block-wise FP8 (quant_method "fp8", as Qwen3-*-FP8 ship)
against transformers' logits for the same checkpoint (which dequantizes it on a machine without an FP8 GPU);
compressed-tensors 8-bit weights (float8 or int8; per tensor, channel, group or block) against transformers
on the weights dequantized block by block in the test; the block arithmetic against a per-element loop;
other formats and broken checkpoints are clear errors; under tensor parallelism the shards equal TP=1."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pellucid import LLM, SamplingParams
from pellucid.models.loader import load_model, read_tensors
from pellucid.models.quantized_checkpoint import dequantize_blockwise
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import PagedModelRunner, hf_logits, load_hf_model, random_token_prompts, relative_error

TOLERANCE = 1e-4
# Tensors a published FP8 checkpoint keeps in full precision (its modules_to_not_convert).
_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate")


def quantize_to_fp8(src: str, dst: str, block: tuple[int, int], seed: int = 0, index_split: bool = False) -> str:
    """Copy checkpoint `src` to `dst` with every 2D weight but _KEPT stored as float8 e4m3 with per-block
    float32 scales (`X.weight_scale_inv`), each block's scale its absolute maximum over 448 times a random
    factor in [1, 2) (so the codes do not all reach the format's edge). `index_split`: write the weights and
    their scales to two shards, so a weight's scales live in another file."""
    if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copytree(src, dst, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        if tensor.dim() != 2 or any(kept in name for kept in _KEPT):
            weights[name] = tensor
            continue
        rows, cols = tensor.shape
        grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[:rows, :cols] = tensor
        amax = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-8)
        scale = amax / 448.0 * (1.0 + torch.rand(grid, generator=gen))
        expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        weights[name] = (tensor / expanded).to(torch.float8_e4m3fn)
        scales[name + "_scale_inv"] = scale
    os.remove(os.path.join(dst, "model.safetensors"))
    if index_split:
        save_file(weights, os.path.join(dst, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
        save_file(scales, os.path.join(dst, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
        weight_map = {name: "model-00001-of-00002.safetensors" for name in weights}
        weight_map.update({name: "model-00002-of-00002.safetensors" for name in scales})
        with open(os.path.join(dst, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    else:
        save_file({**weights, **scales}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(dst, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                           "weight_block_size": list(block)})
    return dst


def _edit_config(model_dir: str, **fields) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)


def _hf_dequantized(model_dir: str) -> torch.nn.Module:
    """transformers' model of the FP8 checkpoint with its weights dequantized (float32, eager attention)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        block = json.load(f)["quantization_config"]["weight_block_size"]
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager",
        quantization_config=FineGrainedFP8Config(weight_block_size=block, dequantize=True)).eval()


# (arch, config overrides, block): a dense model, mixtures of experts with per-expert tensors; blocks that
# divide every dimension (transformers' dequantization needs that).
CASES = {
    "qwen3": ("qwen3", {}, (16, 32)),
    "qwen3-moe": ("qwen3-moe", {"num_experts": 6, "num_experts_per_tok": 2}, (16, 16)),
    "mixtral": ("mixtral", {}, (32, 16)),
    "qwen2-moe": ("qwen2-moe", {}, (16, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_logits_match_transformers(tmp_path, case: str) -> None:
    arch, overrides, block = CASES[case]
    model_dir = quantize_to_fp8(build_tiny_model(arch, str(tmp_path / "full"), seed=3, **overrides),
                                str(tmp_path / "fp8"), block, seed=1, index_split=case == "qwen3-moe")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = _hf_dequantized(model_dir)
    full, _ = load_model(str(tmp_path / "full"), torch.float32, "cpu")
    prompts = random_token_prompts(5, [9, 26, 1])
    runner = PagedModelRunner(model, 16, seed=2)
    for prompt, logits in zip(prompts, runner.step(list(enumerate(prompts)))):
        expected = hf_logits(hf_model, prompt)
        assert relative_error(logits, expected) <= TOLERANCE
        # The weights really went through FP8: the full-precision model's logits differ.
        assert relative_error(PagedModelRunner(full, 16).step([(0, prompt)])[0], expected) > 1e-3


def test_engine_greedy_tokens_match_transformers(tmp_path) -> None:
    """LLM on an FP8 MoE checkpoint: greedy continuations equal transformers' generate on its dequantized
    model, through chunked prefill and the paged cache."""
    model_dir = quantize_to_fp8(build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=4),
                                str(tmp_path / "fp8"), (16, 16), seed=2)
    hf_model = _hf_dequantized(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=16,
              num_kv_blocks=32)
    prompts = random_token_prompts(8, [20, 7, 33])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                         min_new_tokens=10)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected


@pytest.mark.parametrize("shape,block", [((70, 45), (16, 32)), ((3, 33, 64), (8, 128)), ((128, 256), (128, 128)),
                                         ((5, 7), (1, 1))])
def test_dequantize_blockwise_matches_a_per_element_loop(shape, block) -> None:
    """Grids that do not divide the weight (a last partial block), expert-stacked 3D weights, one-element
    blocks: every element is its code times its own block's scale."""
    gen = torch.Generator().manual_seed(sum(shape))
    codes = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    scale = torch.rand(grid, generator=gen) + 0.1
    got = dequantize_blockwise(codes, scale, block, "w")
    flat_codes, flat_got = codes.float().reshape(-1, *shape[-2:]), got.reshape(-1, *shape[-2:])
    flat_scale = scale.reshape(-1, *grid[-2:])
    for b in range(flat_codes.shape[0]):
        for n in range(shape[-2]):
            for k in range(shape[-1]):
                expected = flat_codes[b, n, k] * flat_scale[b, n // block[0], k // block[1]]   # float32
                assert flat_got[b, n, k].item() == expected.item()
    # Without a configured block it is read off the grid when that divides the weight.
    if shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0:
        assert torch.equal(dequantize_blockwise(codes, scale, None, "w"), got)


def test_read_tensors_dequantizes(tmp_path) -> None:
    model_dir = quantize_to_fp8(build_tiny_model("qwen3", str(tmp_path / "full")), str(tmp_path / "fp8"), (16, 16))
    name = "model.layers.0.mlp.down_proj.weight"
    stored = load_file(os.path.join(model_dir, "model.safetensors"))
    got = read_tensors(model_dir, [name, "model.embed_tokens.weight"])
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(got[name], dequantize_blockwise(stored[name], stored[name + "_scale_inv"], (16, 16), name))


def test_other_quantization_methods_are_refused_by_name(tmp_path) -> None:
    model_dir = build_tiny_model("qwen3", str(tmp_path / "m"))
    for method in ("awq", "gptq", "bitsandbytes", "gguf"):
        _edit_config(model_dir, quantization_config={"quant_method": method, "bits": 4})
        with pytest.raises(NotImplementedError, match=f"quant_method '{method}'.*supported: fp8"):
            load_model(model_dir, torch.float32, "cpu")


def test_broken_fp8_checkpoints_are_clear_errors(tmp_path, monkeypatch) -> None:
    model_dir = quantize_to_fp8(build_tiny_model("qwen3", str(tmp_path / "full")), str(tmp_path / "fp8"), (16, 16))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.self_attn.o_proj.weight"

    # A weight's scales of a grid that neither the configured block nor any block makes.
    save_file({**tensors, name + "_scale_inv": tensors[name + "_scale_inv"][:3].contiguous()}, path)
    with pytest.raises(ValueError, match=r"o_proj.weight.*grid of its scales, of shape \(3, 4\); blocks of "
                                         r"\[16, 16\] need 4 x 4"):
        load_model(model_dir, torch.float32, "cpu")      # dequantized at load
    with monkeypatch.context() as patch, pytest.raises(
            ValueError, match=r"o_proj.weight_scale_inv.*has shape \(3, 4\), the model expects \(4, 4\)"):
        patch.setenv("PELLUCID_FP8_LINEAR", "1")       # the projection keeps its codes and scales
        load_model(model_dir, torch.float32, "cpu")
    # A float8 weight without its scales is not cast as if the codes were the weights.
    save_file({k: v for k, v in tensors.items() if k != name + "_scale_inv"}, path)
    with pytest.raises(ValueError, match=r"o_proj.weight.*stored as F8_E4M3 without its scales"):
        load_model(model_dir, torch.float32, "cpu")
    # Nor without a quantization_config at all.
    save_file(tensors, path)
    _edit_config(model_dir, quantization_config=None)
    with pytest.raises(ValueError, match="stored as F8_E4M3 without its scales"):
        load_model(model_dir, torch.float32, "cpu")
    _edit_config(model_dir, quantization_config={"quant_method": "fp8", "weight_block_size": [16]})
    with pytest.raises(ValueError, match="weight block size must be two positive integers"):
        load_model(model_dir, torch.float32, "cpu")


def test_tensor_parallel_shards_of_fp8_experts_equal_tp1(tmp_path) -> None:
    """Blocks that straddle the ranks' shard boundaries (24-row blocks over 32 expert columns split in two):
    TP=2 generates TP=1's tokens."""
    model_dir = quantize_to_fp8(build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=6),
                                str(tmp_path / "fp8"), (24, 24), seed=3)
    engine = dict(dtype="float32", device="cpu", max_model_len=96, num_kv_blocks=24)
    prompts = [{"prompt_token_ids": p} for p in random_token_prompts(4, [12, 30])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp1 = LLM(model_dir, **engine)
    expected = [o.outputs[0].token_ids for o in tp1.generate(prompts, params, use_tqdm=False)]
    tp2 = LLM(model_dir, tensor_parallel_size=2, **engine)
    try:
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        tp2.shutdown()


def quantize_compressed_tensors(src: str, dst: str, reference: str, kind: str, strategy: str,
                                block: tuple[int, int] | None = None, group: int | None = None, seed: int = 0,
                                scale_dtype: torch.dtype = torch.float32, compute_scales: bool = False) -> str:
    """Copy checkpoint `src` to `dst` as llm-compressor writes a W8A8 checkpoint: every 2D weight but _KEPT as
    8-bit codes (`kind` "float": float8 e4m3, "int": int8) with `X.weight_scale` per tensor, output channel,
    group of `group` columns or `block`; and to `reference` the full-precision checkpoint of exactly the weights
    those codes and scales stand for, dequantized block by block here. `compute_scales`: also activation and
    KV-cache scales (static W8A8 with an FP8 KV cache), which a model run in its dtype does not use."""
    gen = torch.Generator().manual_seed(seed)
    code_max, code_dtype = (448.0, torch.float8_e4m3fn) if kind == "float" else (127.0, torch.int8)
    for out in (dst, reference):
        shutil.copytree(src, out, dirs_exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        if tensor.dim() != 2 or any(kept in name for kept in _KEPT):
            stored[name] = dequantized[name] = tensor
            continue
        rows, cols = tensor.shape
        row_block, col_block = {"tensor": (rows, cols), "channel": (1, cols), "group": (1, group),
                                "block": block}[strategy]
        grid = (math.ceil(rows / row_block), math.ceil(cols / col_block))
        scale = torch.empty(grid)
        codes = torch.empty(rows, cols, dtype=code_dtype)
        weight = torch.empty(rows, cols)
        for i in range(grid[0]):
            for j in range(grid[1]):
                part = (slice(i * row_block, (i + 1) * row_block), slice(j * col_block, (j + 1) * col_block))
                amax = tensor[part].abs().max().clamp(min=1e-8)
                scale[i, j] = (amax / code_max * (1.0 + torch.rand((), generator=gen))).to(scale_dtype).float()
                scaled = tensor[part] / scale[i, j]
                codes[part] = scaled.to(code_dtype) if kind == "float" else scaled.round().clamp(-127, 127).to(
                    torch.int8)
                weight[part] = codes[part].float() * scale[i, j]
        stored[name] = codes
        stored[name + "_scale"] = (scale.reshape(1) if strategy == "tensor" else scale).to(scale_dtype)
        dequantized[name] = weight
        if compute_scales:
            stored[name.removesuffix(".weight") + ".input_scale"] = torch.rand(1, generator=gen)
            if name.endswith("k_proj.weight"):
                stored[name.replace("k_proj.weight", "k_scale")] = torch.rand((), generator=gen)
    save_file(stored, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": group, "block_structure": list(block) if block else None}
    activations = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor" if compute_scales else "token",
                   "dynamic": not compute_scales}
    _edit_config(dst, quantization_config={
        "quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"], "sparsity_config": {}, "kv_cache_scheme": None})
    return dst


COMPRESSED_CASES = {
    "fp8-channel": ("qwen3", "float", "channel", {}),
    "fp8-tensor-static": ("qwen3-moe", "float", "tensor", {"compute_scales": True}),
    "fp8-block-bf16-scales": ("qwen3-moe", "float", "block", {"block": (24, 40), "scale_dtype": torch.bfloat16}),
    "int8-group": ("mixtral", "int", "group", {"group": 16}),
}


@pytest.mark.parametrize("case", list(COMPRESSED_CASES))
def test_compressed_tensors_checkpoint_logits_match_transformers(tmp_path, case: str) -> None:
    """Blocks of 24 x 40 leave partial blocks at the edges (64- and 32-wide weights)."""
    arch, kind, strategy, options = COMPRESSED_CASES[case]
    full = build_tiny_model(arch, str(tmp_path / "full"), seed=7)
    model_dir = quantize_compressed_tensors(full, str(tmp_path / "w8"), str(tmp_path / "reference"), kind, strategy,
                                            seed=2, **options)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(str(tmp_path / "reference"))
    prompts = random_token_prompts(6, [14, 3, 29])
    for prompt, logits in zip(prompts, PagedModelRunner(model, 16, seed=1).step(list(enumerate(prompts)))):
        assert relative_error(logits, hf_logits(hf_model, prompt)) <= TOLERANCE


@pytest.mark.parametrize("edit,match", [
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"weights": {"num_bits": 4}}, "4-bit float weights"),
    ({"weights": {"symmetric": False}}, "asymmetric weights with zero points"),
    ({"weights": {"strategy": "tensor_group"}}, "weight strategy 'tensor_group'"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "a sparsity config"),
])
def test_unsupported_compressed_tensors_formats_are_refused(tmp_path, edit, match) -> None:
    full = build_tiny_model("qwen3", str(tmp_path / "full"))
    model_dir = quantize_compressed_tensors(full, str(tmp_path / "w8"), str(tmp_path / "reference"), "float",
                                            "channel")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        quantization = json.load(f)["quantization_config"]
    if "weights" in edit:
        quantization["config_groups"]["group_0"]["weights"].update(edit["weights"])
    else:
        quantization.update(edit)
    _edit_config(model_dir, quantization_config=quantization)
    with pytest.raises(NotImplementedError, match=match):
        load_model(model_dir, torch.float32, "cpu")
