"""A block-wise FP8 checkpoint keeps its projections in FP8 (pellucid.models.fp8_linear): float8 codes with float32
block scales, and the model computes what the same checkpoint fully dequantized at load computes, bit for bit on the
CPU (the GPU kernels: tests/gpu/fp8_linear_checks.py). Projections without scales in the checkpoint, blocks that do
not tile a weight or a rank's part of it, a merged GEMM whose parts cannot all stay, and PELLUCID_FP8_LINEAR=0
dequantize at load instead; tensor-parallel ranks hold their shards of codes and scales; benchmark shapes draw
FP8 projections where their config quantizes them."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pellucid import LLM, SamplingParams
from pellucid.models.fp8_experts import FP8_DTYPE, FP8_MAX, dequantize
from pellucid.models.loader import RANDOM_WEIGHTS_FILE, load_model
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import PagedModelRunner, assert_tp2_generates_tp1_tokens, random_token_prompts
from tests.models.test_quantized_checkpoint import _edit_config, quantize_to_fp8

@pytest.fixture(autouse=True)
def _keep_fp8_projections(monkeypatch):
    monkeypatch.setenv("PELLUCID_FP8_LINEAR", "1")      # opt-in (pellucid.models.fp8_linear)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projection_dtypes(model, layer: int = 0) -> dict[str, torch.dtype]:
    """{projection name: its weight's dtype} of one layer (dense MLP or a shared expert's)."""
    return {name.split(".")[-2]: p.dtype for name, p in model.named_parameters()
            if f"layers.{layer}." in name and name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS
            and ".experts." not in name}


def _logits(model, prompts):
    return PagedModelRunner(model, 16, seed=2).step(list(enumerate(prompts)))


def _load_dequantized(model_dir: str, dtype: torch.dtype, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("PELLUCID_FP8_LINEAR", "0")
        patch.setenv("PELLUCID_FP8_EXPERTS", "0")
        return load_model(model_dir, dtype, "cpu")[0]


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch, block", [("qwen3", (16, 32)), ("llama", (32, 16)), ("qwen2-moe", (16, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_projections_equal_the_dequantized_model(tmp_path, monkeypatch, arch, block, dtype) -> None:
    model_dir = quantize_to_fp8(build_tiny_model(arch, str(tmp_path / "full"), seed=3), str(tmp_path / "fp8"), block,
                                seed=1, index_split=arch == "qwen3")
    model = load_model(model_dir, dtype, "cpu")[0]
    dequantized = _load_dequantized(model_dir, dtype, monkeypatch)
    kept = _projection_dtypes(model)
    assert set(kept.values()) == {FP8_DTYPE} and len(kept) == 7       # attention, and the (shared expert's) MLP
    assert set(_projection_dtypes(dequantized).values()) == {dtype}
    if arch == "qwen2-moe":     # the shared expert's projections stay; the router and its gate have no scales
        mlp = model.model.layers[0].mlp
        assert mlp.shared_expert.down_proj.weight.dtype == FP8_DTYPE
        assert mlp.gate.weight.dtype == dtype and mlp.shared_expert_gate.weight.dtype == dtype
    # The codes and scales are the checkpoint's, and dequantize to the dequantized model's weights.
    for name in ("q_proj", "o_proj"):
        projection = getattr(model.model.layers[1].self_attn, name)
        plain = getattr(dequantized.model.layers[1].self_attn, name)
        assert projection.weight_scale_inv.shape == (projection.out_features // block[0],
                                                     projection.in_features // block[1])
        assert torch.equal(dequantize(projection.weight, projection.weight_scale_inv, dtype), plain.weight)
    prompts = random_token_prompts(5, [9, 26, 1])
    for got, want in zip(_logits(model, prompts), _logits(dequantized, prompts)):
        assert torch.equal(got, want)
    assert _bytes(model) < _bytes(dequantized)


def test_projections_dequantize_where_they_cannot_stay_in_fp8(tmp_path, monkeypatch, caplog) -> None:
    """No scales for q_proj (so its merged q/k/v group dequantizes whole), blocks that do not tile the weights, or
    PELLUCID_FP8_LINEAR=0: dequantized at load, the same logits."""
    full = build_tiny_model("qwen3", str(tmp_path / "full"), seed=7)
    prompts = random_token_prompts(3, [10, 3])
    fp8 = quantize_to_fp8(full, str(tmp_path / "fp8"), (16, 32), seed=3)
    want = _logits(_load_dequantized(fp8, torch.float32, monkeypatch), prompts)
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = dequantize(tensors[name], tensors.pop(name + "_scale_inv"), torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    model = load_model(fp8, torch.float32, "cpu")[0]
    layer0, layer1 = _projection_dtypes(model, 0), _projection_dtypes(model, 1)
    assert {layer0[p] for p in ("q_proj", "k_proj", "v_proj")} == {torch.float32}
    assert {layer0[p] for p in ("o_proj", "gate_proj", "up_proj", "down_proj")} == {FP8_DTYPE}
    assert set(layer1.values()) == {FP8_DTYPE}
    assert all(torch.equal(g, w) for g, w in zip(_logits(model, prompts), want))
    # 24-row blocks tile none of the tiny model's weights: everything dequantizes, with a last partial block.
    partial = quantize_to_fp8(full, str(tmp_path / "fp8-24"), (24, 32), seed=3)
    caplog.set_level("WARNING", logger="pellucid")
    caplog.clear()
    assert set(_projection_dtypes(load_model(partial, torch.float32, "cpu")[0]).values()) == {torch.float32}
    assert "dequantized to torch.float32 as they load" in caplog.text
    with monkeypatch.context() as patch:
        patch.setenv("PELLUCID_FP8_LINEAR", "0")
        assert set(_projection_dtypes(load_model(fp8, torch.float32, "cpu")[0], 1).values()) == {torch.float32}
        patch.setenv("PELLUCID_FP8_LINEAR", "yes")
        with pytest.raises(ValueError, match="PELLUCID_FP8_LINEAR must be 0 or 1"):
            load_model(fp8, torch.float32, "cpu")


def test_projections_dequantize_by_default_and_the_loader_says_how_to_keep_them(tmp_path, monkeypatch, caplog):
    model_dir = quantize_to_fp8(build_tiny_model("qwen3", str(tmp_path / "full"), seed=2), str(tmp_path / "fp8"),
                                (16, 32), seed=1)
    monkeypatch.delenv("PELLUCID_FP8_LINEAR")
    caplog.set_level("WARNING", logger="pellucid")
    model = load_model(model_dir, torch.float32, "cpu")[0]
    assert set(_projection_dtypes(model).values()) == {torch.float32}
    assert "PELLUCID_FP8_LINEAR=1 keeps" in caplog.text


def test_a_projection_stored_in_full_precision_beside_its_scales_is_a_clear_error(tmp_path) -> None:
    model_dir = quantize_to_fp8(build_tiny_model("llama", str(tmp_path / "full"), seed=8), str(tmp_path / "fp8"),
                                (16, 16), seed=4)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.weight.*stored as BF16.*PELLUCID_FP8_LINEAR=0"):
        load_model(model_dir, torch.float32, "cpu")


def test_benchmark_shapes_draw_fp8_projections(tmp_path) -> None:
    """A random-weights directory with an FP8 config: every projection its modules_to_not_convert does not name is
    drawn, then quantized as checkpoints are made (each block's largest code at the format's maximum); the engine
    generates with them."""
    model_dir = build_tiny_model("qwen3-moe", str(tmp_path / "tiny"), seed=9)
    os.remove(os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, RANDOM_WEIGHTS_FILE), "w", encoding="utf-8") as f:
        json.dump({"seed": 5}, f)
    _edit_config(model_dir, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                                 "modules_to_not_convert": ["lm_head", "model.layers.1.self_attn.o_proj",
                                                                            "mlp.gate"]})
    model = load_model(model_dir, torch.float32, "cpu")[0]
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.dtype == FP8_DTYPE and attention.o_proj.weight.dtype == FP8_DTYPE
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    codes = attention.q_proj.weight.float().abs().reshape(attention.q_proj.out_features // 16, 16, -1, 16)
    assert torch.equal(codes.amax(dim=(1, 3)), torch.full_like(codes.amax(dim=(1, 3)), FP8_MAX))
    weights = dequantize(attention.q_proj.weight, attention.q_proj.weight_scale_inv, torch.float32)
    assert abs(weights.std().item() * attention.q_proj.in_features ** 0.5 - 1.0) < 0.1
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("block, o_proj_fp8", [((16, 32), True), ((16, 64), False)])
def test_tensor_parallel_ranks_hold_their_fp8_projection_shards(tmp_path, monkeypatch, block, o_proj_fp8) -> None:
    """TP=2: each rank keeps its rows (q/k/v, gate/up) or columns (o, down) of every projection in FP8 with their
    scales, which dequantize to its slices of the TP=1 weights; a rank's part that does not end on a block (o_proj's
    32 columns in 64-column blocks) dequantizes at load. TP=2 generates TP=1's tokens."""
    from pellucid.distributed import parallel_state

    model_dir = quantize_to_fp8(build_tiny_model("qwen3", str(tmp_path / "full"), seed=6), str(tmp_path / "fp8"),
                                block, seed=3)
    whole = load_model(model_dir, torch.float32, "cpu")[0].model.layers[1]
    for rank in range(2):
        with monkeypatch.context() as patch:      # load as this rank of two (loading runs no collective)
            patch.setattr(parallel_state, "_TP", parallel_state.TensorParallel(rank, 2, torch.device("cpu"), None, None))
            layer = load_model(model_dir, torch.float32, "cpu")[0].model.layers[1]
        full_weight = lambda module: dequantize(module.weight, module.weight_scale_inv, torch.float32)  # noqa: E731
        q = layer.self_attn.q_proj
        assert q.weight.dtype == FP8_DTYPE and tuple(q.weight.shape) == (32, 64)
        assert torch.equal(full_weight(q), full_weight(whole.self_attn.q_proj)[32 * rank:32 * rank + 32])
        down = layer.mlp.down_proj
        assert torch.equal(full_weight(down), full_weight(whole.mlp.down_proj)[:, 64 * rank:64 * rank + 64])
        o_proj = layer.self_attn.o_proj
        assert (o_proj.weight.dtype == FP8_DTYPE) == o_proj_fp8
        whole_o = full_weight(whole.self_attn.o_proj)[:, 32 * rank:32 * rank + 32]
        assert torch.equal(full_weight(o_proj) if o_proj_fp8 else o_proj.weight, whole_o)
    assert_tp2_generates_tp1_tokens(model_dir)
