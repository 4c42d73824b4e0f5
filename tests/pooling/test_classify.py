"""Sequence-classification models (reward models, classifiers, cross-encoders): `LLM.classify` and
`LLM.score` against transformers' `*ForSequenceClassification` on tiny random checkpoints, batched with chunked
prefill and prefix-cache hits in a KV cache too small for all of them at once; a classifier with one label scores text pairs as a cross-encoder;
the requests such a model cannot serve are clear errors; TP=2 equals TP=1."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pellucid import LLM, PoolingParams, SamplingParams
from pellucid.tiny_models import build_tiny_classifier
from tests.reference import random_prompts, relative_error

TOLERANCE = 1e-4
# Chunked prefill (16-token budget), prefix-cache hits (8-token blocks, shared prefixes), requests waiting for
# blocks.
SQUEEZED = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=16, block_size=8,
                num_kv_blocks=12, max_num_seqs=4)
CASES = {"qwen3-3": ("qwen3", 3, {}), "llama-2": ("llama", 2, {}), "qwen3-moe-4": ("qwen3-moe", 4, {}),
         "mistral-1": ("mistral", 1, {})}


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            arch, labels, overrides = CASES[name]
            cache[name] = build_tiny_classifier(arch, str(tmp_path_factory.mktemp(name)), num_labels=labels,
                                                seed=len(cache) + 1, **overrides)
        return cache[name]
    return get


def _hf(model_dir: str):
    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", list(CASES))
def test_classify_equals_transformers(classifiers, name):
    model_dir = classifiers(name)
    hf = _hf(model_dir)
    llm = LLM(model_dir, **SQUEEZED)
    shared = random_prompts(9, [20])[0]
    prompts = random_prompts(3, [5, 40, 1, 23, 31, 12]) + [shared + [7, 8], shared + [9, 10, 11, 12]]
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_used_blocks == 0
    labels = CASES[name][1]
    for prompt, output in zip(prompts, outputs):
        expected = _hf_logits(hf, prompt)
        assert output.prompt_token_ids == prompt
        assert output.outputs.num_classes == labels
        assert relative_error(torch.tensor(output.outputs.logits), expected) <= TOLERANCE
        probs = torch.sigmoid(expected) if labels == 1 else torch.softmax(expected, dim=-1)
        assert torch.allclose(torch.tensor(output.outputs.probs), probs, atol=1e-5)


def test_classify_text_and_truncation(classifiers):
    model_dir = classifiers("qwen3-3")
    hf, tokenizer = _hf(model_dir), AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    texts = ["the quick brown fox", "a b c d e f g h i j k l m n o p"]
    for text, output in zip(texts, llm.classify(texts, PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)):
        ids = tokenizer(text)["input_ids"][-6:]
        assert output.prompt == text and output.prompt_token_ids == ids
        assert relative_error(torch.tensor(output.outputs.logits), _hf_logits(hf, ids)) <= TOLERANCE


def test_cross_encoder_scores_pairs_as_transformers(classifiers):
    """A one-label classifier's score of (query, document) is the sigmoid of its logit for the pair encoding."""
    model_dir = classifiers("mistral-1")
    hf, tokenizer = _hf(model_dir), AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    query, documents = "what is a fox", ["a fox is an animal", "the sky is blue", "foxes run"]
    scores = llm.score(query, documents, use_tqdm=False)
    for document, result in zip(documents, scores):
        ids = tokenizer(query, text_pair=document)["input_ids"]
        assert abs(result.outputs.score - torch.sigmoid(_hf_logits(hf, ids))[0].item()) <= 1e-5
    paired = llm.score([query, "sky"], documents[:2], use_tqdm=False)
    assert abs(paired[1].outputs.score - torch.sigmoid(_hf_logits(
        hf, tokenizer("sky", text_pair=documents[1])["input_ids"]))[0].item()) <= 1e-5


def test_what_a_classifier_cannot_serve_is_a_clear_error(classifiers, tiny_model_factory):
    classifier = LLM(classifiers("qwen3-3"), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="one label"):
        classifier.score("a", ["b"], use_tqdm=False)
    with pytest.raises(ValueError, match="no LM head"):
        classifier.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens only"):
        classifier.classify([[5, 6]], PoolingParams(normalize=True), use_tqdm=False)
    # The engine still serves classifications after the refusals.
    assert len(classifier.classify([[5, 6, 7]], use_tqdm=False)[0].outputs.probs) == 3
    language_model = LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="not a classification model"):
        language_model.classify(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        language_model.generate([[5, 6]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False,
                                extras=[{"pool": "classify"}])


def test_tensor_parallel_classify_equals_tp1(classifiers):
    model_dir = classifiers("qwen3-moe-4")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [9, 33, 2])]
    expected = LLM(model_dir, **SQUEEZED).classify(prompts, use_tqdm=False)
    tp2 = LLM(model_dir, tensor_parallel_size=2, **SQUEEZED)
    try:
        for want, got in zip(expected, tp2.classify(prompts, use_tqdm=False)):
            assert relative_error(torch.tensor(got.outputs.logits), torch.tensor(want.outputs.logits)) <= TOLERANCE
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-untied"])
def test_a_causal_lm_read_as_a_classifier_from_its_token_rows(tiny_model_factory, arch):
    """vLLM's hf_overrides with classifier_from_token (how Qwen3-Reranker is served): the classes' logits are
    the causal LM's logits of those tokens at the last position, or, two-way, the second's minus the first's;
    from the LM head's rows (untied) or the embeddings' (tied)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(arch, num_hidden_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = [100, 250, 7]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    architecture = "Qwen3ForSequenceClassification"
    prompts = random_prompts(11, [6, 30, 2])
    two_way = LLM(model_dir, dtype="float32", device="cpu", hf_overrides={
        "architectures": [architecture], "classifier_from_token": tokens[:2], "is_original_qwen3_reranker": True})
    for prompt, out in zip(prompts, two_way.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)):
        with torch.no_grad():
            last = hf(torch.tensor([prompt])).logits[0, -1]
        assert out.outputs.num_classes == 1
        assert abs(out.outputs.logits[0] - (last[ids[1]] - last[ids[0]]).item()) <= 1e-4
    query, document = "the fox", "a quick brown fox"
    pair = tokenizer(query, text_pair=document)["input_ids"]
    with torch.no_grad():
        last = hf(torch.tensor([pair])).logits[0, -1]
    expected = torch.sigmoid(last[ids[1]] - last[ids[0]]).item()
    assert abs(two_way.score(query, [document], use_tqdm=False)[0].outputs.score - expected) <= 1e-5
    n_way = LLM(model_dir, dtype="float32", device="cpu",
                hf_overrides={"architectures": [architecture], "classifier_from_token": tokens})
    out = n_way.classify([{"prompt_token_ids": prompts[1]}], use_tqdm=False)[0]
    with torch.no_grad():
        last = hf(torch.tensor([prompts[1]])).logits[0, -1]
    assert relative_error(torch.tensor(out.outputs.logits), last[ids]) <= TOLERANCE
    with pytest.raises(Exception, match="not a token"):
        LLM(model_dir, dtype="float32", device="cpu",
            hf_overrides={"architectures": [architecture], "classifier_from_token": ["no-such-token-x"]})
    with pytest.raises(Exception, match="two classifier_from_token tokens"):
        LLM(model_dir, dtype="float32", device="cpu", hf_overrides={
            "architectures": [architecture], "classifier_from_token": tokens, "method": "from_2_way_softmax"})
