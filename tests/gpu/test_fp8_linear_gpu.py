"""FP8 projections on the GPU (pellucid.models.fp8_linear): the kernels under the Triton interpreter on the CPU and
compiled on the GPU, against a brute-force product of the dequantized weights (tests/gpu/fp8_linear_checks.py); an
engine keeping a block-wise FP8 checkpoint's projections in FP8 (decode rows through the skinny kernel, batches
through the tiled one, a long prefill through dequantize + cuBLAS; CUDA graphs) against the same checkpoint
dequantized at load: in float32 the same greedy tokens and log-probabilities within float32 summation order, in
bfloat16 each engine scores the other's sequences to bfloat16's precision."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.check_support import run_script_under_interpreter, triton_importable
from tests.gpu.engine_runs import assert_fp8_engine_matches_dequantized
from tests.models.test_quantized_checkpoint import quantize_to_fp8

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels")
def test_fp8_linear_kernels_under_triton_interpreter():
    run_script_under_interpreter("fp8_linear_checks.py")


@needs_cuda
def test_fp8_linear_kernels_on_gpu():
    from tests.gpu.fp8_linear_checks import check_kernels
    check_kernels("cuda")


def _engine(model_dir: str, dtype: str, fp8: bool, monkeypatch):
    from pellucid.llm import LLM
    from pellucid.models.fp8_experts import FP8_DTYPE

    monkeypatch.setenv("PELLUCID_FP8_LINEAR", "1" if fp8 else "0")
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_model_len=1024, max_num_seqs=16, num_kv_blocks=512)
    q_proj = llm.engine.runner.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == (FP8_DTYPE if fp8 else getattr(torch, dtype))
    return llm


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_projections_engine_against_the_dequantized_engine(tmp_path, monkeypatch, dtype):
    from pellucid.tiny_models import build_tiny_model

    full = build_tiny_model("qwen3", str(tmp_path / "full"), seed=3, hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_hidden_layers=3,
                            max_position_embeddings=2048)
    model_dir = quantize_to_fp8(full, str(tmp_path / "fp8"), (128, 128), seed=1)
    g = torch.Generator().manual_seed(4)
    # One prompt of 600 tokens: prefill steps past fp8_linear.DEQUANTIZE_MIN_ROWS rows.
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 600, 9, 70, 1)]
    assert_fp8_engine_matches_dequantized(lambda fp8: _engine(model_dir, dtype, fp8, monkeypatch), prompts, dtype,
                                          float32_tolerance=1e-4)
