"""A block-wise FP8 mixture of experts keeps its experts' weights in FP8 (pellucid.models.fp8_experts): the
parameters are float8 codes with float32 block scales, and the model computes what the same checkpoint fully
dequantized at load computes, bit for bit (CPU; the GPU kernels in tests/gpu/moe_checks.py "fp8"), from
per-expert and fused 3D checkpoint tensors. Where the experts cannot stay in FP8 they dequantize at load; a
checkpoint whose tensor does not match its FP8 parameter is a clear error; benchmark shapes draw FP8 experts."""
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

# (arch, config overrides, block): every block divides the experts' hidden and intermediate sizes.
CASES = {
    "qwen3-moe": ("qwen3-moe", {"num_experts": 6, "num_experts_per_tok": 2}, (16, 16)),
    "mixtral": ("mixtral", {}, (32, 16)),
    "qwen2-moe": ("qwen2-moe", {}, (16, 32)),
}


def _experts_dtypes(model) -> set[torch.dtype]:
    return {p.dtype for name, p in model.named_parameters() if ".experts." in name and "scale_inv" not in name}


def _logits(model, prompts):
    return PagedModelRunner(model, 16, seed=2).step(list(enumerate(prompts)))


def _load_dequantized(model_dir: str, dtype: torch.dtype, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("PELLUCID_FP8_EXPERTS", "0")
        return load_model(model_dir, dtype, "cpu")[0]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_equal_the_dequantized_model(tmp_path, monkeypatch, case, dtype) -> None:
    arch, overrides, block = CASES[case]
    model_dir = quantize_to_fp8(build_tiny_model(arch, str(tmp_path / "full"), seed=3, **overrides),
                                str(tmp_path / "fp8"), block, seed=1, index_split=case == "qwen3-moe")
    model, _ = load_model(model_dir, dtype, "cpu")
    dequantized = _load_dequantized(model_dir, dtype, monkeypatch)
    assert _experts_dtypes(model) == {FP8_DTYPE}
    assert _experts_dtypes(dequantized) == {dtype}
    experts = model.model.layers[0].mlp.experts
    assert experts.fp8_block == block
    assert experts.gate_up_proj_scale_inv.shape[1:] == (2 * experts.intermediate_size // block[0],
                                                         experts.hidden_size // block[1])
    # The weights are the checkpoint's codes and scales, and dequantize to the fully dequantized model's values.
    gate_up, down = experts.expert_weights(1)
    plain = dequantized.model.layers[0].mlp.experts
    assert torch.equal(gate_up, plain.gate_up_proj[1]) and torch.equal(down, plain.down_proj[1])
    prompts = random_token_prompts(5, [9, 26, 1])
    for got, want in zip(_logits(model, prompts), _logits(dequantized, prompts)):
        assert torch.equal(got, want)
    bytes_of = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert bytes_of(model) < bytes_of(dequantized)


def _fuse_expert_tensors(src: str, dst: str, num_layers: int, num_experts: int) -> None:
    """Rewrite a per-expert FP8 checkpoint with transformers 5's fused 3D expert tensors (codes and scales)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.startswith("model"):
            with open(os.path.join(src, name), "rb") as f_in, open(os.path.join(dst, name), "wb") as f_out:
                f_out.write(f_in.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for suffix in ("", "_scale_inv"):
            per = lambda e, proj: tensors.pop(f"{prefix}.{e}.{proj}.weight{suffix}")  # noqa: E731
            tensors[f"{prefix}.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([per(e, "gate_proj"), per(e, "up_proj")]) for e in range(num_experts)])
            tensors[f"{prefix}.down_proj{suffix}"] = torch.stack([per(e, "down_proj") for e in range(num_experts)])
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_fused_3d_fp8_expert_tensors_load(tmp_path, monkeypatch) -> None:
    """Fused [E, 2I, H] codes with [E, 2I / bn, H / bk] scales, as the experts' parameters hold them: the same
    model as the per-expert checkpoint, kept in FP8 or dequantized."""
    per_expert = quantize_to_fp8(build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=5, num_experts=4),
                                 str(tmp_path / "fp8"), (16, 16), seed=2)
    fused = str(tmp_path / "fused")
    _fuse_expert_tensors(per_expert, fused, num_layers=2, num_experts=4)
    prompts = random_token_prompts(3, [11, 4])
    want = _logits(load_model(per_expert, torch.float32, "cpu")[0], prompts)
    model = load_model(fused, torch.float32, "cpu")[0]
    assert _experts_dtypes(model) == {FP8_DTYPE}
    for dequantize_experts in (False, True):
        if dequantize_experts:
            model = _load_dequantized(fused, torch.float32, monkeypatch)
            assert _experts_dtypes(model) == {torch.float32}
        assert all(torch.equal(g, w) for g, w in zip(_logits(model, prompts), want))


def test_experts_dequantize_where_they_cannot_stay_in_fp8(tmp_path, monkeypatch, caplog) -> None:
    """Blocks that do not tile the experts, experts the config keeps in full precision, or
    PELLUCID_FP8_EXPERTS=0: dequantized at load (the loader's warning says so), the same logits."""
    full = build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=7)
    prompts = random_token_prompts(3, [10, 3])
    fp8 = quantize_to_fp8(full, str(tmp_path / "fp8"), (16, 16), seed=3)
    want = _logits(load_model(fp8, torch.float32, "cpu")[0], prompts)
    with open(os.path.join(fp8, "config.json"), encoding="utf-8") as f:
        quantization = json.load(f)["quantization_config"]
    _edit_config(fp8, quantization_config=dict(quantization, modules_to_not_convert=["lm_head", "mlp.experts"]))
    caplog.set_level("WARNING", logger="pellucid")
    caplog.clear()
    model = load_model(fp8, torch.float32, "cpu")[0]
    assert _experts_dtypes(model) == {torch.float32}
    assert "dequantized to torch.float32 as they load" in caplog.text
    assert all(torch.equal(g, w) for g, w in zip(_logits(model, prompts), want))
    # 24-row blocks do not tile the 32 intermediate rows: a last partial block, which the dequantizer handles.
    partial = quantize_to_fp8(full, str(tmp_path / "fp8-24"), (24, 16), seed=3)
    assert _experts_dtypes(load_model(partial, torch.float32, "cpu")[0]) == {torch.float32}


def test_a_tensor_that_is_not_fp8_codes_is_a_clear_error(tmp_path) -> None:
    model_dir = quantize_to_fp8(build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=8),
                                str(tmp_path / "fp8"), (16, 16), seed=4)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)        # full precision where the config promises FP8 codes
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.weight.*stored as BF16.*PELLUCID_FP8_EXPERTS=0"):
        load_model(model_dir, torch.float32, "cpu")


def test_benchmark_shapes_draw_fp8_experts(tmp_path) -> None:
    """A random-weights directory with an FP8 config (bench's Qwen3-30B-A3B-FP8): the experts are drawn, then
    quantized as checkpoints are made (each block's largest code at the format's maximum), and the engine
    generates with them."""
    model_dir = build_tiny_model("qwen3-moe", str(tmp_path / "tiny"), seed=9)
    os.remove(os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, RANDOM_WEIGHTS_FILE), "w", encoding="utf-8") as f:
        json.dump({"seed": 5}, f)
    _edit_config(model_dir, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]})
    model = load_model(model_dir, torch.float32, "cpu")[0]
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE
    codes = experts.gate_up_proj.float().abs().reshape(experts.num_experts, -1, 16, experts.hidden_size // 16, 16)
    assert torch.equal(codes.amax(dim=(2, 4)), torch.full_like(codes.amax(dim=(2, 4)), FP8_MAX))
    weights = dequantize(experts.gate_up_proj, experts.gate_up_proj_scale_inv, torch.float32)
    assert abs(weights.std().item() * experts.hidden_size ** 0.5 - 1.0) < 0.1      # drawn with std 1/sqrt(fan in)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_tensor_parallel_ranks_hold_their_fp8_expert_shards(tmp_path, monkeypatch, layout) -> None:
    """TP=2 with 16-row blocks over 32 intermediate rows: each rank keeps its 16 rows of every expert in FP8 with
    their scales (slices of per-expert or fused 3D tensors), which dequantize to its slices of the TP=1 experts; and
    TP=2 generates TP=1's tokens."""
    from pellucid.distributed import parallel_state

    model_dir = quantize_to_fp8(build_tiny_model("qwen3-moe", str(tmp_path / "full"), seed=6, num_experts=4),
                                str(tmp_path / "fp8"), (16, 16), seed=3)
    if layout == "fused":
        _fuse_expert_tensors(model_dir, str(tmp_path / "fused"), num_layers=2, num_experts=4)
        model_dir = str(tmp_path / "fused")
    whole = load_model(model_dir, torch.float32, "cpu")[0].model.layers[1].mlp.experts
    for rank in range(2):
        with monkeypatch.context() as patch:      # load as this rank of two (loading runs no collective)
            rank_of_two = parallel_state.TensorParallel(rank, 2, torch.device("cpu"), None, None)
            patch.setattr(parallel_state, "_TP", rank_of_two)
            experts = load_model(model_dir, torch.float32, "cpu")[0].model.layers[1].mlp.experts
        assert experts.gate_up_proj.dtype == FP8_DTYPE and tuple(experts.gate_up_proj.shape) == (4, 32, 64)
        assert tuple(experts.gate_up_proj_scale_inv.shape) == (4, 2, 4)
        assert tuple(experts.down_proj_scale_inv.shape) == (4, 4, 1)
        for e in range(4):
            gate_up, down = experts.expert_weights(e)
            full_gate_up, full_down = whole.expert_weights(e)
            rows = slice(16 * rank, 16 * rank + 16)
            assert torch.equal(gate_up, torch.cat([full_gate_up[:32][rows], full_gate_up[32:][rows]]))
            assert torch.equal(down, full_down[:, rows])
    assert_tp2_generates_tp1_tokens(model_dir)


def test_tiles_keep_the_block_rows_of_the_routing_layout() -> None:
    """The routing lays tokens out for the plain tiles' block rows (pellucid.models.moe routes before it knows the
    weights' dtype or the experts' width); FP8 tiles and every expert width must keep them, or every layer would lay
    its tokens out twice."""
    pytest.importorskip("triton")
    from pellucid.kernels import fused_moe
    g = torch.Generator().manual_seed(0)
    counts = [1, 2, 255, 256, 257, 1024, 1025, 2048, 2049, 8192] + torch.randint(1, 20000, (40,), generator=g).tolist()
    for num_experts, top_k in ((128, 8), (60, 4), (8, 2)):
        for tokens in counts:
            routing = fused_moe.pick_tiles(tokens, top_k, num_experts)
            for width in (768, 1408, 14336):
                plain = fused_moe.pick_tiles(tokens, top_k, num_experts, expert_width=width)
                fp8 = fused_moe.pick_tiles(tokens, top_k, num_experts, fp8=True, expert_width=width)
                a8 = fused_moe.pick_tiles(tokens, top_k, num_experts, fp8=True, expert_width=width,
                                          fp8_activations=True)
                assert a8.block_m == fp8.block_m == plain.block_m == routing.block_m, (tokens, top_k, num_experts)
                # the GPU checks (tests/gpu/moe_checks.py) run every family of these sets
                assert plain in fused_moe.PLAIN_ACTIVATION_TILES and fp8 in fused_moe.PLAIN_ACTIVATION_TILES, \
                    (tokens, top_k, num_experts)
                assert a8 in fused_moe.ALL_TILES, (tokens, top_k, num_experts)
            # and the FP8 K steps lie in one 128-column scale block
            assert 128 % fp8.gate_up.block_k == 0 and 128 % fp8.down.block_k == 0


# The shared memory one program may take on an H100 or H200 (Triton's "Hardware limit" there).
HOPPER_SHARED_MEMORY = 232_448


def _pipelined_bytes(tiles, activation_bytes: int, weight_bytes: int, block_k: int | None = None) -> int:
    """Shared memory of the expert GEMMs' software pipelines, the larger of the two: num_stages copies of the
    activation tile and of the weight tiles (gate and up, or down) that one K step reads; `block_k`: the K step the
    launch takes instead of the tiles' (W8A8 steps by the weight block's K side)."""
    gate_up, down = tiles.gate_up, tiles.down
    return max(gate_up.num_stages * (block_k or gate_up.block_k) * (tiles.block_m * activation_bytes
                                                                    + 2 * gate_up.block_n * weight_bytes),
               down.num_stages * (block_k or down.block_k) * (tiles.block_m * activation_bytes
                                                              + down.block_n * weight_bytes))


def test_tile_families_fit_hoppers_shared_memory() -> None:
    """Every family fits for the activations it serves: the plain ones for 2- and 4-byte activations (fit_dtype
    halves K for 4) with 16-bit, 32-bit or float8 weights (whose K steps are at most the tile's); under W8A8 every
    family W8A8 can take, with float8 codes on both sides, at K steps of the weight block's K side up to 128, the
    most moe_gemm accepts. The estimate is exact where an H200 measured it: the long W8A8 family's down tile with
    2-byte operands raised OutOfResources, "Required: 262144" (BENCHMARKS.md, issue 19 round 18), which is why
    the GPU checks run it with float8 activations only; 256-deep W8A8 steps would need as much."""
    pytest.importorskip("triton")
    from pellucid.kernels import fused_moe
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        size = torch.empty((), dtype=dtype).element_size()
        for family in fused_moe.PLAIN_ACTIVATION_TILES:
            tiles = fused_moe.fit_dtype(family, dtype)
            for weight_bytes in (size, 1):
                assert _pipelined_bytes(tiles, size, weight_bytes) <= HOPPER_SHARED_MEMORY, (family, dtype)
        for family in fused_moe.ALL_TILES:
            tiles = fused_moe.fit_dtype(family, dtype)
            assert _pipelined_bytes(tiles, 1, 1, block_k=128) <= HOPPER_SHARED_MEMORY, (family, dtype)
    assert _pipelined_bytes(fused_moe.FP8_A8_LONG_PREFILL_TILES, 2, 2) == 262_144
    assert _pipelined_bytes(fused_moe.FP8_A8_LONG_PREFILL_TILES, 1, 1, block_k=256) == 262_144


def test_w8a8_experts_compute_the_brute_force_w8a8(tmp_path, monkeypatch) -> None:
    """PELLUCID_FP8_EXPERTS=w8a8 (a checkpoint with activation_scheme "dynamic"): the experts' torch path quantizes
    each GEMM's input per token and weight block as the brute-force reference does (tests/gpu/moe_checks.py), and
    differs from the W8A16 experts by float8's activation rounding; the kernels under the interpreter are checked
    there ("a8")."""
    from tests.gpu.moe_checks import _w8a8_reference
    arch, overrides, block = CASES["qwen3-moe"]
    model_dir = quantize_to_fp8(build_tiny_model(arch, str(tmp_path / "full"), seed=3, **overrides),
                                str(tmp_path / "fp8"), block, seed=1)
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"]["activation_scheme"] == "dynamic"
    monkeypatch.setenv("PELLUCID_FP8_EXPERTS", "w8a8")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    experts = model.model.layers[0].mlp.experts
    assert experts.fp8_activations and "fp8_activations=True" in repr(experts)
    monkeypatch.setenv("PELLUCID_FP8_EXPERTS", "1")
    w8a16 = load_model(model_dir, torch.float32, "cpu")[0].model.layers[0].mlp.experts
    assert not w8a16.fp8_activations
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, experts.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(9)])
    weights = torch.softmax(torch.randn(9, 2, generator=g), dim=-1)
    want = _w8a8_reference(x, experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
                           experts.down_proj_scale_inv, ids, weights).double()
    rel = lambda got: ((got.double() - want).norm() / want.norm()).item()  # noqa: E731
    with torch.no_grad():
        assert rel(experts(x, ids, weights)) < 1e-6
        assert rel(w8a16(x, ids, weights)) > 1e-2


def test_w8a8_needs_dynamic_activations_and_a_known_mode(tmp_path, monkeypatch) -> None:
    arch, overrides, block = CASES["qwen3-moe"]
    model_dir = quantize_to_fp8(build_tiny_model(arch, str(tmp_path / "full"), seed=3, **overrides),
                                str(tmp_path / "fp8"), block, seed=1)
    with open(os.path.join(model_dir, "config.json")) as f:
        quantization = json.load(f)["quantization_config"]
    _edit_config(model_dir, quantization_config=dict(quantization, activation_scheme="static"))
    monkeypatch.setenv("PELLUCID_FP8_EXPERTS", "w8a8")
    with pytest.raises(ValueError, match="activation_scheme is 'static'"):
        load_model(model_dir, torch.float32, "cpu")
    monkeypatch.setenv("PELLUCID_FP8_EXPERTS", "w8a16")
    with pytest.raises(ValueError, match="PELLUCID_FP8_EXPERTS must be one of 0, 1, w8a8"):
        load_model(model_dir, torch.float32, "cpu")

