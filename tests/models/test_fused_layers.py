"""Merged q/k/v and gate/up projections, fused residual add + norm: the fast path equals the
module-by-module path, parameters stay HuggingFace-named views of the merged storage, and traced
sites the fast path skips still carry transformers' values."""
from __future__ import annotations

import pytest
import torch

from pellucid.models.layers import is_observed
from pellucid.models.loader import load_model, read_tensors
from pellucid.tiny_models import build_tiny_model
from tests.models.helpers import PagedModelRunner, relative_error

ARCHS = ["llama", "llama-bias", "qwen2", "qwen3", "mistral"]
VOCAB = 500
SKIPPED_SITES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.act_fn", "post_attention_layernorm", "input_layernorm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, str(tmp_path_factory.mktemp(arch)), seed=11 + len(cache),
                                           num_hidden_layers=3)
        return cache[arch]
    return get


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _logits(model: torch.nn.Module, prompts: list[list[int]], seed: int) -> torch.Tensor:
    """Prefill every prompt but its last token, then decode that token: both step kinds."""
    runner = PagedModelRunner(model, 16, seed=seed)
    first = runner.step([(i, p[:-1]) for i, p in enumerate(prompts)])
    last = runner.step([(i, p[-1:]) for i, p in enumerate(prompts)])
    return torch.cat([torch.cat([a, b]) for a, b in zip(first, last)])


def _observe_everything(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """A no-op forward hook on every module forces the module-by-module path everywhere."""
    return [m.register_forward_hook(lambda *_: None) for m in model.modules()]


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_path_equals_module_by_module_path(checkpoints, arch: str, monkeypatch) -> None:
    model, _ = load_model(checkpoints(arch), torch.float32, "cpu")
    for seed in range(3):
        prompts = _prompts(seed, [5, 19, 2 + 9 * seed])
        fast = _logits(model, prompts, seed)
        handles = _observe_everything(model)
        try:
            assert is_observed(model.model.layers[0].self_attn.q_proj)
            exact = _logits(model, prompts, seed)
        finally:
            for handle in handles:
                handle.remove()
        monkeypatch.setenv("PELLUCID_MERGED_PROJ", "0")
        separate = _logits(model, prompts, seed)
        monkeypatch.delenv("PELLUCID_MERGED_PROJ")
        assert relative_error(fast, exact) <= 1e-5
        assert relative_error(separate, exact) <= 1e-5
        assert not torch.equal(fast, _logits(model, _prompts(seed + 50, [5, 19, 2 + 9 * seed]), seed))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_parameters_are_hf_named_views_of_merged_storage(checkpoints, arch: str) -> None:
    model_dir = checkpoints(arch)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    names = [n for n, _ in model.named_parameters()]
    attn = model.model.layers[1].self_attn
    mlp = model.model.layers[1].mlp
    expected = read_tensors(model_dir, [f"model.layers.1.self_attn.{p}_proj.{k}" for p in "qkv"
                                        for k in (("weight", "bias") if arch == "qwen2" else ("weight",))]
                            + ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"])
    assert not any("qkv" in n or "gate_up" in n for n in names)
    for name, tensor in expected.items():
        assert name in names
        assert torch.equal(dict(model.named_parameters())[name], tensor)
    # The merged storage holds the loaded values, row block by row block.
    assert torch.equal(attn.qkv.weight, torch.cat([expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.q_proj.out_features:].data_ptr()
    if arch == "qwen2":
        assert torch.equal(attn.qkv.bias, torch.cat([expected[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[mlp.gate_proj.out_features:].data_ptr()
    # Writing through a parameter reaches the merged storage (the loader copies into parameters).
    with torch.no_grad():
        attn.v_proj.weight.add_(1.0)
    assert torch.equal(attn.qkv.weight[-attn.v_proj.out_features:], attn.v_proj.weight)


def test_moving_the_model_keeps_projections_merged(checkpoints) -> None:
    model, _ = load_model(checkpoints("qwen3"), torch.float32, "cpu")
    prompts = _prompts(3, [7, 12])
    before = _logits(model, prompts, 0)
    model = model.to(torch.float64).to(torch.float32)      # reallocates every parameter
    mlp = model.model.layers[0].mlp
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[mlp.gate_proj.out_features:].data_ptr()
    assert relative_error(_logits(model, prompts, 0), before) <= 1e-6


def test_replacing_a_merged_parameter_is_an_error(checkpoints) -> None:
    model, _ = load_model(checkpoints("llama"), torch.float32, "cpu")
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match="merge"):
        _logits(model, _prompts(0, [4]), 0)
    attn.qkv.merge()
    _logits(model, _prompts(0, [4]), 0)


def _hf_site_outputs(hf: torch.nn.Module, prompt: list[int], sites: list[str]) -> dict[str, torch.Tensor]:
    modules = dict(hf.named_modules())
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for site in sites:
        def hook(_m, args, out, site=site):
            captured[site + ".input"] = args[0][0].detach().clone()
            captured[site + ".output"] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
        handles.append(modules[site].register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(torch.tensor([prompt]))
    finally:
        for handle in handles:
            handle.remove()
    return captured


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_traced_sites_inside_fused_code_equal_transformers(checkpoints, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from pellucid import LLM, SamplingParams

    model_dir = checkpoints(arch)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    num_layers = hf.config.num_hidden_layers
    for seed in range(2):
        prompt = _prompts(20 + seed, [13])[0]
        layer = seed + 1                      # a middle layer and the last one
        sites = [f"model.layers.{layer}.{s}" for s in SKIPPED_SITES]
        with llm.trace([prompt], SamplingParams(temperature=0.0, max_tokens=1)) as tr:
            handles = {}
            for site in sites:
                module = tr.model.layers[layer]
                for part in site.split(".")[3:]:
                    module = getattr(module, part)
                handles[site + ".output"] = module.output.save()
                handles[site + ".input"] = module.input.save()
            if layer == num_layers - 1:
                handles["model.norm.input"] = tr.model.norm.input.save()
        expected = _hf_site_outputs(hf, prompt, sites + ["model.norm"])
        for name, handle in handles.items():
            assert relative_error(handle[0], expected[name]) <= 1e-4, name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_edit_at_a_merged_projection_matches_a_transformers_hook(checkpoints, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from pellucid import LLM, SamplingParams

    model_dir = checkpoints(arch)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for seed, module_name in enumerate(["self_attn.k_proj", "mlp.up_proj", "post_attention_layernorm"]):
        prompt = _prompts(40 + seed, [11])[0]
        hf_module = dict(hf.named_modules())[f"model.layers.1.{module_name}"]
        width = getattr(hf_module, "out_features", hf.config.hidden_size)
        # An added vector, not a scale: Qwen3's k_norm would undo a scale of k_proj's output.
        vector = torch.randn(width, generator=torch.Generator().manual_seed(seed))
        with llm.trace([prompt], SamplingParams(temperature=0.0, max_tokens=1)) as tr:
            module = tr.model.layers[1]
            for part in module_name.split("."):
                module = getattr(module, part)
            module.output.add(vector)
            logits = tr.logits.save()
        handle = hf_module.register_forward_hook(lambda _m, _a, out: out + vector)
        try:
            with torch.no_grad():
                expected = hf(torch.tensor([prompt])).logits[0]
        finally:
            handle.remove()
        with torch.no_grad():
            clean = hf(torch.tensor([prompt])).logits[0]
        assert relative_error(logits[0], expected) <= 1e-4, module_name
        assert relative_error(logits[0], clean) > 1e-3, module_name


def test_merged_gemms_run_only_while_their_projections_are_unobserved(checkpoints, monkeypatch) -> None:
    from pellucid.models.layers import MergedLinear

    model, _ = load_model(checkpoints("qwen3"), torch.float32, "cpu")
    calls: list[int] = []
    original = MergedLinear.__call__
    monkeypatch.setattr(MergedLinear, "__call__", lambda self, x: calls.append(len(self.sizes)) or original(self, x))
    num_layers = len(model.model.layers)
    _logits(model, _prompts(0, [6]), 0)                       # two steps, every merged GEMM each step
    assert sorted(calls) == sorted([2, 3] * num_layers * 2)
    calls.clear()
    handle = model.model.layers[0].self_attn.v_proj.register_forward_hook(lambda *_: None)
    try:
        _logits(model, _prompts(0, [6]), 0)
    finally:
        handle.remove()
    assert sorted(calls) == sorted([2] * num_layers * 2 + [3] * (num_layers - 1) * 2)
