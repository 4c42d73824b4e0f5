"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers on tiny random checkpoints:
logits, chunked prefill and decode, routing ties, and the checkpoint layouts the loader takes (greedy tokens:
test_models_vs_hf.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pellucid.models.loader import load_model
from pellucid.models.moe import MoeSpec, SparseMoeBlock, route
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import (PagedModelRunner, hf_logits, load_hf_model, random_token_prompts,
                                  relative_error, write_fused_expert_layout)

TOLERANCE = 1e-4

# (arch, config overrides): several expert counts and top-k, renormalised or not, dense layers mixed in.
CONFIGS = {
    "qwen3-moe-e8k2": ("qwen3-moe", {}),
    "qwen3-moe-e16k4-raw": ("qwen3-moe", {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False,
                                          "num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3-moe-step2-k1": ("qwen3-moe", {"num_experts": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4,
                                         "decoder_sparse_step": 2}),
    "qwen2-moe-e6k3": ("qwen2-moe", {}),
    "qwen2-moe-e4k1-norm": ("qwen2-moe", {"num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True}),
    "mixtral-e4k2": ("mixtral", {}),
    "mixtral-e8k3": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            arch, overrides = CONFIGS[name]
            cache[name] = build_tiny_model(arch, str(tmp_path_factory.mktemp(name)), seed=len(cache), **overrides)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_prefill_matches_hf(checkpoints, name: str) -> None:
    model_dir = checkpoints(name)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    for seed in range(2):
        prompts = random_token_prompts(seed, [7, 33, 1, 20 + 17 * seed])
        runner = PagedModelRunner(model, 16, seed=seed)
        batch_logits = runner.step(list(enumerate(prompts)), num_padded_tokens=sum(map(len, prompts)) + 3)
        for prompt, logits in zip(prompts, batch_logits):
            assert relative_error(logits, hf_logits(hf_model, prompt)) <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen3-moe-e16k4-raw", "qwen2-moe-e6k3", "mixtral-e8k3"])
def test_chunked_prefill_decode_and_mixed_batch_match_hf(checkpoints, name: str) -> None:
    model_dir = checkpoints(name)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    prompt, other = random_token_prompts(100, [45, 30])
    expected, expected_other = hf_logits(hf_model, prompt), hf_logits(hf_model, other)
    runner = PagedModelRunner(model, 16)
    chunked = torch.cat([runner.step([("chunked", prompt[:19])])[0], runner.step([("chunked", prompt[19:])])[0]])
    decoded = torch.cat([runner.step([("decode", [token])])[0] for token in prompt])
    assert relative_error(chunked, expected) <= TOLERANCE
    assert relative_error(decoded, expected) <= TOLERANCE
    # A decode, a chunk over a cached prefix and a fresh prompt in one step.
    runner.step([("d", other[:-1]), ("c", prompt[:17])])
    d, c, f = runner.step([("d", other[-1:]), ("c", prompt[17:]), ("f", other)])
    assert relative_error(d, expected_other[-1:]) <= TOLERANCE
    assert relative_error(c, expected[17:]) <= TOLERANCE
    assert relative_error(f, expected_other) <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen3-moe-e16k4-raw", "qwen2-moe-e6k3", "mixtral-e8k3"])
def test_module_paths_and_dense_layers_are_hf(checkpoints, name: str) -> None:
    model_dir = checkpoints(name)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = load_hf_model(model_dir)
    hf_modules = dict(hf_model.named_modules())
    ours = dict(model.named_modules())
    hf_params = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    assert hf_params == {n: tuple(p.shape) for n, p in model.named_parameters()}
    for i, layer in enumerate(model.model.layers):
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        assert sparse == hasattr(hf_modules[f"model.layers.{i}.mlp"], "experts")
        if sparse:
            for sub in ("gate", "experts"):
                assert f"model.layers.{i}.mlp.{sub}" in ours
    assert {n for n in hf_modules if n.startswith("model.layers.")} <= set(ours)


@pytest.mark.parametrize("arch_module,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("seed", range(3))
def test_routing_and_ties_equal_the_hf_router(arch_module: str, norm: bool, seed: int) -> None:
    """The same logits give the same experts and weights as transformers' router, ties included (logits
    rounded to a coarse grid, so many probabilities are equal)."""
    import importlib

    import transformers

    hf = importlib.import_module(f"transformers.models.{arch_module}.modeling_{arch_module}")
    config_class = getattr(transformers, "Qwen3MoeConfig" if arch_module == "qwen3_moe" else "MixtralConfig")
    gen = torch.Generator().manual_seed(seed)
    config = config_class(hidden_size=16, num_experts=12, num_experts_per_tok=3, norm_topk_prob=norm)
    router = (hf.Qwen3MoeTopKRouter if arch_module == "qwen3_moe" else hf.MixtralTopKRouter)(config)
    with torch.no_grad():
        router.weight.copy_((torch.randn(12, 16, generator=gen) * 2).round() / 4)
        router.weight[5] = router.weight[2]                       # two experts always tie
    hidden = (torch.randn(64, 16, generator=gen) * 2).round()
    logits, weights, ids = router(hidden)
    spec = MoeSpec(12, 3, norm if arch_module == "qwen3_moe" else True, arch_module == "qwen3_moe")
    our_ids, our_weights = route(torch.nn.functional.linear(hidden, router.weight), spec)
    assert torch.equal(our_ids, ids) and torch.equal(our_weights, weights)


@pytest.mark.parametrize("name", ["qwen3-moe-e8k2", "mixtral-e4k2", "qwen2-moe-e6k3"])
def test_fused_and_mixed_expert_layouts_load_the_same_weights(checkpoints, tmp_path, name: str) -> None:
    model_dir = checkpoints(name)
    per_expert, _ = load_model(model_dir, torch.float32, "cpu")
    reference = dict(per_expert.named_parameters())
    for layers, sub in ((None, "fused"), ([0], "mixed")):
        write_fused_expert_layout(model_dir, str(tmp_path / sub), layers)
        model, _ = load_model(str(tmp_path / sub), torch.float32, "cpu")
        for n, p in model.named_parameters():
            assert torch.equal(p, reference[n]), n
    # transformers reads the fused layout too, with the same result.
    hf = load_hf_model(str(tmp_path / "fused"))
    prompt = random_token_prompts(3, [12])[0]
    runner = PagedModelRunner(per_expert, 16)
    assert relative_error(runner.step([("r", prompt)])[0], hf_logits(hf, prompt)) <= TOLERANCE


def test_other_expert_layouts_are_refused_by_name(checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen3-moe-e8k2")
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))

    def write(sub: str, change) -> str:
        dst = tmp_path / sub
        write_fused_expert_layout(model_dir, str(dst), [])      # a plain copy
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return str(dst)

    renamed = write("renamed", lambda t: t.__setitem__("model.layers.0.mlp.experts.3.w1.weight",
                                                       t.pop("model.layers.0.mlp.experts.3.gate_proj.weight")))
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight.*unknown expert projection 'w1'"):
        load_model(renamed, torch.float32, "cpu")
    missing = write("missing", lambda t: t.pop("model.layers.1.mlp.experts.7.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.down_proj \(\d+ of \d+"):
        load_model(missing, torch.float32, "cpu")

    def transposed(t: dict) -> None:
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 32, 64)   # [E, I, H]: not transformers' layout
    with pytest.raises(ValueError, match=r"experts\.down_proj.*shape \(8, 32, 64\).*expects \(8, 64, 32\)"):
        load_model(write("transposed", transposed), torch.float32, "cpu")

    def both(t: dict) -> None:
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)
    with pytest.raises(ValueError, match="more than once"):
        load_model(write("both", both), torch.float32, "cpu")


def test_benchmark_shape_without_weight_files_draws_them_at_load(checkpoints, tmp_path) -> None:
    """pellucid_random_weights.json instead of safetensors (bench/models.py's 30B shape): every parameter is
    drawn, reproducibly from the seed, at the scale the checkpoint writer uses."""
    from pellucid.models.loader import RANDOM_WEIGHTS_FILE

    source = checkpoints("qwen3-moe-e8k2")
    for name in ("config.json",):
        (tmp_path / name).write_bytes(open(os.path.join(source, name), "rb").read())
    (tmp_path / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 3}))
    first, _ = load_model(str(tmp_path), torch.float32, "cpu")
    again, _ = load_model(str(tmp_path), torch.float32, "cpu")
    for (name, p), q in zip(first.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
        if p.dim() == 1:
            assert (p - 1).abs().max() < 0.5, name
        else:
            assert abs(p.std().item() * p.shape[-1] ** 0.5 - 1) < 0.2, name
