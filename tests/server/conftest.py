"""Session fixtures: one tiny random model, one AsyncLLM and one server for all server tests (the engine
core in its own process, as `pellucid serve` runs it), and a second server whose engine core runs in the
test's process, for the tests that slow or break its steps."""
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
def threaded_server(server_model_dir):
    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, engine_process=False, **ENGINE_KWARGS)
    running = start_server(llm)
    yield running
    running.stop()
    llm.shutdown()


@pytest.fixture(scope="session")
def reference_llm(server_model_dir):
    from pellucid.llm import LLM
    return LLM(server_model_dir, **ENGINE_KWARGS)
