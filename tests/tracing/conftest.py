"""Shared helpers for the tracing tests: tiny engines, transformers references with hooks."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

NUM_LAYERS = 3        # > 2 so some layer is neither the first nor the last
TOLERANCE = 1e-4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory) -> Callable[[str], str]:
    return lambda arch="llama": tiny_model_factory(arch, num_hidden_layers=NUM_LAYERS)


@pytest.fixture(scope="session")
def make_llm(model_dir) -> Callable[..., Any]:
    from pellucid import LLM

    def make(arch: str = "llama", **kwargs: Any) -> Any:
        kwargs.setdefault("num_kv_blocks", 256)
        return LLM(model_dir(arch), dtype="float32", device="cpu", **kwargs)
    return make


@pytest.fixture(scope="session")
def hf_model(model_dir) -> Callable[[str], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str = "llama") -> torch.nn.Module:
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(model_dir(arch), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        return cache[arch]
    return get


def hf_forward(model: torch.nn.Module, token_ids: list[int],
               hooks: list[tuple[torch.nn.Module, Callable[..., Any]]] = ()) -> dict[str, Any]:
    """Logits, hidden states and every decoder layer's output of one sequence, with optional forward hooks."""
    captured: dict[int, torch.Tensor] = {}
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    for i, layer in enumerate(model.model.layers):
        def capture(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            captured[i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
        handles.append(layer.register_forward_hook(capture))
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return {"logits": out.logits[0].float(), "hidden_states": [h[0] for h in out.hidden_states],
            "layers": [captured[i] for i in range(len(model.model.layers))]}


def replace_output(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A transformers forward hook that replaces a module's (first) output by fn(output)."""
    def hook(_module: Any, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (fn(out[0]), *out[1:])
        return fn(out)
    return hook
