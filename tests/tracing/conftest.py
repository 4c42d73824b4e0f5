"""Shared helpers for the tracing tests: tiny engines, transformers references with hooks."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

# Re-exported: the tracing tests import them from here.
from tests.reference import hf_forward, random_prompts, relative_error  # noqa: F401

NUM_LAYERS = 3        # > 2 so some layer is neither the first nor the last
TOLERANCE = 1e-4


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


def replace_output(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A transformers forward hook that replaces a module's (first) output by fn(output)."""
    def hook(_module: Any, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (fn(out[0]), *out[1:])
        return fn(out)
    return hook
