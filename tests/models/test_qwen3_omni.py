"""Qwen3-Omni's stage models against transformers' Qwen3OmniMoeForConditionalGeneration parts, on a tiny
random checkpoint: the thinker's logits (batched prefill, then decode), the code predictor's greedy codes,
code2wav's waveform whole and in chunked_decode's windows, and each stage loading only its own tensors.
The stages together (talker included) are checked end to end in tests/pipeline/test_omni_vs_hf.py."""
from __future__ import annotations

import pytest
import torch

from pellucid.models.loader import load_model
from pellucid.models.qwen3_omni.code2wav import window_bounds
from pellucid.models.registry import get_model_class
from tests.models.helpers import PagedModelRunner, random_token_prompts, relative_error

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(omni_dir):
    import transformers
    return transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()


def test_thinker_logits_match_hf(omni_dir, hf_model) -> None:
    thinker, config = load_model(omni_dir, torch.float32, "cpu", submodel="thinker")
    assert type(config).__name__ == "Qwen3OmniMoeTextConfig"     # the engine sizes itself by the text config
    for seed in range(2):
        prompts = random_token_prompts(seed, [9, 30, 1], vocab=500)
        runner = PagedModelRunner(thinker, 16, seed=seed)
        prefill = runner.step(list(enumerate(prompts)), num_padded_tokens=sum(map(len, prompts)) + 2)
        nxt = [[int(logits[-1].argmax())] for logits in prefill]
        decode = runner.step([(i, t) for i, t in enumerate(nxt)])
        for prompt, first, step, token in zip(prompts, prefill, decode, nxt):
            with torch.no_grad():
                ref = hf_model.thinker(input_ids=torch.tensor([prompt + token])).logits[0]
            assert relative_error(first, ref[:len(prompt)]) <= TOLERANCE
            assert relative_error(step, ref[len(prompt):]) <= TOLERANCE


def test_code_predictor_matches_hf_greedy(omni_dir, hf_model) -> None:
    talker, _ = load_model(omni_dir, torch.float32, "cpu", submodel="talker")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, hf_model.config.talker_config.text_config.hidden_size, generator=gen)
    first = torch.randint(0, 32, (5,), generator=gen)
    groups = hf_model.config.talker_config.num_code_groups
    with torch.no_grad():
        ours = talker.talker.code_predictor.predict(hidden, talker.talker.model.codec_embedding(first), None, {})
        for row in range(5):
            embeds = torch.stack([hidden[row:row + 1], hf_model.talker.get_input_embeddings()(first[row:row + 1])], 1)
            ref = hf_model.talker.code_predictor.generate(inputs_embeds=embeds, max_new_tokens=groups - 1,
                                                           do_sample=False)
            assert ours[row].tolist() == ref[0].tolist()


@pytest.mark.parametrize("chunk,context", [(7, 5), (4, 9)])
def test_code2wav_matches_hf_whole_and_chunked(omni_dir, hf_model, chunk: int, context: int) -> None:
    code2wav, _ = load_model(omni_dir, torch.float32, "cpu", submodel="code2wav")
    gen = torch.Generator().manual_seed(chunk)
    codes = torch.randint(0, 32, (2, 4, 23), generator=gen)
    with torch.no_grad():
        assert torch.allclose(code2wav(codes), hf_model.code2wav(codes), atol=1e-5)
        ref = hf_model.code2wav.chunked_decode(codes, chunk_size=chunk, left_context_size=context)
        pieces, start = [], 0
        while start < codes.shape[-1]:
            lo, hi, ctx = window_bounds(start, codes.shape[-1], chunk, context)
            pieces.append(code2wav.code2wav.decode_window(codes[..., lo:hi], ctx))
            start = hi
    assert torch.allclose(torch.cat(pieces, dim=-1), ref, atol=1e-5)


def test_stages_load_only_their_tensors(omni_dir) -> None:
    """A stage never reads the other stages' tensors (a 30B checkpoint's shards of other stages stay closed),
    and a whole Omni checkpoint is refused as one model with a message naming its stages."""
    for stage, prefix in [("thinker", "thinker."), ("talker", "talker."), ("code2wav", "code2wav.")]:
        cls = get_model_class("Qwen3OmniMoeForConditionalGeneration", stage)
        assert all(p.startswith(prefix) for p in cls.checkpoint_prefixes)
    with pytest.raises(ValueError, match="multi-stage model.*thinker"):
        load_model(omni_dir, torch.float32, "cpu")
    with pytest.raises(ValueError, match="no stage 'vocoder'"):
        load_model(omni_dir, torch.float32, "cpu", submodel="vocoder")


def test_thinker_as_llm_traces_and_extracts_at_hf_paths(omni_dir, hf_model, tmp_path) -> None:
    """The thinker alone (`LLM(dir, submodel="thinker")`): greedy tokens equal transformers' thinker, a trace
    saves `thinker.model.layers.1.output` = transformers' hidden_states[2], and extraction writes the same
    states (layer ids count the thinker's decoder layers)."""
    from pellucid.extraction import HiddenStatesDataset
    from pellucid.llm import LLM
    from pellucid.sampling_params import SamplingParams

    llm = LLM(omni_dir, submodel="thinker", device="cpu", max_model_len=128, num_kv_blocks=64)
    assert llm.info.backbone == "thinker.model"
    prompt = random_token_prompts(3, [11], vocab=500)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_model.thinker.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                        eos_token_id=None, min_new_tokens=6)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    with torch.no_grad():
        hidden = hf_model.thinker(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    with llm.trace([prompt]) as tr:
        saved = tr.thinker.model.layers[1].output.save()
    assert relative_error(saved.value, hidden[2][0]) <= TOLERANCE
    with pytest.raises(ValueError, match="multimodal|audio/image/video"):
        llm.generate([[int(hf_model.config.thinker_config.audio_token_id)] + prompt], use_tqdm=False)
    llm.extract_hidden_states([prompt], layers=[0, -1], output_dir=str(tmp_path), progress=False)
    item = next(iter(HiddenStatesDataset(str(tmp_path))))
    assert relative_error(item["hidden_states"][:, 0], hidden[1][0]) <= TOLERANCE
    assert relative_error(item["hidden_states"][:, 1], hidden[-1][0]) <= TOLERANCE


@pytest.mark.parametrize("seed", range(3))
def test_code_predictor_draw_equals_the_samplers(seed) -> None:
    """The code predictor's top-k/top-p race over the TOP_K largest logits draws what the engine sampler's
    own steps draw over the whole vocabulary (apply_top_k_top_p, softmax, argmax of probs / noise)."""
    from pellucid.models.qwen3_omni.code_predictor import TOP_K, TOP_P, top_k_top_p_race
    from pellucid.runner.sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(seed)
    rows, vocab = 64, 2048
    # Sharp and flat rows: top-p keeps one token in some, all TOP_K in others.
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.2, 12, rows)[:, None]
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    top_k = torch.full((rows,), TOP_K)
    top_p = torch.full((rows,), TOP_P, dtype=torch.float32)
    expected = apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1).div(noise).argmax(dim=-1)
    got = top_k_top_p_race(logits, noise)
    assert got.tolist() == expected.tolist()
    assert len(set(got.tolist())) > rows // 2          # the draws differ between rows (not all argmax)
    assert got.tolist() != logits.argmax(dim=-1).tolist()
