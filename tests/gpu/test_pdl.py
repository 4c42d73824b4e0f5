"""Programmatic dependent launch (pellucid.kernels.pdl): on where the GPU supports it, and results equal
to the same kernels launched without it (long dependent chains in a CUDA graph, and whole engines)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _hopper(), reason="PDL needs compute capability 9.0 or newer")
def test_pdl_is_on_for_hopper(monkeypatch):
    from pellucid.kernels.pdl import pdl_enabled, pdl_launch_options
    x = torch.empty(1, device="cuda")
    assert pdl_enabled(x), "this GPU supports PDL but pellucid.kernels.pdl reports it off (Triton too old?)"
    assert pdl_launch_options(x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("PELLUCID_PDL", "0")
    assert not pdl_enabled(x)


def _chain(x: torch.Tensor, residual: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
           ) -> torch.Tensor:
    """Each step reads what the step before wrote: add + RMSNorm, a skinny GEMM, the fused SiLU GEMM."""
    from pellucid.kernels.add_rms_norm import add_rms_norm
    from pellucid.kernels.skinny_gemm import SkinnyConfig, linear, pick_config, silu_mul_linear
    for norm_weight, up_weight, down_weight in layers:
        residual, normed = add_rms_norm(x, residual, norm_weight, 1e-6)
        # a CUDA-core tile where the dispatch would leave the shape to cuBLAS (2 rows, N > K)
        up_config = pick_config(*normed.shape[:1], *up_weight.shape) or SkinnyConfig(2, 4, 512, 4, 3, False)
        x = silu_mul_linear(linear(normed, up_weight, config=up_config), down_weight)
    return residual + x


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 2])
def test_dependent_chain_in_a_graph_equals_no_pdl(monkeypatch, seed, rows):
    """60 dependent launches replayed from one CUDA graph many times: a kernel that read its input before
    its producer finished would show as a mismatch against the launches without PDL."""
    hidden, inner = 512, 768
    g = torch.Generator().manual_seed(seed)
    layers = [(1 + 0.1 * torch.randn(hidden, generator=g), torch.randn(2 * inner, hidden, generator=g) / hidden ** 0.5,
               torch.randn(hidden, inner, generator=g) / inner ** 0.5) for _ in range(20)]
    layers = [tuple(t.to("cuda", torch.bfloat16) for t in layer) for layer in layers]
    x = torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16)
    residual = torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16)

    monkeypatch.setenv("PELLUCID_PDL", "0")
    expected = _chain(x, residual, layers)
    monkeypatch.setenv("PELLUCID_PDL", "1")
    _chain(x, residual, layers)     # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, residual, layers)
    for _ in range(20):
        x.copy_(torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16))
        monkeypatch.setenv("PELLUCID_PDL", "0")
        expected = _chain(x, residual, layers)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_equal_with_and_without_pdl(tiny_model_factory, monkeypatch, arch):
    """bf16, batch 1 and a small batch (skinny GEMMs, split-KV decode): PDL changes no arithmetic, so
    the tokens are identical."""
    from tests.gpu.test_gpu_engine import _generate, _prompts
    model_dir = tiny_model_factory(arch, seed=3, num_hidden_layers=3)
    runs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("PELLUCID_PDL", pdl)
        single, _ = _generate(model_dir, _prompts(7, 1), [40], device="cuda", dtype="bfloat16")
        batch, llm = _generate(model_dir, _prompts(8, 5), [24] * 5, device="cuda", dtype="bfloat16")
        assert llm.engine.runner.cuda_graphs is not None
        runs[pdl] = (single, batch)
    assert runs["1"] == runs["0"]
