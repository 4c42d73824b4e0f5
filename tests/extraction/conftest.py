"""Shared helpers for the extraction tests: tiny engines and transformers references."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

TOLERANCE = 1e-4
EXTRACTION_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "lfm2"]


def num_layers_of(arch: str) -> int:
    return 4 if arch == "lfm2" else 3


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def ext_model_dir(tiny_model_factory) -> Callable[[str], str]:
    def get(arch: str = "llama") -> str:
        if arch == "lfm2":
            return tiny_model_factory("lfm2")
        return tiny_model_factory(arch, num_hidden_layers=num_layers_of(arch))
    return get


@pytest.fixture(scope="session")
def make_ext_llm(ext_model_dir) -> Callable[..., Any]:
    from pellucid import LLM

    def make(arch: str = "llama", **kwargs: Any) -> Any:
        kwargs.setdefault("num_kv_blocks", 256)
        return LLM(ext_model_dir(arch), dtype="float32", device="cpu", **kwargs)
    return make


@pytest.fixture(scope="session")
def hf_reference(ext_model_dir) -> Callable[[str, list[int]], dict[str, Any]]:
    """`ref(arch, token_ids)`: transformers' hidden_states plus every decoder layer's output and the
    backbone's (final normed) output, captured with forward hooks."""
    from transformers import AutoModelForCausalLM

    models: dict[str, torch.nn.Module] = {}

    def ref(arch: str, token_ids: list[int]) -> dict[str, Any]:
        if arch not in models:
            models[arch] = AutoModelForCausalLM.from_pretrained(ext_model_dir(arch), dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        model = models[arch]
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for i, layer in enumerate(model.model.layers):
            def capture(_m: Any, _a: Any, out: Any, i: int = i) -> None:
                captured[i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
            handles.append(layer.register_forward_hook(capture))
        try:
            with torch.no_grad():
                out = model(torch.tensor([token_ids]), output_hidden_states=True)
                final = model.model(torch.tensor([token_ids])).last_hidden_state[0]
        finally:
            for h in handles:
                h.remove()
        return {"hidden_states": [h[0] for h in out.hidden_states], "final": final,
                "layers": [captured[i] for i in range(len(model.model.layers))]}
    return ref


def expected_states(ref: dict[str, Any], layers: list[int]) -> torch.Tensor:
    """[T, len(layers), hidden]: layer i's output (transformers' hidden_states[i + 1] for all but the last
    layer), -1 the final normed output."""
    cols = [ref["final"] if layer == -1 else ref["layers"][layer] for layer in layers]
    return torch.stack(cols, dim=1)
