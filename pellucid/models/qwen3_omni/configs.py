"""The parts of a Qwen3OmniMoeConfig each stage reads, and the token ids the stages agree on."""
from __future__ import annotations

from typing import Any

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
STAGES = ("thinker", "talker", "code2wav")


class OmniConfig:
    """Read-only view of a Qwen3OmniMoeConfig (transformers' object, as AutoConfig loads it)."""

    def __init__(self, hf_config: Any) -> None:
        for name in ("thinker_config", "talker_config", "code2wav_config"):
            if getattr(hf_config, name, None) is None:
                raise ValueError(f"not a Qwen3-Omni config: it has no {name}")
        self.hf = hf_config
        self.thinker = hf_config.thinker_config
        self.thinker_text = hf_config.thinker_config.text_config
        self.talker = hf_config.talker_config
        self.talker_text = hf_config.talker_config.text_config
        self.code_predictor = hf_config.talker_config.code_predictor_config
        self.code2wav = hf_config.code2wav_config
        talker_groups = int(self.talker.num_code_groups)
        if int(self.code_predictor.num_code_groups) != talker_groups:
            raise ValueError(f"talker num_code_groups={talker_groups} but its code predictor has "
                             f"{self.code_predictor.num_code_groups}")
        if int(self.code2wav.num_quantizers) != talker_groups:
            raise ValueError(f"code2wav decodes {self.code2wav.num_quantizers} codebooks, the talker makes {talker_groups}")

    @property
    def num_code_groups(self) -> int:
        return int(self.talker.num_code_groups)

    @property
    def multimodal_token_ids(self) -> frozenset[int]:
        t = self.thinker
        return frozenset(int(i) for i in (t.audio_token_id, t.image_token_id, t.video_token_id))

    @property
    def tts_token_ids(self) -> tuple[int, int, int]:
        """(tts_bos, tts_eos, tts_pad): thinker tokens whose embeddings frame the talker's text input."""
        h = self.hf
        return int(h.tts_bos_token_id), int(h.tts_eos_token_id), int(h.tts_pad_token_id)

    @property
    def talker_suppressed_ids(self) -> list[int]:
        """Codec ids the talker never samples: transformers suppresses the top 1024 of its vocabulary (the
        special codec ids), all but the codec EOS."""
        vocab = int(self.talker_text.vocab_size)
        eos = int(self.talker.codec_eos_token_id)
        return [i for i in range(max(vocab - 1024, 0), vocab) if i != eos]

    def speaker_id(self, speaker: str) -> int:
        speakers = {str(k).lower(): int(v) for k, v in (self.talker.speaker_id or {}).items()}
        if speaker.lower() not in speakers:
            raise ValueError(f"unknown voice {speaker!r}; this checkpoint's voices: {', '.join(sorted(speakers))}")
        return speakers[speaker.lower()]

    @property
    def speakers(self) -> list[str]:
        return sorted(str(k).lower() for k in (self.talker.speaker_id or {}))

    @property
    def samples_per_frame(self) -> int:
        c = self.code2wav
        total = 1
        for factor in list(c.upsample_rates) + list(c.upsampling_ratios):
            total *= int(factor)
        return total


def check_text_prompt(token_ids: list[int], omni: OmniConfig) -> None:
    """ValueError for a prompt holding audio / image / video placeholders (text input only)."""
    found = omni.multimodal_token_ids.intersection(token_ids)
    if found:
        raise ValueError(f"the prompt holds audio/image/video placeholder tokens {sorted(found)}: Qwen3-Omni's "
                         "audio and image encoders are not implemented, only text input is served")
