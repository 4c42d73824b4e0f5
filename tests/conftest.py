"""Shared fixtures: tiny random models of each architecture, built once per test session, offline."""
from __future__ import annotations

import os

# Before torch loads OpenMP: the tests run engines in this process, in engine-core processes and in server
# processes on a 2-core machine, where OpenMP threads spinning while they wait starve the others
# (see pellucid/engine/core_proc.py, which sets the same for its engine processes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`factory(arch, **overrides) -> model dir`, cached per distinct arguments."""
    from pellucid.tiny_models import build_tiny_model

    cache: dict[tuple, str] = {}

    def factory(arch: str, seed: int = 0, **overrides) -> str:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = build_tiny_model(arch, str(out), seed=seed, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def flashhead_model_factory(tiny_model_factory):
    """`factory(arch, **overrides) -> model dir` of a tiny model with its FlashHead asset built (3 k-means
    iterations on the CPU)."""
    from pellucid.cli import main as cli_main

    def factory(arch: str, **overrides) -> str:
        model_dir = tiny_model_factory(arch, **overrides)
        if not os.path.exists(os.path.join(model_dir, "flashhead")):
            assert cli_main(["flashhead", "build", model_dir, "--iterations", "3", "--device", "cpu"]) == 0
        return model_dir

    return factory


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3-Omni checkpoint (thinker, talker, code2wav) with its tokenizer."""
    from pellucid.tiny_omni import build_tiny_omni

    return build_tiny_omni(str(tmp_path_factory.mktemp("qwen3-omni")))
