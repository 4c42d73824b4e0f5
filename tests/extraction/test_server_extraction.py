"""`/v1/completions` with `extract_hidden_states`, through the openai client's extra_body."""
from __future__ import annotations

import os

import openai
import pytest

from pellucid import SamplingParams
from pellucid.extraction import HiddenStatesDataset, read_manifest
from pellucid.tracing.serialization import b64_to_tensors
from tests.extraction.conftest import TOLERANCE, expected_states, random_prompts, relative_error
from tests.server.server_harness import run_app_in_thread

MODEL = "tiny-llama"
LAYERS = [0, 2, -1]


@pytest.fixture(scope="module")
def server(ext_model_dir, tmp_path_factory):
    from pellucid.engine.async_llm import AsyncLLM
    from pellucid.server.app import build_app

    extract_dir = tmp_path_factory.mktemp("server-extract")
    llm = AsyncLLM(ext_model_dir("llama"), served_model_name=MODEL, dtype="float32", device="cpu", num_kv_blocks=128,
                   max_model_len=64)
    url, server, thread = run_app_in_thread(build_app(llm, MODEL, extract_dir=str(extract_dir)))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    yield client, extract_dir
    server.should_exit = True
    thread.join(30)
    llm.shutdown()


def _complete(client, prompt, extract, max_tokens=6):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"ignore_eos": True, "extract_hidden_states": extract})


def test_inline_round_trip(server, make_ext_llm, hf_reference):
    client, _ = server
    prompts = random_prompts(61, [11, 19])
    response = _complete(client, prompts, {"layers": LAYERS, "output": "inline"})
    reference = make_ext_llm("llama").generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                               use_tqdm=False)
    for choice in response.choices:
        field = choice.model_extra["hidden_states"]
        assert field["layers"] == LAYERS and field["prompt_length"] == len(prompts[choice.index])
        tensors = b64_to_tensors(field["data"])
        sequence = prompts[choice.index] + reference[choice.index].outputs[0].token_ids
        assert tensors["input_ids"].tolist() == sequence and field["num_tokens"] == len(sequence)
        assert int(tensors["prompt_length"]) == len(prompts[choice.index])
        ref = hf_reference("llama", sequence)
        assert relative_error(tensors["hidden_states"], expected_states(ref, LAYERS)) <= TOLERANCE


def test_server_output_goes_to_the_configured_directory(server, hf_reference):
    client, extract_dir = server
    prompt = random_prompts(62, [14])[0]
    response = _complete(client, prompt, {"layers": [1, -1], "output": "server"})
    field = response.choices[0].model_extra["hidden_states"]
    assert "data" not in field and field["file"].startswith("layers_1_-1" + os.sep)
    subdir = extract_dir / "layers_1_-1"
    assert [e["id"] for e in read_manifest(str(subdir))] == [field["id"]]
    (item,) = list(HiddenStatesDataset(str(subdir)))
    assert item["input_ids"].shape[0] == field["num_tokens"] == len(prompt) + 6
    ref = hf_reference("llama", item["input_ids"].tolist())
    assert relative_error(item["hidden_states"], expected_states(ref, [1, -1])) <= TOLERANCE


@pytest.mark.parametrize("extract, message", [
    ({"layers": [0], "output": "/tmp/pellucid-evil"}, "never writes to a path"),
    ({"layers": [0], "output": "server", "path": "/tmp/pellucid-evil"}, "never to a path"),
    ({"layers": [0], "output_dir": "/tmp/pellucid-evil"}, "never to a path"),
    ({"layers": [3]}, "out of range"),
    ({"layers": [0, -5]}, "out of range"),
    ({"output": "inline"}, "needs 'layers'"),
    ("layers=0", "must be an object"),
])
def test_refusals_are_http_400(server, extract, message):
    client, _ = server
    with pytest.raises(openai.BadRequestError, match=message) as info:
        _complete(client, [5, 6, 7], extract)
    assert info.value.status_code == 400
    assert not os.path.exists("/tmp/pellucid-evil")


def test_too_long_for_extraction_is_400(server):
    client, _ = server
    with pytest.raises(openai.BadRequestError, match="max_model_len=64") as info:
        _complete(client, random_prompts(63, [60])[0], {"layers": [0]}, max_tokens=4)
    assert info.value.status_code == 400


def test_streaming_is_refused(server):
    client, _ = server
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, stream=True,
                                  extra_body={"extract_hidden_states": {"layers": [0]}})
