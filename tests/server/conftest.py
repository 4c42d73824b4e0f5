"""Session fixtures: one tiny random model, one AsyncLLM and one server for all server tests."""
from __future__ import annotations

import pytest

from pellucid.engine.async_llm import AsyncLLM
from server_harness import ENGINE_KWARGS, MODEL_NAME, start_server


@pytest.fixture(scope="session")
def server_model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def async_engine(server_model_dir):
    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(async_engine):
    running = start_server(async_engine)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def reference_llm(server_model_dir):
    from pellucid.llm import LLM
    return LLM(server_model_dir, **ENGINE_KWARGS)
