"""Interventions over HTTP through the openai client's extra_body, against the offline engine."""
from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import torch

from pellucid import LLM, SamplingParams
from pellucid.engine.async_llm import AsyncLLM
from pellucid.tokenizer import apply_chat_template
from pellucid.tracing import Add, Save, TracePlan, b64_to_tensors, ops_to_json, tensors_to_b64
from tests.server.server_harness import MODEL_NAME, start_server
from tests.tracing.conftest import TOLERANCE, relative_error

MODEL = MODEL_NAME          # the name the test harness serves
KWARGS = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def served(model_dir):
    engine = AsyncLLM(model_dir("qwen3"), served_model_name=MODEL, **KWARGS)
    running = start_server(engine)
    client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)
    yield running, client, LLM(model_dir("qwen3"), **KWARGS)
    running.stop()
    engine.shutdown()


def _vector(seed: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed)) * 3.0


@pytest.mark.parametrize("seed", [0, 1])
def test_completions_interventions_round_trip(served, seed):
    _, client, llm = served
    prompt = ["the cat sat on the mat", "hello world quick brown fox"][seed]
    ops = [Add(site="model.layers.1", value=_vector(seed)), Save(site="model.layers.2", name="h"),
           Save(site="logits", positions="last", name="last_logits")]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"interventions": ops_to_json(ops), "ignore_eos": True})
    choice = resp.choices[0]
    saves = b64_to_tensors(choice.model_extra["saves"])
    offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False, extras=[{"trace": TracePlan(ops)}])[0]
    assert choice.text == offline.outputs[0].text
    assert set(saves) == {"h", "last_logits"}
    for name in saves:
        assert relative_error(saves[name], offline.extras["saves"][name]) <= TOLERANCE
    assert choice.model_extra["save_positions"]["h"] == offline.extras["save_positions"]["h"]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "saves" not in (plain.choices[0].model_extra or {})


def test_chat_completions_interventions_with_plain_list_values(served):
    _, client, llm = served
    ops = [{"op": "scale", "site": "model.layers.0.mlp", "factor": 0.0},
           {"op": "add", "site": "model.layers.1", "value": [0.25] * 64, "phase": "generated"},
           {"op": "save", "site": "model.norm", "positions": {"start": -2}}]
    messages = [{"role": "user", "content": "hello there"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"interventions": ops, "ignore_eos": True})
    saves = b64_to_tensors(resp.choices[0].model_extra["saves"])
    prompt_ids = apply_chat_template(llm.get_tokenizer(), messages, True)
    offline = llm.generate([list(prompt_ids)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False, extras=[{"trace": ops}])[0]
    assert resp.choices[0].message.content == offline.outputs[0].text
    assert relative_error(saves["model.norm.output"], offline.extras["saves"]["model.norm.output"]) <= TOLERANCE
    assert saves["model.norm.output"].shape == (2 + 3, 64)


@pytest.mark.parametrize("interventions, message", [
    ([{"op": "apply", "site": "model.norm"}], "offline only"),
    ([{"op": "add", "site": "model.norm"}], "needs a 'value'"),
    ([{"op": "add", "site": "model.norm", "value": "%%%"}], "base64"),
    ([{"op": "save", "site": "model.layrs.0"}], "did you mean"),
    ([{"op": "save", "site": "model.norm", "positions": [999]}], "beyond"),
    ({"op": "save"}, "list"),
    ([{"op": "add", "site": "model.norm", "value": [1.0] * 5}], "add value of shape (5,) does not fit"),
    ([{"op": "scale", "site": "model.norm", "factor": [1.0] * 3}], "scale factor of shape (3,) does not fit"),
    ([{"op": "set", "site": "model.norm", "positions": [0, 1], "value": [[1.0] * 64] * 3}], "selects 2 positions"),
])
def test_malformed_interventions_are_400_naming_the_problem(served, interventions, message):
    running, _, _ = served
    r = httpx.post(f"{running.base_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "interventions": interventions})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_failing_intervention_fails_only_its_request(served):
    running, client, _ = served
    bad = ops_to_json([Add(site="model.layers.1", value=torch.ones(5))])
    good = ops_to_json([Save(site="model.layers.1", name="h")])

    def call(ops):
        return client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=8, temperature=0,
                                         extra_body={"interventions": ops, "ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, ops) for ops in (good, bad, good, good)]
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except openai.APIStatusError as exc:
                results.append(exc)
    assert isinstance(results[1], openai.APIStatusError) and "shape" in str(results[1])
    for r in (results[0], results[2], results[3]):
        assert b64_to_tensors(r.choices[0].model_extra["saves"])["h"].shape[1] == 64
    assert running.llm.is_running


def test_saves_b64_is_safetensors():
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    back = b64_to_tensors(tensors_to_b64(tensors))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_interventions_stream_text_and_bring_the_saves_in_the_last_chunk(served, seed):
    running, client, _ = served
    ops = ops_to_json([Add(site="model.layers.0", value=_vector(seed + 4) * 0.02), Save(site="model.layers.1", name="h")])
    kwargs = dict(model=MODEL, prompt=["the cat sat on the mat", "hello world quick brown fox"][seed], max_tokens=12,
                  temperature=0)
    whole = client.completions.create(extra_body={"interventions": ops, "ignore_eos": True}, **kwargs)
    chunks = list(client.completions.create(stream=True, extra_body={"interventions": ops, "ignore_eos": True},
                                            **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1                      # the text streamed, token by token
    assert "".join(texts) == whole.choices[0].text
    carrying = [c for c in chunks if c.choices and "saves" in (c.choices[0].model_extra or {})]
    assert len(carrying) == 1 and carrying[0] is [c for c in chunks if c.choices][-1]
    assert carrying[0].choices[0].finish_reason == "length"
    streamed = b64_to_tensors(carrying[0].choices[0].model_extra["saves"])["h"]
    assert torch.equal(streamed, b64_to_tensors(whole.choices[0].model_extra["saves"])["h"])
    assert carrying[0].choices[0].model_extra["save_positions"] == whole.choices[0].model_extra["save_positions"]
