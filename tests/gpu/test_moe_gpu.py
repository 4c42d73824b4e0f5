"""The fused mixture-of-experts kernels: under the Triton interpreter on the CPU, compiled on the GPU; the MoE
block inside a CUDA graph; MoE models on the GPU against the CPU engine, with router traces."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.check_support import assert_close, run_script_under_interpreter, triton_importable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels (test_moe_kernels_on_gpu)")
def test_moe_kernels_under_triton_interpreter():
    run_script_under_interpreter("moe_checks.py")


@needs_cuda
@pytest.mark.parametrize("part", ["routing", "experts", "fp8", "block"])
def test_moe_kernels_on_gpu(part):
    from tests.gpu.moe_checks import run_part
    run_part("cuda", part)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 200])
def test_moe_block_replays_in_a_cuda_graph(num_tokens):
    """Captured once, the graph computes each new input's own routing (different experts every replay)."""
    from pellucid.kernels.fused_moe import route_and_align
    from pellucid.models.moe import MoeSpec, SparseMoeBlock
    torch.manual_seed(num_tokens)
    block = SparseMoeBlock(MoeSpec(32, 4, True, True), 256, 128, 0, torch.bfloat16, "cuda")
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    x = torch.randn(num_tokens, 256, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        block(x)                    # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        for _ in range(3):
            x.copy_(torch.randn(num_tokens, 256, device="cuda"))
            graph.replay()
            # The kernel's own routing as reference: bf16 logits tie often, and ties go to the lowest index.
            ids, weights, _ = route_and_align(block.gate(x), block.spec)
            ref = block.experts._forward_masked(x, ids.long(), weights)
            assert_close(out.clone(), ref, torch.bfloat16, f"graph replay T={num_tokens}")


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_float32_greedy_on_gpu_equals_cpu(tiny_model_factory, arch):
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    model_dir = tiny_model_factory(arch, num_hidden_layers=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 70, 1)]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    results = []
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, device=device, dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=512)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if device == "cuda":
            assert llm.engine.runner.cuda_graphs.num_replays > 0
    assert results[0] == results[1]


@needs_cuda
def test_router_traces_on_gpu_equal_cpu(tiny_model_factory):
    """Router saves and a forced expert (a tap on the router logits, inside CUDA graphs for decode steps)
    and an ablated expert (per-request path) give the CPU engine's values."""
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams
    from pellucid.tracing import Add, Save, Scale, TracePlan
    from tests.reference import relative_error

    model_dir = tiny_model_factory("qwen3-moe", num_hidden_layers=3)
    force = torch.zeros(8)
    force[5] = 1e4
    mask = torch.ones(8)
    mask[2] = 0.0
    plans = [[Save(site="model.layers.1.mlp.gate", name="router"), Save(site="model.layers.1.mlp.routing", name="r")],
             [Add(site="model.layers.2.mlp.gate", value=force), Save(site="logits", name="logits")],
             [Scale(site="model.layers.0.mlp.routing", factor=mask), Save(site="logits", name="logits")]]
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (12, 30, 7, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, device=device, dtype="float32", max_model_len=256, num_kv_blocks=512)
        extras = [{"trace": TracePlan(p)} for p in plans] + [None]
        runs.append(llm.generate(prompts, params, use_tqdm=False, extras=extras))
    for cpu, gpu in zip(*runs):
        assert cpu.outputs[0].token_ids == gpu.outputs[0].token_ids
        for name, value in (cpu.extras.get("saves") or {}).items():
            assert relative_error(gpu.extras["saves"][name], value) <= 1e-4, name
