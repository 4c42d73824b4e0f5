"""LLM.embed against transformers' backbone (`AutoModel`): pooling types, normalisation, matryoshka dimensions,
truncation, the sentence-transformers files that name a model's pooler, backbone-only checkpoints, and the
engine's batching, chunking, preemption and prefix caching underneath."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pellucid import LLM, PoolingParams
from pellucid.pooling import PoolerConfig
from tests.reference import random_prompts

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def backbone():
    from transformers import AutoModel

    cache = {}

    def get(model_dir: str):
        if model_dir not in cache:
            cache[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        return cache[model_dir]
    return get


def reference(model, ids: list[int], pooling: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[pooling]
    pooled = pooled[:dimensions] if dimensions else pooled
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def embeddings(outputs) -> list[torch.Tensor]:
    return [torch.tensor(out.outputs.embedding) for out in outputs]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= TOLERANCE * max(1.0, expected.abs().max().item())


def with_sentence_transformers_files(src: str, dst: str, mode: str, normalize: bool, extra_modules=()) -> str:
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += list(extra_modules)
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    modes = {key: False for key in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                                    "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                                    "pooling_mode_lasttoken")}
    modes[mode] = True
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "include_prompt": True, **modes}, f)
    return dst


@pytest.mark.parametrize("arch", ["qwen3", "llama", "lfm2"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("seed", [0, 1])
def test_embeddings_equal_transformers_under_chunking_and_preemption(tiny_model_factory, backbone, arch, pooling,
                                                                     seed):
    model_dir = tiny_model_factory(arch)
    lengths = torch.randint(2, 90, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(seed, lengths)
    # A small token budget splits prompts over steps; few KV blocks make requests wait and be preempted.
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=24, block_size=4, max_num_batched_tokens=48,
              max_num_seqs=4, enable_prefix_caching=arch != "lfm2", pooler_config={"pooling_type": pooling})
    outputs = llm.embed(prompts, use_tqdm=False)
    assert [out.prompt_token_ids for out in outputs] == prompts
    for ids, got in zip(prompts, embeddings(outputs)):
        assert_close(got, reference(backbone(model_dir), ids, pooling, normalize=True))
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_shared_prefixes_come_from_the_prefix_cache(tiny_model_factory, backbone):
    model_dir = tiny_model_factory("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    instruction = random_prompts(5, [33])[0]
    queries = [instruction + tail for tail in random_prompts(6, [5, 9, 2, 14])]
    llm.embed(queries[:1], use_tqdm=False)
    hits = llm.engine.kv_manager.prefix_cache_hits
    before = llm.engine.stats()
    outputs = llm.embed(queries, use_tqdm=False)
    assert llm.engine.kv_manager.prefix_cache_hits - hits >= 3 * 32 + 32     # the instruction's 8 full blocks
    after = llm.engine.stats()      # prompts count as prompt tokens; the dropped tokens are not generation
    assert after.generation_tokens_total == before.generation_tokens_total
    cached = llm.engine.kv_manager.prefix_cache_hits - hits
    assert after.prompt_tokens_total - before.prompt_tokens_total == sum(len(q) for q in queries) - cached
    for ids, got in zip(queries, embeddings(outputs)):
        assert_close(got, reference(backbone(model_dir), ids, "last", normalize=True))


@pytest.mark.parametrize("mode,pooling", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                          ("pooling_mode_lasttoken", "last")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_files_choose_the_pooler(tiny_model_factory, backbone, tmp_path, mode, pooling,
                                                       normalize):
    model_dir = with_sentence_transformers_files(tiny_model_factory("qwen3"), str(tmp_path / "st"), mode, normalize)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128)
    prompts = random_prompts(11, [7, 30, 1, 16])
    for ids, got in zip(prompts, embeddings(llm.embed(prompts, use_tqdm=False))):
        assert_close(got, reference(backbone(model_dir), ids, pooling, normalize))
    # A request may turn normalisation the other way.
    flipped = embeddings(llm.embed(prompts[:2], PoolingParams(normalize=not normalize), use_tqdm=False))
    for ids, got in zip(prompts, flipped):
        assert_close(got, reference(backbone(model_dir), ids, pooling, not normalize))


def test_pooler_config_overrides_the_model_directory(tiny_model_factory, backbone, tmp_path):
    model_dir = with_sentence_transformers_files(tiny_model_factory("qwen3"), str(tmp_path / "st"),
                                                 "pooling_mode_cls_token", normalize=True)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128,
              pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    prompts = random_prompts(12, [9, 21])
    for ids, got in zip(prompts, embeddings(llm.embed(prompts, use_tqdm=False))):
        assert_close(got, reference(backbone(model_dir), ids, "mean", normalize=False))
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(model_dir, dtype="float32", device="cpu", pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="takes pooling_type and normalize"):
        LLM(model_dir, dtype="float32", device="cpu", pooler_config={"dimensions": 3})


def test_modules_this_engine_cannot_run_are_refused(tiny_model_factory, tmp_path):
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    model_dir = with_sentence_transformers_files(tiny_model_factory("qwen3"), str(tmp_path / "dense"),
                                                 "pooling_mode_mean_tokens", True, [dense])
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="Dense"):
        llm.embed([[5, 6, 7]], use_tqdm=False)
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids      # generation still serves
    model_dir = with_sentence_transformers_files(tiny_model_factory("qwen3"), str(tmp_path / "max"),
                                                 "pooling_mode_max_tokens", True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        PoolerConfig.for_model(model_dir)


def test_dimensions_truncate_matryoshka_models_only(tiny_model_factory, backbone):
    plain = LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="not trained for shorter embeddings"):
        plain.embed([[4, 5, 6]], PoolingParams(dimensions=16), use_tqdm=False)

    model_dir = tiny_model_factory("qwen3", matryoshka_dimensions=(16, 32, 64))
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    prompts = random_prompts(13, [12, 25])
    for dims in (16, 32):
        for ids, got in zip(prompts, embeddings(llm.embed(prompts, PoolingParams(dimensions=dims), use_tqdm=False))):
            assert_close(got, reference(backbone(model_dir), ids, "last", True, dimensions=dims))
    with pytest.raises(ValueError, match="one of the model's matryoshka dimensions"):
        llm.embed(prompts, PoolingParams(dimensions=24), use_tqdm=False)
    with pytest.raises(ValueError, match="positive integer"):
        llm.embed(prompts, PoolingParams(dimensions=0), use_tqdm=False)
    # hf_overrides reach the frontend's pooler too: the plain model declared matryoshka serves 16 dimensions.
    declared = LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu", num_kv_blocks=64,
                   hf_overrides={"matryoshka_dimensions": [16, 64]})
    got = embeddings(declared.embed(prompts[:1], PoolingParams(dimensions=16), use_tqdm=False))[0]
    assert_close(got, reference(backbone(tiny_model_factory("qwen3")), prompts[0], "last", True, dimensions=16))


def test_truncation_keeps_the_last_tokens_and_long_inputs_are_refused(tiny_model_factory, backbone):
    model_dir = tiny_model_factory("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=64)
    long = random_prompts(14, [100])[0]
    with pytest.raises(ValueError, match="at most 63"):
        llm.embed([long], use_tqdm=False)
    out = llm.embed([long], PoolingParams(truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-40:]
    assert_close(torch.tensor(out.outputs.embedding), reference(backbone(model_dir), long[-40:], "last", True))


def test_text_prompts_and_backbone_only_checkpoints(tiny_model_factory, backbone, tmp_path):
    """An embedding model published as transformers' backbone alone (tensors without the `model.` prefix)
    loads, with its tied head."""
    from transformers import AutoModel, AutoTokenizer

    source = tiny_model_factory("qwen3", tie_word_embeddings=True)
    bare = str(tmp_path / "bare")
    AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(bare)
    AutoTokenizer.from_pretrained(source).save_pretrained(bare)
    llm = LLM(bare, dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.info.lm_head["name"] == "dense"
    texts = ["a short text", "another, somewhat longer text to embed"]
    tokenizer = AutoTokenizer.from_pretrained(bare)
    for text, out in zip(texts, llm.embed(texts, use_tqdm=False)):
        ids = tokenizer(text)["input_ids"]
        assert out.prompt == text and out.prompt_token_ids == ids
        assert_close(torch.tensor(out.outputs.embedding), reference(backbone(source), ids, "last", True))


@pytest.mark.parametrize("how", ["headless checkpoint", "--head none"])
def test_engines_without_an_lm_head_serve_embeddings_only(tiny_model_factory, backbone, tmp_path, how):
    """A backbone-only checkpoint whose config does not tie the head (Qwen3-Embedding-8B ships so) has no LM
    head; `head="none"` drops a model's. Either engine embeds as transformers does and refuses, by name,
    every request that would read a token or logits."""
    from pellucid import SamplingParams
    from pellucid.engine.messages import EngineCoreRequest
    from pellucid.tracing import Save, TracePlan
    from transformers import AutoModel

    source = tiny_model_factory("qwen3")
    if how == "headless checkpoint":
        model_dir = str(tmp_path / "untied")
        AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**config, "tie_word_embeddings": False}, f)
        shutil.copy(os.path.join(source, "tokenizer.json"), model_dir)
        shutil.copy(os.path.join(source, "tokenizer_config.json"), model_dir)
        llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    else:
        llm = LLM(source, dtype="float32", device="cpu", num_kv_blocks=64, head="none")
    assert llm.info.lm_head["name"] == "none" and not llm.info.computes_logits
    prompts = random_prompts(15, [6, 31, 12])
    for ids, got in zip(prompts, embeddings(llm.embed(prompts, use_tqdm=False))):
        assert_close(got, reference(backbone(source), ids, "last", True))
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate(prompts[:1], use_tqdm=False, extras=[{"trace": TracePlan([Save(site="model")])}])
    # The engine refuses what a frontend let by.
    with pytest.raises(ValueError, match="embeddings and classifications only"):
        llm.engine.add_request(EngineCoreRequest("x", [5, 6], SamplingParams(max_tokens=1), 0.0, False, None))
    with pytest.raises(ValueError, match="one greedy token that nobody reads"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False,
                     extras=[{"trace": TracePlan([Save(site="model")]), "pool": "last"}])
    assert len(embeddings(llm.embed(prompts[:1], use_tqdm=False))) == 1      # still serving


@pytest.mark.parametrize("seed", [0, 1])
def test_embeddings_beside_generation_with_steps_launched_ahead(tiny_model_factory, backbone, seed):
    """Embedding requests (last and mean pooling) join a batch of generation requests that step ahead of
    their readback, in a KV pool small enough that requests are preempted and recomputed: each embedding
    equals transformers', and every generation equals its run alone."""
    from pellucid import SamplingParams
    from pellucid.pooling.embedder import EMBED_SAMPLING, Embedder

    model_dir = tiny_model_factory("qwen3")
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=22, block_size=4, max_num_batched_tokens=40,
                  async_scheduling=True)
    llm = LLM(model_dir, **kwargs)
    gen_prompts = random_prompts(80 + seed, [9, 23, 4])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [out.outputs[0].token_ids for out in LLM(model_dir, **kwargs).generate(gen_prompts, params, use_tqdm=False)]
    embed_prompts = random_prompts(90 + seed, [61, 7, 48, 2])
    embedders = {p: Embedder.for_engine(llm.info, {"pooling_type": p}) for p in ("last", "mean")}
    for i, prompt in enumerate(gen_prompts):
        llm.add_request(f"gen{i}", prompt, params)
    finished, preempted = {}, set()
    for step in range(500):
        if step in (1, 3):          # embeddings arrive while the generations decode, ahead of their readback
            for i, prompt in enumerate(embed_prompts):
                pooling = "last" if (i + step) % 2 else "mean"
                llm.add_request(f"emb{step}-{i}-{pooling}", prompt, EMBED_SAMPLING, extras=embedders[pooling].extras())
        preempted |= {r.request_id for r in llm.engine.scheduler.requests.values() if r.num_preemptions}
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
        if not llm.has_unfinished_requests() and step > 3:
            break
    assert llm.engine.num_steps_ahead > 0
    assert any(rid.startswith("emb") for rid in preempted)     # an embedding's prompt was recomputed
    assert [finished[f"gen{i}"].outputs[0].token_ids for i in range(len(gen_prompts))] == alone
    for rid, out in finished.items():
        if rid.startswith("emb"):
            pooling = rid.rsplit("-", 1)[1]
            got = embedders[pooling].embeddings([out], PoolingParams())[0]
            assert_close(got, reference(backbone(model_dir), out.prompt_token_ids, pooling, True))
    assert sum(rid.startswith("emb") for rid in finished) == 2 * len(embed_prompts)


def test_score_is_the_cosine_of_the_embeddings(tiny_model_factory, backbone):
    from transformers import AutoTokenizer

    model_dir = tiny_model_factory("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["one small text", "another text here", "a third", "one small text"]

    def vector(text):
        return reference(backbone(model_dir), tokenizer(text)["input_ids"], "last", True)
    against_one = [out.outputs.score for out in llm.score(texts[0], texts, use_tqdm=False)]
    assert against_one == pytest.approx([float(vector(texts[0]) @ vector(t)) for t in texts], abs=1e-5)
    pairwise = [out.outputs.score for out in llm.score(texts[:2], texts[2:], use_tqdm=False)]
    assert pairwise == pytest.approx([float(vector(texts[0]) @ vector(texts[2])),
                                      float(vector(texts[1]) @ vector(texts[3]))], abs=1e-5)
    with pytest.raises(ValueError, match="give one text_1"):
        llm.score(texts[:2], texts[:3])
