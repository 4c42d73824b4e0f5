"""Skinny decode GEMMs (pellucid.kernels.skinny_gemm) against torch matmul in fp32 and the unfused torch
MLP code: on the GPU, and on the CPU under the Triton interpreter (small shapes).

`python tests/gpu/test_skinny_gemm.py DEVICE` runs the kernel checks and exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

import pytest
import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu.check_support import assert_close, run_script_under_interpreter, triton_importable

# [N, K] of the q/k/v (merged), o, gate/up (merged) and down projections of Qwen3-0.6B, Llama-3.2-1B, Llama-3.1-8B,
# then Qwen3-30B-A3B's q/k/v, o (a whole-K tile past K = 3072) and router.
MODEL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                (5120, 2048), (2048, 4096), (128, 2048)]
ODD_SHAPES = [(40, 96), (33, 700), (130, 520), (7, 1030)]


def _tiles(m: int, n: int, k: int):
    """The tile the dispatch picks (or a CUDA-core tile past the crossover) and a tensor-core tile."""
    from pellucid.kernels.skinny_gemm import SkinnyConfig, pick_config
    block_m = 1 << (m - 1).bit_length()
    return [pick_config(m, n, k) or SkinnyConfig(block_m, 4, 128, 4, 3, False), SkinnyConfig(16, 32, 128, 4, 4, True)]


def _poison(shape: tuple[int, int], dtype: torch.dtype, device: str) -> None:
    """Leave NaNs in the block the caching allocator hands out next, so an unwritten output shows."""
    torch.full(shape, float("nan"), dtype=dtype, device=device)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _silu_mul_reference(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up           # rounded to the activation dtype, as the MLP does
    return _reference(act, weight, bias)


def check_linear(device: str, shapes: list[tuple[int, int]], rows: list[int], dtypes: list[torch.dtype],
                 seed: int) -> None:
    from pellucid.kernels import skinny_gemm
    g = torch.Generator().manual_seed(seed)
    for dtype in dtypes:
        for n, k in shapes:
            weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
            bias = torch.randn(n, generator=g).to(dtype).to(device)
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dtype).to(device)
                gate_up = (2 * torch.randn(m, 2 * k, generator=g)).to(dtype).to(device)
                for config in _tiles(m, n, k):
                    for b in (None, bias) if m in (1, 3) else ((None, bias)[(seed + m) % 2],):
                        what = f"{dtype} M={m} N={n} K={k} bias={b is not None} {config}"
                        _poison((m, n), dtype, device)
                        assert_close(skinny_gemm.linear(x, weight, b, config=config), _reference(x, weight, b), dtype,
                                     f"linear {what}")
                        _poison((m, n), dtype, device)
                        assert_close(skinny_gemm.silu_mul_linear(gate_up, weight, b, config=config),
                                     _silu_mul_reference(gate_up, weight, b), dtype, f"silu_mul_linear {what}")


def check_refusals(device: str) -> None:
    from pellucid.kernels import skinny_gemm
    x = torch.randn(2, 64, device=device)
    for bad in (lambda: skinny_gemm.linear(x, torch.randn(8, 32, device=device)),
                lambda: skinny_gemm.linear(x, torch.randn(8, 64, device=device, dtype=torch.bfloat16)),
                lambda: skinny_gemm.linear(torch.randn(64, 64, device=device), torch.randn(8, 64, device=device)),
                lambda: skinny_gemm.silu_mul_linear(torch.randn(2, 63, device=device), torch.randn(8, 31, device=device))):
        with pytest.raises(ValueError):
            bad()


GPU_PARTS = ["refusals", "odd-0", "odd-1", "odd-2", "models-0", "models-1", "dtypes"]


def run_part(device: str, part: str) -> None:
    """One slice of the checks (the GPU test runs them as separate cases, so a slow compile shows where)."""
    cpu = device == "cpu"     # the interpreter is slow: fewer shapes and rows there
    if part == "refusals":
        check_refusals(device)
    elif part.startswith("odd-"):
        check_linear(device, ODD_SHAPES[:2] if cpu else ODD_SHAPES, [1, 3] if cpu else list(range(1, 17)),
                     [torch.float32, torch.bfloat16], int(part[4:]))
    elif part.startswith("models-"):
        check_linear(device, MODEL_SHAPES, [1, 2, 3, 4, 7, 8, 16], [torch.bfloat16], int(part[7:]))
    elif part == "dtypes":
        check_linear(device, MODEL_SHAPES[:4], [1, 2, 8], [torch.float32, torch.float16], 3)
    else:
        raise ValueError(part)


def run_all(device: str) -> None:
    for part in ["refusals", "odd-0", "odd-1"] if device == "cpu" else GPU_PARTS:
        run_part(device, part)


def test_picked_tiles_are_launchable():
    """Every tile pick_config returns has power-of-two blocks and warps (Triton refuses others), and a
    whole-K tile at M = 1 covers K, so none of its weight loads waits behind the PDL wait."""
    from pellucid.kernels import skinny_gemm
    g = torch.Generator().manual_seed(0)
    shapes = [(n, k) for n, k in MODEL_SHAPES] + [tuple(int(v) for v in torch.randint(1, 20000, (2,), generator=g))
                                                   for _ in range(200)]
    power_of_two = lambda v: v >= 1 and v & (v - 1) == 0    # noqa: E731
    for n, k in shapes:
        for m in (1, 2):
            for silu in (False, True):
                config = skinny_gemm.pick_config(m, n, k, silu)
                if config is None:
                    continue
                assert all(map(power_of_two, (config.block_m, config.block_n, config.block_k, config.num_warps))), \
                    (m, n, k, silu, config)
                if skinny_gemm._preloads(m, n, k, silu):
                    assert config.block_k >= k and config.num_warps <= 32, (m, n, k, silu, config)


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA machine runs the compiled kernel (test_skinny_gemm_on_gpu); this check is for "
                           "machines without one (the GPU machine's Triton 3.6 interpreter cannot index a range "
                           "by the kernel's runtime K: 'only 0-dimensional arrays can be converted')")
def test_skinny_gemm_under_triton_interpreter():
    run_script_under_interpreter("test_skinny_gemm.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("part", GPU_PARTS)
def test_skinny_gemm_on_gpu(part):
    run_part("cuda", part)


def _mlp_reference(mlp, x: torch.Tensor) -> torch.Tensor:
    act = torch.nn.functional.silu(_reference(x, mlp.gate_proj.weight, None)) * _reference(x, mlp.up_proj.weight, None)
    return _reference(act, mlp.down_proj.weight, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gated_mlp_dispatch_on_gpu(monkeypatch, seed):
    """Decode-sized batches take the fused down projection; a hook on act_fn or down_proj turns it off and
    sees the real value; a prefill-sized batch keeps cuBLAS; all match the unfused torch code."""
    from pellucid.kernels import skinny_gemm
    from pellucid.models.layers import GatedMLP
    monkeypatch.setenv("PELLUCID_FUSED_KERNELS", "all")
    calls = []
    fused = skinny_gemm.silu_mul_linear
    monkeypatch.setattr(skinny_gemm, "silu_mul_linear", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    torch.manual_seed(seed)
    mlp = GatedMLP(256, 768, False, torch.bfloat16, "cuda")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.05)
    for m in (1, 3, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1, 64):
        x = torch.randn(m, 256, device="cuda").to(torch.bfloat16)
        calls.clear()
        assert_close(mlp(x), _mlp_reference(mlp, x), torch.bfloat16, f"GatedMLP M={m}")
        assert len(calls) == (1 if m <= skinny_gemm.MAX_ROWS else 0), (m, calls)
        for site in (mlp.act_fn, mlp.down_proj):
            seen = []
            handle = site.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
            calls.clear()
            assert_close(mlp(x), _mlp_reference(mlp, x), torch.bfloat16, f"GatedMLP M={m} hooked")
            handle.remove()
            assert not calls and len(seen) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_mlp_graph_capture_on_gpu(monkeypatch):
    """The skinny path captures into a CUDA graph and replays on new inputs."""
    from pellucid.models.layers import GatedMLP
    monkeypatch.setenv("PELLUCID_FUSED_KERNELS", "all")
    torch.manual_seed(0)
    mlp = GatedMLP(128, 384, True, torch.bfloat16, "cuda")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    mlp(x)      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp(x)
    for _ in range(3):
        x.copy_(torch.randn(4, 128, device="cuda"))
        graph.replay()
        act = torch.nn.functional.silu(_reference(x, mlp.gate_proj.weight, mlp.gate_proj.bias)) * \
            _reference(x, mlp.up_proj.weight, mlp.up_proj.bias)
        assert_close(out, _reference(act, mlp.down_proj.weight, mlp.down_proj.bias), torch.bfloat16, "graph replay")


if __name__ == "__main__":
    run_all(sys.argv[1])
