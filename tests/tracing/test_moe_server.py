"""A mixture-of-experts model behind the HTTP server: greedy completions equal the offline engine, and router
interventions (an ablated expert, saved router logits) travel as JSON through the openai client."""
from __future__ import annotations

import openai
import pytest
import torch

from pellucid import LLM, SamplingParams
from pellucid.engine.async_llm import AsyncLLM
from pellucid.tracing import Save, Scale, TracePlan, b64_to_tensors, ops_to_json
from tests.server.server_harness import MODEL_NAME, start_server
from tests.tracing.conftest import TOLERANCE, relative_error

KWARGS = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def served(model_dir):
    engine = AsyncLLM(model_dir("qwen3-moe"), served_model_name=MODEL_NAME, **KWARGS)
    running = start_server(engine)
    client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)
    yield client, LLM(model_dir("qwen3-moe"), **KWARGS)
    running.stop()
    engine.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_completions_and_router_interventions_over_http(served, seed):
    client, llm = served
    prompt = ["the cat sat on the mat", "hello world quick brown fox"][seed]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text

    mask = torch.ones(8)
    mask[seed + 2] = 0.0
    ops = [Scale(site="model.layers.1.mlp.routing", factor=mask), Save(site="model.layers.1.mlp.gate", name="router"),
           Save(site="model.layers.1.mlp.routing", name="routing")]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"interventions": ops_to_json(ops), "ignore_eos": True})
    offline = llm.generate([prompt], params, use_tqdm=False, extras=[{"trace": TracePlan(ops)}])[0]
    choice = resp.choices[0]
    assert choice.text == offline.outputs[0].text
    saves = b64_to_tensors(choice.model_extra["saves"])
    for name in ("router", "routing"):
        assert relative_error(saves[name], offline.extras["saves"][name]) <= TOLERANCE
    assert not bool((saves["routing"][:, seed + 2] != 0).any())
