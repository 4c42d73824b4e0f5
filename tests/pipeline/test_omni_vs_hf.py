"""The Qwen3-Omni pipeline against transformers' Qwen3OmniMoeForConditionalGeneration.generate, on a tiny
random checkpoint in float32: the thinker's tokens and the talker's codes (every codebook of every frame)
are equal, the talker greedy with transformers' default repetition penalty; the waveform is equal within
1e-5 when decoded in transformers' windows (300 frames, 25 of left context), and streamed in small windows
it equals transformers' chunked_decode of the same codes with the same windows."""
from __future__ import annotations

import pytest
import torch

from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.omni import OmniLLM
from pellucid.pipeline.qwen3_omni import AudioRequest
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import apply_chat_template
from tests.pipeline.doubles import RecordingConnector, install

WAVE_TOLERANCE = 1e-5
THINKER_TOKENS, TALKER_TOKENS = 16, 40
CASES = [  # (conversation, voice)
    ([{"role": "user", "content": "Hello there, how are you?"}], "ethan"),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What time is it?"},
      {"role": "assistant", "content": "It is half past seven."},
      {"role": "user", "content": "And when does the train leave?"}], "chelsie"),
]


@pytest.fixture(scope="module")
def hf_results(omni_dir):
    """transformers' generate for each case: (thinker tokens, talker codes [G, frames], waveform)."""
    import transformers

    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(omni_dir)
    talker_generate = model.talker.generate
    results = []
    for conversation, voice in CASES:
        captured = {}

        def record(*args, **kwargs):
            captured["out"] = talker_generate(*args, **kwargs)
            return captured["out"]
        model.talker.generate = record
        ids = apply_chat_template(tokenizer, conversation)
        sequences, wave = model.generate(torch.tensor([ids]), speaker=voice, thinker_max_new_tokens=THINKER_TOKENS,
                                         thinker_eos_token_id=tokenizer.eos_token_id, talker_do_sample=False,
                                         talker_max_new_tokens=TALKER_TOKENS)
        talker = captured["out"]
        codes = torch.stack([h[-1] for h in talker.hidden_states if h[-1] is not None], dim=1)[0].transpose(0, 1)
        results.append((sequences[0, len(ids):].tolist(), talker.sequences[0].tolist(), codes, wave[0, 0], model))
    model.talker.generate = talker_generate
    return results


def run_cases(omni: OmniLLM):
    recorders = install(omni.pipeline, RecordingConnector)
    for i, (conversation, voice) in enumerate(CASES):
        omni.add_request(f"c{i}", apply_chat_template(omni.tokenizer, conversation),
                         SamplingParams(temperature=0, max_tokens=THINKER_TOKENS),
                         AudioRequest(voice, SamplingParams(temperature=0, repetition_penalty=1.05,
                                                            max_tokens=TALKER_TOKENS)))
    outputs = {}
    while omni.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in omni.step())
    frames = recorders[1]      # talker -> code2wav
    return [(outputs[f"c{i}"], frames.rows(f"c{i}", "codes")) for i in range(len(CASES))]


def test_tokens_codes_and_waveform_match_transformers(omni_dir, hf_results) -> None:
    with OmniLLM(omni_dir, qwen3_omni_graph(7, decode_chunk=300, left_context=25), device="cpu",
                 max_model_len=256, num_kv_blocks=256) as omni:
        ours = run_cases(omni)
    for (out, frames), (thinker, talker, codes, wave, _) in zip(ours, hf_results):
        assert out.error is None
        assert out.token_ids == thinker
        assert out.stage_token_ids["talker"] == talker
        assert torch.equal(frames.T, codes)          # every codebook of every frame the talker fed back
        assert out.audio.shape == wave.shape
        assert torch.allclose(out.audio, wave, rtol=0, atol=WAVE_TOLERANCE)


def test_streamed_windows_equal_chunked_decode(omni_dir, hf_results) -> None:
    """Frames streamed one by one and decoded in windows of 4 with 3 of left context: transformers'
    chunked_decode(codes, 4, 3) of the same codes."""
    with OmniLLM(omni_dir, qwen3_omni_graph(1, decode_chunk=4, left_context=3), device="cpu",
                 max_model_len=256, num_kv_blocks=256) as omni:
        ours = run_cases(omni)
    for (out, _), (_, _, codes, _, model) in zip(ours, hf_results):
        with torch.no_grad():
            reference = model.code2wav.chunked_decode(codes[None], chunk_size=4, left_context_size=3)[0, 0]
        assert out.audio.shape == reference.shape
        assert torch.allclose(out.audio, reference, rtol=0, atol=WAVE_TOLERANCE)


def test_a_shorter_first_window_equals_decoding_those_windows(omni_dir, hf_results) -> None:
    """A first code2wav window of 2 frames, then windows of 4 with 3 of left context: each window decoded by
    transformers' code2wav on its frames and context, its new samples concatenated."""
    graph = qwen3_omni_graph(3, decode_chunk=4, left_context=3, first_chunk_size=1, first_decode_chunk=2)
    with OmniLLM(omni_dir, graph, device="cpu", max_model_len=256, num_kv_blocks=256) as omni:
        ours = run_cases(omni)
    for (out, _), (_, _, codes, _, model) in zip(ours, hf_results):
        decoder, frames = model.code2wav, codes.shape[-1]
        pieces, start = [], 0
        with torch.no_grad():
            while start < frames:
                end = min(start + (2 if start == 0 else 4), frames)
                context = 3 if start - 3 > 0 else start
                pieces.append(decoder(codes[None, :, start - context:end])[0, 0, context * decoder.total_upsample:])
                start = end
        reference = torch.cat(pieces)
        assert out.audio.shape == reference.shape
        assert torch.allclose(out.audio, reference, rtol=0, atol=WAVE_TOLERANCE)
