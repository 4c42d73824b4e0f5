"""Shared helpers for the extraction tests: tiny engines and transformers references."""
from __future__ import annotations

import errno
import os
import threading
from typing import Any, Callable

import pytest
import torch

# Re-exported: the extraction tests import them from here.
from tests.reference import hf_forward, random_prompts, relative_error  # noqa: F401

TOLERANCE = 1e-4
EXTRACTION_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "lfm2"]


def num_layers_of(arch: str) -> int:
    return 4 if arch == "lfm2" else 3


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
        out = hf_forward(model, token_ids)
        with torch.no_grad():
            final = model.model(torch.tensor([token_ids])).last_hidden_state[0]
        return {"hidden_states": out["hidden_states"], "final": final, "layers": out["layers"]}
    return ref


def expected_states(ref: dict[str, Any], layers: list[int]) -> torch.Tensor:
    """[T, len(layers), hidden]: layer i's output (transformers' hidden_states[i + 1] for all but the last
    layer), -1 the final normed output."""
    cols = [ref["final"] if layer == -1 else ref["layers"][layer] for layer in layers]
    return torch.stack(cols, dim=1)


class DiskFillsUp:
    """Stands in for the `os` module in the writer: the files opened after the first `files_ok` whose path
    `matches` fail half written, as on a disk that filled up (counted by opens, so concurrent writer
    threads cannot slip one past)."""

    def __init__(self, files_ok: int, matches: Callable[[str], bool]) -> None:
        self.files_ok, self.matches = files_ok, matches
        self.started = 0
        self.failing: set[int] = set()
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        if self.matches(path):
            with self.lock:
                self.started += 1
                if self.started > self.files_ok:
                    self.failing.add(fd)
        return fd

    def close(self, fd):
        self.failing.discard(fd)
        os.close(fd)

    def write(self, fd, data):
        if fd in self.failing:
            os.write(fd, bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)
