"""/classify, and /v1/score and /v1/rerank of a cross-encoder, on a served sequence-classification model (the
engine core in its own process), against transformers' `*ForSequenceClassification`."""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pellucid.engine.async_llm import AsyncLLM
from pellucid.tiny_models import build_tiny_classifier
from server_harness import ENGINE_KWARGS, MODEL_NAME, random_prompts, start_server


@pytest.fixture(scope="module", params=[3, 1], ids=["3-labels", "cross-encoder"])
def served(request, tmp_path_factory):
    model_dir = build_tiny_classifier("qwen3", str(tmp_path_factory.mktemp("classifier")), num_labels=request.param,
                                      seed=request.param)
    llm = AsyncLLM(model_dir, served_model_name=MODEL_NAME, dtype="float32", **ENGINE_KWARGS)
    running = start_server(llm)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield running, hf, AutoTokenizer.from_pretrained(model_dir), request.param
    running.stop()
    llm.shutdown()


def _logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_classify_equals_transformers(served):
    running, hf, tokenizer, labels = served
    texts = random_prompts(4, 5)
    reply = httpx.post(f"{running.url}/classify", json={"model": MODEL_NAME, "input": texts}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids) and body["model"] == MODEL_NAME
    for i, (row, token_ids) in enumerate(zip(body["data"], ids)):
        logits = _logits(hf, token_ids)
        probs = torch.sigmoid(logits) if labels == 1 else torch.softmax(logits, dim=-1)
        assert row["index"] == i and row["num_classes"] == labels
        assert torch.allclose(torch.tensor(row["logits"]), logits, atol=1e-5)
        assert torch.allclose(torch.tensor(row["probs"]), probs, atol=1e-5)
        assert row["label"] == hf.config.id2label[int(probs.argmax())]
    by_ids = httpx.post(f"{running.url}/classify", json={"input": ids[1], "truncate_prompt_tokens": 2},
                        timeout=60).json()
    assert torch.allclose(torch.tensor(by_ids["data"][0]["logits"]), _logits(hf, ids[1][-2:]), atol=1e-5)
    for body, param in (({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
                        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"input": [[5] * 600]}, "input")):
        refused = httpx.post(f"{running.url}/classify", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)


def test_score_and_rerank_of_a_cross_encoder(served):
    running, hf, tokenizer, labels = served
    query, documents = "the quick fox", ["a fox jumps", "hello world", "the mat", "quick brown fox"]
    reply = httpx.post(f"{running.url}/v1/score", json={"text_1": query, "text_2": documents}, timeout=60)
    if labels != 1:
        assert reply.status_code == 400 and "one label" in reply.json()["error"]["message"]
        return
    expected = [torch.sigmoid(_logits(hf, tokenizer(query, text_pair=d)["input_ids"]))[0].item() for d in documents]
    assert [round(d["score"], 5) for d in reply.json()["data"]] == [round(s, 5) for s in expected]
    ranked = httpx.post(f"{running.url}/v1/rerank", json={"query": query, "documents": documents, "top_n": 2},
                        timeout=60).json()
    best = sorted(range(len(documents)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == best
    assert [round(r["relevance_score"], 5) for r in ranked["results"]] == [round(expected[i], 5) for i in best]


def test_a_classification_model_refuses_generation_and_a_language_model_refuses_classify(served, server):
    running, *_ = served
    refused = httpx.post(f"{running.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert refused.status_code == 400 and "no LM head" in refused.json()["error"]["message"]
    refused = httpx.post(f"{server.url}/classify", json={"input": "hello"}, timeout=60)
    assert refused.status_code == 400 and "not a classification model" in refused.json()["error"]["message"]


def test_serve_with_hf_overrides_reads_a_causal_lm_as_a_reranker(tiny_model_factory):
    """`pellucid serve --hf-overrides` (a real server process, the CLI's flag): a causal LM read as a two-way
    classifier from its token rows, as Qwen3-Reranker is served; /v1/rerank scores each document with
    sigmoid(logit(yes) - logit(no)) of transformers' causal LM on the pair."""
    import json
    import signal

    from transformers import AutoModelForCausalLM

    from server_harness import PELLUCID_CLI, free_port, start_serve_process, wait_healthy

    model_dir = tiny_model_factory("qwen3", num_hidden_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    no, yes = tokenizer.convert_ids_to_tokens([40, 90])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    port = free_port()
    proc = start_serve_process(PELLUCID_CLI, model_dir, port, "--dtype", "float32", "--hf-overrides",
                               json.dumps(overrides))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=180, interval=0.2)
        query, documents = "the quick fox", ["a fox", "hello world", "quick brown fox jumps"]
        reply = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": documents}, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for document in documents:
        with torch.no_grad():
            last = hf(torch.tensor([tokenizer(query, text_pair=document)["input_ids"]])).logits[0, -1]
        expected.append(torch.sigmoid(last[90] - last[40]).item())
    got = {r["index"]: r["relevance_score"] for r in reply.json()["results"]}
    assert [r["index"] for r in reply.json()["results"]] == sorted(range(3), key=lambda i: -expected[i])
    assert all(abs(got[i] - expected[i]) <= 1e-5 for i in range(3))
