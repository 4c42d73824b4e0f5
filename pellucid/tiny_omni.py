"""A tiny random Qwen3-Omni checkpoint (thinker, talker with code predictor, code2wav), built offline with
transformers' own classes, for tests and benchmarks of the speech pipeline.

The layout is the real model's at toy sizes: the thinker's vocabulary holds the chat and TTS special
tokens, "user" and "assistant" encode as one token each (as in Qwen's vocabulary, so the talker finds
the turns where the real model does), and the talker's vocabulary is the codebook plus 1024 special ids
(transformers suppresses [vocab - 1024, vocab) except the codec EOS when the talker samples).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from pellucid.tiny_models import EOS_TOKEN, build_tokenizer

OMNI_SPECIAL_TOKENS = ("<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>", "<|audio_pad|>", "<|image_pad|>",
                       "<|video_pad|>", "<|audio_start|>", "<|vision_start|>")
ROLE_TOKENS = ("system", "user", "assistant")
BPE_VOCAB = 512

CODEBOOK = 32           # codes per codebook; the talker's vocabulary is CODEBOOK + 1024
NUM_CODE_GROUPS = 4     # codebooks per frame (talker's first + the code predictor's others)


def tiny_omni_config(token_ids: dict[str, int], vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The config dict (Qwen3OmniMoeConfig kwargs); `overrides` replace top-level sections' keys, e.g.
    thinker_text={"num_hidden_layers": 4}, talker={"accept_hidden_layer": 1}, code2wav={...}."""
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "interleaved": True}
    thinker_text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                        num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                        rope_parameters=mrope, eos_token_id=token_ids["im_end"])
    multimodal = dict(audio_token_id=token_ids["<|audio_pad|>"], image_token_id=token_ids["<|image_pad|>"],
                      video_token_id=token_ids["<|video_pad|>"], audio_start_token_id=token_ids["<|audio_start|>"])
    thinker = dict(audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                                     d_model=32, output_dim=64, n_window=4, n_window_infer=8, conv_chunksize=8,
                                     downsample_hidden_size=16, max_source_positions=64),
                   vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                      patch_size=4, num_position_embeddings=16, deepstack_visual_indexes=[0]),
                   user_token_id=token_ids["user"], vision_start_token_id=token_ids["<|vision_start|>"], **multimodal)
    talker_text = dict(vocab_size=CODEBOOK + 1024, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=1024, rms_norm_eps=1e-6,
                       rope_parameters={**mrope, "mrope_section": [2, 2, 2]})
    code_predictor = dict(vocab_size=CODEBOOK, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=NUM_CODE_GROUPS,
                          max_position_embeddings=64, rms_norm_eps=1e-6)
    special = CODEBOOK + 8      # codec specials live in the suppressed range [CODEBOOK, CODEBOOK + 1024)
    talker = dict(num_code_groups=NUM_CODE_GROUPS, thinker_hidden_size=64, accept_hidden_layer=2,
                  codec_eos_token_id=special, codec_nothink_id=special + 1, codec_think_bos_id=special + 2,
                  codec_think_eos_id=special + 3, codec_pad_id=special + 4, codec_bos_id=special + 5,
                  speaker_id={"ethan": special + 10, "chelsie": special + 11}, spatial_merge_size=2,
                  vision_start_token_id=token_ids["<|vision_start|>"], **multimodal)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, max_position_embeddings=512, num_attention_heads=4,
                    num_key_value_heads=4, sliding_window=8, intermediate_size=64, num_hidden_layers=2,
                    num_quantizers=NUM_CODE_GROUPS, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32)
    sections = {"thinker_text": thinker_text, "thinker": thinker, "talker_text": talker_text,
                "code_predictor": code_predictor, "talker": talker, "code2wav": code2wav}
    for name, values in overrides.items():
        if name not in sections:
            raise ValueError(f"unknown tiny Qwen3-Omni config section {name!r}; known: {', '.join(sections)}")
        sections[name].update(values)
    return dict(
        thinker_config={**thinker, "text_config": thinker_text},
        talker_config={**talker, "text_config": talker_text, "code_predictor_config": code_predictor},
        code2wav_config=code2wav,
        im_start_token_id=token_ids["im_start"], im_end_token_id=token_ids["im_end"],
        tts_pad_token_id=token_ids["<|tts_pad|>"], tts_bos_token_id=token_ids["<|tts_bos|>"],
        tts_eos_token_id=token_ids["<|tts_eos|>"], system_token_id=token_ids["system"],
        user_token_id=token_ids["user"], assistant_token_id=token_ids["assistant"])


def build_tiny_omni(out_dir: str, seed: int = 0, **overrides: Any) -> str:
    """Write a random-weight float32 Qwen3OmniMoeForConditionalGeneration checkpoint with its tokenizer."""
    import transformers

    build_tokenizer(out_dir, vocab_size=BPE_VOCAB, extra_special_tokens=OMNI_SPECIAL_TOKENS, added_tokens=ROLE_TOKENS)
    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    token_ids = {**added, "im_start": added["<|im_start|>"], "im_end": added[EOS_TOKEN]}
    vocab_size = max(added.values()) + 1
    config = transformers.Qwen3OmniMoeConfig(**tiny_omni_config(token_ids, vocab_size, **copy.deepcopy(overrides)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32)
        _widen_weights(model)
    model.generation_config = transformers.GenerationConfig(eos_token_id=token_ids["im_end"])
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _widen_weights(model: torch.nn.Module) -> None:
    """Weights of O(1) gain (HF's 0.02-std init makes every tiny model's outputs near-uniform and hides bugs)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn_like(param))
            elif "conv" in name and param.dim() == 3:
                param.copy_(torch.randn_like(param) / (param.shape[1] * param.shape[2]) ** 0.5)
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        # code2wav clamps its output to [-1, 1]: a quieter last convolution keeps most samples inside.
        last_conv = model.code2wav.decoder[-1].conv
        last_conv.weight.mul_(0.05)
        last_conv.bias.mul_(0.05)
