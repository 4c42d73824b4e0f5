"""/v1/embeddings through the official openai client, against transformers' backbone."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from server_harness import MODEL_NAME, random_prompts


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def backbone(server_model_dir):
    return AutoModel.from_pretrained(server_model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(server_model_dir)


def expected(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0).numpy()


@pytest.mark.parametrize("seed", [0, 1])
def test_embeddings_equal_transformers_in_either_encoding(client, backbone, seed):
    model, tokenizer = backbone
    texts = random_prompts(seed, 5)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    as_base64 = client.embeddings.create(model=MODEL_NAME, input=texts)          # the client asks for base64
    as_floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    for response in (as_base64, as_floats):
        assert [d.index for d in response.data] == list(range(len(texts)))
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ids)
        for row, token_ids in zip(response.data, ids):
            np.testing.assert_allclose(np.array(row.embedding), expected(model, token_ids), atol=1e-5)
    assert as_base64.model == MODEL_NAME and as_base64.data[0].object == "embedding"


def test_token_id_inputs_and_truncation(client, backbone):
    model, _ = backbone
    prompts = [[int(t) for t in torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40)]
    single = client.embeddings.create(model=MODEL_NAME, input=prompts[1], encoding_format="float")
    assert len(single.data) == 1
    np.testing.assert_allclose(np.array(single.data[0].embedding), expected(model, prompts[1]), atol=1e-5)
    batch = client.embeddings.create(model=MODEL_NAME, input=prompts, encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 10})
    assert batch.usage.prompt_tokens == 3 + 10 + 10
    for row, token_ids in zip(batch.data, prompts):
        np.testing.assert_allclose(np.array(row.embedding), expected(model, token_ids[-10:]), atol=1e-5)


def test_raw_base64_is_little_endian_float32(server, backbone):
    model, tokenizer = backbone
    finished = server.metric('pellucid:e2e_request_latency_seconds_count')
    reply = httpx.post(f"{server.base_url}/embeddings", json={"input": "one two three", "encoding_format": "base64"},
                       timeout=60)
    assert reply.status_code == 200
    vector = np.frombuffer(base64.b64decode(reply.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, expected(model, tokenizer("one two three")["input_ids"]), atol=1e-5)
    assert server.metric('pellucid:e2e_request_latency_seconds_count') == finished + 1


@pytest.mark.parametrize("body,param,status", [
    ({"input": []}, "input", 400),
    ({"input": ""}, "input", 400),
    ({"input": [[]]}, "input", 400),
    ({"input": [[5, 6], [100000]]}, "input", 400),
    ({"input": list(range(3, 600))}, "input", 400),
    ({"input": "hi", "dimensions": 16}, "dimensions", 400),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", 400),
    ({"input": "hi", "model": "other"}, "model", 404),
    ({}, "input", 400),
])
def test_bad_requests_are_refused_naming_the_field(server, body, param, status):
    reply = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _random_body(rng) -> dict:
    """Each field absent, valid (mostly) or invalid."""
    def ids(n):
        return [rng.randrange(3, 500) for _ in range(n)]
    fields = {  # field: (valid values, invalid values)
        "input": (["hello world", ["a b", "c"], ids(rng.randrange(1, 40)), [ids(3), ids(20)]],
                  ["", [], [[]], ["a b", 5], None, {"text": "a"}, [-1, 2], [10 ** 6], "x" * 3000, list(range(3, 600))]),
        "encoding_format": (["float", "base64"], ["int8", 3, None]),
        "dimensions": ([None], [0, 16, 64, 10 ** 9, "8", -1]),
        "truncate_prompt_tokens": ([None, 1, 5, 200], [0, -3, "x"]),
        "normalize": ([None, True, False], ["yes", [1]]),
        "add_special_tokens": ([True, False], [2, "no"]),
        "model": ([MODEL_NAME, None], ["other", 7]),
        "user": (["u"], [5]),
    }
    body = {}
    for key, (valid, invalid) in fields.items():
        roll = rng.random()
        if key == "input" or roll < 0.5:
            body[key] = rng.choice(invalid if rng.random() < 0.2 else valid)
    return body


def test_random_requests_never_fail_the_server(server):
    """Random valid and invalid bodies, some abandoned mid-request: every answer is a 200 or an OpenAI error
    naming its cause (never a 5xx), and afterwards no request runs and no KV block is held."""
    import asyncio
    import random

    from server_harness import wait_until
    from test_server_load import engine_idle

    rng = random.Random(3)
    bodies = [_random_body(rng) for _ in range(120)]

    async def run() -> list:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(body: dict, abandon: bool):
                try:
                    post = client.post(f"{server.base_url}/embeddings", json=body)
                    return await (asyncio.wait_for(post, 0.01) if abandon else post)
                except asyncio.TimeoutError:
                    return None
            return await asyncio.gather(*(one(b, i % 7 == 3) for i, b in enumerate(bodies)))

    for body, reply in zip(bodies, asyncio.run(run())):
        if reply is None:
            continue
        assert reply.status_code in (200, 400, 404), (body, reply.text)
        if reply.status_code != 200:
            assert reply.json()["error"]["message"], body
    wait_until(lambda: engine_idle(server), timeout=60)
    assert httpx.post(f"{server.base_url}/embeddings", json={"input": "still serving"}, timeout=60).status_code == 200


def test_a_server_without_an_lm_head_embeds_and_refuses_generation(server_model_dir, backbone):
    """`--head none` (as for a headless embedding checkpoint): /v1/embeddings serves, the generation
    endpoints answer 400 naming why."""
    from pellucid.engine.async_llm import AsyncLLM
    from pellucid.server.app import build_app
    from server_harness import ENGINE_KWARGS, run_app_in_thread

    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, engine_process=False, head="none", **ENGINE_KWARGS)
    url, uvicorn_server, thread = run_app_in_thread(build_app(llm, MODEL_NAME))
    try:
        model, tokenizer = backbone
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": "one two", "encoding_format": "float"}, timeout=60)
        assert reply.status_code == 200
        np.testing.assert_allclose(np.array(reply.json()["data"][0]["embedding"]),
                                   expected(model, tokenizer("one two")["input_ids"]), atol=1e-5)
        for path, body in (("completions", {"prompt": "hi", "max_tokens": 2}),
                           ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            refused = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
            assert refused.status_code == 400 and "no LM head" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["pellucid"]["lm_head"]["name"] == "none"
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)
        llm.shutdown()


def test_chat_messages_embed_the_rendered_conversation(server, backbone):
    model, tokenizer = backbone
    messages = [{"role": "system", "content": "Represent the query."}, {"role": "user", "content": "cat on a mat"}]
    for extra, generation in (({}, False), ({"add_generation_prompt": True}, True)):
        reply = httpx.post(f"{server.base_url}/embeddings", timeout=60,
                           json={"messages": messages, "encoding_format": "float", **extra})
        assert reply.status_code == 200, reply.text
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        assert reply.json()["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(np.array(reply.json()["data"][0]["embedding"]), expected(model, ids), atol=1e-5)
    for body, param in (({"messages": messages, "input": "x"}, "input"),
                        ({"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
                        ({"messages": []}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role")):
        refused = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(server, backbone):
    model, tokenizer = backbone
    texts = ["the cat sat", "a quick brown fox", "hello world", "the mat"]

    def vector(text):
        return expected(model, tokenizer(text)["input_ids"])

    one = httpx.post(f"{server.url}/v1/score", json={"text_1": texts[0], "text_2": texts}, timeout=60).json()
    assert [d["index"] for d in one["data"]] == list(range(len(texts)))
    np.testing.assert_allclose([d["score"] for d in one["data"]], [vector(texts[0]) @ vector(t) for t in texts],
                               atol=1e-5)
    assert abs(one["data"][0]["score"] - 1.0) < 1e-5
    pairwise = httpx.post(f"{server.url}/score", json={"text_1": texts[:2], "text_2": texts[2:]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [vector(texts[0]) @ vector(texts[2]), vector(texts[1]) @ vector(texts[3])], atol=1e-5)
    documents = texts[1:] + [{"text": "cat"}]
    reply = httpx.post(f"{server.url}/v1/rerank", json={"query": texts[0], "documents": documents, "top_n": 3},
                       timeout=60).json()
    plain = [d if isinstance(d, str) else d["text"] for d in documents]
    scores = [float(vector(texts[0]) @ vector(d)) for d in plain]
    best = sorted(range(len(plain)), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in reply["results"]] == best
    assert [r["document"]["text"] for r in reply["results"]] == [plain[i] for i in best]
    np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], [scores[i] for i in best], atol=1e-5)
    for path, body, param in (("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                              ("score", {"text_1": [], "text_2": "x"}, "text_1"),
                              ("score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
                              ("rerank", {"query": "q", "documents": []}, "documents"),
                              ("rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                              ("rerank", {"query": "", "documents": ["a"]}, "query")):
        refused = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
